// `kvctl simulate` end to end, in-process: options, JSON output, bad trace lines, and the
// --compare table and chart.
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "kvctl.h"
#include "nlohmann/json.hpp"

namespace kvpool {
namespace {

std::string WriteTrace() {
  const std::string path =
      ::testing::TempDir() + "/kvpool_simcli_" + std::to_string(getpid()) + ".jsonl";
  std::ofstream f(path);
  // Three conversations of growing prompts, 2 s apart, and one bad line.
  double t = 0;
  for (int turn = 1; turn <= 4; ++turn) {
    for (int conv = 0; conv < 3; ++conv) {
      f << "{\"timestamp\": " << t << ", \"input_length\": " << 512 * (turn + 1) - 50
        << ", \"output_length\": 8, \"hash_ids\": [";
      for (int b = 0; b <= turn; ++b) f << (b ? ", " : "") << conv * 100 + b;
      f << "]}\n";
      t += 2000;
    }
  }
  f << "{\"timestamp\": 99999, \"input_length\": 10}\n";
  return path;
}

TEST(SimulateCli, JsonReportsHitsBoundsAndLoad) {
  const std::string trace = WriteTrace();
  std::ostringstream out, err;
  const int rc = kvctl::RunKvctl({"kvctl", "simulate", "--trace", trace, "--instances", "2", "--gpu-blocks", "4096",
                                  "--model", "llama-3.3-70b", "--policy", "cache_aware", "--json"},
                                 out, err);
  ASSERT_EQ(rc, 0) << err.str();
  EXPECT_TRUE(absl::StrContains(err.str(), ":13: skipped: missing field output_length")) << err.str();
  const auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["trace"]["requests"].get<int>(), 12);
  EXPECT_EQ(j["trace"]["skipped_lines"].get<int>(), 1);
  const auto& r = j["result"];
  EXPECT_EQ(r["requests"].get<int>(), 12);
  // Turns 2..4 of each conversation reuse the previous prompt: a large share is cacheable.
  const double bound = r["hit_rate"]["upper_bound"].get<double>();
  EXPECT_GT(bound, 0.4);
  EXPECT_LE(r["hit_rate"]["total"].get<double>(), bound + 1e-12);
  EXPECT_GT(r["hit_rate"]["gpu"].get<double>(), 0.0);
  EXPECT_GE(r["load"]["requests_max"].get<double>(), r["load"]["requests_mean"].get<double>());
  EXPECT_GT(r["events"]["kv"].get<int>(), 0);
  std::remove(trace.c_str());
}

TEST(SimulateCli, CompareWritesTableAndChart) {
  const std::string trace = WriteTrace();
  const std::string chart = ::testing::TempDir() + "/kvpool_simcli_" + std::to_string(getpid()) + ".png";
  std::ostringstream out, err;
  const int rc = kvctl::RunKvctl({"kvctl", "simulate", "--trace", trace, "--instances", "3", "--gpu-blocks", "2048",
                                  "--pool-blocks", "100000", "--compare", "--chart", chart},
                                 out, err);
  for (const char* p : {"random", "least_load", "cache_aware", "ttft", "upper bound"}) {
    EXPECT_TRUE(absl::StrContains(out.str(), p)) << out.str();
  }
  EXPECT_TRUE(std::filesystem::exists(chart + ".dat"));
  if (std::system("command -v gnuplot > /dev/null 2>&1") == 0) {
    EXPECT_EQ(rc, 0) << err.str();
    EXPECT_TRUE(std::filesystem::exists(chart));
  } else {
    EXPECT_EQ(rc, 1);  // the table is printed, the chart is reported missing
    EXPECT_TRUE(absl::StrContains(err.str(), "gnuplot")) << err.str();
  }
  for (const std::string& f : {chart, chart + ".dat", chart + ".gp", trace}) std::remove(f.c_str());
}

TEST(SimulateCli, BadArgumentsExitTwo) {
  const std::string trace = WriteTrace();
  for (std::vector<std::string> args : {
           std::vector<std::string>{"--policy", "fastest"},
           std::vector<std::string>{"--model", "no-such-model"},
           std::vector<std::string>{"--instances", "0"},
           std::vector<std::string>{"--strict"},
       }) {
    std::vector<std::string> argv = {"kvctl", "simulate", "--trace", trace};
    argv.insert(argv.end(), args.begin(), args.end());
    std::ostringstream out, err;
    EXPECT_EQ(kvctl::RunKvctl(argv, out, err), 2) << args[0] << ": " << err.str();
  }
  std::ostringstream out, err;
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "simulate", "--trace", "/nonexistent.jsonl"}, out, err), 1);
  std::remove(trace.c_str());
}

}  // namespace
}  // namespace kvpool
