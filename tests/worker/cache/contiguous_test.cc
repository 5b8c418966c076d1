// The contiguous baseline, and the paged policy against it behind one interface.
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvpool/worker/cache/contiguous_cache_manager.h"
#include "test_util.h"

namespace kvpool::cache {
namespace {

using ::testing::ElementsAre;
using testing::PagedConfig;
using testing::Seq;
using testing::Table;
using testing::TokenRequest;

constexpr int kB = 16;

std::unique_ptr<CacheManager> Make(absl::string_view policy, int32_t num_blocks,
                                   int64_t max_len) {
  CacheConfig c = PagedConfig(num_blocks, kB);
  c.max_model_len = max_len;
  auto m = CreateCacheManager(policy, c);
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

RequestSpec Hashed(RequestId id, int64_t prompt) {
  RequestSpec s;
  s.id = id;
  s.num_prompt_tokens = prompt;
  return s;
}

TEST(ContiguousTest, ReservesMaxLenPerRequest) {
  auto m = Make("contiguous", 17, 64);  // 16 usable, 4 per request
  EXPECT_EQ(m->policy(), "contiguous");
  for (RequestId id = 0; id < 4; ++id) {
    ASSERT_TRUE(m->AddRequest(Hashed(id, 10)).ok());
    auto hit = m->GetComputedBlocks(id);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->num_tokens, 0);
    auto a = m->AllocateSlots(id, 10, &*hit);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->num_new_blocks, 4);
  }
  EXPECT_THAT(Table(*m, 1), ElementsAre(5, 6, 7, 8));
  // Batch cap reached although only 40 of 256 reserved tokens hold KV.
  ASSERT_TRUE(m->AddRequest(Hashed(4, 10)).ok());
  EXPECT_EQ(m->AllocateSlots(4, 10).status().code(), absl::StatusCode::kResourceExhausted);
  const CacheUsage u = m->Usage();
  EXPECT_EQ(u.live_tokens, 40);
  EXPECT_EQ(u.reserved_tokens, 256);
  // Decode never allocates; running past max_model_len is refused.
  auto d = m->AllocateSlots(0, 54);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->num_new_blocks, 0);
  EXPECT_EQ(m->AllocateSlots(0, 1).status().code(), absl::StatusCode::kOutOfRange);
  // A count near INT64_MAX is refused too (num_slots + n overflowed to a negative sum,
  // which passed the check), and changes nothing.
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->AddRequest(Hashed(0, 10)).ok());
  ASSERT_TRUE(m->AllocateSlots(0, 10).ok());
  EXPECT_EQ(m->AllocateSlots(0, INT64_MAX).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m->AllocateSlots(0, INT64_MAX - 5).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(m->Usage().live_tokens, 40);
}

TEST(ContiguousTest, FreedRangesCoalesce) {
  auto m = Make("contiguous", 13, 64);  // 12 usable: 3 reservations
  for (RequestId id = 0; id < 3; ++id) {
    ASSERT_TRUE(m->AddRequest(Hashed(id, 5)).ok());
    ASSERT_TRUE(m->AllocateSlots(id, 5).ok());
  }
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->Free(1).ok());
  // 0 and 1 coalesced into one 8-block range: two new reservations fit in it.
  for (RequestId id = 10; id < 12; ++id) {
    ASSERT_TRUE(m->AddRequest(Hashed(id, 5)).ok());
    ASSERT_TRUE(m->AllocateSlots(id, 5).ok());
  }
  EXPECT_THAT(Table(*m, 10), ElementsAre(1, 2, 3, 4));
  EXPECT_THAT(Table(*m, 11), ElementsAre(5, 6, 7, 8));
  EXPECT_EQ(m->ResetPrefixCache().code(), absl::StatusCode::kFailedPrecondition);
  for (RequestId id : {2, 10, 11}) ASSERT_TRUE(m->Free(id).ok());
  EXPECT_TRUE(m->ResetPrefixCache().ok());
  EXPECT_EQ(m->Usage().free_blocks, 12);
}

