// PageAllocator against a reference model (a set of free pages), under random traffic.
#include "kvpool/pool_node/page_allocator.h"

#include <random>
#include <set>

#include "gtest/gtest.h"

namespace kvpool::pool_node {
namespace {

TEST(PageAllocator, PrefersOneContiguousExtent) {
  PageAllocator a(16);
  auto r1 = a.Allocate(4);
  auto r2 = a.Allocate(4);
  ASSERT_TRUE(r1 && r2);
  a.Free(*r1);  // free: [0..3], [8..15]
  auto r3 = a.Allocate(4);  // best fit: the 4-page hole, not the 8-page tail
  ASSERT_TRUE(r3);
  EXPECT_EQ(*r3, (std::vector<uint32_t>{0, 1, 2, 3}));
}

TEST(PageAllocator, GathersScatteredPagesWhenFragmented) {
  PageAllocator a(8);
  std::vector<std::vector<uint32_t>> runs;
  for (int i = 0; i < 8; ++i) runs.push_back(*a.Allocate(1));
  for (int i = 0; i < 8; i += 2) a.Free(runs[i]);
  auto r = a.Allocate(4);
  ASSERT_TRUE(r);
  EXPECT_EQ(*r, (std::vector<uint32_t>{0, 2, 4, 6}));
  EXPECT_FALSE(a.Allocate(1));
}

TEST(PageAllocator, MarkUsedRejectsUsedOrRepeatedPages) {
  PageAllocator a(8);
  EXPECT_TRUE(a.MarkUsed(std::vector<uint32_t>{3, 5}));
  EXPECT_FALSE(a.MarkUsed(std::vector<uint32_t>{5}));
  EXPECT_FALSE(a.MarkUsed(std::vector<uint32_t>{1, 1}));
  EXPECT_FALSE(a.MarkUsed(std::vector<uint32_t>{8}));
  EXPECT_EQ(a.free_pages(), 6u);
  EXPECT_FALSE(a.IsFree(3));
  EXPECT_TRUE(a.IsFree(4));
}

TEST(PageAllocator, DifferentialAgainstReferenceModel) {
  constexpr uint32_t kPages = 257;
  PageAllocator a(kPages);
  std::set<uint32_t> free_model;
  for (uint32_t i = 0; i < kPages; ++i) free_model.insert(i);
  std::vector<std::vector<uint32_t>> live;
  std::mt19937 rng(42);
  for (int step = 0; step < 20000; ++step) {
    if (live.empty() || rng() % 2 == 0) {
      const uint32_t n = 1 + rng() % 20;
      auto run = a.Allocate(n);
      ASSERT_EQ(run.has_value(), n <= free_model.size()) << step;
      if (!run) continue;
      ASSERT_EQ(run->size(), n);
      for (uint32_t p : *run) ASSERT_EQ(free_model.erase(p), 1u) << "page handed out twice: " << p;
      live.push_back(*run);
    } else {
      const size_t i = rng() % live.size();
      a.Free(live[i]);
      for (uint32_t p : live[i]) free_model.insert(p);
      live.erase(live.begin() + i);
    }
    ASSERT_EQ(a.free_pages(), free_model.size());
  }
  for (uint32_t p = 0; p < kPages; ++p) ASSERT_EQ(a.IsFree(p), free_model.count(p) == 1) << p;
}

}  // namespace
}  // namespace kvpool::pool_node
