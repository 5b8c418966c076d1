// kvpool::trace: parsing (good, malformed, truncated lines), block-size mapping, token
// synthesis, and the infinite-cache upper bound on handcrafted traces.
#include "kvpool/router/trace.h"

#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"

namespace kvpool::trace {
namespace {

Trace ParseOrDie(const std::string& text, ParseOptions options = {}) {
  std::istringstream in(text);
  auto t = ParseTrace(in, options);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? *std::move(t) : Trace{};
}

TEST(ParseTrace, GoodLines) {
  const Trace t = ParseOrDie(
      "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 6, \"hash_ids\": [0, 1]}\n"
      "\n"
      "{\"timestamp\": 40.5, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [0]}\n");
  ASSERT_EQ(t.requests.size(), 2u);
  EXPECT_TRUE(t.issues.empty());
  EXPECT_EQ(t.lines, 3);
  EXPECT_EQ(t.requests[0].line, 1);
  EXPECT_EQ(t.requests[0].input_length, 1000);
  EXPECT_EQ(t.requests[0].output_length, 6);
  EXPECT_EQ(t.requests[0].hash_ids, (std::vector<uint64_t>{0, 1}));
  EXPECT_EQ(t.requests[1].line, 3);
  EXPECT_DOUBLE_EQ(t.requests[1].timestamp_ms, 40.5);
}

TEST(ParseTrace, SortsByTimestampStably) {
  const Trace t = ParseOrDie(
      "{\"timestamp\": 9, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [1]}\n"
      "{\"timestamp\": 3, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [2]}\n"
      "{\"timestamp\": 3, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [3]}\n");
  ASSERT_EQ(t.requests.size(), 3u);
  EXPECT_EQ(t.requests[0].hash_ids[0], 2u);
  EXPECT_EQ(t.requests[1].hash_ids[0], 3u);
  EXPECT_EQ(t.requests[2].hash_ids[0], 1u);
}

struct BadLine {
  std::string line;
  std::string reason_part;
};

class MalformedLine : public ::testing::TestWithParam<BadLine> {};

TEST_P(MalformedLine, IsReportedWithLineNumberAndSkipped) {
  const std::string good = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}\n";
  const Trace t = ParseOrDie(good + GetParam().line + "\n" + good);
  EXPECT_EQ(t.requests.size(), 2u);
  ASSERT_EQ(t.issues.size(), 1u);
  EXPECT_EQ(t.issues[0].line, 2);
  EXPECT_TRUE(absl::StrContains(t.issues[0].reason, GetParam().reason_part)) << t.issues[0].reason;
}

INSTANTIATE_TEST_SUITE_P(
    Lines, MalformedLine,
    ::testing::Values(
        BadLine{"{not json", "not valid JSON"},
        // A number beyond double: nlohmann throws out_of_range, not parse_error (it ended
        // the whole load instead of this line).
        BadLine{"{\"timestamp\": 1e999, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}",
                "not valid JSON"},
        BadLine{"[1, 2]", "not a JSON object"},
        BadLine{"{\"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}", "missing field timestamp"},
        BadLine{"{\"timestamp\": -1, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}",
                "timestamp=-1"},
        BadLine{"{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}",
                "input_length=0"},
        BadLine{"{\"timestamp\": 0, \"input_length\": \"10\", \"output_length\": 1, \"hash_ids\": [5]}",
                "input_length=\"10\""},
        BadLine{"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1.5, \"hash_ids\": [5]}",
                "output_length=1.5"},
        BadLine{"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1}", "missing field hash_ids"},
        BadLine{"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [-3]}",
                "hash_ids[0]=-3"},
        BadLine{"{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 1, \"hash_ids\": [5]}",
                "hash_ids has 1 entries but input_length=1000 needs ceil(1000/512)=2"},
        // Above the router's 2^24 prompt tokens: named before any token is synthesized.
        BadLine{"{\"timestamp\": 0, \"input_length\": 16777217, \"output_length\": 1, \"hash_ids\": [5]}",
                "input_length=16777217 is above the router's limit of 16777216"},
        BadLine{"{\"timestamp\": 0, \"input_length\": 1099511627776, \"output_length\": 1, \"hash_ids\": [1]}",
                "input_length=1099511627776 is above the router's limit"},
        // A replay's max_new_tokens would wrap (2^32 -> 0), a simulation's sums overflow.
        BadLine{"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 4294967296, \"hash_ids\": [5]}",
                "output_length=4294967296 must be an integer in 0..16777216"},
        // A simulation's clock would print 300-digit spans.
        BadLine{"{\"timestamp\": 1e300, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}",
                "must be a number of ms in 0..1e+12"},
        BadLine{"{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [18446744073709551616]}",
                "hash_ids[0]=1.8446744073709552e+19 must be an integer in 0..2^64-1"}));

// Hash ids use the whole 64-bit range (ids that are hashes, not counters).
TEST(ParseTrace, HashIdsTakeTheWholeUnsignedRange) {
  const Trace t = ParseOrDie(
      "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 1, \"hash_ids\": [18446744073709551615, 9223372036854775808]}\n");
  ASSERT_EQ(t.requests.size(), 1u) << (t.issues.empty() ? "" : t.issues[0].reason);
  EXPECT_EQ(t.requests[0].hash_ids[0], ~uint64_t{0});
  EXPECT_EQ(t.requests[0].hash_ids[1], uint64_t{1} << 63);
}

TEST(ParseTrace, TruncatedLastLineIsReported) {
  const Trace t = ParseOrDie(
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}\n"
      "{\"timestamp\": 5, \"input_length\": 10, \"output_le");
  EXPECT_EQ(t.requests.size(), 1u);
  ASSERT_EQ(t.issues.size(), 1u);
  EXPECT_EQ(t.issues[0].line, 2);
  EXPECT_TRUE(absl::StrContains(t.issues[0].reason, "truncated last line")) << t.issues[0].reason;
}

