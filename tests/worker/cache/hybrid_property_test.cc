// Property test of the hybrid dual cache: random prefill / decode / fork / free /
// explicit evictions on a tight pool, checking after every operation that
//   - each page's ref_cnt equals its holders (block tables, live states, held checkpoints)
//   - cached checkpoint runs are whole (every page cached, same ref_cnt, right length)
//   - a hit never includes a checkpoint without its MLA prefix, and strict/replay agree
//     with the definition (hit = c, or hit = m with m - c to replay)
//   - RESOURCE_EXHAUSTED changes no ref_cnt and no queue position
//   - replaying the events gives exactly the cached sets of both kinds
#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::cache {
namespace {

using testing::EventReplayer;

constexpr int32_t kB = 8;
constexpr int32_t kStep = 32;  // a checkpoint every 4 blocks
constexpr int32_t kStatePages = 2;
constexpr int32_t kBlocks = 64;

class HybridPropertyTest : public ::testing::TestWithParam<std::tuple<uint32_t, HybridHitMode>> {};

TEST_P(HybridPropertyTest, InvariantsHoldUnderRandomOperations) {
  const auto [seed, mode] = GetParam();
  std::mt19937 rng(seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  RecordingEventSink sink;
  CacheConfig config;
  config.num_blocks = kBlocks;
  config.layout = CacheLayout::Hybrid(kB, kStatePages, kStep);
  config.hybrid_mode = mode;
  config.hash_options.model_id = "hybrid-prop";
  config.event_sink = &sink;
  auto m = testing::MakeManager(config);
  ASSERT_NE(m, nullptr);
  const BlockPool& pool = m->block_pool();
  EventReplayer replay;

  std::vector<std::vector<TokenId>> docs(3);
  for (auto& d : docs) {
    for (int i = 0; i < 120; ++i) d.push_back(static_cast<TokenId>(uniform(0, 5000)));
  }
  std::vector<RequestId> live;
  RequestId next_id = 1;
  int checkpoint_hits = 0, exhausted = 0, replays = 0;

  auto snapshot = [&]() {
    std::vector<int32_t> refs;
    for (BlockId b = 0; b < kBlocks; ++b) refs.push_back(pool.block(b).ref_cnt);
    return std::make_pair(refs, pool.FreeQueueOrder());
  };
  auto drop = [&](RequestId id) {
    ASSERT_TRUE(m->Free(id).ok());
    live.erase(std::find(live.begin(), live.end(), id));
  };

  for (int op = 0; op < 3000; ++op) {
    SCOPED_TRACE(::testing::Message() << "seed " << seed << " op " << op);
    const int dice = uniform(0, 99);
    if (dice < 35 && live.size() < 6) {
      const RequestId id = next_id++;
      const auto& doc = docs[static_cast<size_t>(uniform(0, 2))];
      std::vector<TokenId> prompt(doc.begin(), doc.begin() + uniform(1, 110));
      for (int i = uniform(0, 3); i > 0; --i) prompt.push_back(static_cast<TokenId>(uniform(0, 1)));
      const int64_t n = static_cast<int64_t>(prompt.size());
      ASSERT_TRUE(m->AddRequest(testing::TokenRequest(id, prompt)).ok());
      auto hit = m->GetComputedBlocks(id);
      ASSERT_TRUE(hit.ok());
      // The hit's definition.
      const auto hashes = m->BlockHashes(id);
      const int64_t mm = hit->attn_hit_tokens, c = hit->checkpoint_tokens;
      ASSERT_LE(c, mm);
      ASSERT_LE(mm, n - 1);
      ASSERT_EQ(c % kStep, 0);
      for (int64_t i = 0; i < mm / kB; ++i) {
        ASSERT_TRUE(pool.IsCached(hashes[static_cast<size_t>(i)], StateKind::kAttnKv));
      }
      if (c > 0) {
        ASSERT_NE(hit->checkpoint, kNoBlock);
        ASSERT_EQ(pool.block(hit->checkpoint).hash, hashes[static_cast<size_t>(c / kB - 1)]);
        ++checkpoint_hits;
      } else {
        ASSERT_EQ(hit->checkpoint, kNoBlock);
      }
      // c is the last cached checkpoint <= m.
      for (int64_t k = c + kStep; k <= mm; k += kStep) {
        ASSERT_FALSE(pool.IsCached(hashes[static_cast<size_t>(k / kB - 1)],
                                   StateKind::kLinearState));
      }
      if (mode == HybridHitMode::kStrict) {
        ASSERT_EQ(hit->num_tokens, c);
        ASSERT_EQ(hit->replay_tokens, 0);
      } else {
        ASSERT_EQ(hit->num_tokens, mm);
        ASSERT_EQ(hit->replay_tokens, mm - c);
        replays += hit->replay_tokens > 0 ? 1 : 0;
      }
      const auto before = snapshot();
      auto a = m->AllocateSlots(id, n - hit->num_tokens, &*hit);
      live.push_back(id);
      if (!a.ok()) {
        ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted) << a.status();
        ASSERT_EQ(snapshot(), before) << "a failed allocation changed the pool";
        ++exhausted;
        drop(id);
      } else {
        ASSERT_NE(a->live_state, kNoBlock);
        ASSERT_EQ(a->restore.src, hit->checkpoint);
      }
    } else if (dice < 65 && !live.empty()) {
      const RequestId id = live[static_cast<size_t>(uniform(0, static_cast<int>(live.size()) - 1))];
      std::vector<TokenId> t;
      for (int i = uniform(1, 9); i > 0; --i) t.push_back(static_cast<TokenId>(uniform(0, 1)));
      ASSERT_TRUE(m->AppendTokens(id, t).ok());
      const auto before = snapshot();
      auto a = m->AllocateSlots(id, static_cast<int64_t>(t.size()));
      if (!a.ok()) {
        ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
        ASSERT_EQ(snapshot(), before);
        ++exhausted;
        drop(id);
      }
    } else if (dice < 70 && !live.empty() && live.size() < 6) {
      const RequestId parent = live[static_cast<size_t>(uniform(0, static_cast<int>(live.size()) - 1))];
      const RequestId child = next_id++;
      const auto before = snapshot();
      auto copies = m->Fork(parent, std::vector<RequestId>{child});
      if (copies.ok()) {
        live.push_back(child);
        ASSERT_EQ(copies->size(), 1u);
        ASSERT_EQ((*copies)[0].num_pages, kStatePages);
      } else {
        ASSERT_EQ(copies.status().code(), absl::StatusCode::kResourceExhausted);
        ASSERT_EQ(snapshot(), before);
      }
    } else if (dice < 92 && !live.empty()) {
      drop(live[static_cast<size_t>(uniform(0, static_cast<int>(live.size()) - 1))]);
    } else {
      const StateKind kind = uniform(0, 1) == 0 ? StateKind::kAttnKv : StateKind::kLinearState;
      auto cached = pool.CachedHashes(kind);
      if (!cached.empty()) {
        std::sort(cached.begin(), cached.end());
        auto s = m->EvictCached(cached[static_cast<size_t>(uniform(0, static_cast<int>(cached.size()) - 1))], kind);
        ASSERT_TRUE(s.ok() || s.status().code() == absl::StatusCode::kFailedPrecondition) << s.status();
      }
    }

    // --- invariants ----------------------------------------------------------------
    std::vector<int32_t> holders(kBlocks, 0);
    for (RequestId id : live) {
      for (BlockId b : m->BlockTable(id)) ++holders[b];
      if (m->LiveState(id) != kNoBlock) {
        for (BlockId p : pool.RunPages(m->LiveState(id))) ++holders[p];
      }
      for (const auto& cp : m->Checkpoints(id)) {
        for (BlockId p : pool.RunPages(cp.head)) ++holders[p];
      }
    }
    int32_t state_in_use = 0;
    for (BlockId b = 1; b < kBlocks; ++b) {
      ASSERT_EQ(pool.block(b).ref_cnt, holders[b]) << "block " << b;
      ASSERT_EQ(pool.block(b).in_free_queue, holders[b] == 0) << "block " << b;
      if (holders[b] > 0 && pool.block(b).kind == StateKind::kLinearState) ++state_in_use;
    }
    ASSERT_EQ(m->Usage().state_pages_in_use, state_in_use);
    for (const BlockHash& h : pool.CachedHashes(StateKind::kLinearState)) {
      const BlockId head = pool.GetCachedCheckpoint(h);
      const auto pages = pool.RunPages(head);
      ASSERT_EQ(pages.size(), static_cast<size_t>(kStatePages));
      for (BlockId p : pages) {
        ASSERT_TRUE(pool.block(p).is_cached);
        ASSERT_EQ(pool.block(p).run_head, head);
        ASSERT_EQ(pool.block(p).ref_cnt, pool.block(head).ref_cnt);
      }
    }
    replay.Apply(sink.events());
    ASSERT_EQ(replay.Held(StateKind::kAttnKv), testing::CachedSet(pool, StateKind::kAttnKv));
    ASSERT_EQ(replay.Held(StateKind::kLinearState),
              testing::CachedSet(pool, StateKind::kLinearState));
  }
  EXPECT_GT(checkpoint_hits, 20);
  EXPECT_GT(exhausted, 0);
  if (mode == HybridHitMode::kReplay) {
    EXPECT_GT(replays, 10);
  }
  EXPECT_GT(m->Usage().evicted_checkpoints, 0u);
  for (RequestId id : std::vector<RequestId>(live)) drop(id);
  EXPECT_EQ(pool.num_free_blocks(), kBlocks - 1);
}

INSTANTIATE_TEST_SUITE_P(
    Seeds, HybridPropertyTest,
    ::testing::Combine(::testing::Values(11u, 12u, 13u),
                       ::testing::Values(HybridHitMode::kStrict, HybridHitMode::kReplay)),
    [](const ::testing::TestParamInfo<std::tuple<uint32_t, HybridHitMode>>& info) {
      return absl::StrCat("seed", std::get<0>(info.param), "_",
                          HybridHitModeName(std::get<1>(info.param)));
    });

}  // namespace
}  // namespace kvpool::cache
