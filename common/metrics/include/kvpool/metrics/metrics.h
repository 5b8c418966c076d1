// Prometheus metrics for kvpool services: counters, gauges and histograms in a
// registry, rendered in the Prometheus text exposition format (version 0.0.4) and
// served over HTTP at /metrics.
//
// Example:
//   MetricsRegistry registry;
//   Counter& routed = registry.GetCounter("kvpool_router_decisions_total",
//                                         "Routing decisions", {{"policy", "ttft"}});
//   routed.Increment();
//   registry.AddScrapeHook([&] { registry.GetGauge("kvpool_index_entries", "...").Set(n()); });
//   ASSIGN_OR_RETURN(auto server, MetricsHttpServer::Start(&registry, "0.0.0.0", 9100));
//
// Thread safety: all methods are thread-safe. Metric objects live as long as the
// registry and never move, so callers keep references to them; updates are lock-free
// (relaxed atomics: a scrape may see a value a few updates old, which Prometheus
// semantics allow).
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace kvpool {

using MetricLabels = std::vector<std::pair<std::string, std::string>>;

class Counter {
 public:
  void Increment(double v = 1.0) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Gauge {
 public:
  void Set(double v) { value_.store(v, std::memory_order_relaxed); }
  void Add(double v) { value_.fetch_add(v, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0.0};
};

class Histogram {
 public:
  // `bounds`: strictly increasing upper bounds; +Inf is implicit.
  explicit Histogram(std::vector<double> bounds);
  void Observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  // Cumulative counts per bound (and +Inf last), sum and count, read racily.
  std::vector<uint64_t> CumulativeCounts() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }

  // Exponential bounds: start, start*factor, ... (n of them).
  static std::vector<double> ExponentialBounds(double start, double factor, int n);

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds_.size() + 1
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

class MetricsRegistry {
 public:
  // Returns the series (name, labels), creating it on first use. A name keeps the
  // type and help of its first registration.
  Counter& GetCounter(absl::string_view name, absl::string_view help, const MetricLabels& labels = {});
  Gauge& GetGauge(absl::string_view name, absl::string_view help, const MetricLabels& labels = {});
  Histogram& GetHistogram(absl::string_view name, absl::string_view help,
                          const std::vector<double>& bounds, const MetricLabels& labels = {});

  // Runs before every Render(): the place to refresh gauges computed from state. Returns
  // an id for RemoveScrapeHook.
  uint64_t AddScrapeHook(std::function<void()> hook);
  // Removes a hook; once it returns the hook neither runs nor will (it waits for a Render
  // running it). An owner whose state a hook reads calls it before that state goes.
  void RemoveScrapeHook(uint64_t id);

  // Prometheus text format.
  std::string Render() const;

 private:
  enum class Type { kCounter, kGauge, kHistogram };
  struct Family {
    Type type;
    std::string help;
    // label string ("{a=\"b\"}" or "") -> series
    std::map<std::string, std::unique_ptr<Counter>> counters;
    std::map<std::string, std::unique_ptr<Gauge>> gauges;
    std::map<std::string, std::unique_ptr<Histogram>> histograms;
  };
  Family& GetFamily(absl::string_view name, absl::string_view help, Type type)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::map<std::string, Family, std::less<>> families_ ABSL_GUARDED_BY(mu_);
  // Held while hooks run (they take mu_ through Get*): a removal waits for them.
  mutable absl::Mutex hooks_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::vector<std::pair<uint64_t, std::function<void()>>> hooks_ ABSL_GUARDED_BY(hooks_mu_);
  uint64_t next_hook_ ABSL_GUARDED_BY(hooks_mu_) = 1;
};

// Serves GET /metrics (the registry) and GET /healthz ("ok") on host:port in a
// background thread until destroyed. Port 0 picks a free port (see port()).
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const MetricsRegistry* registry,
                                                                  const std::string& host, int port);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  struct Impl;
  MetricsHttpServer() = default;
  std::unique_ptr<Impl> impl_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace kvpool