TEST(ContiguousTest, ForkCopiesEveryUsedBlock) {
  auto m = Make("contiguous", 17, 64);
  ASSERT_TRUE(m->AddRequest(Hashed(0, 20)).ok());
  ASSERT_TRUE(m->AllocateSlots(0, 20).ok());
  auto copies = m->Fork(0, std::vector<RequestId>{1});
  ASSERT_TRUE(copies.ok());
  ASSERT_EQ(copies->size(), 2u);
  EXPECT_EQ((*copies)[0].src, 1);
  EXPECT_EQ((*copies)[0].dst, 5);
  EXPECT_EQ(m->Usage().used_blocks, 8);
}

// A repeated child id reserved twice and kept one reservation for good.
TEST(ContiguousTest, ForkRefusesARepeatedChildAndChangesNothing) {
  auto m = Make("contiguous", 17, 64);  // 16 usable: 4 reservations of 4
  ASSERT_TRUE(m->AddRequest(Hashed(0, 10)).ok());
  ASSERT_TRUE(m->AllocateSlots(0, 10).ok());
  EXPECT_EQ(m->Fork(0, std::vector<RequestId>{7, 7}).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m->Usage().used_blocks, 4);
  ASSERT_TRUE(m->Free(0).ok());
  EXPECT_EQ(m->Usage().free_blocks, 16);
}

TEST(ContiguousTest, ConfigErrors) {
  CacheConfig c = PagedConfig(17, kB);
  EXPECT_THAT(std::string(ContiguousCacheManager::Create(c).status().message()),
              ::testing::HasSubstr("max_model_len"));
  c.max_model_len = 1000;
  EXPECT_THAT(std::string(ContiguousCacheManager::Create(c).status().message()),
              ::testing::HasSubstr("raise num_blocks"));
  // A huge max_model_len ("no limit") is refused by its size; rounding it up to whole
  // blocks used to overflow into a reservation of 1 block that requests then outgrew.
  c.max_model_len = std::numeric_limits<int64_t>::max();
  EXPECT_THAT(std::string(ContiguousCacheManager::Create(c).status().message()),
              ::testing::HasSubstr("raise num_blocks"));
  c.max_model_len = 64;
  c.layout = CacheLayout::Hybrid(kB, 2, 64);
  EXPECT_EQ(ContiguousCacheManager::Create(c).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto m = Make("contiguous", 17, 64);
  EXPECT_EQ(m->AddRequest(Hashed(0, 65)).code(), absl::StatusCode::kInvalidArgument);
}

// The same request loop on both policies: paging admits more requests and wastes at
// most one partial block per request.
TEST(PolicyComparisonTest, PagingAdmitsMoreOnTheSameWorkload) {
  const std::vector<int64_t> lengths = {20, 300, 45, 17, 900, 33, 64, 128, 5, 70};
  std::vector<std::unique_ptr<CacheManager>> ms;
  ms.push_back(Make("contiguous", 257, 1024));
  ms.push_back(Make("paged", 257, 1024));
  std::vector<int> admitted;
  for (auto& m : ms) {
    int n = 0;
    for (RequestId id = 0; id < 100; ++id) {
      ASSERT_TRUE(m->AddRequest(Hashed(id, lengths[id % lengths.size()])).ok());
      if (!m->AllocateSlots(id, lengths[id % lengths.size()]).ok()) break;
      ++n;
    }
    admitted.push_back(n);
    const CacheUsage u = m->Usage();
    const double utilization = static_cast<double>(u.live_tokens) / u.reserved_tokens;
    if (m->policy() == "paged") {
      EXPECT_GT(utilization, 0.9);
      EXPECT_LE(u.reserved_tokens - u.live_tokens, static_cast<int64_t>(n) * (kB - 1));
    } else {
      EXPECT_LT(utilization, 0.2);
    }
  }
  EXPECT_EQ(admitted[0], 4);  // 256 blocks / 64 per reservation
  EXPECT_GT(admitted[1], 3 * admitted[0]);
}

}  // namespace
}  // namespace kvpool::cache
