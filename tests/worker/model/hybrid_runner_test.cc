// ModelRunner on tiny-hybrid (3 KDA + 1 MLA layers, 64-token blocks, a KDA checkpoint
// every 256 tokens): checkpoint restore + replay (and strict) equal the uninterrupted
// run, checkpoints saved by decode steps, and blocks + checkpoints imported as bytes.
#include <algorithm>
#include <iterator>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/worker/model/model_runner.h"
#include "test_util.h"

namespace kvpool::model {
namespace {

using testing::Concat;
using testing::MakeRunner;
using testing::Gen;
using testing::Tokens;

constexpr int kBlock = 64;
constexpr int kCheckpoint = 256;

// 5 blocks: the MLA hit m = 320 and the last checkpoint c = 256 below it.
std::vector<TokenId> Prefix() { return Tokens(5 * kBlock, 31); }

RunnerOptions Mode(cache::HybridHitMode mode) {
  RunnerOptions o;
  o.hybrid_mode = mode;
  return o;
}

class HybridRunnerTest : public ::testing::TestWithParam<cache::HybridHitMode> {};

TEST_P(HybridRunnerTest, CheckpointRestoreEqualsUninterrupted) {
  const bool replay = GetParam() == cache::HybridHitMode::kReplay;
  auto warm = MakeRunner("tiny-hybrid", Mode(GetParam()));
  auto cold = MakeRunner("tiny-hybrid", Mode(GetParam()));
  ASSERT_TRUE(warm && cold);
  Gen(*warm, Concat(Prefix(), Tokens(10, 1)), 2);
  const auto prompt = Concat(Prefix(), Tokens(12, 2));
  const GenerateResult hit = Gen(*warm, prompt, 5);
  EXPECT_EQ(hit.checkpoint_tokens, kCheckpoint);
  EXPECT_EQ(hit.hit_tokens, replay ? 5 * kBlock : kCheckpoint);
  EXPECT_EQ(hit.replayed_tokens, replay ? 5 * kBlock - kCheckpoint : 0);
  EXPECT_EQ(hit.recomputed_tokens, static_cast<int64_t>(prompt.size()) - hit.hit_tokens);
  const GenerateResult recompute = Gen(*cold, prompt, 5);
  EXPECT_EQ(recompute.hit_tokens, 0);
  EXPECT_SAME_OUTPUT(hit, recompute);
}

TEST(HybridRunnerOnceTest, SharedPrefixInOneBatchWaitsForItsCheckpoint) {
  // Two requests with the same prefix arrive together: the second may only restore the
  // checkpoint once the first one's prefill has written it. (Replay mode; strict
  // restores through the same path.)
  auto r = MakeRunner("tiny-hybrid");
  auto cold = MakeRunner("tiny-hybrid");
  ASSERT_TRUE(r && cold);
  const auto p1 = Concat(Prefix(), Tokens(10, 1));
  const auto p2 = Concat(Prefix(), Tokens(12, 2));
  auto a = r->AddSequence(testing::Req(p1, 2));
  auto b = r->AddSequence(testing::Req(p2, 3));
  ASSERT_TRUE(a.ok() && b.ok());
  while (r->NumUnfinished() > 0) ASSERT_TRUE(r->Step().ok());
  auto rb = r->TakeResult(*b);
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_EQ(rb->checkpoint_tokens, kCheckpoint);
  EXPECT_SAME_OUTPUT(*rb, Gen(*cold, p2, 3));
}

TEST_P(HybridRunnerTest, CheckpointSavedByDecodeEqualsRecompute) {
  auto warm = MakeRunner("tiny-hybrid", Mode(GetParam()));
  auto cold = MakeRunner("tiny-hybrid", Mode(GetParam()));
  ASSERT_TRUE(warm && cold);
  // Decode crosses token 256: the checkpoint there is saved by a decode step.
  const auto turn1 = Tokens(kCheckpoint - 6, 41);
  const GenerateResult r1 = Gen(*warm, turn1, 12);
  const auto turn2 = Concat(Concat(turn1, r1.output_tokens), Tokens(70, 42));
  const GenerateResult hit = Gen(*warm, turn2, 4);
  EXPECT_EQ(hit.checkpoint_tokens, kCheckpoint);
  EXPECT_EQ(hit.hit_tokens, kCheckpoint);
  EXPECT_SAME_OUTPUT(hit, Gen(*cold, turn2, 4));
}

TEST(HybridRunnerOnceTest, CorruptedCheckpointChangesTheOutput) {
  // The restore path really reads the checkpoint pages (replay mode; strict restores
  // through the same code).
  auto warm = MakeRunner("tiny-hybrid");
  auto cold = MakeRunner("tiny-hybrid");
  ASSERT_TRUE(warm && cold);
  Gen(*warm, Concat(Prefix(), Tokens(10, 1)), 1);
  const auto prompt = Concat(Prefix(), Tokens(12, 2));
  const auto chain = warm->HashPrompt(prompt, "");
  const cache::BlockId head =
      warm->cache().block_pool().GetCachedCheckpoint(chain[kCheckpoint / kBlock - 1]);
  ASSERT_NE(head, cache::kNoBlock);
  float* state = reinterpret_cast<float*>(warm->arena().PageAddress(head));
  for (int i = 0; i < 4096; ++i) state[i] += 0.25f;  // layer 0, head 0
  const GenerateResult hit = Gen(*warm, prompt, 3);
  EXPECT_EQ(hit.checkpoint_tokens, kCheckpoint);
  EXPECT_NE(hit.hidden_digest, Gen(*cold, prompt, 3).hidden_digest);
}

TEST_P(HybridRunnerTest, ImportedBlocksAndCheckpointEqualRecompute) {
  const bool replay = GetParam() == cache::HybridHitMode::kReplay;
  auto a = MakeRunner("tiny-hybrid", Mode(GetParam()));
  auto cold = MakeRunner("tiny-hybrid", Mode(GetParam()));
  ASSERT_TRUE(a && cold);
  Gen(*a, Concat(Prefix(), Tokens(10, 1)), 2);
  const auto prompt = Concat(Prefix(), Tokens(12, 2));
  const GenerateResult ref = Gen(*cold, prompt, 4);
  const auto chain = a->HashPrompt(prompt, "");
  ASSERT_EQ(chain.size(), 5u);
  std::vector<std::vector<std::byte>> blocks;
  for (const BlockHash& h : chain) {
    auto e = a->ExportBlock(h);
    ASSERT_TRUE(e.ok()) << e.status();
    blocks.push_back(*e);
  }
  auto ckpt = a->ExportCheckpoint(chain[kCheckpoint / kBlock - 1]);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_EQ(ckpt->size(), static_cast<size_t>(a->arena().state_bytes()));

  {  // Blocks + checkpoint.
    auto b = MakeRunner("tiny-hybrid", Mode(GetParam()));
    ASSERT_TRUE(b);
    PrefixImport im;
    im.chain = chain;
    for (const auto& v : blocks) im.blocks.emplace_back(v);
    im.checkpoints.push_back({chain[kCheckpoint / kBlock - 1], *ckpt});
    auto stats = b->ImportPrefix(im);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->blocks_imported, 5);
    EXPECT_EQ(stats->checkpoints_imported, 1);
    const GenerateResult got = Gen(*b, prompt, 4);
    EXPECT_EQ(got.checkpoint_tokens, kCheckpoint);
    EXPECT_EQ(got.hit_tokens, replay ? 5 * kBlock : kCheckpoint);
    EXPECT_SAME_OUTPUT(got, ref);
  }
  {  // Blocks only: no checkpoint may be cached without bytes; the KDA state starts
     // from zero (replay: all 320 tokens through the KDA layers; strict: recompute).
    auto b = MakeRunner("tiny-hybrid", Mode(GetParam()));
    ASSERT_TRUE(b);
    PrefixImport im;
    im.chain = chain;
    for (const auto& v : blocks) im.blocks.emplace_back(v);
    auto stats = b->ImportPrefix(im);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(b->cache().block_pool().GetCachedCheckpoint(chain[kCheckpoint / kBlock - 1]),
              cache::kNoBlock);
    const GenerateResult got = Gen(*b, prompt, 4);
    EXPECT_EQ(got.checkpoint_tokens, 0);
    EXPECT_EQ(got.replayed_tokens, replay ? 5 * kBlock : 0);
    EXPECT_SAME_OUTPUT(got, ref);
  }
}

// A fetch of 9 blocks and the checkpoint at 512 that fails (node gone, DATA_LOSS, lease
// run out): FinishImport(false) must leave nothing the import cached. The import also
// set aside the checkpoint run at 256, which it was not asked to fill: evicting that one
// twice (as unfilled, then as cached) returned NOT_FOUND, which ended FinishImport
// before the blocks, so all 9 blocks stayed hits over pages nobody wrote.
TEST_P(HybridRunnerTest, FailedFetchAcrossTwoCheckpointsLeavesNoHit) {
  auto a = MakeRunner("tiny-hybrid", Mode(GetParam()));
  auto b = MakeRunner("tiny-hybrid", Mode(GetParam()));
  auto cold = MakeRunner("tiny-hybrid", Mode(GetParam()));
  ASSERT_TRUE(a && b && cold);
  const auto prompt = Tokens(9 * kBlock + 10, 47);
  Gen(*a, prompt, 1);
  const auto chain = a->HashPrompt(prompt, "");
  ASSERT_EQ(chain.size(), 9u);
  bool have[9];
  std::fill(std::begin(have), std::end(have), true);
  const BlockHash at512[1] = {chain[2 * kCheckpoint / kBlock - 1]};
  const int64_t free_before = b->cache().block_pool().num_free_blocks();
  auto plan = b->BeginImport(chain, have, at512);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->blocks.size(), 9u);
  ASSERT_EQ(plan->checkpoints.size(), 1u);
  // Only the checkpoint it brings bytes for is set aside (before, also the one at 256,
  // and a live KDA state), so only 9 blocks and one state run are taken.
  EXPECT_TRUE(plan->unfilled.empty());
  EXPECT_EQ(plan->cached_checkpoints.size(), 1u);
  EXPECT_EQ(b->cache().block_pool().num_free_blocks(),
            free_before - 9 - b->arena().state_pages());
  ASSERT_TRUE(b->FinishImport(*plan, /*filled=*/false).ok());
  for (const BlockHash& h : chain) EXPECT_EQ(b->ExportBlock(h).status().code(), absl::StatusCode::kNotFound);
  for (int c : {kCheckpoint, 2 * kCheckpoint}) {
    EXPECT_EQ(b->cache().block_pool().GetCachedCheckpoint(chain[c / kBlock - 1]), cache::kNoBlock) << c;
  }
  const GenerateResult got = Gen(*b, prompt, 3);
  EXPECT_EQ(got.hit_tokens, 0);
  EXPECT_SAME_OUTPUT(got, Gen(*cold, prompt, 3));
}

