// Prefix caching through KvCacheManager: the ideas of vLLM's
// tests/v1/core/test_prefix_caching.py and SGLang's radix cache tests, ported.
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::cache {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;
using testing::Concat;
using testing::EventReplayer;
using testing::MakeManager;
using testing::PagedConfig;
using testing::Prefill;
using testing::Seq;
using testing::Table;
using testing::TokenRequest;

constexpr int kB = 16;

// vLLM test_prefill: free-queue order after frees is partial blocks first, then never
// used blocks, then cached blocks with each chain's tail first.
TEST(PrefixCachingTest, PrefillSharesCommonPrefixAndOrdersTheFreeQueue) {
  auto m = MakeManager(PagedConfig(11, kB));
  const auto common = Seq(0, 3 * kB);
  // Request 0: 3 common blocks + 7 unique tokens -> blocks 1..4, the 4th partial.
  PrefixHit hit0 = Prefill(*m, TokenRequest(0, Concat(common, Seq(1000, 7))));
  EXPECT_EQ(hit0.num_tokens, 0);
  EXPECT_THAT(Table(*m, 0), ElementsAre(1, 2, 3, 4));
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 3u);
  for (BlockId b : {1, 2, 3}) EXPECT_TRUE(m->block_pool().block(b).is_cached);
  EXPECT_FALSE(m->block_pool().block(4).is_cached);

  // Request 1: the same 3 common blocks + 5 unique tokens: 3 blocks hit, one new block.
  PrefixHit hit1 = Prefill(*m, TokenRequest(1, Concat(common, Seq(2000, 5))));
  EXPECT_EQ(hit1.num_tokens, 3 * kB);
  EXPECT_THAT(hit1.blocks, ElementsAre(1, 2, 3));
  EXPECT_THAT(Table(*m, 1), ElementsAre(1, 2, 3, 5));
  for (BlockId b : {1, 2, 3}) EXPECT_EQ(m->block_pool().block(b).ref_cnt, 2);
  EXPECT_EQ(m->block_pool().num_free_blocks(), 5);

  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->Free(1).ok());
  EXPECT_EQ(m->block_pool().num_free_blocks(), 10);
  EXPECT_THAT(m->block_pool().FreeQueueOrder(), ElementsAre(5, 4, 6, 7, 8, 9, 10, 3, 2, 1));

  // Request 2 hits the common prefix again and takes its new block from the queue head.
  PrefixHit hit2 = Prefill(*m, TokenRequest(2, Concat(common, Seq(3000, 7))));
  EXPECT_EQ(hit2.num_tokens, 3 * kB);
  EXPECT_THAT(Table(*m, 2), ElementsAre(1, 2, 3, 5));
  EXPECT_THAT(m->block_pool().FreeQueueOrder(), ElementsAre(4, 6, 7, 8, 9, 10));
}

// The hit is prefix-only and block-granular: 8,000 matching tokens at b = 16 reuse
// exactly 500 blocks, even when the prompts diverge mid-block afterwards.
TEST(PrefixCachingTest, HitIsPrefixOnlyAndBlockGranular) {
  auto m = MakeManager(PagedConfig(1200, kB));
  const auto shared = Seq(0, 8000);
  Prefill(*m, TokenRequest(0, Concat(shared, Seq(100000, 300))));
  ASSERT_TRUE(m->Free(0).ok());
  PrefixHit hit = Prefill(*m, TokenRequest(1, Concat(shared, Seq(200000, 300))));
  EXPECT_EQ(hit.blocks.size(), 500u);
  EXPECT_EQ(hit.num_tokens, 8000);

  // Divergence inside a block: 8,008 matching tokens still reuse 500 blocks.
  auto more = Concat(shared, Seq(100000, 8));
  PrefixHit hit2 = Prefill(*m, TokenRequest(2, Concat(more, Seq(300000, 50))));
  EXPECT_EQ(hit2.blocks.size(), 500u);

  // A prompt that differs in its first block hits nothing, whatever follows.
  auto other = Seq(0, 8000);
  other[3] = 999999;
  PrefixHit hit3 = Prefill(*m, TokenRequest(3, other));
  EXPECT_EQ(hit3.num_tokens, 0);
}

