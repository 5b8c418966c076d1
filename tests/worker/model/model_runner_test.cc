// ModelRunner on tiny-gqa and tiny-mla: determinism, THE INVARIANT (local hit, pool
// import and recompute give bit-identical outputs), tenant isolation, batching, errors.
#include "kvpool/worker/model/model_runner.h"

#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::model {
namespace {

using testing::Concat;
using testing::MakeRunner;
using testing::Gen;
using testing::Req;
using testing::Tokens;

class RunnerTest : public ::testing::TestWithParam<const char*> {
 protected:
  std::string preset() const { return GetParam(); }
  int block() const { return GetPreset(preset())->block_tokens; }
  // A shared prefix of 2 blocks and a few tokens (short: the tests stay quick).
  std::vector<TokenId> Prefix() const { return Tokens(2 * block(), 11); }
  // A runner with `changed` options gives the default runner's output for the prefix
  // and `extra` more tokens (4 generated).
  void ExpectSameOutputWith(const RunnerOptions& changed, int extra) {
    auto a = MakeRunner(preset());
    auto b = MakeRunner(preset(), changed);
    ASSERT_TRUE(a && b);
    const auto prompt = Concat(Prefix(), Tokens(5, extra));
    EXPECT_SAME_OUTPUT(Gen(*a, prompt, 4), Gen(*b, prompt, 4));
  }
};

TEST_P(RunnerTest, SameRequestSameOutputInAnotherRunner) {
  auto a = MakeRunner(preset());
  auto b = MakeRunner(preset());
  ASSERT_TRUE(a && b);
  const auto prompt = Concat(Prefix(), Tokens(5, 3));
  const GenerateResult ra = Gen(*a, prompt, 6);
  const GenerateResult rb = Gen(*b, prompt, 6);
  EXPECT_EQ(ra.output_tokens.size(), 6u);
  EXPECT_SAME_OUTPUT(ra, rb);
  EXPECT_EQ(ra.hit_tokens, 0);
  EXPECT_EQ(ra.recomputed_tokens, static_cast<int64_t>(prompt.size()));
  // Another seed is another model.
  RunnerOptions other;
  other.weight_seed = 99;
  auto c = MakeRunner(preset(), other);
  ASSERT_TRUE(c);
  EXPECT_NE(Gen(*c, prompt, 6).hidden_digest, ra.hidden_digest);
}

TEST_P(RunnerTest, KernelThreadCountDoesNotChangeTheOutput) {
  RunnerOptions two;
  two.num_threads = 2;
  ExpectSameOutputWith(two, 8);
}

// A forward pass builds its attention block table in chunks of rows (a long prefill's
// table grows with the square of its length): the chunking does not change the output.
// 8 entries: chunks of a few rows, down to one row once rows are 8 blocks wide.
TEST_P(RunnerTest, AttentionTableChunksDoNotChangeTheOutput) {
  RunnerOptions small;
  small.max_table_entries = 8;
  ExpectSameOutputWith(small, 40);
}

TEST_P(RunnerTest, PrefixHitEqualsRecompute) {
  auto warm = MakeRunner(preset());
  auto cold = MakeRunner(preset());
  RunnerOptions no_cache;
  no_cache.enable_prefix_caching = false;
  auto uncached = MakeRunner(preset(), no_cache);
  ASSERT_TRUE(warm && cold && uncached);
  Gen(*warm, Concat(Prefix(), Tokens(7, 1)), 3);
  const auto prompt = Concat(Prefix(), Tokens(9, 2));
  const GenerateResult hit = Gen(*warm, prompt, 8);
  const GenerateResult recompute = Gen(*cold, prompt, 8);
  const GenerateResult nocache = Gen(*uncached, prompt, 8);
  EXPECT_EQ(hit.hit_tokens, 2 * block());
  EXPECT_EQ(hit.recomputed_tokens, 9);
  EXPECT_EQ(recompute.hit_tokens, 0);
  EXPECT_EQ(nocache.hit_tokens, 0);
  EXPECT_SAME_OUTPUT(hit, recompute);
  EXPECT_SAME_OUTPUT(hit, nocache);
  // Asking again hits every full block below the last token.
  const GenerateResult again = Gen(*warm, prompt, 8);
  EXPECT_EQ(again.hit_tokens, static_cast<int64_t>((prompt.size() - 1) / block() * block()));
  EXPECT_SAME_OUTPUT(again, recompute);
}

TEST_P(RunnerTest, HitOnBlocksFilledDuringDecodeEqualsRecompute) {
  // Turn 2 of a chat: the prompt contains turn 1's output, whose K/V was written by
  // decode steps; recomputing it as a prompt must give the same bytes.
  auto warm = MakeRunner(preset());
  auto cold = MakeRunner(preset());
  ASSERT_TRUE(warm && cold);
  const auto turn1 = Concat(Tokens(block() - 3, 5), {});
  const GenerateResult r1 = Gen(*warm, turn1, block() + 4);
  const auto turn2 = Concat(Concat(turn1, r1.output_tokens), Tokens(4, 6));
  const GenerateResult hit = Gen(*warm, turn2, 5);
  const GenerateResult recompute = Gen(*cold, turn2, 5);
  EXPECT_GE(hit.hit_tokens, 2 * block());
  EXPECT_SAME_OUTPUT(hit, recompute);
}

TEST_P(RunnerTest, CorruptedCacheChangesTheOutput) {
  // The hit path really reads the cached pages: flip the bytes and the output moves.
  auto warm = MakeRunner(preset());
  auto cold = MakeRunner(preset());
  ASSERT_TRUE(warm && cold);
  Gen(*warm, Concat(Prefix(), Tokens(3, 1)), 1);
  const auto prompt = Concat(Prefix(), Tokens(3, 2));
  const auto hashes = warm->HashPrompt(prompt, "");
  const cache::BlockId id = warm->cache().block_pool().GetCachedBlock(hashes[1]);
  ASSERT_NE(id, cache::kNoBlock);
  std::byte* page = warm->arena().PageAddress(id);
  for (int64_t i = 0; i < warm->arena().page_bytes(); i += 2) page[i] ^= std::byte{0x55};
  const GenerateResult hit = Gen(*warm, prompt, 4);
  EXPECT_EQ(hit.hit_tokens, 2 * block());
  EXPECT_NE(hit.hidden_digest, Gen(*cold, prompt, 4).hidden_digest);
}

TEST_P(RunnerTest, TenantSaltsDoNotShareCache) {
  auto r = MakeRunner(preset());
  auto cold = MakeRunner(preset());
  ASSERT_TRUE(r && cold);
  const auto prompt = Concat(Prefix(), Tokens(5, 4));
  const GenerateResult first = Gen(*r, prompt, 3, "tenant-a");
  const GenerateResult other = Gen(*r, prompt, 3, "tenant-b");
  const GenerateResult same = Gen(*r, prompt, 3, "tenant-a");
  EXPECT_EQ(other.hit_tokens, 0);  // b never sees a's blocks
  EXPECT_EQ(same.hit_tokens, 2 * block());
  EXPECT_NE(r->HashPrompt(prompt, "tenant-a"), r->HashPrompt(prompt, "tenant-b"));
  // The salt names the cache, not the math: every answer is the model's answer.
  const GenerateResult ref = Gen(*cold, prompt, 3);
  EXPECT_SAME_OUTPUT(first, ref);
  EXPECT_SAME_OUTPUT(other, ref);
  EXPECT_SAME_OUTPUT(same, ref);
}

TEST_P(RunnerTest, BatchedStepsEqualRunningAlone) {
  auto r = MakeRunner(preset());
  ASSERT_TRUE(r);
  const std::vector<std::vector<TokenId>> prompts = {
      Concat(Prefix(), Tokens(3, 21)), Tokens(block() + 5, 22), Concat(Prefix(), Tokens(8, 23))};
  const std::vector<int> max_new = {5, 2, 7};
  std::vector<SequenceId> ids;
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto id = r->AddSequence(Req(prompts[i], max_new[i]));
    ASSERT_TRUE(id.ok()) << id.status();
    ids.push_back(*id);
  }
  int steps = 0;
  while (r->NumUnfinished() > 0) {
    ASSERT_TRUE(r->Step().ok());
    ++steps;
  }
  // Sequence 2 shares sequence 0's prefix, whose pages are being filled in step 1: it
  // waits one step and then hits them (7 new tokens from step 2 on: 8 steps).
  EXPECT_EQ(steps, 8);
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto res = r->TakeResult(ids[i]);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_EQ(res->hit_tokens, i == 2 ? 2 * block() : 0);
    auto alone = MakeRunner(preset());
    ASSERT_TRUE(alone);
    EXPECT_SAME_OUTPUT(*res, Gen(*alone, prompts[i], max_new[i]));
  }
}

