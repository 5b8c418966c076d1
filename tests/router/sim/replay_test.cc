// kvctl replay against a real kvpool-router service on loopback, with simulated instances
// that register, heartbeat and publish KV events (no worker servers: route-only replay).
#include <atomic>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>
#include <unistd.h>

#include "absl/strings/match.h"
#include "kvctl.h"
#include "kvpool/router/router_client.h"
#include "kvpool/router/router_server.h"
#include "../sim_router_test.h"
#include "kvpool/router/trace.h"
#include "nlohmann/json.hpp"

namespace kvpool {
namespace {

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "/kvpool_replay_" + std::to_string(getpid()) + "_" + name;
}

std::string Line(double ts, int64_t len, const std::vector<uint64_t>& ids) {
  std::string s = "{\"timestamp\": " + std::to_string(ts) + ", \"input_length\": " + std::to_string(len) +
                  ", \"output_length\": 4, \"hash_ids\": [";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]}\n";
}

class ReplayTest : public testing::SimRouterTest {
 protected:
  void SetUp() override { StartRouter({"sim-w0", "sim-w1"}); }

  // Publishes `req`'s cache blocks as stored on `source` (as its worker would after a prefill).
  void PublishPrompt(const std::string& source, const trace::TraceRequest& req) {
    auto hasher = BlockHasher::Create({.model_id = "tiny-gqa", .block_tokens = 16});
    ASSERT_TRUE(hasher.ok());
    v1::EventBatch b;
    b.set_source_id(source);
    v1::KvEvent* e = b.add_events();
    e->set_sequence(1);
    v1::BlockStored* st = e->mutable_stored();
    for (const BlockHash& h : trace::CacheBlockHashes(req, 512, 512, *hasher)) st->add_block_hashes(h.ToBytes());
    st->set_kind(v1::STATE_KIND_ATTN_KV);
    st->set_tier(v1::TIER_GPU);
    auto r = client_->PublishEvents({b});
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->events_applied(), 1u);
  }
};

TEST_F(ReplayTest, RoutesEveryRequestAndReportsHitsAndLoad) {
  // Six requests in two conversations; sim-w1 already holds conversation A's first prompt.
  const std::string path = TempPath("trace.jsonl");
  {
    std::ofstream f(path);
    f << Line(0, 1000, {1, 2}) << Line(10, 1500, {1, 2, 3}) << Line(20, 900, {7, 8}) << Line(30, 1400, {7, 8, 9})
      << Line(40, 2000, {1, 2, 3, 4}) << "{\"timestamp\": 50, \"input_length\": 5\n"  // malformed: skipped
      << Line(60, 1900, {7, 8, 9, 10});
  }
  PublishPrompt("sim-w1", trace::TraceRequest{.input_length = 1000, .hash_ids = {1, 2}});
  const std::string csv = TempPath("log.csv");
  std::ostringstream out, err;
  // One request in flight at a time: with two, request 1 (same conversation) could be
  // routed first, and its in-flight load may then send request 0 elsewhere.
  const int rc = kvctl::RunKvctl({"kvctl", "replay", "--trace", path, "--router", addr_, "--speed", "50", "--json",
                                  "--csv", csv, "--concurrency", "1"},
                                 out, err);
  ASSERT_EQ(rc, 0) << err.str();
  EXPECT_TRUE(absl::StrContains(err.str(), ":6: skipped")) << err.str();
  const auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["requests"].get<int>(), 6);
  EXPECT_EQ(j["errors"].get<int>(), 0);
  EXPECT_EQ(j["skipped_trace_lines"].get<int>(), 1);
  int routed = 0;
  for (const auto& [id, v] : j["instances"].items()) {
    EXPECT_TRUE(id == "sim-w0" || id == "sim-w1") << id;
    routed += v["requests"].get<int>();
  }
  EXPECT_EQ(routed, 6);
  // The published prompt makes the router predict GPU hits (request 0 at least fully).
  EXPECT_GT(j["router_hit_rate"]["gpu"].get<double>(), 0.0);
  EXPECT_GE(j["load"]["requests_max"].get<double>(), j["load"]["requests_mean"].get<double>());
  EXPECT_EQ(j["worker_requests"].get<int>(), 0);  // simulated instances serve no Worker API
  std::ifstream log(csv);
  std::string line;
  int lines = 0;
  bool first_hit = false;
  while (std::getline(log, line)) {
    ++lines;
    if (absl::StartsWith(line, "0,")) first_hit = absl::StrContains(line, ",ok,sim-w1,");
  }
  EXPECT_EQ(lines, 7);  // header + 6
  EXPECT_TRUE(first_hit) << "request 0 should go to sim-w1, which holds its prefix";
  std::remove(path.c_str());
  std::remove(csv.c_str());
}

TEST_F(ReplayTest, PlainProgressAndTextSummary) {
  const std::string path = TempPath("trace2.jsonl");
  {
    std::ofstream f(path);
    f << Line(0, 600, {1, 2}) << Line(1, 600, {1, 3});
  }
  std::ostringstream out, err;
  const int rc = kvctl::RunKvctl({"kvctl", "replay", "--trace", path, "--router", addr_, "--limit", "1"}, out, err);
  ASSERT_EQ(rc, 0) << err.str();
  EXPECT_TRUE(absl::StrContains(out.str(), "kvctl replay: 1 requests")) << out.str();
  EXPECT_TRUE(absl::StrContains(out.str(), "route-only replay")) << out.str();
  std::remove(path.c_str());
}

TEST(Replay, RefusesNonLocalRouters) {
  std::ostringstream out, err;
  const int rc = kvctl::RunKvctl({"kvctl", "replay", "--trace", "/dev/null", "--router", "8.8.8.8:50051"}, out, err);
  EXPECT_EQ(rc, 2);
  EXPECT_TRUE(absl::StrContains(err.str(), "loopback")) << err.str();
}

}  // namespace
}  // namespace kvpool