// The last prompt token is always recomputed (its logits give the next token).
TEST(PrefixCachingTest, HitIsCappedSoTheLastTokenIsRecomputed) {
  auto m = MakeManager(PagedConfig(20, kB));
  const auto prompt = Seq(0, 3 * kB);
  Prefill(*m, TokenRequest(0, prompt));
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->AddRequest(TokenRequest(1, prompt)).ok());
  auto hit = m->GetComputedBlocks(1);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->num_tokens, 2 * kB);
  // The recomputed block gets the same hash as the free cached one: a duplicate.
  ASSERT_TRUE(m->AllocateSlots(1, kB, &*hit).ok());
  const BlockId recomputed = Table(*m, 1)[2];
  EXPECT_TRUE(m->block_pool().block(recomputed).is_cached);
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 3u);
}

// A hit handed to AllocateSlots is checked like GetComputedBlocks' own: one that covers
// the last known token (whose logits give the next token) is refused. Before, a
// hand-built hit of the whole prompt was accepted and left no token to compute.
TEST(PrefixCachingTest, AHitOverTheLastKnownTokenIsRefused) {
  auto m = MakeManager(PagedConfig(20, kB));
  const auto prompt = Seq(0, 3 * kB);
  Prefill(*m, TokenRequest(0, prompt));
  const BlockId third = Table(*m, 0)[2];
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->AddRequest(TokenRequest(1, prompt)).ok());
  auto hit = m->GetComputedBlocks(1);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->blocks.size(), 2u);
  PrefixHit whole = *hit;
  whole.blocks.push_back(third);
  whole.num_tokens = 3 * kB;
  auto refused = m->AllocateSlots(1, 0, &whole);
  EXPECT_FALSE(refused.ok());
  EXPECT_THAT(std::string(refused.status().message()), ::testing::HasSubstr("last known token"));
  EXPECT_TRUE(m->AllocateSlots(1, kB, &*hit).ok());
}

// Hashed mode takes block_hashes as they are: a tenant_salt or extra_keys beside them
// would be ignored (no isolation), so it is refused naming the field.
TEST(PrefixCachingTest, HashedRequestWithSaltOrExtraKeysIsRefused) {
  auto m = MakeManager(PagedConfig(20, kB));
  RequestSpec s;
  s.id = 7;
  s.num_prompt_tokens = 2 * kB;
  s.block_hashes = {BlockHash{1, 2}, BlockHash{3, 4}};
  s.tenant_salt = "tenant";
  auto st = m->AddRequest(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("tenant_salt"));
  s.tenant_salt.clear();
  s.extra_keys = {5};
  st = m->AddRequest(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("extra_keys"));
  s.extra_keys.clear();
  EXPECT_TRUE(m->AddRequest(s).ok());
}

// vLLM test_decode: a decode step allocates only when the last block is full, and the
// step that fills a block hashes and caches it.
TEST(PrefixCachingTest, DecodeAllocatesOnlyAtABlockBoundaryAndCachesFullBlocks) {
  RecordingEventSink sink;
  auto m = MakeManager(PagedConfig(10, kB, &sink));
  Prefill(*m, TokenRequest(0, Seq(0, kB + 10)));
  ASSERT_EQ(Table(*m, 0).size(), 2u);
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 1u);
  const size_t events_before = sink.events().size();
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(m->AppendTokens(0, std::vector<TokenId>{static_cast<TokenId>(500 + i)}).ok());
    auto a = m->AllocateSlots(0, 1);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->num_new_blocks, 0) << "step " << i;
  }
  // 32 tokens: the second block is now full and cached, with request 0's tokens.
  EXPECT_EQ(m->NumTokens(0), 2 * kB);
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 2u);
  const BlockId second = Table(*m, 0)[1];
  EXPECT_TRUE(m->block_pool().block(second).is_cached);
  EXPECT_EQ(m->block_pool().block(second).hash, m->BlockHashes(0)[1]);
  ASSERT_EQ(sink.events().size(), events_before + 1);
  EXPECT_EQ(sink.events().back().parent, m->BlockHashes(0)[0]);
  // The next token needs a new block.
  ASSERT_TRUE(m->AppendTokens(0, std::vector<TokenId>{7}).ok());
  auto a = m->AllocateSlots(0, 1);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->num_new_blocks, 1);
  EXPECT_EQ(a->first_new_block, 2);
  EXPECT_EQ(Table(*m, 0).size(), 3u);
}

