#include "kvpool/common/stream_copy.h"

#include <cstdint>
#include <vector>

#include "gtest/gtest.h"

namespace kvpool {
namespace {

// Every length around the 16-byte head and 64-byte body edges, at every destination and
// source misalignment: the bytes equal memcpy's and nothing outside [dst, dst+n) changes.
TEST(StreamCopy, EqualsMemcpyAtEveryAlignmentAndLength) {
  std::vector<uint8_t> src(512), dst(600);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t doff = 0; doff < 16; ++doff) {
    for (size_t soff = 0; soff < 16; soff += 5) {
      for (size_t n : {0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 400}) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        StreamCopy(dst.data() + 32 + doff, src.data() + soff, n);
        StreamFence();
        for (size_t i = 0; i < dst.size(); ++i) {
          const bool inside = i >= 32 + doff && i < 32 + doff + n;
          const uint8_t want = inside ? src[soff + (i - 32 - doff)] : 0xEE;
          ASSERT_EQ(dst[i], want) << "doff " << doff << " soff " << soff << " n " << n << " at " << i;
        }
      }
    }
  }
}

TEST(StreamCopy, LargeCopyMatches) {
  std::vector<uint8_t> src((4 << 20) + 13), dst(src.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i ^ (i >> 9));
  StreamCopy(dst.data(), src.data(), src.size());
  StreamFence();
  EXPECT_EQ(dst, src);
}

}  // namespace
}  // namespace kvpool
