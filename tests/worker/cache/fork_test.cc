// Fork (parallel sampling, beam search) and copy-on-write.
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::cache {
namespace {

using ::testing::ElementsAre;
using testing::MakeManager;
using testing::PagedConfig;
using testing::Prefill;
using testing::Seq;
using testing::Table;
using testing::TokenRequest;

constexpr int kB = 16;

TEST(ForkTest, SamplesShareThePromptAndCopyTheSharedPartialBlockOnFirstWrite) {
  auto m = MakeManager(PagedConfig(20, kB));
  Prefill(*m, TokenRequest(0, Seq(0, 2 * kB + 8)));  // [1 2 3(partial: 8 tokens)]
  ASSERT_THAT(Table(*m, 0), ElementsAre(1, 2, 3));
  auto copies = m->Fork(0, std::vector<RequestId>{1, 2, 3});
  ASSERT_TRUE(copies.ok()) << copies.status();
  EXPECT_TRUE(copies->empty()) << "no KDA state: nothing to copy at fork time";
  for (BlockId b : {1, 2, 3}) EXPECT_EQ(m->block_pool().block(b).ref_cnt, 4);
  EXPECT_EQ(m->Usage().used_blocks, 3);
  EXPECT_EQ(m->NumTokens(2), 2 * kB + 8);

  // Each sample's first token writes into the shared partial block: copy-on-write.
  int new_blocks = 0;
  for (RequestId id : {1, 2, 3}) {
    ASSERT_TRUE(m->AppendTokens(id, std::vector<TokenId>{static_cast<TokenId>(100 + id)}).ok());
    auto a = m->AllocateSlots(id, 1);
    ASSERT_TRUE(a.ok()) << a.status();
    ASSERT_EQ(a->copies.size(), 1u);
    EXPECT_EQ(a->copies[0].src, 3);
    EXPECT_EQ(a->copies[0].dst, Table(*m, id)[2]);
    EXPECT_EQ(Table(*m, id)[0], 1);
    EXPECT_EQ(Table(*m, id)[1], 2);
    new_blocks += 1;
  }
  EXPECT_EQ(m->block_pool().block(3).ref_cnt, 1);
  // The last holder (the parent) writes in place: no copy.
  ASSERT_TRUE(m->AppendTokens(0, std::vector<TokenId>{7}).ok());
  auto a = m->AllocateSlots(0, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->copies.empty());
  EXPECT_THAT(Table(*m, 0), ElementsAre(1, 2, 3));
  // Only the divergent suffix consumed blocks: 3 prompt blocks + 1 per sample.
  EXPECT_EQ(m->Usage().used_blocks, 3 + new_blocks);
  EXPECT_EQ(m->Usage().cow_copies, 3u);
  for (RequestId id : {0, 1, 2, 3}) ASSERT_TRUE(m->Free(id).ok());
  EXPECT_EQ(m->Usage().used_blocks, 0);
}

TEST(ForkTest, ForkAtABlockBoundaryNeedsNoCopy) {
  auto m = MakeManager(PagedConfig(20, kB));
  Prefill(*m, TokenRequest(0, Seq(0, 2 * kB)));
  ASSERT_TRUE(m->Fork(0, std::vector<RequestId>{1}).ok());
  ASSERT_TRUE(m->AppendTokens(1, std::vector<TokenId>{5}).ok());
  auto a = m->AllocateSlots(1, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_TRUE(a->copies.empty());
  EXPECT_EQ(a->num_new_blocks, 1);
  EXPECT_THAT(Table(*m, 1), ElementsAre(1, 2, 3));
}

// Beams that diverge fill their own blocks, which get cached under their own hashes;
// beams that happen to agree produce duplicate copies of one hash.
TEST(ForkTest, DivergentBeamsCacheTheirOwnBlocks) {
  auto m = MakeManager(PagedConfig(20, kB));
  Prefill(*m, TokenRequest(0, Seq(0, kB + 8)));
  ASSERT_TRUE(m->Fork(0, std::vector<RequestId>{1, 2}).ok());
  const std::vector<TokenId> same = Seq(500, 8);
  for (RequestId id : {0, 1, 2}) {
    const std::vector<TokenId> t = id == 2 ? Seq(900, 8) : same;
    ASSERT_TRUE(m->AppendTokens(id, t).ok());
    ASSERT_TRUE(m->AllocateSlots(id, 8).ok());
  }
  EXPECT_EQ(m->BlockHashes(0)[1], m->BlockHashes(1)[1]);
  EXPECT_NE(m->BlockHashes(0)[1], m->BlockHashes(2)[1]);
  // 1 shared + 2 hashes for block 1 (0 and 1 are duplicates of one hash).
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 3u);
  EXPECT_NE(Table(*m, 0)[1], Table(*m, 1)[1]);
  // A new request continuing beam 2 hits its block.
  auto prompt = Seq(0, kB + 8);
  auto t2 = Seq(900, 8);
  prompt.insert(prompt.end(), t2.begin(), t2.end());
  prompt.push_back(1);
  EXPECT_EQ(Prefill(*m, TokenRequest(3, prompt)).num_tokens, 2 * kB);
  EXPECT_EQ(Table(*m, 3)[1], Table(*m, 2)[1]);
}

TEST(ForkTest, ForkErrors) {
  auto m = MakeManager(PagedConfig(20, kB));
  Prefill(*m, TokenRequest(0, Seq(0, 10)));
  EXPECT_EQ(m->Fork(7, std::vector<RequestId>{8}).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(m->Fork(0, std::vector<RequestId>{0}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m->Fork(0, std::vector<RequestId>{5, 5}).status().code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(m->block_pool().block(1).ref_cnt, 1);
}

// Slots allocated ahead of the known tokens (a lookahead of 5) would be shared for
// writing: each child writes its own tokens there, and copy-on-write only guards a write
// that adds slots. Fork refuses until the tokens are known, and changes nothing.
TEST(ForkTest, ForkWithSlotsAheadOfTheKnownTokensIsRefused) {
  auto m = MakeManager(PagedConfig(20, kB));
  Prefill(*m, TokenRequest(0, Seq(0, kB + 4)));
  ASSERT_TRUE(m->AllocateSlots(0, 5).ok());  // slots kB+4 .. kB+8, tokens not known yet
  auto f = m->Fork(0, std::vector<RequestId>{1});
  EXPECT_EQ(f.status().code(), absl::StatusCode::kFailedPrecondition) << f.status();
  EXPECT_THAT(std::string(f.status().message()), ::testing::HasSubstr("slots ahead"));
  EXPECT_EQ(m->NumTokens(1), 0);
  EXPECT_EQ(m->block_pool().block(Table(*m, 0)[1]).ref_cnt, 1);
  // Once the tokens are known the slots are the parent's computed tokens: Fork shares them.
  ASSERT_TRUE(m->AppendTokens(0, std::vector<TokenId>{1, 2, 3, 4, 5}).ok());
  ASSERT_TRUE(m->Fork(0, std::vector<RequestId>{1}).ok());
  EXPECT_EQ(m->block_pool().block(Table(*m, 0)[1]).ref_cnt, 2);
}

// A count past the whole cache is refused before base + n or the block count could
// overflow (they threw std::length_error from vector::reserve, ending the process).
TEST(ForkTest, AllocateSlotsBeyondTheCacheIsRefused) {
  auto m = MakeManager(PagedConfig(20, kB));
  Prefill(*m, TokenRequest(0, Seq(0, 10)));
  auto a = m->AllocateSlots(0, INT64_MAX - 5);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
  EXPECT_THAT(std::string(a.status().message()), ::testing::HasSubstr("exceeds the whole cache"));
  EXPECT_TRUE(m->AllocateSlots(0, 1).ok());  // the request is unharmed
}

TEST(ForkTest, CopyOnWriteRespectsExhaustion) {
  auto m = MakeManager(PagedConfig(3, kB));  // 2 usable
  Prefill(*m, TokenRequest(0, Seq(0, kB + 4)));
  ASSERT_TRUE(m->Fork(0, std::vector<RequestId>{1}).ok());
  ASSERT_TRUE(m->AppendTokens(1, std::vector<TokenId>{1}).ok());
  auto a = m->AllocateSlots(1, 1);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(m->block_pool().block(2).ref_cnt, 2);
  EXPECT_EQ(m->NumTokens(1), kB + 4);
}

}  // namespace
}  // namespace kvpool::cache
