// kvpool-router's flags and lifecycle: parse, print the config, serve until a signal.
#include <cmath>
#include <csignal>
#include <iostream>
#include <tuple>
#include <utility>
#include <thread>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvpool/common/cli_flags.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/units.h"
#include "kvpool/router/router_server.h"

namespace kvpool::router {

int RunRouterMain(int argc, char** argv) {
  CLI::App app{"kvpool-router: routes LLM requests to the worker that can serve them fastest", "kvpool-router"};
  RouterServerOptions o;
  RouterOptions& c = o.host.core;
  std::string policy = "cache_aware", hybrid = "strict";
  std::vector<std::string> models = {"tiny-gqa"};
  double heartbeat_timeout_s = 10, decision_timeout_s = 30, approx_ttl_s = 120;
  int heartbeat_interval_ms = 1000;
  app.add_option("--listen", o.listen, "gRPC listen address host:port (port 0 picks one)")->capture_default_str();
  app.add_option("--policy", policy, "random|round_robin|least_load|power_of_two|session|cache_aware|ttft")
      ->capture_default_str();
  app.add_option("--models,--model", models, "models served: preset names or JSON spec paths (comma-separated)")
      ->delimiter(',')
      ->capture_default_str();
  app.add_option("--block-tokens", c.block_tokens, "tokens per block for every model; 0 = each model's own")
      ->capture_default_str();
  app.add_option("--max-index-entries", c.max_index_entries, "index bound, (hash, holder) pairs")
      ->capture_default_str();
  app.add_option("--ttft-slo", c.ttft_slo_s, "seconds; Route answers RESOURCE_EXHAUSTED when every estimate is above (0 = off)")
      ->capture_default_str();
  app.add_option("--ttft-decode-weight", c.ttft_decode_weight,
                 "ttft policy: a worker's running sequences count as this many prefill tokens each (0 = off)")
      ->capture_default_str();
  app.add_option("--hybrid-mode", hybrid, "hybrid (KDA) hits: strict (stop at the last checkpoint) or replay")
      ->capture_default_str();
  app.add_option("--metrics-port", o.metrics_port, "Prometheus /metrics port (0 picks one, -1 off)")
      ->capture_default_str();
  app.add_option("--heartbeat-interval-ms", heartbeat_interval_ms, "interval told to sources at Register")
      ->capture_default_str();
  app.add_option("--heartbeat-timeout", heartbeat_timeout_s, "seconds without a heartbeat before a source is dropped")
      ->capture_default_str();
  app.add_option("--decision-timeout", decision_timeout_s, "seconds before an unconfirmed decision stops counting as load")
      ->capture_default_str();
  app.add_option("--approx-ttl", approx_ttl_s, "seconds a predicted block lives for workers that publish no events")
      ->capture_default_str();
  app.add_option("--overlap-weight", c.policy_params.overlap_weight, "cache_aware w1")->capture_default_str();
  app.add_option("--load-weight", c.policy_params.load_weight, "cache_aware w2")->capture_default_str();
  app.add_option("--balance-rel", c.policy_params.balance_rel, "cache_aware herding cap: load <= rel*mean + abs")
      ->capture_default_str();
  app.add_option("--balance-abs", c.policy_params.balance_abs, "cache_aware herding cap: load <= rel*mean + abs")
      ->capture_default_str();
  app.add_option("--max-streams", o.host.max_streams, "concurrent PublishEvents streams")->capture_default_str();
  app.add_option("--apply-slice-events", o.host.apply_slice_events, "events applied per lock hold")
      ->capture_default_str();
  app.add_option("--seed", c.seed, "seed of the random policies")->capture_default_str();
  std::string flops, dram_bw, nvme_bw, max_message = "128MiB";
  app.add_option("--max-message-bytes", max_message,
                 "largest request accepted, e.g. 128MiB: an event batch (sources send <= 4 MiB) or a Route; "
                 "memory held by event streams stays below --max-streams x this")
      ->capture_default_str();
  app.add_option("--flops", flops, "achieved prefill FLOP/s of a worker for the cost model, e.g. 400e12 (default) or 1e10 for CPU tiny-* workers (as deploy/local/cluster.sh gives)");
  app.add_option("--pool-dram-bandwidth", dram_bw, "pool DRAM fetch bandwidth for the cost model, e.g. 25GB/s (default)");
  app.add_option("--pool-nvme-bandwidth", nvme_bw, "pool NVMe fetch bandwidth for the cost model, e.g. 7GB/s (default)");
  kvpool::RequireDecimalIntegers(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  auto bad = [](absl::string_view msg) {
    std::cerr << msg << "\n";
    return 2;
  };
  auto p = ParsePolicy(policy);
  if (!p.ok()) return bad(absl::StrCat("--policy: ", p.status().message()));
  c.policy = *p;
  auto h = ParseHybridMode(hybrid);
  if (!h.ok()) return bad(absl::StrCat("--hybrid-mode: ", h.status().message()));
  c.hybrid_mode = *h;
  c.models = models;
  if (!flops.empty()) {
    auto f = ParseNumber(flops, "--flops");
    if (!f.ok()) return bad(f.status().message());
    if (!(*f >= kMinFlops && *f <= kMaxFlops)) {
      return bad(absl::StrCat("--flops='", flops, "' is outside ", kMinFlops, "..", kMaxFlops, " FLOP/s; e.g. 400e12 or 400T"));
    }
    c.cost.achieved_flops = *f;
  }
  for (auto [flag, text, out] : {std::tuple{"--pool-dram-bandwidth", &dram_bw, &c.pool_dram_bandwidth},
                                 std::tuple{"--pool-nvme-bandwidth", &nvme_bw, &c.pool_nvme_bandwidth}}) {
    if (text->empty()) continue;
    auto r = ParseRate(*text, flag);
    if (!r.ok()) return bad(r.status().message());
    if (!(*r >= kMinBandwidth && *r <= kMaxBandwidth)) {
      return bad(absl::StrCat(flag, "='", *text, "' is outside ", kMinBandwidth, "..", kMaxBandwidth,
                              " bytes/s; e.g. 25GB/s"));
    }
    *out = *r;
  }
  {
    auto m = ParseBytes(max_message, "--max-message-bytes");
    if (!m.ok()) return bad(m.status().message());
    if (*m < kMinRouterMessageBytes || *m > kMaxRouterMessageBytes) {
      return bad(absl::StrCat("--max-message-bytes='", max_message, "' is outside ", kMinRouterMessageBytes, "..",
                              kMaxRouterMessageBytes, " bytes (8MiB..2047MiB): an event batch of a source takes "
                              "up to 4 MiB"));
    }
    o.max_message_bytes = static_cast<int>(*m);
  }
  if (heartbeat_interval_ms <= 0) return bad("--heartbeat-interval-ms must be > 0");
  // Durations: positive and at most a day (inf would keep a dead source, or a decision,
  // for good; NaN compares false everywhere).
  for (auto [flag, v] : {std::pair{"--heartbeat-timeout", heartbeat_timeout_s},
                         std::pair{"--decision-timeout", decision_timeout_s}, std::pair{"--approx-ttl", approx_ttl_s}}) {
    if (!(v > 0 && v <= 86400)) return bad(absl::StrCat(flag, "=", v, " must be in (0, 86400] seconds"));
  }
  // Policy weights: finite and >= 0 (NaN made cache_aware's choice arbitrary, a negative
  // weight turned it upside down).
  for (auto [flag, v] : {std::pair{"--overlap-weight", c.policy_params.overlap_weight},
                         std::pair{"--load-weight", c.policy_params.load_weight},
                         std::pair{"--balance-rel", c.policy_params.balance_rel},
                         std::pair{"--balance-abs", c.policy_params.balance_abs},
                         std::pair{"--ttft-decode-weight", c.ttft_decode_weight}}) {
    if (!std::isfinite(v) || v < 0) return bad(absl::StrCat(flag, "=", v, " must be a finite number >= 0"));
  }
  if (!std::isfinite(c.ttft_slo_s) || c.ttft_slo_s < 0) {
    return bad(absl::StrCat("--ttft-slo=", c.ttft_slo_s, " must be a finite number of seconds >= 0 (0 = off)"));
  }
  if (absl::Status m = CheckMetricsPort(o.metrics_port); !m.ok()) return bad(m.message());
  if (absl::Status l = CheckListenAddress("--listen", o.listen); !l.ok()) return bad(l.message());
  // Otherwise Tick drops every source between two of its heartbeats.
  if (heartbeat_timeout_s * 1000 < 2.0 * heartbeat_interval_ms) {
    return bad(absl::StrCat("--heartbeat-timeout=", heartbeat_timeout_s, " s is shorter than 2 x --heartbeat-interval-ms=",
                            heartbeat_interval_ms, " ms; every source would be dropped between heartbeats. Set "
                            "--heartbeat-timeout to at least ", 2.0 * heartbeat_interval_ms / 1000, " s or lower "
                            "--heartbeat-interval-ms"));
  }
  if (o.host.max_streams == 0) return bad("--max-streams must be >= 1");
  if (o.host.apply_slice_events == 0) return bad("--apply-slice-events must be >= 1");
  c.heartbeat_interval = absl::Milliseconds(heartbeat_interval_ms);
  c.heartbeat_timeout = absl::Seconds(heartbeat_timeout_s);
  c.decision_timeout = absl::Seconds(decision_timeout_s);
  c.approx_ttl = absl::Seconds(approx_ttl_s);

  // Signals go to a waiting thread, not to whichever thread gRPC happens to run.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  auto server = RouterServer::Start(o);
  if (!server.ok()) {
    std::cerr << "kvpool-router: " << server.status().message() << "\n";
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::cout << "kvpool-router listening on port " << (*server)->port() << "\n"
            << "  listen               " << o.listen << "\n"
            << "  policy               " << PolicyName(c.policy) << "\n"
            << "  models               " << absl::StrJoin(c.models, ",") << "\n"
            << "  block_tokens         " << (c.block_tokens == 0 ? std::string("model default") : std::to_string(c.block_tokens)) << "\n"
            << "  max_index_entries    " << c.max_index_entries << "\n"
            << "  ttft_slo_s           " << (c.ttft_slo_s > 0 ? std::to_string(c.ttft_slo_s) : std::string("off")) << "\n"
            << "  hybrid_mode          " << HybridModeName(c.hybrid_mode) << "\n"
            << "  heartbeat            every " << heartbeat_interval_ms << " ms, dropped after " << heartbeat_timeout_s << " s\n"
            << "  decision_timeout_s   " << decision_timeout_s << "\n"
            << "  approx_ttl_s         " << approx_ttl_s << "\n"
            << "  cache_aware          w1=" << c.policy_params.overlap_weight << " w2=" << c.policy_params.load_weight
            << " cap=" << c.policy_params.balance_rel << "*mean+" << c.policy_params.balance_abs << "\n"
            << "  metrics              " << ((*server)->metrics_port() >= 0 ? absl::StrCat("http://", o.metrics_host, ":", (*server)->metrics_port(), "/metrics") : std::string("off")) << "\n"
            << std::flush;
  RouterServer* s = server->get();
  std::thread waiter([s, sigs] {
    int sig = 0;
    sigwait(&sigs, &sig);
    std::cout << "kvpool-router: signal " << sig << ", shutting down\n" << std::flush;
    s->Shutdown();
  });
  s->Wait();
  waiter.join();
  return 0;
}

}  // namespace kvpool::router