TEST_P(RunnerTest, ImportedBlocksEqualRecompute) {
  // Runner a computes a prefix; its blocks travel as bytes (a pool node) into runner
  // b, whose request then hits them.
  auto a = MakeRunner(preset());
  auto b = MakeRunner(preset());
  auto cold = MakeRunner(preset());
  ASSERT_TRUE(a && b && cold);
  Gen(*a, Concat(Prefix(), Tokens(4, 1)), 2);
  const auto prompt = Concat(Prefix(), Tokens(6, 2));
  const auto chain = a->HashPrompt(prompt, "");
  ASSERT_EQ(chain.size(), 2u);
  std::vector<std::vector<std::byte>> bytes;
  PrefixImport import;
  import.chain = chain;
  for (const BlockHash& h : chain) {
    auto e = a->ExportBlock(h);
    ASSERT_TRUE(e.ok()) << e.status();
    bytes.push_back(*e);
  }
  for (const auto& v : bytes) import.blocks.emplace_back(v);
  auto stats = b->ImportPrefix(import);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->blocks_imported, 2);
  const GenerateResult fetched = Gen(*b, prompt, 6);
  EXPECT_EQ(fetched.hit_tokens, 2 * block());
  EXPECT_SAME_OUTPUT(fetched, Gen(*cold, prompt, 6));
  // Importing again finds the blocks present.
  auto again = b->ImportPrefix(import);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->blocks_present, 2);
  EXPECT_EQ(again->blocks_imported, 0);
  // Exported bytes round-trip exactly.
  auto back = b->ExportBlock(chain[1]);
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, bytes[1]);
}