// vLLM test_evict: cached blocks are evicted lazily, least recently freed first; a
// block reused for new data loses its old hash and the removal is announced.
TEST(PrefixCachingTest, ReusedBlocksLoseTheirOldHash) {
  RecordingEventSink sink;
  auto m = MakeManager(PagedConfig(7, kB, &sink));  // 6 usable blocks
  Prefill(*m, TokenRequest(0, Seq(0, 3 * kB + 1)));     // blocks 1..4 (3 cached)
  ASSERT_TRUE(m->Free(0).ok());
  EXPECT_THAT(m->block_pool().FreeQueueOrder(), ElementsAre(4, 5, 6, 3, 2, 1));
  const BlockHash old3 = m->block_pool().block(3).hash;
  // A new 5-block request takes 4, 5, 6 and then evicts the chain tail (3) first.
  Prefill(*m, TokenRequest(1, Seq(5000, 4 * kB + 1)));
  EXPECT_THAT(Table(*m, 1), ElementsAre(4, 5, 6, 3, 2));
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 4u + 1u);
  EventReplayer r;
  r.Apply(sink.events());
  EXPECT_EQ(r.Held(StateKind::kAttnKv), testing::CachedSet(m->block_pool(), StateKind::kAttnKv));
  EXPECT_FALSE(m->block_pool().IsCached(old3, StateKind::kAttnKv));
  // Only block 1 (the chain's root) survived.
  ASSERT_TRUE(m->AddRequest(TokenRequest(2, Seq(0, 3 * kB + 1))).ok());
  auto hit = m->GetComputedBlocks(2);
  ASSERT_TRUE(hit.ok());
  EXPECT_THAT(hit->blocks, ElementsAre(1));
  EXPECT_EQ(m->Usage().evicted_blocks, 2u);
}

// vLLM test_hash_block_correct_reuse / SGLang: a block that just served a hit moves to
// the tail when freed, so other free blocks are evicted before it.
TEST(PrefixCachingTest, HitBlockIsNotEvictedWhileOtherFreeBlocksExist) {
  auto m = MakeManager(PagedConfig(7, kB));
  Prefill(*m, TokenRequest(0, Seq(0, kB + 1)));    // block 1 cached, 2 partial
  Prefill(*m, TokenRequest(1, Seq(100, kB + 1)));  // block 3 cached, 4 partial
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->Free(1).ok());
  // Hit request 0's block again, then free it: it becomes most recently used.
  PrefixHit hit = Prefill(*m, TokenRequest(2, Seq(0, kB + 3)));
  EXPECT_THAT(hit.blocks, ElementsAre(1));
  ASSERT_TRUE(m->Free(2).ok());
  const BlockHash h1 = m->block_pool().block(1).hash;
  const BlockHash h3 = m->block_pool().block(3).hash;
  // Four uncached blocks go first, then block 3 (older), never block 1.
  Prefill(*m, TokenRequest(3, Seq(9000, 4 * kB + 1)));
  EXPECT_FALSE(m->block_pool().IsCached(h3, StateKind::kAttnKv));
  EXPECT_TRUE(m->block_pool().IsCached(h1, StateKind::kAttnKv));
  EXPECT_EQ(m->block_pool().block(1).ref_cnt, 0);
}

