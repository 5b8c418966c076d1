// BlockMap against std::map under random inserts, erases and EraseIf scans; a key space
// far smaller than the table's capacity range, so probe runs collide, wrap around the
// end and back-shift on erase.
#include "kvpool/router/block_map.h"

#include <map>
#include <memory>
#include <random>

#include "gtest/gtest.h"

namespace kvpool::router {
namespace {

struct Value {
  uint64_t payload = 0;
  std::unique_ptr<int> owned;  // moves must carry it
  uint8_t slot_state = 0;
  char pad[23] = {};
};

void ExpectSame(const BlockMap<Value>& m, const std::map<BlockHash, uint64_t>& ref) {
  ASSERT_EQ(m.size(), ref.size());
  size_t seen = 0;
  for (const auto& [key, v] : m) {
    auto it = ref.find(key);
    ASSERT_NE(it, ref.end()) << key.lo;
    ASSERT_EQ(v.payload, it->second);
    ASSERT_NE(v.owned, nullptr);
    ASSERT_EQ(*v.owned, static_cast<int>(it->second));
    ++seen;
  }
  ASSERT_EQ(seen, ref.size());
  for (const auto& [key, payload] : ref) {
    const Value* v = m.FindValue(key);
    ASSERT_NE(v, nullptr) << key.lo;
    ASSERT_EQ(v->payload, payload);
  }
}

class BlockMapTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(BlockMapTest, MatchesStdMapUnderRandomOperations) {
  std::mt19937_64 rng(GetParam());
  BlockMap<Value> m;
  std::map<BlockHash, uint64_t> ref;
  // Keys whose lo has only high bits set land in the last slots: runs wrap to slot 0.
  auto key = [&](uint64_t k) { return BlockHash{(k % 2 == 0) ? ~uint64_t{0} - (k % 7) : k * 0x1234567ull, k}; };
  for (int step = 0; step < 20000; ++step) {
    const uint64_t k = rng() % 600;
    const BlockHash h = key(k);
    const int op = static_cast<int>(rng() % 10);
    if (op < 6) {
      auto [it, inserted] = m.try_emplace(h);
      ASSERT_EQ(inserted, !ref.contains(h)) << step;
      const uint64_t payload = rng() % 100000;
      it->second.payload = payload;
      it->second.owned = std::make_unique<int>(static_cast<int>(payload));
      ref[h] = payload;
    } else if (op < 9) {
      auto it = m.find(h);
      ASSERT_EQ(it != m.end(), ref.contains(h)) << step;
      if (it != m.end()) m.erase(it);
      ref.erase(h);
    } else if (step % 50 == 9) {
      const uint64_t mod = 2 + rng() % 5;
      m.EraseIf([&](const BlockHash& kh, Value& v) {
        ++v.payload;  // visited exactly once
        *v.owned = static_cast<int>(v.payload);
        return kh.hi % mod == 0;
      });
      for (auto it = ref.begin(); it != ref.end();) {
        ++it->second;
        it = (it->first.hi % mod == 0) ? ref.erase(it) : std::next(it);
      }
    }
    if (step % 997 == 0) ExpectSame(m, ref);
  }
  ExpectSame(m, ref);
  for (auto it = ref.begin(); it != ref.end(); it = ref.erase(it)) m.erase(m.find(it->first));
  EXPECT_EQ(m.size(), 0u);
  EXPECT_EQ(m.begin(), m.end());
}

INSTANTIATE_TEST_SUITE_P(Seeds, BlockMapTest, ::testing::Values(1, 2, 3, 4));

}  // namespace
}  // namespace kvpool::router