TEST(ParseTrace, CompleteLastLineWithoutNewlineIsKept) {
  const Trace t = ParseOrDie("{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}");
  EXPECT_EQ(t.requests.size(), 1u);
  EXPECT_TRUE(t.issues.empty());
}

TEST(ParseTrace, StrictModeFailsOnTheFirstBadLine) {
  std::istringstream in(
      "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [5]}\n"
      "{\"timestamp\": 0}\n");
  auto t = ParseTrace(in, {.strict = true});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(t.status().message(), "line 2:")) << t.status();
}

TEST(ParseTrace, LimitAndBlockSize) {
  const std::string lines =
      "{\"timestamp\": 0, \"input_length\": 100, \"output_length\": 1, \"hash_ids\": [1, 2, 3, 4]}\n"
      "{\"timestamp\": 1, \"input_length\": 20, \"output_length\": 1, \"hash_ids\": [1]}\n"
      "{\"timestamp\": 2, \"input_length\": 20, \"output_length\": 1, \"hash_ids\": [1]}\n";
  const Trace t = ParseOrDie(lines, {.trace_block_tokens = 32, .limit = 2});
  EXPECT_EQ(t.requests.size(), 2u);
  EXPECT_TRUE(t.issues.empty());
  EXPECT_TRUE(t.limited);  // a line was left unread
  EXPECT_FALSE(ParseOrDie(lines, {.trace_block_tokens = 32, .limit = 3}).limited);
  EXPECT_FALSE(ParseOrDie(lines + "\n  \n", {.trace_block_tokens = 32, .limit = 3}).limited);  // blank: nothing more
  const Trace t512 = ParseOrDie(lines);  // 100 tokens need 1 block of 512, not 4
  EXPECT_EQ(t512.requests.size(), 2u);
  EXPECT_EQ(t512.issues.size(), 1u);
  std::istringstream in(lines);
  EXPECT_FALSE(ParseTrace(in, {.trace_block_tokens = 0}).ok());
}

