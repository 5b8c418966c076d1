// The hybrid dual cache: MLA blocks + KDA live states and checkpoints in one pool.
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::cache {
namespace {

using ::testing::ElementsAre;
using testing::Concat;
using testing::EventReplayer;
using testing::MakeManager;
using testing::Prefill;
using testing::Seq;
using testing::Table;
using testing::TokenRequest;

// tiny-hybrid: 64-token blocks, a checkpoint every 256 tokens (4 blocks), 2-page states.
constexpr int kB = 64;
constexpr int kStep = 256;

CacheConfig HybridConfig(int32_t num_blocks, HybridHitMode mode, KvEventSink* sink = nullptr) {
  auto spec = GetPreset("tiny-hybrid");
  EXPECT_TRUE(spec.ok());
  auto layout = CacheLayout::FromModelSpec(*spec);
  EXPECT_TRUE(layout.ok()) << layout.status();
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.layout = *layout;
  c.hybrid_mode = mode;
  c.hash_options.model_id = "tiny-hybrid";
  c.event_sink = sink;
  return c;
}

TEST(HybridLayoutTest, DerivedFromModelSpecs) {
  auto tiny = CacheLayout::FromModelSpec(*GetPreset("tiny-hybrid"));
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ(tiny->block_tokens, 64);
  EXPECT_EQ(tiny->checkpoint_tokens, 256);
  EXPECT_EQ(tiny->page_bytes, 64 * 1152);
  EXPECT_EQ(tiny->state_pages, 2);  // 96 KiB of fp32 state in 72 KiB pages
  ASSERT_EQ(tiny->groups.size(), 2u);
  EXPECT_EQ(tiny->groups[0].attention, AttentionKind::kMla);
  EXPECT_EQ(tiny->groups[1].state, StateKind::kLinearState);

  auto kimi = CacheLayout::FromModelSpec(*GetPreset("kimi-k3"));
  ASSERT_TRUE(kimi.ok());
  EXPECT_EQ(kimi->checkpoint_tokens, 6144);
  EXPECT_EQ(kimi->state_pages, 123);  // 207 MiB of KDA state in 1.69 MiB pages

  auto llama = CacheLayout::FromModelSpec(*GetPreset("llama-3.3-70b"));
  ASSERT_TRUE(llama.ok());
  EXPECT_FALSE(llama->hybrid());
}

TEST(HybridTest, LiveStateAndCheckpointsAtEveryBoundary) {
  RecordingEventSink sink;
  auto m = MakeManager(HybridConfig(64, HybridHitMode::kReplay, &sink));
  ASSERT_TRUE(m->AddRequest(TokenRequest(0, Seq(0, 700))).ok());
  auto hit = m->GetComputedBlocks(0);
  ASSERT_TRUE(hit.ok());
  auto a = m->AllocateSlots(0, 700, &*hit);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_NE(a->live_state, kNoBlock);
  EXPECT_EQ(m->block_pool().RunPages(a->live_state).size(), 2u);
  EXPECT_EQ(a->restore.src, kNoBlock);  // nothing to restore: the state starts at zero
  ASSERT_EQ(a->checkpoint_saves.size(), 2u);
  const auto hashes = m->BlockHashes(0);
  EXPECT_EQ(a->checkpoint_saves[0].boundary_tokens, 256);
  EXPECT_EQ(a->checkpoint_saves[0].hash, hashes[3]);
  EXPECT_EQ(a->checkpoint_saves[1].boundary_tokens, 512);
  EXPECT_EQ(a->checkpoint_saves[1].hash, hashes[7]);
  EXPECT_EQ(Table(*m, 0).size(), 11u);
  const CacheUsage u = m->Usage();
  EXPECT_EQ(u.state_pages_in_use, 2 + 2 * 2);
  EXPECT_EQ(u.used_blocks, 11 + 6);
  EXPECT_EQ(u.reserved_tokens, 11 * kB);
  // Events: the MLA chain, then a checkpoint per boundary with its chain parent.
  std::vector<const KvEvent*> ckpt;
  for (const KvEvent& e : sink.events()) {
    if (e.kind == StateKind::kLinearState) ckpt.push_back(&e);
  }
  ASSERT_EQ(ckpt.size(), 2u);
  EXPECT_THAT(ckpt[0]->hashes, ElementsAre(hashes[3]));
  EXPECT_EQ(ckpt[0]->parent, hashes[2]);
  EXPECT_THAT(ckpt[1]->hashes, ElementsAre(hashes[7]));

  // Decode across the next boundary (768) saves one more checkpoint.
  for (int i = 700; i < 768; ++i) {
    ASSERT_TRUE(m->AppendTokens(0, std::vector<TokenId>{static_cast<TokenId>(i)}).ok());
    auto d = m->AllocateSlots(0, 1);
    ASSERT_TRUE(d.ok()) << d.status();
    EXPECT_EQ(d->checkpoint_saves.size(), i == 767 ? 1u : 0u) << i;
  }
  ASSERT_TRUE(m->Free(0).ok());
  const CacheUsage after = m->Usage();
  EXPECT_EQ(after.used_blocks, 0);
  EXPECT_EQ(after.state_pages_in_use, 0);
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kLinearState), 3u);
}

