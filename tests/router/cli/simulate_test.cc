// kvctl simulate: arguments and trace lines that used to abort the process or reach a
// shell are refused with a message that names the flag, the line or the field.
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "chart.h"
#include "kvctl.h"
#include "run_cli.h"

namespace kvpool::kvctl {
namespace {

namespace fs = std::filesystem;

using cli_test::Result;
using cli_test::RunCli;

class KvctlSimulateTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "kvctl_simulate_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string Write(const std::string& name, const std::string& text) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  // A few requests sharing a prefix: enough for every policy to run.
  std::string GoodTrace() {
    return Write("good.jsonl",
                 "{\"timestamp\": 0, \"input_length\": 1000, \"output_length\": 4, \"hash_ids\": [1, 2]}\n"
                 "{\"timestamp\": 10, \"input_length\": 1000, \"output_length\": 4, \"hash_ids\": [1, 3]}\n"
                 "{\"timestamp\": 20, \"input_length\": 600, \"output_length\": 4, \"hash_ids\": [1, 4]}\n");
  }
  static bool HaveGnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }
  static std::string Slurp(const std::string& path) {
    std::ifstream f(path);
    std::stringstream s;
    s << f.rdbuf();
    return s.str();
  }

  std::string dir_;
};

TEST_F(KvctlSimulateTest, HugeTraceBlockTokensIsABadArgumentNotAnAbort) {
  // The reviewer's repro: this used to allocate 2^40 tokens and terminate on bad_alloc.
  const std::string t =
      Write("huge.jsonl", "{\"timestamp\":0,\"input_length\":1099511627776,\"output_length\":1,\"hash_ids\":[1]}\n");
  Result r = RunCli({"simulate", "--trace", t, "--trace-block-tokens", "1099511627776"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "--trace-block-tokens")) << r.err;
}

TEST_F(KvctlSimulateTest, InputLengthAboveTheRouterLimitNamesTheLine) {
  std::string ids;
  for (int i = 0; i < 17; ++i) ids += (i ? "," : "") + std::to_string(i);
  const std::string t = Write("long.jsonl", "{\"timestamp\":0,\"input_length\":16777217,\"output_length\":1,\"hash_ids\":[" +
                                                ids + "]}\n");
  Result strict = RunCli({"simulate", "--trace", t, "--trace-block-tokens", "1048576", "--strict"});
  EXPECT_EQ(strict.code, 2) << strict.err;
  EXPECT_TRUE(absl::StrContains(strict.err, "line 1: input_length=16777217")) << strict.err;
  Result lax = RunCli({"simulate", "--trace", t, "--trace-block-tokens", "1048576"});
  EXPECT_EQ(lax.code, 1) << lax.err;
  EXPECT_TRUE(absl::StrContains(lax.err, ":1: skipped: input_length=16777217")) << lax.err;
}

TEST_F(KvctlSimulateTest, NegativeLimitIsRejected) {
  const std::string t = GoodTrace();
  ASSERT_EQ(RunCli({"simulate", "--trace", t, "--limit", "1"}).code, 0);
  Result r = RunCli({"simulate", "--trace", t, "--limit", "-1"});
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(absl::StrContains(r.err, "--limit: '-1' is negative; give a number >= 0")) << r.err;
}

TEST(GnuplotQuoteTest, DoublesSingleQuotes) {
  EXPECT_EQ(GnuplotQuote("plain.png"), "'plain.png'");
  EXPECT_EQ(GnuplotQuote("it's.png"), "'it''s.png'");
  EXPECT_EQ(GnuplotQuote("'$(x);\""), "'''$(x);\"'");
}

TEST_F(KvctlSimulateTest, ChartPathWithASingleQuote) {
  const std::string chart = dir_ + "/it's.png";
  Result r = RunCli({"simulate", "--trace", GoodTrace(), "--compare", "--chart", chart});
  const std::string gp = Slurp(chart + ".gp");
  EXPECT_TRUE(absl::StrContains(gp, "set output '" + dir_ + "/it''s.png'\n")) << gp;
  EXPECT_TRUE(absl::StrContains(gp, "plot '" + dir_ + "/it''s.png.dat' using")) << gp;
  if (!HaveGnuplot()) GTEST_SKIP() << "gnuplot is not installed: checked the script's quoting only";
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(chart)) << r.err;
  EXPECT_GT(fs::file_size(chart), 0u);
}

TEST_F(KvctlSimulateTest, ChartPathIsNeverRunByAShell) {
  // With popen("gnuplot '<path>.gp'") this path ran `touch <dir>/pwned`.
  const std::string sub = dir_ + "/x';touch '" + dir_;
  fs::create_directories(sub);
  const std::string chart = sub + "/pwned';'.png";
  Result r = RunCli({"simulate", "--trace", GoodTrace(), "--compare", "--chart", chart});
  EXPECT_FALSE(fs::exists(dir_ + "/pwned")) << "the chart path reached a shell";
  if (HaveGnuplot()) {
    EXPECT_EQ(r.code, 0) << r.err;
    EXPECT_TRUE(fs::exists(chart)) << r.err;
  }
}

TEST_F(KvctlSimulateTest, AnExceptionInACommandIsAnErrorNotAnAbort) {
  // nlohmann::json throws type_error.316 dumping a non-UTF-8 string; it used to escape
  // RunKvctl (only CLI::ParseError was caught) and terminate the process.
  const std::string t = Write("bad\xff.jsonl", Slurp(GoodTrace()));
  Result r = RunCli({"simulate", "--trace", t, "--json"});
  EXPECT_EQ(r.code, 1);
  EXPECT_TRUE(absl::StrContains(r.err, "kvctl: ")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "UTF-8")) << r.err;
}

}  // namespace
}  // namespace kvpool::kvctl
