// kvctl load: open-loop Route load on a running kvpool-router.
//
//   schedule (Poisson or fixed interval, --rate for --duration) ─► one sender thread
//       ─► async Route on C client connections (round robin) ─► callback: latency, status
//
// Open loop: each request has a scheduled send time fixed before the run; the sender
// never waits for answers. Latency is measured from the *scheduled* time, so a sender
// or router stall counts against every request it delayed (no coordinated omission); the
// sender's own lateness is reported as send lag. Loopback and private (test-namespace)
// addresses only.
//
// Prompts: --prompts distinct prompts of --prompt-tokens tokens whose first
// --shared-prefix-tokens are the same for all (a shared system prompt), the rest unique
// to the prompt; request i sends prompt i mod --prompts, so the router sees prefix hits.
//
// --sim-instances N registers N simulated instances ("kvctl-load-sim-K", approximate mode:
// they publish no events, so the router predicts their caches from its own decisions) and
// heartbeats them during the run, for a router with no workers attached.
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include <CLI/CLI.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "format.h"
#include "kvctl.h"
#include "kvpool/common/percentile.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/router/router_client.h"
#include "kvpool/v1/router.grpc.pb.h"
#include "net.h"
#include "nlohmann/json.hpp"

namespace kvpool::kvctl {
namespace {

using nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

struct LoadArgs {
  std::string router;
  double rate = 1000;
  double duration_s = 10;
  int concurrency = 16;
  std::string model = "tiny-gqa";
  int64_t prompt_tokens = 1024;
  int64_t shared_prefix_tokens = -1;  // -1: half of --prompt-tokens
  int prompts = 256;
  std::string arrivals = "poisson";
  uint64_t seed = 1;
  double timeout_s = 5;
  int sim_instances = 0;
  bool json = false;
};

double SortedPercentile(const std::vector<double>& v, double q) { return NearestRankSorted(v, q); }

struct Call {
  grpc::ClientContext ctx;
  v1::RouteResponse resp;
  size_t index = 0;
  Clock::time_point scheduled;
};

void RunLoad(LoadArgs a, Io& io) {
  auto fail = [&io](absl::string_view msg, int code) {
    *io.err << "kvctl load: " << msg << "\n";
    io.exit_code = code;
  };
  if (!AllowedHost(a.router)) {
    return fail(absl::StrCat("--router=", a.router,
                             " is not a loopback or private (test-namespace) address; load only drives "
                             "local or test clusters"),
                2);
  }
  if (!(a.rate > 0) || a.rate > 1e6) return fail("--rate must be in (0, 1e6] requests/s", 2);
  if (!(a.duration_s > 0) || a.duration_s > 3600) return fail("--duration must be in (0, 3600] seconds", 2);
  if (a.rate * a.duration_s > 2e7) return fail("--rate x --duration must be <= 2e7 requests", 2);
  if (a.concurrency < 1 || a.concurrency > 1024) return fail("--concurrency must be in [1, 1024]", 2);
  if (a.prompt_tokens < 1 || a.prompt_tokens > (1 << 20)) return fail("--prompt-tokens must be in [1, 2^20]", 2);
  if (a.shared_prefix_tokens == -1) a.shared_prefix_tokens = a.prompt_tokens / 2;
  if (a.shared_prefix_tokens < 0 || a.shared_prefix_tokens > a.prompt_tokens) {
    return fail("--shared-prefix-tokens must be in [0, --prompt-tokens]", 2);
  }
  if (a.prompts < 1 || a.prompts > 65536) return fail("--prompts must be in [1, 65536]", 2);
  // Every prompt is built up front (4 bytes a token, more as protobuf): 65536 x 2^20
  // tokens would be 256 GiB.
  constexpr int64_t kMaxTotalTokens = int64_t{1} << 28;
  if (int64_t{a.prompts} * a.prompt_tokens > kMaxTotalTokens) {
    return fail(absl::StrCat("--prompts x --prompt-tokens = ", int64_t{a.prompts} * a.prompt_tokens,
                             " tokens, more than 2^28 built up front; lower either"),
                2);
  }
  if (a.arrivals != "poisson" && a.arrivals != "fixed") return fail("--arrivals must be poisson or fixed", 2);
  // Bounded so the deadline (now + timeout, in system_clock ticks) cannot overflow.
  if (!(a.timeout_s > 0) || a.timeout_s > 3600) return fail("--timeout must be in (0, 3600] seconds", 2);
  if (a.sim_instances < 0 || a.sim_instances > 1024) return fail("--sim-instances must be in [0, 1024]", 2);
  auto spec = ResolveModelSpec(a.model);
  if (!spec.ok()) return fail(absl::StrCat("--model: ", spec.status().message()), 2);

  // Simulated instances, heartbeating until the run ends (registered again if the
  // router forgot them), then unregistered: a router must not keep routing to their
  // .invalid addresses after kvctl exits.
  std::unique_ptr<router::RouterClient> control;
  struct SimInstances {
    router::RouterClient* router = nullptr;
    std::vector<v1::RegisterRequest> requests;
    std::vector<uint64_t> registrations;  // 0: not registered
    std::atomic<bool> stop{false};
    std::thread heartbeats;
    ~SimInstances() {
      stop = true;
      if (heartbeats.joinable()) heartbeats.join();
      // At most 5 s in all, and none after a router that does not answer (its
      // heartbeat timeout drops the rest).
      const absl::Time give_up = absl::Now() + absl::Seconds(5);
      for (size_t k = 0; k < requests.size(); ++k) {
        if (registrations[k] == 0) continue;
        const absl::Duration left = give_up - absl::Now();
        if (left <= absl::ZeroDuration()) break;
        const absl::Status st = router->Unregister(requests[k].source_id(), registrations[k],
                                                   std::min(left, absl::Seconds(2)));
        if (absl::IsDeadlineExceeded(st) || absl::IsUnavailable(st)) break;
      }
    }
  } sims;
  if (a.sim_instances > 0) {
    auto c = router::RouterClient::Connect(a.router, absl::Seconds(5));
    if (!c.ok()) return fail(c.status().message(), 1);
    control = *std::move(c);
    sims.router = control.get();
    sims.registrations.assign(static_cast<size_t>(a.sim_instances), 0);
    for (int k = 0; k < a.sim_instances; ++k) {
      v1::RegisterRequest r;
      r.set_source_id(absl::StrCat("kvctl-load-sim-", k));
      r.set_kind(v1::SOURCE_KIND_WORKER);
      // Simulated: it serves nothing, so an address in .invalid (RFC 2606: never resolves).
      r.set_address(absl::StrCat("kvctl-load-sim-", k, ".invalid:1"));
      r.mutable_model()->set_name(spec->name);
      r.set_capacity_blocks(1 << 16);
      r.set_publishes_events(false);
      sims.requests.push_back(r);
      auto st = control->Register(r);
      if (!st.ok()) return fail(absl::StrCat("--sim-instances: Register: ", st.status().message()), 1);
      sims.registrations[static_cast<size_t>(k)] = st->registration();
    }
    sims.heartbeats = std::thread([&sims] {
      while (!sims.stop.load()) {
        for (size_t k = 0; k < sims.requests.size() && !sims.stop.load(); ++k) {
          v1::HeartbeatRequest h;
          h.set_source_id(sims.requests[k].source_id());
          // Short deadlines, and a round ends at a router that does not answer (tried
          // again next round), so one unreachable router does not hold a round for
          // 1 s per instance. A failed call is retried next round.
          auto hr = sims.router->Heartbeat(h, absl::Seconds(1));
          if (!hr.ok() && (absl::IsDeadlineExceeded(hr.status()) || absl::IsUnavailable(hr.status()))) break;
          if (hr.ok() && hr->unknown_source()) {
            auto again = sims.router->Register(sims.requests[k]);
            if (again.ok()) sims.registrations[k] = again->registration();
          }
        }
        for (int t = 0; t < 20 && !sims.stop.load(); ++t) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    });
  }

  // Prompts: shared prefix, then a tail unique to the prompt; ids kept inside the vocabulary.
  // The tail's ids are a mix of (prompt, position): an affine id like (r + 1) * 1000003
  // repeated every `vocab` prompts (512 for tiny-*), so --prompts 1024 held 512 distinct
  // prompts and the hit rate came out high.
  const uint64_t vocab = static_cast<uint64_t>(std::max(2, spec->vocab_size));
  std::vector<v1::RouteRequest> reqs(static_cast<size_t>(a.prompts));
  for (size_t r = 0; r < reqs.size(); ++r) {
    reqs[r].mutable_model()->set_name(spec->name);
    auto* toks = reqs[r].mutable_tokens();
    toks->Reserve(static_cast<int>(a.prompt_tokens));
    for (int64_t t = 0; t < a.prompt_tokens; ++t) {
      const uint64_t id = t < a.shared_prefix_tokens ? static_cast<uint64_t>(t) * 7919
                                                      : Mix64((static_cast<uint64_t>(r) << 32) ^ static_cast<uint64_t>(t));
      toks->Add(static_cast<uint32_t>(id % vocab));
    }
  }

  // The schedule, fixed before the run.
  std::vector<double> sched_s;
  sched_s.reserve(static_cast<size_t>(a.rate * a.duration_s * 1.1) + 16);
  std::mt19937_64 rng(a.seed);
  std::exponential_distribution<double> gap(a.rate);
  if (a.arrivals == "fixed") {
    const size_t n = static_cast<size_t>(std::llround(a.rate * a.duration_s));
    for (size_t i = 0; i < n; ++i) sched_s.push_back(static_cast<double>(i) / a.rate);
  } else {
    for (double t = gap(rng); t < a.duration_s; t += gap(rng)) sched_s.push_back(t);
  }
  const size_t n = sched_s.size();

  // C client connections (a local subchannel pool each, so each is its own TCP connection).
  std::vector<std::unique_ptr<v1::Router::Stub>> stubs;
  for (int i = 0; i < a.concurrency; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("kvpool.kvctl.load.channel", i);
    auto ch = grpc::CreateCustomChannel(a.router, grpc::InsecureChannelCredentials(), args);
    if (!ch->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(5))) {
      return fail(absl::StrCat("cannot connect to --router=", a.router, " within 5 s"), 1);
    }
    stubs.push_back(v1::Router::NewStub(ch));
  }

  std::vector<double> lat_us(n, -1), lag_us(n, 0);
  std::vector<uint8_t> code_of(n, 0);
  std::atomic<size_t> pending{0};
  std::atomic<uint64_t> total_blocks{0}, gpu_blocks{0}, pool_blocks{0};
  std::mutex err_mu;
  std::string first_error;
  std::map<std::string, std::string> first_error_by_code;
  Clock::time_point last_done{};
  const auto start = Clock::now() + std::chrono::milliseconds(20);
  const auto timeout = std::chrono::duration_cast<std::chrono::system_clock::duration>(
      std::chrono::duration<double>(a.timeout_s));
  for (size_t i = 0; i < n; ++i) {
    const auto target = start + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(sched_s[i]));
    std::this_thread::sleep_until(target);
    auto* call = new Call;
    call->index = i;
    call->scheduled = target;
    call->ctx.set_deadline(std::chrono::system_clock::now() + timeout);
    lag_us[i] = std::chrono::duration<double, std::micro>(Clock::now() - target).count();
    pending.fetch_add(1);
    stubs[i % stubs.size()]->async()->Route(
        &call->ctx, &reqs[i % reqs.size()], &call->resp, [&, call](grpc::Status s) {
          const auto now = Clock::now();
          lat_us[call->index] = std::chrono::duration<double, std::micro>(now - call->scheduled).count();
          code_of[call->index] = static_cast<uint8_t>(s.error_code());
          if (s.ok()) {
            total_blocks.fetch_add(call->resp.total_blocks(), std::memory_order_relaxed);
            gpu_blocks.fetch_add(call->resp.gpu_hit_blocks(), std::memory_order_relaxed);
            pool_blocks.fetch_add(call->resp.pool_hit_blocks(), std::memory_order_relaxed);
          }
          {
            std::lock_guard<std::mutex> l(err_mu);
            if (!s.ok()) {
              const std::string code = absl::StatusCodeToString(static_cast<absl::StatusCode>(s.error_code()));
              if (first_error.empty()) first_error = absl::StrCat(code, ": ", s.error_message());
              first_error_by_code.emplace(code, s.error_message());
            }
            last_done = std::max(last_done, now);
          }
          delete call;
          pending.fetch_sub(1);
        });
  }
  const auto issued_end = Clock::now();
  while (pending.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  stubs.clear();

  // ---- summary -------------------------------------------------------------------------------
  std::vector<double> ok_lat, all_lat, lag(lag_us);
  std::map<std::string, uint64_t> errors_by_code;
  size_t ok = 0;
  for (size_t i = 0; i < n; ++i) {
    all_lat.push_back(lat_us[i]);
    if (code_of[i] == 0) {
      ++ok;
      ok_lat.push_back(lat_us[i]);
    } else {
      ++errors_by_code[absl::StatusCodeToString(static_cast<absl::StatusCode>(code_of[i]))];
    }
  }
  std::sort(ok_lat.begin(), ok_lat.end());
  std::sort(all_lat.begin(), all_lat.end());
  std::sort(lag.begin(), lag.end());
  Clock::time_point end;
  {
    std::lock_guard<std::mutex> l(err_mu);
    end = std::max(last_done, issued_end);
  }
  const double wall_s = std::max(1e-9, std::chrono::duration<double>(end - start).count());
  const double send_s = std::max(1e-9, std::chrono::duration<double>(issued_end - start).count());
  double mean = 0;
  for (double x : ok_lat) mean += x / static_cast<double>(ok_lat.size());
  const size_t errors = n - ok;
  auto share = [](uint64_t x, uint64_t y) { return y > 0 ? static_cast<double>(x) / static_cast<double>(y) : 0.0; };

  ordered_json j;
  j["router"] = a.router;
  j["model"] = spec->name;
  j["arrivals"] = a.arrivals;
  j["seed"] = a.seed;
  j["concurrency"] = a.concurrency;
  j["prompt_tokens"] = a.prompt_tokens;
  j["shared_prefix_tokens"] = a.shared_prefix_tokens;
  j["prompts"] = a.prompts;
  j["sim_instances"] = a.sim_instances;
  j["target_rate_per_s"] = a.rate;
  j["duration_s"] = a.duration_s;
  j["requests"] = n;
  j["ok"] = ok;
  j["errors"] = errors;
  j["errors_by_code"] = errors_by_code;
  if (!first_error.empty()) j["first_error"] = first_error;
  j["first_error_by_code"] = first_error_by_code;
  j["send_rate_per_s"] = static_cast<double>(n) / send_s;
  j["achieved_rate_per_s"] = static_cast<double>(n) / wall_s;  // answers (ok or not) per second of the run
  j["ok_rate_per_s"] = static_cast<double>(ok) / wall_s;
  j["wall_s"] = wall_s;
  j["latency_us"] = {{"p50", SortedPercentile(ok_lat, 0.50)}, {"p90", SortedPercentile(ok_lat, 0.90)},
                     {"p99", SortedPercentile(ok_lat, 0.99)}, {"max", ok_lat.empty() ? 0.0 : ok_lat.back()},
                     {"mean", mean}};
  j["latency_all_us"] = {{"p50", SortedPercentile(all_lat, 0.50)}, {"p99", SortedPercentile(all_lat, 0.99)},
                         {"max", all_lat.empty() ? 0.0 : all_lat.back()}};
  j["send_lag_us"] = {{"p50", SortedPercentile(lag, 0.50)}, {"p99", SortedPercentile(lag, 0.99)},
                      {"max", lag.empty() ? 0.0 : lag.back()}};
  j["router_hit_rate"] = {{"gpu", share(gpu_blocks.load(), total_blocks.load())},
                          {"pool", share(pool_blocks.load(), total_blocks.load())}};

  if (a.json) {
    *io.out << j.dump(2) << "\n";
  } else {
    Report r;
    r.Line(absl::StrCat("kvctl load: ", a.router, ", ", spec->name, ", ", a.arrivals, " arrivals at ",
                        Fixed(a.rate, 0), "/s for ", Fixed(a.duration_s, 1), " s over ", a.concurrency,
                        " connections"),
           "");
    r.Line("requests", absl::StrCat(WithCommas(static_cast<int64_t>(n)), " (", WithCommas(static_cast<int64_t>(ok)),
                                    " ok, ", WithCommas(static_cast<int64_t>(errors)), " errors)"));
    for (const auto& [code, count] : errors_by_code) {
      r.Line(absl::StrCat("  ", code), absl::StrCat(WithCommas(static_cast<int64_t>(count)), " (first: ",
                                                    first_error_by_code[code], ")"));
    }
    if (!first_error.empty()) r.Line("first error", first_error);
    r.Line("rate", absl::StrCat("achieved ", Fixed(static_cast<double>(n) / wall_s, 0), "/s, sent ",
                                Fixed(static_cast<double>(n) / send_s, 0), "/s, target ", Fixed(a.rate, 0), "/s"));
    r.Line("latency",
           absl::StrCat("p50 ", Fixed(SortedPercentile(ok_lat, 0.5), 0), " us  p90 ", Fixed(SortedPercentile(ok_lat, 0.9), 0),
                        " us  p99 ", Fixed(SortedPercentile(ok_lat, 0.99), 0), " us  max ",
                        Fixed(ok_lat.empty() ? 0.0 : ok_lat.back(), 0), " us (from the scheduled send time)"));
    r.Line("send lag", absl::StrCat("p50 ", Fixed(SortedPercentile(lag, 0.5), 0), " us  p99 ",
                                    Fixed(SortedPercentile(lag, 0.99), 0), " us"));
    r.Line("router hit", absl::StrCat("gpu ", Fixed(share(gpu_blocks.load(), total_blocks.load()), 3), "  pool ",
                                      Fixed(share(pool_blocks.load(), total_blocks.load()), 3)));
    r.Print(*io.out);
  }
  if (n > 0 && ok == 0) io.exit_code = 1;  // nothing got through
}

}  // namespace

void AddLoadCommands(CLI::App& app, Io& io) {
  auto args = std::make_shared<LoadArgs>();
  CLI::App* load = app.add_subcommand(
      "load", "open-loop Route load on a loopback/private kvpool-router: rate, latency p50/p90/p99/max, errors");
  load->add_option("--router", args->router, "router address host:port (loopback or private)")->required();
  load->add_option("--rate", args->rate, "requests per second (mean for poisson)")
      ->check(FiniteNumber())->capture_default_str();
  load->add_option("--duration", args->duration_s, "seconds of arrivals")->check(FiniteNumber())->capture_default_str();
  load->add_option("--concurrency", args->concurrency, "client connections the requests are spread over")
      ->capture_default_str();
  load->add_option("--model", args->model, "model name")->capture_default_str();
  load->add_option("--prompt-tokens", args->prompt_tokens, "tokens per request")->capture_default_str();
  load->add_option("--shared-prefix-tokens", args->shared_prefix_tokens, "leading tokens every prompt shares (default: half of --prompt-tokens)")
      ->capture_default_str();
  load->add_option("--prompts", args->prompts, "distinct prompts (request i sends prompt i mod N)")
      ->capture_default_str();
  load->add_option("--arrivals", args->arrivals, "poisson or fixed (fixed interval)")->capture_default_str();
  load->add_option("--seed", args->seed, "seed of the poisson schedule")->capture_default_str();
  load->add_option("--timeout", args->timeout_s, "per-request deadline, seconds")
      ->check(FiniteNumber())->capture_default_str();
  load->add_option("--sim-instances", args->sim_instances,
                   "register this many simulated instances (approximate mode) and heartbeat them during the run")
      ->capture_default_str();
  load->add_flag("--json", args->json, "print JSON");
  load->callback([args, &io] { RunLoad(*args, io); });
}

}  // namespace kvpool::kvctl
