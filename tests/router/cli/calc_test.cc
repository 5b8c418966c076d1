// kvctl calc: figures against the textbook, and errors that name the flag.
#include <cctype>
#include <sstream>

#include <gtest/gtest.h>

#include "kvctl.h"
#include "run_cli.h"
#include "nlohmann/json.hpp"

namespace kvpool::kvctl {
namespace {

using cli_test::Result;
using cli_test::RunCli;

nlohmann::json Json(std::vector<std::string> args) {
  args.push_back("--json");
  Result r = RunCli(args);
  EXPECT_EQ(r.code, 0) << r.err;
  return nlohmann::json::parse(r.out);
}

TEST(KvctlCalcTest, KvLlama) {
  auto j = Json({"calc", "kv", "--model", "llama-3.3-70b", "--context", "8192"});
  EXPECT_EQ(j["bytes_per_token"], 327680);
  EXPECT_EQ(j["layers"]["gqa"]["bytes_per_token_per_layer"], 4096);
  EXPECT_EQ(j["footprint_bytes"], 327680LL * 8192);
  EXPECT_EQ(j["fixed_state_bytes_per_request"], 0);
}

TEST(KvctlCalcTest, KvDeepSeekFp8) {
  auto j = Json({"calc", "kv", "--model", "deepseek-v3", "--kv-dtype", "fp8"});
  EXPECT_EQ(j["bytes_per_token"], 35136);
  EXPECT_EQ(j["layers"]["mla"]["bytes_per_token_per_layer"], 576);
}

TEST(KvctlCalcTest, KvKimiCrossover) {
  auto j = Json({"calc", "kv", "--model", "kimi-k3"});
  EXPECT_EQ(j["bytes_per_token"], 27648);
  EXPECT_EQ(j["layers"]["kda"]["state_bytes_per_layer"], 3 * 1024 * 1024);
  EXPECT_NEAR(j["fixed_state_bytes_per_request"].get<double>() / (1 << 30), 0.20, 0.005);
  EXPECT_NEAR(j["crossover_tokens"].get<double>(), 7851, 1);
}

TEST(KvctlCalcTest, UtilUniformAndPaged) {
  auto j = Json({"calc", "util", "--max-len", "4096", "--page-size", "16"});
  EXPECT_NEAR(j["contiguous_utilization"].get<double>(), 0.5001, 0.00005);
  EXPECT_DOUBLE_EQ(j["paged_expected_waste_tokens"].get<double>(), 7.5);
  EXPECT_GT(j["paged_utilization"].get<double>(), 0.99);
  EXPECT_EQ(j["block_table_bytes_max"], 256 * 4);
}

TEST(KvctlCalcTest, UtilBatchCap) {
  auto j = Json({"calc", "util", "--max-len", "4096", "--mean-len", "1024", "--hbm-free", "40GiB",
                 "--model", "llama-3.3-70b"});
  // 40 GiB / (4096 tokens x 320 KiB) = 32 contiguous requests.
  EXPECT_EQ(j["batch_cap_contiguous"], 32);
  EXPECT_EQ(j["batch_cap_paged"], static_cast<int64_t>((40.0 * (1 << 30)) / ((1024 + 7.5) * 327680)));
}

TEST(KvctlCalcTest, TtftTextbook) {
  auto j = Json({"calc", "ttft", "--model", "llama-3.3-70b", "--context", "8192", "--hit", "0.8",
                 "--tier", "dram", "--queue", "0.1"});
  EXPECT_NEAR(j["full_recompute"]["recompute_s"].get<double>(), 2.896, 0.001);
  EXPECT_NEAR(j["with_hit"]["total_s"].get<double>(), 0.71, 0.005);
  EXPECT_NEAR(j["hit_rate_to_halve_prefill"].get<double>(), 0.51, 0.005);
}

TEST(KvctlCalcTest, TtftHumanOutputMentionsTheBreakdown) {
  Result r = RunCli({"calc", "ttft", "--model", "llama-3.3-70b", "--context", "8192", "--hit", "0.8"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("recompute of the miss"), std::string::npos);
  EXPECT_NE(r.out.find("hit rate that halves prefill"), std::string::npos);
}

struct BadCase {
  std::vector<std::string> args;
  std::string flag;  // the error must name it
};

// `kvctl calc ttft` of a valid request with `flag value` added; the error must name `flag`.
BadCase TtftWith(const std::string& flag, const std::string& value) {
  return BadCase{{"calc", "ttft", "--model", "llama-3.3-70b", "--context", "10", "--hit", "0.5", flag, value}, flag};
}

class KvctlBadArgsTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(KvctlBadArgsTest, FailsNamingTheFlag) {
  Result r = RunCli(GetParam().args);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find(GetParam().flag), std::string::npos) << r.err;
}

INSTANTIATE_TEST_SUITE_P(
    All, KvctlBadArgsTest,
    ::testing::Values(
        BadCase{{"calc", "kv", "--model", "gpt-9"}, "--model"},
        BadCase{{"calc", "kv", "--model", "llama-3.3-70b", "--kv-dtype", "int3"}, "--kv-dtype"},
        BadCase{{"calc", "kv", "--model", "llama-3.3-70b", "--context", "-5"}, "--context"},
        BadCase{{"calc", "kv", "--model", "llama-3.3-70b", "--context", "many"}, "--context"},
        // CLI11 reads integers with base 0: 010 was 8 and 0x10 16, without a word.
        BadCase{{"calc", "kv", "--model", "llama-3.3-70b", "--context", "010"}, "--context: '010' has a leading zero"},
        BadCase{{"calc", "kv", "--model", "llama-3.3-70b", "--context", "0x2000"}, "--context: '0x2000'"},
        BadCase{{"calc", "util", "--max-len", "0100", "--page-size", "16"}, "--max-len"},
        // The leading zero is named before a range check reads the value as octal.
        BadCase{{"replay", "--router", "127.0.0.1:1", "--trace", "/nonexistent", "--concurrency", "04000"},
                "--concurrency: '04000' has a leading zero"},
        // strtoull wrapped -1 into 2^64 - 1 for unsigned options.
        BadCase{{"route", "--router", "127.0.0.1:1", "--prompt-tokens", "-1"}, "--prompt-tokens: '-1' is negative"},
        BadCase{{"route", "--router", "127.0.0.1:1", "--prompt-tokens", " -1"}, "--prompt-tokens: ' -1' is negative"},
        BadCase{{"calc", "kv", "--model", "llama-3.3-70b", "--context", " 010"}, "--context: ' 010' has a leading zero"},
        // 327,680 B x 1e14 overflowed int64 into a negative footprint.
        BadCase{{"calc", "kv", "--model", "llama-3.3-70b", "--context", "100000000000000"}, "--context"},
        BadCase{{"calc", "util", "--max-len", "4611686018427387904", "--page-size", "1"}, "--max-len"},
        // --gpu-blocks 2^31-1 overflowed the cache's block count (int32 + 1); 0 instances
        // or an infinite time scale were "not in range 0.000000 to 1.8e308".
        BadCase{{"simulate", "--trace", "x.jsonl", "--gpu-blocks", "2147483647"}, "--gpu-blocks: Value 2147483647 not in range 1 to"},
        BadCase{{"simulate", "--trace", "x.jsonl", "--instances", "0"}, "--instances: Value 0 not in range 1 to 4096"},
        BadCase{{"simulate", "--trace", "x.jsonl", "--time-scale", "inf"}, "--time-scale"},
        // Every prompt is built up front: 65536 x 2^20 tokens would be 256 GiB.
        BadCase{{"load", "--router", "127.0.0.1:1", "--prompts", "65536", "--prompt-tokens", "1048576"},
                "--prompts x --prompt-tokens"},
        // CLI11's ranges let nan through.
        BadCase{{"calc", "util", "--max-len", "100", "--mean-len", "nan"}, "--mean-len"},
        BadCase{{"calc", "ttft", "--model", "llama-3.3-70b", "--context", "10", "--hit", "nan"}, "--hit"},
        BadCase{{"replay", "--trace", "x.jsonl", "--max-duration", "nan"}, "--max-duration"},
        BadCase{{"health", "--addr", "127.0.0.1:1", "--wait", "inf"}, "--wait"},
        BadCase{{"calc", "util", "--max-len", "-1"}, "--max-len"},
        BadCase{{"calc", "util", "--max-len", "abc"}, "--max-len"},
        BadCase{{"calc", "util", "--max-len", "100", "--mean-len", "200"}, "--mean-len"},
        BadCase{{"calc", "util", "--max-len", "100", "--hbm-free", "lots", "--model", "tiny-gqa"},
                "--hbm-free"},
        BadCase{{"calc", "util", "--max-len", "100", "--hbm-free", "1GiB"}, "--model"},
        BadCase{{"calc", "ttft", "--model", "llama-3.3-70b", "--context", "10", "--hit", "1.5"},
                "--hit"},
        BadCase{{"calc", "ttft", "--model", "llama-3.3-70b", "--context", "10", "--hit", "-0.1"},
                "--hit"},
        BadCase{{"calc", "ttft", "--model", "llama-3.3-70b", "--context", "10", "--hit", "x"},
                "--hit"},
        BadCase{{"calc", "ttft", "--model", "llama-3.3-70b", "--context", "0", "--hit", "0.5"},
                "--context"},
        TtftWith("--queue", "-1"),
        TtftWith("--tier", "tape"),
        TtftWith("--flops", "fast"),
        TtftWith("--bandwidth", "0"),
        // Positive but absurd: the figures overflowed to inf / NaN.
        TtftWith("--flops", "1e-300"),
        TtftWith("--bandwidth", "1e-300"),
        BadCase{{"simulate", "--trace", "unread.jsonl", "--flops", "1e-300"}, "--flops"},
        BadCase{{"simulate", "--trace", "unread.jsonl", "--pool-bandwidth", "1e300"}, "--pool-bandwidth"},
        BadCase{{"calc", "ttft", "--context", "10", "--hit", "0.5"}, "--model"}));

TEST(KvctlTest, NoSubcommandIsAnError) {
  Result r = RunCli({});
  EXPECT_EQ(r.code, 2);
}

}  // namespace
}  // namespace kvpool::kvctl