TEST(ParseTrace, HugeInputLengthIsRejectedWithItsLineInStrictMode) {
  // The repro of a kvctl abort: one trace block covering 2^40 tokens.
  std::istringstream in(
      "{\"timestamp\":0,\"input_length\":1099511627776,\"output_length\":1,\"hash_ids\":[1]}\n");
  auto t = ParseTrace(in, {.trace_block_tokens = kMaxTraceBlockTokens, .strict = true});
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(t.status().message(), "line 1: input_length=1099511627776")) << t.status();
  EXPECT_TRUE(absl::StrContains(t.status().message(), "split or drop")) << t.status();
}

TEST(ParseTrace, InputLengthAtTheLimitIsKept) {
  // 2^24 tokens in 16 blocks of 2^20: both limits exactly.
  std::string ids;
  for (int i = 0; i < 16; ++i) ids += (i ? "," : "") + std::to_string(i);
  const Trace t = ParseOrDie("{\"timestamp\": 0, \"input_length\": 16777216, \"output_length\": 1, \"hash_ids\": [" +
                                 ids + "]}\n",
                             {.trace_block_tokens = kMaxTraceBlockTokens});
  ASSERT_EQ(t.requests.size(), 1u);
  EXPECT_EQ(t.requests[0].input_length, kMaxTraceInputTokens);
}

TEST(ParseTrace, TraceBlockTokensIsBounded) {
  const std::string line = "{\"timestamp\": 0, \"input_length\": 2, \"output_length\": 1, \"hash_ids\": [1]}\n";
  for (int64_t bad : {int64_t{0}, kMaxTraceBlockTokens + 1, int64_t{1} << 40,
                      std::numeric_limits<int64_t>::max()}) {
    std::istringstream in(line);
    auto t = ParseTrace(in, {.trace_block_tokens = bad});
    ASSERT_FALSE(t.ok()) << bad;
    EXPECT_TRUE(absl::StrContains(t.status().message(), "--trace-block-tokens=")) << t.status();
    EXPECT_TRUE(absl::StrContains(t.status().message(), "must be in 1..1048576")) << t.status();
    // The line parser checks it too (it used to compute input_length + trace_block_tokens - 1,
    // which overflows int64 for INT64_MAX).
    auto r = ParseTraceLine(line, 1, bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_TRUE(absl::StrContains(r.status().message(), "--trace-block-tokens=")) << r.status();
    EXPECT_FALSE(BlockMapping::Create(bad, 16).ok()) << bad;
  }
  EXPECT_TRUE(ParseTraceLine(line, 1, kMaxTraceBlockTokens).ok());
}

TEST(LoadTrace, MissingFileIsNotFound) {
  auto t = LoadTrace("/nonexistent/trace.jsonl", {});
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
}

TEST(LoadTrace, BundledSyntheticTraceParsesCleanly) {
  const char* root = std::getenv("KVPOOL_SOURCE_DIR");
  if (root == nullptr) GTEST_SKIP() << "KVPOOL_SOURCE_DIR is not set (run through ctest)";
  auto t = LoadTrace(std::string(root) + "/../shared/data/traces/synthetic_trace.jsonl", {});
  if (t.status().code() == absl::StatusCode::kNotFound) GTEST_SKIP() << "bundled trace not present";
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_GT(t->requests.size(), 1000u);
  EXPECT_TRUE(t->issues.empty());
}

// ---- block-size mapping ----------------------------------------------------------------

TEST(BlockMapping, TraceBlocksMapOntoWholeCacheBlocks) {
  auto m = BlockMapping::Create(512, 16);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->CacheBlocksForTraceHit(1, 40160), 32);
  EXPECT_EQ(m->CacheBlocksForTraceHit(3, 40160), 96);
  // The last trace block is partial: a full hit covers only the prompt's full blocks.
  EXPECT_EQ(m->CacheBlocksForTraceHit(2, 1000), 1000 / 16);
  EXPECT_EQ(m->FullCacheBlocks(1000), 62);
  EXPECT_EQ(m->MaxReusableCacheBlocks(1024), 63);  // the last token is recomputed
  // A cache block straddling two trace blocks is reusable only when both hit.
  auto odd = BlockMapping::Create(100, 64);
  ASSERT_TRUE(odd.ok());
  EXPECT_EQ(odd->CacheBlocksForTraceHit(1, 1000), 1);  // [0,64) yes, [64,128) straddles
  EXPECT_EQ(odd->CacheBlocksForTraceHit(2, 1000), 3);
  EXPECT_FALSE(BlockMapping::Create(512, 0).ok());
  EXPECT_FALSE(BlockMapping::Create(0, 16).ok());
}