// MLA hit m = 640 (10 blocks); checkpoints at 256 and 512, so c = 512.
TEST(HybridTest, StrictAndReplayHits) {
  for (HybridHitMode mode : {HybridHitMode::kStrict, HybridHitMode::kReplay}) {
    SCOPED_TRACE(HybridHitModeName(mode));
    auto m = MakeManager(HybridConfig(64, mode));
    Prefill(*m, TokenRequest(0, Seq(0, 700)));
    ASSERT_TRUE(m->Free(0).ok());
    ASSERT_TRUE(m->AddRequest(TokenRequest(1, Concat(Seq(0, 640), Seq(5000, 100)))).ok());
    auto hit = m->GetComputedBlocks(1);
    ASSERT_TRUE(hit.ok());
    EXPECT_EQ(hit->attn_hit_tokens, 640);
    EXPECT_EQ(hit->checkpoint_tokens, 512);
    ASSERT_NE(hit->checkpoint, kNoBlock);
    if (mode == HybridHitMode::kStrict) {
      EXPECT_EQ(hit->num_tokens, 512);
      EXPECT_EQ(hit->blocks.size(), 8u);
      EXPECT_EQ(hit->replay_tokens, 0);
    } else {
      EXPECT_EQ(hit->num_tokens, 640);
      EXPECT_EQ(hit->blocks.size(), 10u);
      EXPECT_EQ(hit->replay_tokens, 128);
    }
    auto a = m->AllocateSlots(1, 740 - hit->num_tokens, &*hit);
    ASSERT_TRUE(a.ok()) << a.status();
    EXPECT_EQ(a->restore.src, hit->checkpoint);
    EXPECT_EQ(a->restore.dst, a->live_state);
    EXPECT_EQ(a->restore.num_pages, 2);
    EXPECT_EQ(m->block_pool().block(hit->checkpoint).ref_cnt, 1);
    EXPECT_EQ(m->NumTokens(1), 740);
    ASSERT_TRUE(m->Free(1).ok());
    EXPECT_EQ(m->block_pool().block(hit->checkpoint).ref_cnt, 0);
    EXPECT_EQ(m->Usage().state_pages_in_use, 0);
  }
}