TEST_P(RunnerTest, InPlaceImportLandsInPagesAndFailedFetchLeavesNoHit) {
  // BeginImport hands out the pages; the caller writes the bytes there itself (as a
  // transport Get does). FinishImport(false) — the fetch failed — must leave nothing
  // cached under those hashes, or a request would hit pages of garbage.
  auto a = MakeRunner(preset());
  auto b = MakeRunner(preset());
  auto cold = MakeRunner(preset());
  ASSERT_TRUE(a && b && cold);
  const auto prompt = Concat(Prefix(), Tokens(5, 3));
  Gen(*a, prompt, 1);
  const auto chain = a->HashPrompt(prompt, "");
  ASSERT_EQ(chain.size(), 2u);
  const bool have[2] = {true, true};
  auto failed = b->BeginImport(chain, have, {});
  ASSERT_TRUE(failed.ok()) << failed.status();
  ASSERT_EQ(failed->blocks.size(), 2u);
  ASSERT_TRUE(b->FinishImport(*failed, /*filled=*/false).ok());
  EXPECT_EQ(b->ExportBlock(chain[0]).status().code(), absl::StatusCode::kNotFound);
  const GenerateResult recomputed = Gen(*b, prompt, 4);
  EXPECT_EQ(recomputed.hit_tokens, 0);
  auto c = MakeRunner(preset());
  ASSERT_TRUE(c);
  auto plan = c->BeginImport(chain, have, {});
  ASSERT_TRUE(plan.ok()) << plan.status();
  for (const ImportPlan::BlockSlot& slot : plan->blocks) {
    auto bytes = a->ExportBlock(chain[static_cast<size_t>(slot.chain_index)]);
    ASSERT_TRUE(bytes.ok());
    std::memcpy(c->arena().PageAddress(slot.page), bytes->data(), bytes->size());
  }
  ASSERT_TRUE(c->FinishImport(*plan, /*filled=*/true).ok());
  const GenerateResult fetched = Gen(*c, prompt, 4);
  EXPECT_EQ(fetched.hit_tokens, 2 * block());
  EXPECT_SAME_OUTPUT(fetched, Gen(*cold, prompt, 4));
  EXPECT_SAME_OUTPUT(fetched, recomputed);
}

