#include "kvpool/metrics/metrics.h"

#include <cmath>
#include <chrono>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "httplib.h"

namespace kvpool {
namespace {

std::string EscapeLabel(absl::string_view v) {
  std::string out;
  for (char c : v) {
    if (c == '\\' || c == '"') out.push_back('\\');
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out.push_back(c);
  }
  return out;
}

std::string LabelString(const MetricLabels& labels, absl::string_view extra_key = {},
                        absl::string_view extra_value = {}) {
  if (labels.empty() && extra_key.empty()) return "";
  std::string s = "{";
  bool first = true;
  for (const auto& [k, v] : labels) {
    absl::StrAppend(&s, first ? "" : ",", k, "=\"", EscapeLabel(v), "\"");
    first = false;
  }
  if (!extra_key.empty()) absl::StrAppend(&s, first ? "" : ",", extra_key, "=\"", extra_value, "\"");
  return s + "}";
}

// Adds le="..." to an existing label string.
std::string WithLe(const std::string& labels, absl::string_view le) {
  if (labels.empty()) return absl::StrCat("{le=\"", le, "\"}");
  return absl::StrCat(labels.substr(0, labels.size() - 1), ",le=\"", le, "\"}");
}

std::string Num(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (std::isnan(v)) return "NaN";
  std::ostringstream s;
  s.precision(17);
  s << v;
  return s.str();
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i <= bounds_.size(); ++i) buckets_[i].store(0, std::memory_order_relaxed);
}

void Histogram::Observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  buckets_[i].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

std::vector<uint64_t> Histogram::CumulativeCounts() const {
  std::vector<uint64_t> out(bounds_.size() + 1);
  uint64_t acc = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    acc += buckets_[i].load(std::memory_order_relaxed);
    out[i] = acc;
  }
  return out;
}

std::vector<double> Histogram::ExponentialBounds(double start, double factor, int n) {
  std::vector<double> b;
  double v = start;
  for (int i = 0; i < n; ++i, v *= factor) b.push_back(v);
  return b;
}

MetricsRegistry::Family& MetricsRegistry::GetFamily(absl::string_view name, absl::string_view help,
                                                    Type type) {
  auto it = families_.find(name);
  if (it == families_.end()) {
    it = families_.emplace(std::string(name), Family{type, std::string(help), {}, {}, {}}).first;
  }
  return it->second;
}

Counter& MetricsRegistry::GetCounter(absl::string_view name, absl::string_view help,
                                     const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = GetFamily(name, help, Type::kCounter).counters[LabelString(labels)];
  if (!slot) slot = std::make_unique<Counter>();
  return *slot;
}

Gauge& MetricsRegistry::GetGauge(absl::string_view name, absl::string_view help,
                                 const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = GetFamily(name, help, Type::kGauge).gauges[LabelString(labels)];
  if (!slot) slot = std::make_unique<Gauge>();
  return *slot;
}

Histogram& MetricsRegistry::GetHistogram(absl::string_view name, absl::string_view help,
                                         const std::vector<double>& bounds,
                                         const MetricLabels& labels) {
  absl::MutexLock lock(&mu_);
  auto& slot = GetFamily(name, help, Type::kHistogram).histograms[LabelString(labels)];
  if (!slot) slot = std::make_unique<Histogram>(bounds);
  return *slot;
}

uint64_t MetricsRegistry::AddScrapeHook(std::function<void()> hook) {
  absl::MutexLock lock(&hooks_mu_);
  const uint64_t id = next_hook_++;
  hooks_.emplace_back(id, std::move(hook));
  return id;
}

void MetricsRegistry::RemoveScrapeHook(uint64_t id) {
  absl::MutexLock lock(&hooks_mu_);
  std::erase_if(hooks_, [id](const auto& h) { return h.first == id; });
}

std::string MetricsRegistry::Render() const {
  {
    // Under hooks_mu_, not mu_ (hooks call GetGauge): RemoveScrapeHook waits for them.
    absl::MutexLock lock(&hooks_mu_);
    for (const auto& [id, h] : hooks_) h();
  }

  absl::MutexLock lock(&mu_);
  std::string out;
  for (const auto& [name, f] : families_) {
    const char* type = f.type == Type::kCounter ? "counter" : f.type == Type::kGauge ? "gauge" : "histogram";
    absl::StrAppend(&out, "# HELP ", name, " ", f.help, "\n# TYPE ", name, " ", type, "\n");
    for (const auto& [labels, c] : f.counters) absl::StrAppend(&out, name, labels, " ", Num(c->value()), "\n");
    for (const auto& [labels, g] : f.gauges) absl::StrAppend(&out, name, labels, " ", Num(g->value()), "\n");
    for (const auto& [labels, h] : f.histograms) {
      const auto counts = h->CumulativeCounts();
      for (size_t i = 0; i < h->bounds().size(); ++i) {
        absl::StrAppend(&out, name, "_bucket", WithLe(labels, Num(h->bounds()[i])), " ", counts[i], "\n");
      }
      absl::StrAppend(&out, name, "_bucket", WithLe(labels, "+Inf"), " ", counts.back(), "\n");
      absl::StrAppend(&out, name, "_sum", labels, " ", Num(h->sum()), "\n");
      // The +Inf bucket's count, read in the same pass as the buckets: count() is a
      // separate atomic, and an Observe between the reads made _count and +Inf differ.
      absl::StrAppend(&out, name, "_count", labels, " ", counts.back(), "\n");
    }
  }
  return out;
}

struct MetricsHttpServer::Impl {
  httplib::Server server;
};

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const MetricsRegistry* registry, const std::string& host, int port) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port=", port, " is outside 0..65535"));
  }
  std::unique_ptr<MetricsHttpServer> s(new MetricsHttpServer());
  s->impl_ = std::make_unique<Impl>();
  s->impl_->server.Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->Render(), "text/plain; version=0.0.4");
  });
  s->impl_->server.Get("/healthz", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok\n", "text/plain");
  });
  // httplib's default sets SO_REUSEPORT too, which let a second server (another cluster's
  // process of this user) bind the same port and take half the scrapes: SO_REUSEADDR only.
  s->impl_->server.set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const void*>(&yes), sizeof(yes));
  });
  int bound = port == 0 ? s->impl_->server.bind_to_any_port(host)
                        : (s->impl_->server.bind_to_port(host, port) ? port : -1);
  if (bound < 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen for metrics on ", host, ":", port,
                                               "; is the port in use? pick another --metrics-port"));
  }
  s->port_ = bound;
  Impl* impl = s->impl_.get();
  s->thread_ = std::thread([impl] { impl->server.listen_after_bind(); });
  // httplib's stop() before the listen loop has started is lost (the loop then runs
  // forever and the destructor's join hangs), so return only once it is running.
  for (int i = 0; i < 5000 && !impl->server.is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return s;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (impl_) impl_->server.stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace kvpool