TEST(HybridTest, PartialHitsAfterEvictingChosenBlocksOrCheckpoints) {
  auto m = MakeManager(HybridConfig(64, HybridHitMode::kReplay));
  const auto prompt = Seq(0, 700);
  Prefill(*m, TokenRequest(0, prompt));
  const auto hashes = std::vector<BlockHash>(m->BlockHashes(0).begin(), m->BlockHashes(0).end());
  ASSERT_TRUE(m->Free(0).ok());
  RequestId next = 1;
  auto probe = [&]() {
    const RequestId id = next++;
    EXPECT_TRUE(m->AddRequest(TokenRequest(id, prompt)).ok());
    auto hit = m->GetComputedBlocks(id);
    EXPECT_TRUE(hit.ok());
    EXPECT_TRUE(m->Free(id).ok());  // never allocated: nothing to release
    return *hit;
  };
  PrefixHit full = probe();
  EXPECT_EQ(full.attn_hit_tokens, 640);
  EXPECT_EQ(full.checkpoint_tokens, 512);

  // Evict MLA block 5 (tokens 320..383): m = 320, so c falls back to 256.
  ASSERT_TRUE(m->EvictCached(hashes[5], StateKind::kAttnKv).ok());
  PrefixHit h1 = probe();
  EXPECT_EQ(h1.attn_hit_tokens, 320);
  EXPECT_EQ(h1.checkpoint_tokens, 256);
  EXPECT_EQ(h1.replay_tokens, 64);
  EXPECT_TRUE(m->block_pool().IsCached(hashes[7], StateKind::kLinearState))
      << "the 512 checkpoint is still cached, just unreachable";

  // Evict the 256 checkpoint: c = 0, the whole MLA hit is replayed from the zero state.
  ASSERT_TRUE(m->EvictCached(hashes[3], StateKind::kLinearState).ok());
  PrefixHit h2 = probe();
  EXPECT_EQ(h2.attn_hit_tokens, 320);
  EXPECT_EQ(h2.checkpoint_tokens, 0);
  EXPECT_EQ(h2.checkpoint, kNoBlock);
  EXPECT_EQ(h2.num_tokens, 320);
  EXPECT_EQ(h2.replay_tokens, 320);

  // A checkpoint is never a hit without its MLA prefix: drop block 1 and the 512
  // checkpoint (still cached) is not found.
  ASSERT_TRUE(m->EvictCached(hashes[1], StateKind::kAttnKv).ok());
  PrefixHit h3 = probe();
  EXPECT_EQ(h3.attn_hit_tokens, 64);
  EXPECT_EQ(h3.checkpoint, kNoBlock);
  EXPECT_TRUE(m->block_pool().IsCached(hashes[7], StateKind::kLinearState));
}

TEST(HybridTest, StrictModeMissesWithoutACheckpoint) {
  auto m = MakeManager(HybridConfig(64, HybridHitMode::kStrict));
  const auto prompt = Seq(0, 300);
  Prefill(*m, TokenRequest(0, prompt));
  const BlockHash boundary = m->BlockHashes(0)[3];
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->EvictCached(boundary, StateKind::kLinearState).ok());
  ASSERT_TRUE(m->AddRequest(TokenRequest(1, prompt)).ok());
  auto hit = m->GetComputedBlocks(1);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->attn_hit_tokens, 256);
  EXPECT_EQ(hit->num_tokens, 0) << "strict: no checkpoint, no hit";
  // Allocating from zero recomputes the state and saves the 256 checkpoint again.
  auto a = m->AllocateSlots(1, 300, &*hit);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->checkpoint_saves.size(), 1u);
  EXPECT_EQ(a->checkpoint_saves[0].hash, boundary);
}

