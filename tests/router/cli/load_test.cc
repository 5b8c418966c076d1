// kvctl load against a real kvpool-router service on loopback, with simulated instances
// that register and heartbeat (route-only). No timed assertions: counts and fields only.
#include <atomic>
#include <sstream>
#include <thread>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "kvctl.h"
#include "kvpool/router/router_client.h"
#include "kvpool/router/router_server.h"
#include "../sim_router_test.h"
#include "net.h"
#include "nlohmann/json.hpp"

namespace kvpool {
namespace {

class LoadTest : public testing::SimRouterTest {
 protected:
  void SetUp() override { StartRouter({"sim-w0", "sim-w1", "sim-w2"}); }
};

TEST_F(LoadTest, FixedRateRoutesEveryRequestAndReportsJson) {
  std::ostringstream out, err;
  const int rc = kvctl::RunKvctl({"kvctl", "load", "--router", addr_, "--rate", "100", "--duration", "0.5",
                                  "--concurrency", "4", "--arrivals", "fixed", "--prompt-tokens", "256",
                                  "--shared-prefix-tokens", "128", "--json"},
                                 out, err);
  ASSERT_EQ(rc, 0) << err.str();
  const auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["requests"].get<int>(), 50);
  EXPECT_EQ(j["ok"].get<int>() + j["errors"].get<int>(), 50);
  EXPECT_EQ(j["errors"].get<int>(), 0) << j.dump();
  EXPECT_TRUE(j["errors_by_code"].is_object());
  EXPECT_EQ(j["concurrency"].get<int>(), 4);
  EXPECT_EQ(j["arrivals"].get<std::string>(), "fixed");
  for (const char* k : {"target_rate_per_s", "achieved_rate_per_s", "send_rate_per_s", "wall_s"}) {
    ASSERT_TRUE(j.contains(k)) << k;
    EXPECT_GT(j[k].get<double>(), 0.0) << k;
  }
  for (const char* k : {"p50", "p90", "p99", "max", "mean"}) {
    ASSERT_TRUE(j["latency_us"].contains(k)) << k;
    EXPECT_GT(j["latency_us"][k].get<double>(), 0.0) << k;
  }
  EXPECT_LE(j["latency_us"]["p50"].get<double>(), j["latency_us"]["p99"].get<double>());
  EXPECT_LE(j["latency_us"]["p99"].get<double>(), j["latency_us"]["max"].get<double>());
  ASSERT_TRUE(j["send_lag_us"].contains("p99"));
  // The router saw every request.
  auto st = client_->GetStats();
  ASSERT_TRUE(st.ok()) << st.status();
  uint64_t decisions = 0;
  for (const auto& [policy, n] : st->decisions_by_policy()) decisions += n;
  EXPECT_EQ(decisions, 50u);
}

TEST_F(LoadTest, PoissonTextReportAndErrorsByCode) {
  // An unknown model: every Route fails with the router's error, counted by code.
  std::ostringstream out, err;
  const int rc = kvctl::RunKvctl({"kvctl", "load", "--router", addr_, "--rate", "200", "--duration", "0.2",
                                  "--concurrency", "2", "--model", "llama-3.3-70b", "--prompt-tokens", "64",
                                  "--json"},
                                 out, err);
  EXPECT_EQ(rc, 1) << "no request got through";
  const auto j = nlohmann::json::parse(out.str());
  EXPECT_GT(j["requests"].get<int>(), 0);
  EXPECT_EQ(j["ok"].get<int>(), 0);
  EXPECT_EQ(j["errors"].get<int>(), j["requests"].get<int>());
  int by_code = 0;
  for (const auto& [code, n] : j["errors_by_code"].items()) by_code += n.get<int>();
  EXPECT_EQ(by_code, j["requests"].get<int>());
  EXPECT_TRUE(j.contains("first_error"));
  for (const auto& [code, n] : j["errors_by_code"].items()) {
    EXPECT_TRUE(j["first_error_by_code"].contains(code)) << code;
  }

  std::ostringstream tout, terr;
  ASSERT_EQ(kvctl::RunKvctl({"kvctl", "load", "--router", addr_, "--rate", "100", "--duration", "0.2",
                             "--prompt-tokens", "64"},
                            tout, terr),
            0)
      << terr.str();
  EXPECT_TRUE(absl::StrContains(tout.str(), "latency")) << tout.str();
  EXPECT_TRUE(absl::StrContains(tout.str(), "achieved")) << tout.str();
}

TEST_F(LoadTest, SimInstancesRegisterAndTakeRequests) {
  std::ostringstream out, err;
  const int rc = kvctl::RunKvctl({"kvctl", "load", "--router", addr_, "--rate", "50", "--duration", "0.4",
                                  "--arrivals", "fixed", "--prompt-tokens", "64", "--sim-instances", "2", "--json"},
                                 out, err);
  ASSERT_EQ(rc, 0) << err.str();
  const auto j = nlohmann::json::parse(out.str());
  EXPECT_EQ(j["requests"].get<int>(), 20);
  EXPECT_EQ(j["errors"].get<int>(), 0) << j.dump();
  EXPECT_EQ(j["sim_instances"].get<int>(), 2);
  EXPECT_EQ(j["ok"].get<int>(), 20) << "the router had only the simulated instances to route to";
  // Unregistered on the way out: the router does not route to .invalid addresses
  // until their heartbeats are missed.
  auto st = client_->GetStats();
  ASSERT_TRUE(st.ok()) << st.status();
  int sims = 0;
  for (const auto& inst : st->instances()) sims += absl::StartsWith(inst.source_id(), "kvctl-load-sim-") ? 1 : 0;
  EXPECT_EQ(sims, 0);
}

TEST(LoadArgsTest, RejectsPublicAddressesAndBadArguments) {
  std::ostringstream out, err;
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "load", "--router", "8.8.8.8:50051"}, out, err), 2);
  EXPECT_TRUE(absl::StrContains(err.str(), "loopback")) << err.str();
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "load", "--router", "127.0.0.1:1", "--rate", "0"}, out, err), 2);
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "load", "--router", "127.0.0.1:1", "--arrivals", "bursty"}, out, err), 2);
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "load", "--router", "127.0.0.1:1", "--prompt-tokens", "10",
                             "--shared-prefix-tokens", "11"},
                            out, err),
            2);
  // A timeout past the clock's range used to overflow duration_cast; refused before connecting.
  for (const char* timeout : {"1e30", "3601", "inf", "nan"}) {
    std::ostringstream o, e;
    EXPECT_EQ(kvctl::RunKvctl({"kvctl", "load", "--router", "127.0.0.1:1", "--timeout", timeout}, o, e), 2)
        << timeout;
    EXPECT_TRUE(absl::StrContains(e.str(), "--timeout")) << timeout << ": " << e.str();
  }
}

TEST(NetTest, AllowedHost) {
  for (const char* ok : {"127.0.0.1:50051", "localhost:1", "[::1]:9", "10.1.2.3:7", "172.16.0.1:1", "172.31.9.9:1",
                         "192.168.1.1:80", "169.254.3.4:5", "127.0.0.1"}) {
    EXPECT_TRUE(kvctl::AllowedHost(ok)) << ok;
  }
  for (const char* bad : {"8.8.8.8:53", "172.32.0.1:1", "example.com:80", "[2001:db8::1]:5", "", "1.2.3:4",
                          "256.0.0.1:1", "0127.0.0.1:50051", "010.0.0.1:80", "127.0.0.01:1", "+127.0.0.1:1"}) {
    EXPECT_FALSE(kvctl::AllowedHost(bad)) << bad;
  }
}

}  // namespace
}  // namespace kvpool