TEST(SynthesizeTokens, EqualHashIdsGiveEqualTokensAndHashes) {
  TraceRequest a{.input_length = 1000, .hash_ids = {7, 9}};
  TraceRequest b{.input_length = 700, .hash_ids = {7, 11}};
  TraceRequest c{.input_length = 1000, .hash_ids = {8, 9}};
  const auto ta = SynthesizeTokens(a, 512, 128256);
  const auto tb = SynthesizeTokens(b, 512, 128256);
  ASSERT_EQ(ta.size(), 1000u);
  ASSERT_EQ(tb.size(), 700u);
  EXPECT_TRUE(std::equal(ta.begin(), ta.begin() + 512, tb.begin()));
  EXPECT_FALSE(std::equal(ta.begin() + 512, ta.begin() + 700, tb.begin() + 512));
  for (TokenId t : SynthesizeTokens(a, 512, 512)) EXPECT_LT(t, 512u);

  auto hasher = BlockHasher::Create({.model_id = "tiny-gqa", .block_tokens = 16});
  ASSERT_TRUE(hasher.ok());
  const auto ha = CacheBlockHashes(a, 512, 512, *hasher);
  const auto hb = CacheBlockHashes(b, 512, 512, *hasher);
  const auto hc = CacheBlockHashes(c, 512, 512, *hasher);
  ASSERT_EQ(ha.size(), 62u);
  ASSERT_EQ(hb.size(), 43u);
  // Shared prefix = trace block 0 = cache blocks 0..31; the rest differs.
  for (size_t i = 0; i < 32; ++i) EXPECT_EQ(ha[i], hb[i]) << i;
  EXPECT_NE(ha[32], hb[32]);
  // Same id at the same position after a different prefix: a different block (chained).
  EXPECT_NE(ha[40], hc[40]);
}

// ---- analysis --------------------------------------------------------------------------

