#include "kvpool/common/checksum.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/stream_copy.h"

namespace kvpool {
namespace {

std::string IsaName(ChecksumIsa isa) {
  switch (isa) {
    case ChecksumIsa::kAuto: return "auto";
    case ChecksumIsa::kScalar: return "scalar";
    case ChecksumIsa::kAvx2: return "avx2";
    case ChecksumIsa::kAvx512: return "avx512";
  }
  return "?";
}

class ChecksumStreamTest : public testing::TestWithParam<ChecksumIsa> {
 protected:
  void SetUp() override {
    if (!ChecksumIsaSupported(GetParam())) {
      GTEST_SKIP() << "this CPU lacks " << IsaName(GetParam())
                   << ": ChecksumStream never runs that path here (the paths this CPU has are tested)";
    }
  }
};

std::vector<std::byte> RandomBytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::byte> v(n);
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

// Every length up to a few KiB (around the 240-byte short path, the 64-byte stripe and
// the 1 KiB block), fed whole: the digest is libxxhash's XXH3-64 (Checksum64).
TEST_P(ChecksumStreamTest, WholeInputEqualsChecksum64) {
  const std::vector<std::byte> data = RandomBytes(4200, 1);
  for (size_t n = 0; n <= data.size(); ++n) {
    ChecksumStream c(GetParam());
    c.Update(std::span(data).first(n));
    ASSERT_EQ(c.Digest(), Checksum64(std::span(data).first(n))) << "n " << n;
    ASSERT_EQ(c.length(), n);
  }
}

// Random cuts into pieces of 0..70 bytes or up to 40 KiB, each by Update or by CopyUpdate
// (plain or streaming stores, destinations aligned or not): the same digest as one
// Checksum64 of the whole, and the destination holds exactly the source bytes.
TEST_P(ChecksumStreamTest, AnyCutAndCopyEqualsChecksum64) {
  std::mt19937_64 rng(7);
  const std::vector<std::byte> data = RandomBytes((1 << 20) + 300, 2);
  std::vector<std::byte> dst(data.size() + 64);
  for (int t = 0; t < 300; ++t) {
    const size_t len = t < 100 ? rng() % 3000 : rng() % data.size();
    const size_t shift = rng() % 2 == 0 ? 0 : rng() % 64;  // dst misalignment
    std::fill(dst.begin(), dst.end(), std::byte{0xEE});
    std::vector<bool> copied(len, false);
    ChecksumStream c(GetParam());
    size_t off = 0;
    while (off < len) {
      const size_t want = rng() % 3 == 0 ? rng() % 71 : rng() % 40000;
      const size_t k = std::min(len - off, want);
      switch (rng() % 3) {
        case 0:
          c.Update(std::span(data).subspan(off, k));
          break;
        case 1:
        case 2: {
          c.CopyUpdate(dst.data() + shift + off, data.data() + off, k, rng() % 2 == 0);
          for (size_t i = off; i < off + k; ++i) copied[i] = true;
          break;
        }
      }
      off += k;
    }
    StreamFence();
    ASSERT_EQ(c.Digest(), Checksum64(std::span(data).first(len))) << "t " << t << " len " << len;
    // The bytes copied, and no other, changed (compared whole: a per-byte assertion made
    // this test take 20 s under ASan).
    std::vector<std::byte> want(dst.size(), std::byte{0xEE});
    for (size_t i = 0; i < len; ++i) {
      if (copied[i]) want[shift + i] = data[i];
    }
    if (dst != want) {
      const size_t i = static_cast<size_t>(std::mismatch(dst.begin(), dst.end(), want.begin()).first - dst.begin());
      FAIL() << "t " << t << " len " << len << ": first wrong byte at " << i;
    }
  }
}

// Digest does not end the stream: a digest taken midway equals the prefix's, and the
// stream goes on to the whole's.
TEST_P(ChecksumStreamTest, DigestMidwayThenContinue) {
  const std::vector<std::byte> data = RandomBytes(10000, 3);
  ChecksumStream c(GetParam());
  for (size_t cut : {100, 240, 241, 1024, 1088, 5000, 10000}) {
    c.Update(std::span(data).subspan(c.length(), cut - c.length()));
    ASSERT_EQ(c.Digest(), Checksum64(std::span(data).first(cut))) << "cut " << cut;
  }
}

// One flipped bit anywhere (first, a block edge, the held-back last stripe) changes it.
TEST_P(ChecksumStreamTest, DetectsAFlippedBit) {
  std::vector<std::byte> data = RandomBytes(1 << 16, 4);
  ChecksumStream a(GetParam());
  a.Update(data);
  const uint64_t good = a.Digest();
  for (size_t at : {size_t{0}, size_t{1023}, size_t{1024}, data.size() - 65, data.size() - 1}) {
    data[at] ^= std::byte{0x10};
    ChecksumStream b(GetParam());
    b.Update(data);
    EXPECT_NE(b.Digest(), good) << "at " << at;
    data[at] ^= std::byte{0x10};
  }
}

INSTANTIATE_TEST_SUITE_P(Isa, ChecksumStreamTest,
                         testing::Values(ChecksumIsa::kAuto, ChecksumIsa::kScalar, ChecksumIsa::kAvx2,
                                         ChecksumIsa::kAvx512),
                         [](const testing::TestParamInfo<ChecksumIsa>& i) { return IsaName(i.param); });

}  // namespace
}  // namespace kvpool