// Out of blocks: RESOURCE_EXHAUSTED, and not one reference count changed.
TEST(PrefixCachingTest, FailedAllocationLeavesRefcountsUntouched) {
  auto m = MakeManager(PagedConfig(6, kB));  // 5 usable
  const auto common = Seq(0, 2 * kB);
  Prefill(*m, TokenRequest(0, Concat(common, Seq(50, 1))));  // 3 blocks, 2 cached
  ASSERT_TRUE(m->Free(0).ok());
  Prefill(*m, TokenRequest(1, Seq(700, kB)));  // 1 block in use
  std::vector<int32_t> before;
  for (BlockId b = 0; b < 6; ++b) before.push_back(m->block_pool().block(b).ref_cnt);
  const auto queue_before = m->block_pool().FreeQueueOrder();

  // Hits the 2 free cached blocks and wants 3 more: 5 > 4 free.
  ASSERT_TRUE(m->AddRequest(TokenRequest(2, Concat(common, Seq(60, 3 * kB)))).ok());
  auto hit = m->GetComputedBlocks(2);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->blocks.size(), 2u);
  auto a = m->AllocateSlots(2, 3 * kB, &*hit);
  ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(a.status().message()), ::testing::HasSubstr("raise num_blocks"));
  for (BlockId b = 0; b < 6; ++b) EXPECT_EQ(m->block_pool().block(b).ref_cnt, before[b]);
  EXPECT_EQ(m->block_pool().FreeQueueOrder(), queue_before);
  EXPECT_TRUE(Table(*m, 2).empty());
  EXPECT_EQ(m->NumTokens(2), 0);
  // A smaller step fits and the same hit is still valid.
  auto b = m->AllocateSlots(2, kB, &*hit);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(Table(*m, 2).size(), 3u);
}

// Two requests that miss at the same time compute the same block twice: the hash maps
// to both, is announced once, and stays cached until the last copy is evicted.
TEST(PrefixCachingTest, DuplicateHashes) {
  RecordingEventSink sink;
  auto m = MakeManager(PagedConfig(8, kB, &sink));
  const auto prompt = Seq(0, kB + 5);
  ASSERT_TRUE(m->AddRequest(TokenRequest(0, prompt)).ok());
  ASSERT_TRUE(m->AddRequest(TokenRequest(1, prompt)).ok());
  auto h0 = m->GetComputedBlocks(0);
  auto h1 = m->GetComputedBlocks(1);
  ASSERT_TRUE(h0.ok() && h1.ok());
  ASSERT_TRUE(m->AllocateSlots(0, kB + 5, &*h0).ok());
  ASSERT_TRUE(m->AllocateSlots(1, kB + 5, &*h1).ok());
  EXPECT_NE(Table(*m, 0)[0], Table(*m, 1)[0]);
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 1u);
  EXPECT_EQ(sink.events().size(), 1u);
  // A third request hits one of the copies.
  PrefixHit hit = Prefill(*m, TokenRequest(2, prompt));
  EXPECT_EQ(hit.blocks.size(), 1u);
  const BlockHash shared = m->BlockHashes(0)[0];
  for (RequestId id : {0, 1, 2}) ASSERT_TRUE(m->Free(id).ok());
  EXPECT_TRUE(m->block_pool().IsCached(shared, StateKind::kAttnKv));
  // Evict every block: one removal event in total.
  Prefill(*m, TokenRequest(3, Seq(5000, 7 * kB)));
  EXPECT_FALSE(m->block_pool().IsCached(shared, StateKind::kAttnKv));
  EventReplayer r;
  r.Apply(sink.events());
  EXPECT_TRUE(r.Held(StateKind::kAttnKv).count(shared) == 0);
  EXPECT_EQ(r.Held(StateKind::kAttnKv), testing::CachedSet(m->block_pool(), StateKind::kAttnKv));
}

// Requests of different tenants never share a block: the salt is in the first hash.
TEST(PrefixCachingTest, TenantSaltIsolatesPrefixes) {
  auto m = MakeManager(PagedConfig(20, kB));
  const auto prompt = Seq(0, 4 * kB);
  Prefill(*m, TokenRequest(0, prompt, "tenant-a"));
  EXPECT_EQ(Prefill(*m, TokenRequest(1, prompt, "tenant-b")).num_tokens, 0);
  EXPECT_EQ(Prefill(*m, TokenRequest(2, prompt, "")).num_tokens, 0);
  EXPECT_EQ(Prefill(*m, TokenRequest(3, prompt, "tenant-a")).num_tokens, 3 * kB);
  const auto t0 = Table(*m, 0), t1 = Table(*m, 1), t3 = Table(*m, 3);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_NE(t0[i], t1[i]);
    EXPECT_EQ(t0[i], t3[i]);
  }
}

// vLLM test_mm_prefix_caching / cache_salt: extra keys (LoRA id, image hash) split too.
TEST(PrefixCachingTest, ExtraKeysIsolatePrefixes) {
  auto m = MakeManager(PagedConfig(20, kB));
  const auto prompt = Seq(0, 3 * kB);
  RequestSpec a = TokenRequest(0, prompt);
  a.extra_keys = {42};
  Prefill(*m, a);
  RequestSpec b = TokenRequest(1, prompt);
  b.extra_keys = {43};
  EXPECT_EQ(Prefill(*m, b).num_tokens, 0);
  RequestSpec c = TokenRequest(2, prompt);
  c.extra_keys = {42};
  EXPECT_EQ(Prefill(*m, c).num_tokens, 2 * kB);
}

// Leaf-first, least recently used first (SGLang radix cache eviction): freeing two
// chains with a shared root evicts their tails, oldest first, and the root last.
TEST(PrefixCachingTest, EvictsLeavesFirstLeastRecentlyUsedFirst) {
  RecordingEventSink sink;
  auto m = MakeManager(PagedConfig(8, kB, &sink));  // 7 usable
  const auto root = Seq(0, kB);
  Prefill(*m, TokenRequest(0, Concat(root, Seq(100, 2 * kB))));  // r, a1, a2 (+ no partial)
  Prefill(*m, TokenRequest(1, Concat(root, Seq(200, 2 * kB))));  // r (hit), b1, b2
  ASSERT_TRUE(m->Free(0).ok());  // a2, a1 to the tail (r still held by 1)
  ASSERT_TRUE(m->Free(1).ok());  // b2, b1, r
  sink.Clear();
  // 7 usable: 5 cached free + 2 never used. Take 7 blocks: every cached block goes.
  Prefill(*m, TokenRequest(2, Seq(9000, 7 * kB)));
  std::vector<BlockHash> removed;
  for (const KvEvent& e : sink.events()) {
    if (e.type == KvEvent::Type::kRemoved) {
      removed.insert(removed.end(), e.hashes.begin(), e.hashes.end());
    }
  }
  ASSERT_EQ(removed.size(), 5u);
  // Rebuild the expected order from the hashes of the two chains.
  auto hasher = BlockHasher::Create({.model_id = "test-model", .block_tokens = kB});
  ASSERT_TRUE(hasher.ok());
  const auto ha = testing::HashPrefix(*hasher, Concat(root, Seq(100, 2 * kB)));
  const auto hb = testing::HashPrefix(*hasher, Concat(root, Seq(200, 2 * kB)));
  EXPECT_THAT(removed, ElementsAre(ha[2], ha[1], hb[2], hb[1], ha[0]));
  EXPECT_EQ(ha[0], hb[0]);
}

TEST(PrefixCachingTest, ResetPrefixCacheRefusesWhileInUse) {
  RecordingEventSink sink;
  auto m = MakeManager(PagedConfig(10, kB, &sink));
  Prefill(*m, TokenRequest(0, Seq(0, 2 * kB + 1)));
  absl::Status s = m->ResetPrefixCache();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("in use"));
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->ResetPrefixCache().ok());
  EXPECT_EQ(sink.events().back().type, KvEvent::Type::kCleared);
  EXPECT_EQ(Prefill(*m, TokenRequest(1, Seq(0, 2 * kB + 1))).num_tokens, 0);
}