// Hits the manager did not make are refused (FAILED_PRECONDITION), not followed: a
// negative checkpoint_tokens without a checkpoint read hashes[-1], and a strict hit with
// blocks but no checkpoint started the KDA state from zero past them.
TEST(HybridTest, MalformedHitsAreRefused) {
  for (HybridHitMode mode : {HybridHitMode::kStrict, HybridHitMode::kReplay}) {
    auto m = MakeManager(HybridConfig(64, mode));
    const auto prompt = Seq(0, 300);
    Prefill(*m, TokenRequest(0, prompt));
    ASSERT_TRUE(m->Free(0).ok());
    ASSERT_TRUE(m->AddRequest(TokenRequest(1, prompt)).ok());
    auto hit = m->GetComputedBlocks(1);
    ASSERT_TRUE(hit.ok());
    ASSERT_EQ(hit->checkpoint_tokens, 256);
    PrefixHit no_ckpt = *hit;
    no_ckpt.checkpoint = kNoBlock;
    no_ckpt.checkpoint_tokens = -256;
    EXPECT_EQ(m->AllocateSlots(1, 300 - no_ckpt.num_tokens, &no_ckpt).status().code(),
              absl::StatusCode::kFailedPrecondition);
    if (mode == HybridHitMode::kStrict) {
      PrefixHit blocks_only = *hit;  // 4 blocks, no checkpoint
      blocks_only.checkpoint = kNoBlock;
      blocks_only.checkpoint_tokens = 0;
      EXPECT_EQ(m->AllocateSlots(1, 300 - blocks_only.num_tokens, &blocks_only).status().code(),
                absl::StatusCode::kFailedPrecondition);
    }
    auto good = m->AllocateSlots(1, 300 - hit->num_tokens, &*hit);  // nothing changed meanwhile
    EXPECT_TRUE(good.ok()) << good.status();
  }
}

TEST(HybridTest, ReplaySavesCheckpointsMissingBetweenRestoreAndHit) {
  auto m = MakeManager(HybridConfig(64, HybridHitMode::kReplay));
  const auto prompt = Seq(0, 700);
  Prefill(*m, TokenRequest(0, prompt));
  const BlockHash h512 = m->BlockHashes(0)[7];
  ASSERT_TRUE(m->Free(0).ok());
  ASSERT_TRUE(m->EvictCached(h512, StateKind::kLinearState).ok());
  ASSERT_TRUE(m->AddRequest(TokenRequest(1, prompt)).ok());
  auto hit = m->GetComputedBlocks(1);
  ASSERT_TRUE(hit.ok());
  EXPECT_EQ(hit->checkpoint_tokens, 256);
  EXPECT_EQ(hit->replay_tokens, 640 - 256);
  auto a = m->AllocateSlots(1, 60, &*hit);
  ASSERT_TRUE(a.ok());
  ASSERT_EQ(a->checkpoint_saves.size(), 1u);
  EXPECT_EQ(a->checkpoint_saves[0].boundary_tokens, 512);
  EXPECT_TRUE(m->block_pool().IsCached(h512, StateKind::kLinearState));
}

// Checkpoints share the pool with MLA blocks: pressure evicts them as whole runs, and
// events keep the router's view exact.
TEST(HybridTest, CheckpointsAreEvictedAsRunsUnderPressure) {
  RecordingEventSink sink;
  auto m = MakeManager(HybridConfig(24, HybridHitMode::kReplay, &sink));  // 23 usable
  Prefill(*m, TokenRequest(0, Seq(0, 520)));  // 9 blocks + live 2 + 2 checkpoints x 2
  ASSERT_EQ(m->Usage().used_blocks, 15);
  const BlockHash h256 = m->BlockHashes(0)[3];
  ASSERT_TRUE(m->Free(0).ok());
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kLinearState), 2u);
  // A fresh request needs 11 blocks + 2 live pages + 2 checkpoints = 17 pages: the 11
  // never-used or uncached pages, then the tail: the 512 checkpoint, blocks 7..4.
  Prefill(*m, TokenRequest(1, Seq(10000, 11 * kB - 10)));
  EventReplayer r;
  r.Apply(sink.events());
  EXPECT_EQ(r.Held(StateKind::kLinearState),
            testing::CachedSet(m->block_pool(), StateKind::kLinearState));
  EXPECT_EQ(r.Held(StateKind::kAttnKv), testing::CachedSet(m->block_pool(), StateKind::kAttnKv));
  EXPECT_EQ(m->Usage().evicted_checkpoints, 1u);
  // Request 0's 256 checkpoint survives next to request 1's two new ones.
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kLinearState), 3u);
  // No page of the surviving checkpoint was handed out.
  const BlockId survivor = m->block_pool().GetCachedCheckpoint(h256);
  ASSERT_NE(survivor, kNoBlock);
  for (BlockId p : m->block_pool().RunPages(survivor)) {
    EXPECT_EQ(m->block_pool().block(p).ref_cnt, 0);
    EXPECT_TRUE(m->block_pool().block(p).is_cached);
  }
}

