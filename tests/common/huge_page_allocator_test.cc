// HugePageAllocator: small blocks from operator new, large ones 2 MiB aligned mappings;
// a hash table that grows through both keeps every element.
#include "kvpool/common/huge_page_allocator.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "gtest/gtest.h"

namespace kvpool {
namespace {

TEST(HugePageAllocatorTest, LargeBlocksAreAlignedWritableAndReleased) {
  HugePageAllocator<uint64_t> a;
  for (size_t n : {size_t{1}, size_t{1000}, kHugePageBytes / 8, kHugePageBytes / 8 + 1, size_t{3} << 20}) {
    uint64_t* p = a.allocate(n);
    ASSERT_NE(p, nullptr) << n;
    if (n * 8 >= kHugePageBytes) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % kHugePageBytes, 0u) << n;
    }
    for (size_t i = 0; i < n; ++i) p[i] = i * 3;
    for (size_t i = 0; i < n; i += 4097) ASSERT_EQ(p[i], i * 3);
    a.deallocate(p, n);
  }
}

TEST(HugePageAllocatorTest, MapGrowingPastTheThresholdKeepsEveryElement) {
  absl::flat_hash_map<uint64_t, uint64_t, absl::Hash<uint64_t>, std::equal_to<uint64_t>,
                      HugePageAllocator<std::pair<const uint64_t, uint64_t>>>
      m;
  constexpr uint64_t kN = 300000;  // ~8 MiB of slots at the last growth
  for (uint64_t i = 0; i < kN; ++i) m[i * 7919] = i;
  ASSERT_EQ(m.size(), kN);
  for (uint64_t i = 0; i < kN; ++i) {
    auto it = m.find(i * 7919);
    ASSERT_NE(it, m.end()) << i;
    ASSERT_EQ(it->second, i);
  }
  for (uint64_t i = 0; i < kN; i += 2) m.erase(i * 7919);
  EXPECT_EQ(m.size(), kN / 2);
  EXPECT_EQ(m.count(1 * 7919), 1u);
}

}  // namespace
}  // namespace kvpool