TEST(PrefixCachingTest, EventsCarryParentsAndSequenceNumbers) {
  RecordingEventSink sink;
  auto m = MakeManager(PagedConfig(20, kB, &sink));
  const auto prompt = Seq(0, 3 * kB + 2);
  Prefill(*m, TokenRequest(0, prompt));
  Prefill(*m, TokenRequest(1, Concat(Seq(0, 3 * kB), Seq(77, kB + 1))));
  ASSERT_EQ(sink.events().size(), 2u);
  const KvEvent& first = sink.events()[0];
  EXPECT_EQ(first.sequence, 1u);
  EXPECT_EQ(first.type, KvEvent::Type::kStored);
  EXPECT_EQ(first.kind, StateKind::kAttnKv);
  EXPECT_EQ(first.tier, Tier::kGpu);
  EXPECT_FALSE(first.parent.has_value());
  EXPECT_THAT(first.hashes, ElementsAreArray(m->BlockHashes(0)));
  const KvEvent& second = sink.events()[1];
  EXPECT_EQ(second.sequence, 2u);
  EXPECT_EQ(second.parent, m->BlockHashes(0)[2]);
  EXPECT_THAT(second.hashes, ElementsAre(m->BlockHashes(1)[3]));
  EXPECT_EQ(sink.source_ids()[0], "test-worker");
}

TEST(PrefixCachingTest, HashedRequestsNeedNoTokens) {
  auto m = MakeManager(PagedConfig(20, kB));
  RequestSpec s;
  s.id = 0;
  s.num_prompt_tokens = 3 * kB + 4;
  s.block_hashes = {BlockHash{1, 1}, BlockHash{2, 2}, BlockHash{3, 3}};
  Prefill(*m, s);
  s.id = 1;
  s.block_hashes = {BlockHash{1, 1}, BlockHash{2, 2}, BlockHash{9, 9}};
  EXPECT_EQ(Prefill(*m, s).num_tokens, 2 * kB);
  s.id = 2;
  s.block_hashes = {BlockHash{1, 1}, BlockHash{2, 2}, BlockHash{3, 3}, BlockHash{4, 4}};
  EXPECT_EQ(m->AddRequest(s).code(), absl::StatusCode::kInvalidArgument);
  // A hash repeated within the chain (two copies, and for hybrids two checkpoints, under
  // one key) is refused, naming the entry.
  s.id = 3;
  s.block_hashes = {BlockHash{1, 1}, BlockHash{2, 2}, BlockHash{1, 1}};
  const absl::Status dup = m->AddRequest(s);
  EXPECT_EQ(dup.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(dup.message().find("block_hashes[2]"), absl::string_view::npos) << dup;
}

TEST(PrefixCachingTest, StaleHitIsRefused) {
  auto m = MakeManager(PagedConfig(4, kB));  // 3 usable
  Prefill(*m, TokenRequest(0, Seq(0, 2 * kB + 1)));
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->AddRequest(TokenRequest(1, Seq(0, 2 * kB + 1))).ok());
  auto hit = m->GetComputedBlocks(1);
  ASSERT_TRUE(hit.ok());
  ASSERT_EQ(hit->blocks.size(), 2u);
  // Another request evicts the hit blocks before request 1 allocates.
  Prefill(*m, TokenRequest(2, Seq(500, 3 * kB)));
  auto a = m->AllocateSlots(1, 1, &*hit);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(PrefixCachingTest, DisabledPrefixCachingNeverHits) {
  CacheConfig c = PagedConfig(20, kB);
  c.enable_prefix_caching = false;
  auto m = MakeManager(c);
  Prefill(*m, TokenRequest(0, Seq(0, 3 * kB)));
  EXPECT_EQ(Prefill(*m, TokenRequest(1, Seq(0, 3 * kB))).num_tokens, 0);
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kAttnKv), 0u);
}

TEST(PrefixCachingTest, ConfigErrorsNameTheField) {
  CacheConfig c = PagedConfig(1, kB);
  auto m = KvCacheManager::Create(c);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), ::testing::HasSubstr("num_blocks=1"));
  c = PagedConfig(10, 0);
  EXPECT_THAT(std::string(KvCacheManager::Create(c).status().message()),
              ::testing::HasSubstr("block_tokens"));
  auto unknown = CreateCacheManager("lru", PagedConfig(10, kB));
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::cache