// Checkpoints are a cache: a decode step whose slot fits in a block the request holds
// does not fail because the checkpoint at the boundary it reaches does not fit (it was
// RESOURCE_EXHAUSTED, and the runner ended the sequence); the latest boundaries are
// saved first when only some fit.
TEST(HybridTest, CheckpointsThatDoNotFitAreSkippedNotRequired) {
  auto m = MakeManager(HybridConfig(7, HybridHitMode::kReplay));  // 6 usable pages
  // 255 tokens: 4 blocks + the 2-page live state; 0 free.
  ASSERT_TRUE(m->AddRequest(TokenRequest(0, Seq(0, 255))).ok());
  auto hit = m->GetComputedBlocks(0);
  ASSERT_TRUE(hit.ok());
  ASSERT_TRUE(m->AllocateSlots(0, 255, &*hit).ok());
  ASSERT_EQ(m->Usage().used_blocks, 6);
  // Token 256 fills block 3 and reaches the 256 boundary: no page for its checkpoint.
  ASSERT_TRUE(m->AppendTokens(0, std::vector<TokenId>{255}).ok());
  auto d = m->AllocateSlots(0, 1);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(d->checkpoint_saves.empty());
  EXPECT_EQ(m->block_pool().num_cached_hashes(StateKind::kLinearState), 0u);
  ASSERT_TRUE(m->Free(0).ok());

  // 20 usable pages, a 770-token prefill: 13 blocks + 2 live pages leave 5, room for two
  // of the three checkpoints (256, 512, 768): 512 and 768 are saved.
  auto big = MakeManager(HybridConfig(21, HybridHitMode::kReplay));
  ASSERT_TRUE(big->AddRequest(TokenRequest(1, Seq(0, 770))).ok());
  auto h = big->GetComputedBlocks(1);
  ASSERT_TRUE(h.ok());
  auto a = big->AllocateSlots(1, 770, &*h);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->checkpoint_saves.size(), 2u);
  EXPECT_EQ(a->checkpoint_saves[0].boundary_tokens, 512);
  EXPECT_EQ(a->checkpoint_saves[1].boundary_tokens, 768);
}

TEST(HybridTest, ForkCopiesTheLiveStatePerChild) {
  auto m = MakeManager(HybridConfig(64, HybridHitMode::kReplay));
  Prefill(*m, TokenRequest(0, Seq(0, 100)));
  const BlockId parent_state = m->LiveState(0);
  auto copies = m->Fork(0, std::vector<RequestId>{1, 2});
  ASSERT_TRUE(copies.ok()) << copies.status();
  ASSERT_EQ(copies->size(), 2u);
  std::set<BlockId> states{parent_state};
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ((*copies)[i].src, parent_state);
    EXPECT_EQ((*copies)[i].num_pages, 2);
    EXPECT_EQ((*copies)[i].dst, m->LiveState(static_cast<RequestId>(i + 1)));
    states.insert((*copies)[i].dst);
  }
  EXPECT_EQ(states.size(), 3u);
  EXPECT_EQ(m->Usage().state_pages_in_use, 6);
  for (RequestId id : {0, 1, 2}) ASSERT_TRUE(m->Free(id).ok());
  EXPECT_EQ(m->Usage().used_blocks, 0);
}

TEST(HybridTest, InvalidCheckpointIntervalIsRejected) {
  CacheConfig c = HybridConfig(64, HybridHitMode::kReplay);
  c.layout.checkpoint_tokens = 100;
  auto m = KvCacheManager::Create(c);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(std::string(m.status().message()), ::testing::HasSubstr("checkpoint_tokens=100"));
}

}  // namespace
}  // namespace kvpool::cache