// A failed fetch evicts only the pages it was to fill. Here the local prefix is 5 blocks
// with a checkpoint after 4: a strict hit stops at the checkpoint, so the import copies
// local block 4 into a fresh page and fetches blocks 5..8. Before, FinishImport(false)
// evicted block 4 by hash, the local copy it came from as well: a good local block lost.
TEST_P(HybridRunnerTest, FailedFetchKeepsTheLocalBlocksItCopied) {
  auto b = MakeRunner("tiny-hybrid", Mode(GetParam()));
  ASSERT_TRUE(b);
  Gen(*b, Concat(Prefix(), Tokens(10, 1)), 1);  // blocks 0..4 cached, checkpoint at 256
  const auto prompt = Concat(Prefix(), Tokens(4 * kBlock + 10, 2));
  const auto chain = b->HashPrompt(prompt, "");
  ASSERT_EQ(chain.size(), 9u);
  bool have[9];
  for (size_t i = 0; i < 9; ++i) have[i] = i >= 5;
  auto plan = b->BeginImport(chain, have, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->blocks.size(), 4u);
  ASSERT_TRUE(b->FinishImport(*plan, /*filled=*/false).ok());
  for (size_t i = 0; i < 5; ++i) EXPECT_TRUE(b->ExportBlock(chain[i]).ok()) << "local block " << i << " was evicted";
  for (size_t i = 5; i < 9; ++i) EXPECT_EQ(b->ExportBlock(chain[i]).status().code(), absl::StatusCode::kNotFound) << i;
  const GenerateResult got = Gen(*b, prompt, 1);
  EXPECT_EQ(got.hit_tokens, GetParam() == cache::HybridHitMode::kReplay ? 5 * kBlock : kCheckpoint);
}

INSTANTIATE_TEST_SUITE_P(Modes, HybridRunnerTest,
                         ::testing::Values(cache::HybridHitMode::kReplay,
                                           cache::HybridHitMode::kStrict),
                         [](const auto& info) {
                           return std::string(cache::HybridHitModeName(info.param));
                         });

}  // namespace
}  // namespace kvpool::model