TEST(AnalyzeTrace, UpperBoundOnAHandcraftedTrace) {
  // Trace blocks of 4 tokens, cache blocks of 2.
  //   r0  [1 2 3]     10 tokens  first: no hit
  //   r1  [1 2 4]     12 tokens  hits 1 2        -> 2 trace blocks, 8 tokens
  //   r2  [1 2 3]     10 tokens  duplicate of r0 -> 3 trace blocks, capped at (10-1)/2 = 4 cache blocks
  //   r3  [5 2 3]     12 tokens  2,3 after 5 are new prefixes: no hit
  //   r4  [1 2 4 6]   16 tokens  hits 1 2 4      -> 12 tokens
  std::vector<TraceRequest> reqs = {
      {.input_length = 10, .hash_ids = {1, 2, 3}},   {.input_length = 12, .hash_ids = {1, 2, 4}},
      {.input_length = 10, .hash_ids = {1, 2, 3}},   {.input_length = 12, .hash_ids = {5, 2, 3}},
      {.input_length = 16, .hash_ids = {1, 2, 4, 6}},
  };
  auto m = BlockMapping::Create(4, 2);
  ASSERT_TRUE(m.ok());
  const TraceAnalysis a = AnalyzeTrace(reqs, *m);
  EXPECT_EQ(a.requests, 5u);
  EXPECT_EQ(a.prompt_tokens, 60);
  EXPECT_EQ(a.trace_blocks, 16);
  EXPECT_EQ(a.trace_hit_blocks, 0 + 2 + 3 + 0 + 3);
  EXPECT_EQ(a.unique_trace_blocks, 3 + 1 + 3 + 1);
  EXPECT_DOUBLE_EQ(a.upper_bound_trace_blocks, 8.0 / 16);
  EXPECT_EQ(a.request_hit_tokens, (std::vector<int64_t>{0, 8, 8, 0, 12}));
  EXPECT_EQ(a.hit_tokens, 28);
  EXPECT_DOUBLE_EQ(a.upper_bound, 28.0 / 60);
  EXPECT_EQ(a.duplicate_requests, 1u);
  EXPECT_EQ(a.duplicate, (std::vector<bool>{false, false, true, false, false}));
  EXPECT_DOUBLE_EQ(a.dedup_upper_bound, 20.0 / 50);
  EXPECT_LT(a.dedup_upper_bound, a.upper_bound);
}

TEST(AnalyzeTrace, APartialLastBlockOnlyCoversTheTokensItHad) {
  // r0's second trace block had 2 of 4 tokens; r1 reuses its id (and so its tokens) but
  // only those 2 tokens were ever computed: 6 tokens reusable, not 8.
  std::vector<TraceRequest> reqs = {{.input_length = 6, .hash_ids = {1, 2}},
                                    {.input_length = 12, .hash_ids = {1, 2, 3}}};
  auto m = BlockMapping::Create(4, 2);
  ASSERT_TRUE(m.ok());
  const TraceAnalysis a = AnalyzeTrace(reqs, *m);
  EXPECT_EQ(a.trace_hit_blocks, 2);  // Mooncake's count: every matching block
  EXPECT_EQ(a.request_hit_tokens[1], 6);
}

TEST(AnalyzeTrace, SameIdsDifferentLengthAreNotDuplicates) {
  std::vector<TraceRequest> reqs = {{.input_length = 7, .hash_ids = {1, 2}}, {.input_length = 8, .hash_ids = {1, 2}}};
  auto m = BlockMapping::Create(4, 4);
  ASSERT_TRUE(m.ok());
  const TraceAnalysis a = AnalyzeTrace(reqs, *m);
  EXPECT_EQ(a.duplicate_requests, 0u);
  EXPECT_EQ(a.request_hit_tokens[1], 4);  // (8-1)/4 = 1 block: the last token is recomputed
}

TEST(AnalyzeTrace, BundledTraceMatchesItsReadme) {
  const char* root = std::getenv("KVPOOL_SOURCE_DIR");
  if (root == nullptr) GTEST_SKIP() << "KVPOOL_SOURCE_DIR is not set (run through ctest)";
  auto t = LoadTrace(std::string(root) + "/../shared/data/traces/synthetic_trace.jsonl", {});
  if (!t.ok()) GTEST_SKIP() << t.status();
  auto m = BlockMapping::Create(512, 16);
  ASSERT_TRUE(m.ok());
  const TraceAnalysis a = AnalyzeTrace(t->requests, *m);
  // Bounds that hold for any trace: the token bound at cache granularity cannot exceed
  // the block bound by more than the partial last blocks allow, and dedup never raises it.
  EXPECT_GT(a.upper_bound, 0.0);
  EXPECT_LE(a.upper_bound, a.upper_bound_trace_blocks + 0.05);
  EXPECT_LE(a.dedup_upper_bound, a.upper_bound);
  EXPECT_LE(a.unique_trace_blocks, a.trace_blocks);
}

}  // namespace
}  // namespace kvpool::trace