TEST_P(RunnerTest, ImportRefusesBadInput) {
  auto r = MakeRunner(preset());
  ASSERT_TRUE(r);
  const auto chain = r->HashPrompt(Concat(Prefix(), Tokens(1, 2)), "");
  std::vector<std::byte> short_block(10);
  PrefixImport bad;
  bad.chain = chain;
  bad.blocks = {short_block, short_block};
  auto s = r->ImportPrefix(bad);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("blocks[0]"), absl::string_view::npos) << s.status();
  PrefixImport missing;
  missing.chain = chain;
  missing.blocks.resize(2);  // empty spans: "cached here", which they are not
  s = r->ImportPrefix(missing);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("not cached here"), absl::string_view::npos);
  EXPECT_EQ(r->ExportBlock(chain[0]).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(RunnerTest, BadRequestsNameTheField) {
  RunnerOptions o;
  o.max_model_len = 200;
  auto r = MakeRunner(preset(), o);
  ASSERT_TRUE(r);
  auto s = r->AddSequence(Req({1, 2, 512}, 1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("prompt_tokens[2]=512"), absl::string_view::npos)
      << s.status();
  EXPECT_NE(s.status().message().find("vocab_size=512"), absl::string_view::npos);
  s = r->AddSequence(Req({}, 1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("prompt_tokens is empty"), absl::string_view::npos);
  s = r->AddSequence(Req(Tokens(190, 1), 11));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("max_model_len=200"), absl::string_view::npos)
      << s.status();
  s = r->AddSequence(Req({1}, -1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("max_new_tokens=-1"), absl::string_view::npos);
  // A max_new_tokens whose sum with the prompt overflows int64 (CheckSequence takes
  // int64; before, the sum went negative and passed the max_model_len check).
  const std::vector<TokenId> two = {1, 2};
  const absl::Status huge = r->CheckSequence(two, std::numeric_limits<int64_t>::max());
  EXPECT_EQ(huge.code(), absl::StatusCode::kInvalidArgument) << huge;
  EXPECT_NE(huge.message().find("max_model_len=200"), absl::string_view::npos) << huge;
  RunnerOptions tiny;
  tiny.num_blocks = 3;  // 2 usable pages
  auto small = MakeRunner(preset(), tiny);
  ASSERT_TRUE(small);
  s = small->AddSequence(Req(Tokens(3 * block(), 1), 1));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("raise num_blocks"), absl::string_view::npos);
  EXPECT_EQ(r->TakeResult(12345).status().code(), absl::StatusCode::kNotFound);
}

TEST_P(RunnerTest, PrefillOnlyAndAbort) {
  auto r = MakeRunner(preset());
  auto cold = MakeRunner(preset());
  ASSERT_TRUE(r && cold);
  const auto prompt = Concat(Prefix(), Tokens(2, 9));
  const GenerateResult p = Gen(*r, prompt, 0);
  EXPECT_TRUE(p.output_tokens.empty());
  // The prefill-only digest is the hidden state that gives the first output token.
  const GenerateResult one = Gen(*cold, prompt, 1);
  EXPECT_EQ(p.hidden_digest, one.hidden_digest);
  auto id = r->AddSequence(Req(prompt, 50));
  ASSERT_TRUE(id.ok());
  ASSERT_TRUE(r->Step().ok());
  EXPECT_EQ(r->TakeResult(*id).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(r->Abort(*id).ok());
  EXPECT_EQ(r->NumUnfinished(), 0);
  EXPECT_EQ(r->cache().Usage().num_requests, 0);
}

TEST(RunnerCreateTest, RealShapePresetRefused) {
  auto spec = GetPreset("deepseek-v3");
  ASSERT_TRUE(spec.ok());
  auto r = ModelRunner::Create(*spec);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition);
}

// Regression: Create used to accept shapes the kernels refuse; the first Step then
// failed in the kernel and a second one dereferenced an empty output (segfault).
TEST(RunnerCreateTest, ShapesTheKernelsRefuseAreRefusedAtCreate) {
  struct Case {
    const char* preset;
    void (*mutate)(ModelSpec&);
    const char* field;
  };
  const Case cases[] = {
      {"tiny-gqa", [](ModelSpec& s) { s.gqa.head_dim = 32; }, "gqa.head_dim"},
      {"tiny-gqa", [](ModelSpec& s) { s.block_tokens = 32; }, "block_tokens"},
      {"tiny-mla", [](ModelSpec& s) { s.block_tokens = 16; }, "block_tokens"},
      {"tiny-mla", [](ModelSpec& s) { s.mla.kv_lora_rank = 256; }, "mla.kv_lora_rank"},
      {"tiny-mla", [](ModelSpec& s) { s.mla.rope_dim = 32; }, "mla.rope_dim"},
      {"tiny-hybrid", [](ModelSpec& s) { s.kda.head_k_dim = 320; }, "kda.head_k_dim"},
      {"tiny-hybrid", [](ModelSpec& s) { s.kda.head_v_dim = 320; }, "kda.head_v_dim"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    auto spec = GetPreset(c.preset);
    ASSERT_TRUE(spec.ok());
    spec->name = "custom";
    c.mutate(*spec);
    auto r = ModelRunner::Create(*spec);
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_NE(r.status().message().find(c.field), std::string::npos) << r.status();
  }
}

TEST(RunnerCreateTest, HugeMaxRunningOnAHybridDoesNotSizeScratchForIt) {
  RunnerOptions o;
  o.max_running = 1 << 30;  // the KDA scratch used to be sized for this many sequences
  auto r = MakeRunner("tiny-hybrid", o);
  ASSERT_TRUE(r);
  EXPECT_EQ(Gen(*r, Tokens(8, 1), 2).output_tokens.size(), 2u);
}

// Regression: admission took only the prompt's pages, so when two sequences that each
// fit alone ran together one ran out of pages mid-decode and failed with
// RESOURCE_EXHAUSTED. Now the second waits until the first has finished.
TEST(RunnerAdmissionTest, AcceptedSequencesDoNotRunOutOfPagesMidDecode) {
  RunnerOptions o;
  o.num_blocks = 5;  // 4 usable pages of 16 tokens; each request needs 3
  auto alone = MakeRunner("tiny-gqa", o);
  auto r = MakeRunner("tiny-gqa", o);
  ASSERT_TRUE(alone && r);
  const GenerateRequest a = Req(Tokens(16, 1), 32), b = Req(Tokens(16, 2), 32);
  const GenerateResult ra_alone = Gen(*alone, a.prompt_tokens, 32);
  const GenerateResult rb_alone = Gen(*alone, b.prompt_tokens, 32);
  auto ia = r->AddSequence(a);
  auto ib = r->AddSequence(b);
  ASSERT_TRUE(ia.ok() && ib.ok());
  while (r->NumUnfinished() > 0) ASSERT_TRUE(r->Step().ok());
  auto ra = r->TakeResult(*ia);
  auto rb = r->TakeResult(*ib);
  ASSERT_TRUE(ra.ok()) << ra.status();
  ASSERT_TRUE(rb.ok()) << rb.status();
  EXPECT_SAME_OUTPUT(*ra, ra_alone);
  EXPECT_SAME_OUTPUT(*rb, rb_alone);
  EXPECT_EQ(r->cache().Usage().num_requests, 0);
}

// Both fit at once when their reservations do: they run in the same steps.
TEST(RunnerAdmissionTest, SequencesWhoseReservationsFitRunTogether) {
  RunnerOptions o;
  o.num_blocks = 7;  // 6 usable pages; each request needs 3
  auto r = MakeRunner("tiny-gqa", o);
  ASSERT_TRUE(r);
  auto ia = r->AddSequence(Req(Tokens(16, 1), 32));
  auto ib = r->AddSequence(Req(Tokens(16, 2), 32));
  ASSERT_TRUE(ia.ok() && ib.ok());
  ASSERT_TRUE(r->Step().ok());
  EXPECT_EQ(r->NumWaiting(), 0);
  EXPECT_TRUE(r->Started(*ia) && r->Started(*ib));
  while (r->NumUnfinished() > 0) ASSERT_TRUE(r->Step().ok());
  EXPECT_TRUE(r->TakeResult(*ia).ok());
  EXPECT_TRUE(r->TakeResult(*ib).ok());
}

// last_step_tokens: what one batched forward pass computed, the engine's measure of
// prefill throughput (tokens over the step's time).
TEST(RunnerAdmissionTest, LastStepTokensCountsTheWholeBatch) {
  auto r = MakeRunner("tiny-gqa");
  ASSERT_TRUE(r);
  auto ia = r->AddSequence(Req(Tokens(50, 1), 3));
  auto ib = r->AddSequence(Req(Tokens(30, 2), 3));
  ASSERT_TRUE(ia.ok() && ib.ok());
  ASSERT_TRUE(r->Step().ok());  // both prompts
  EXPECT_EQ(r->last_step_tokens(), 80);
  ASSERT_TRUE(r->Step().ok());  // one decode token each
  EXPECT_EQ(r->last_step_tokens(), 2);
  // A prompt whose first 3 blocks (48 tokens) hit the cache computes only the rest.
  auto ic = r->AddSequence(Req(Concat(Tokens(48, 1), Tokens(7, 9)), 1));
  ASSERT_TRUE(ic.ok());
  ASSERT_TRUE(r->Step().ok());
  EXPECT_EQ(r->last_step_tokens(), 7 + 2);
}

INSTANTIATE_TEST_SUITE_P(Tiny, RunnerTest, ::testing::Values("tiny-gqa", "tiny-mla"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

}  // namespace
}  // namespace kvpool::model
