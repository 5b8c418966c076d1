#include "kvpool/metrics/metrics.h"

#include <gtest/gtest.h>

#include "httplib.h"

namespace kvpool {
namespace {

TEST(MetricsRegistryTest, RendersPrometheusText) {
  MetricsRegistry r;
  r.GetCounter("kvpool_requests_total", "Requests", {{"policy", "ttft"}}).Increment(3);
  r.GetGauge("kvpool_kv_usage", "KV usage").Set(0.25);
  auto& h = r.GetHistogram("kvpool_latency_seconds", "Latency", {0.001, 0.01});
  h.Observe(0.0005);
  h.Observe(0.005);
  h.Observe(5);
  const std::string text = r.Render();
  EXPECT_NE(text.find("# TYPE kvpool_requests_total counter"), std::string::npos);
  EXPECT_NE(text.find("kvpool_requests_total{policy=\"ttft\"} 3"), std::string::npos);
  EXPECT_NE(text.find("kvpool_kv_usage 0.25"), std::string::npos);
  EXPECT_NE(text.find("kvpool_latency_seconds_bucket{le=\"0.001\"} 1"), std::string::npos);
  EXPECT_NE(text.find("kvpool_latency_seconds_bucket{le=\"0.01\"} 2"), std::string::npos);
  EXPECT_NE(text.find("kvpool_latency_seconds_bucket{le=\"+Inf\"} 3"), std::string::npos);
  EXPECT_NE(text.find("kvpool_latency_seconds_count 3"), std::string::npos);
}

TEST(MetricsRegistryTest, SameSeriesIsReturnedAgainAndHooksRun) {
  MetricsRegistry r;
  Counter& a = r.GetCounter("c", "h", {{"k", "v"}});
  Counter& b = r.GetCounter("c", "h", {{"k", "v"}});
  EXPECT_EQ(&a, &b);
  int calls = 0;
  r.AddScrapeHook([&] { r.GetGauge("g", "h").Set(++calls); });
  EXPECT_NE(r.Render().find("g 1"), std::string::npos);
  EXPECT_NE(r.Render().find("g 2"), std::string::npos);
}

// A removed hook never runs again: an owner removes the hook that reads its state
// before that state goes (RouterHost, the pool node). Before, hooks could not be removed
// and a Render after the owner went called into freed memory.
TEST(MetricsRegistryTest, ARemovedHookRunsNoMore) {
  MetricsRegistry r;
  int a = 0, b = 0;
  const uint64_t ha = r.AddScrapeHook([&] { ++a; });
  r.AddScrapeHook([&] { ++b; });
  r.Render();
  r.RemoveScrapeHook(ha);
  r.Render();
  EXPECT_EQ(a, 1);
  EXPECT_EQ(b, 2);
}

TEST(MetricsHttpServerTest, ServesMetricsOverHttp) {
  MetricsRegistry r;
  r.GetCounter("kvpool_up_total", "Up").Increment();
  auto server = MetricsHttpServer::Start(&r, "127.0.0.1", 0);
  ASSERT_TRUE(server.ok()) << server.status();
  httplib::Client client("127.0.0.1", (*server)->port());
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("kvpool_up_total 1"), std::string::npos);
  EXPECT_EQ(client.Get("/healthz")->body, "ok\n");
}

// A second server on a port one already serves is refused (httplib's SO_REUSEPORT let it
// bind, and the two then shared the scrapes), naming the port.
TEST(MetricsHttpServerTest, PortInUseIsRefused) {
  MetricsRegistry r;
  auto first = MetricsHttpServer::Start(&r, "127.0.0.1", 0);
  ASSERT_TRUE(first.ok()) << first.status();
  const int port = (*first)->port();
  auto second = MetricsHttpServer::Start(&r, "127.0.0.1", port);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable) << second.status();
  EXPECT_NE(second.status().message().find(std::to_string(port)), absl::string_view::npos) << second.status();
}

TEST(MetricsHttpServerTest, RejectsBadPort) {
  MetricsRegistry r;
  EXPECT_EQ(MetricsHttpServer::Start(&r, "127.0.0.1", 70000).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool
