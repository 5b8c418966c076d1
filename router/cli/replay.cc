// kvctl replay: drives a live cluster with a Mooncake trace. Each request is sent at its
// arrival time (scaled by --speed): Route on the router, then, when the chosen instance has
// an address that answers kvpool.v1.Worker, Generate on that worker with the prompt
// synthesized from the trace's hash ids (router/trace). Loopback and private
// (test-namespace) addresses only; bounded by --limit and --max-duration.
//
//   schedule ─► C sender threads ─► Route ─► [Generate] ─► per-request record ─► summary
#include <grpcpp/grpcpp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <system_error>
#include <thread>

#include <CLI/CLI.hpp>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "format.h"
#include "kvctl.h"
#include "net.h"
#include "kvpool/common/percentile.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/common/units.h"
#include "kvpool/router/router_client.h"
#include "kvpool/router/trace.h"
#include "kvpool/v1/worker.grpc.pb.h"
#include "nlohmann/json.hpp"

namespace kvpool::kvctl {
namespace {

using nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

struct ReplayArgs {
  std::string trace;
  std::string router;
  std::string model = "tiny-gqa";
  double speed = 1.0;
  size_t limit = 1000;
  int concurrency = 8;
  int64_t trace_block_tokens = trace::kDefaultTraceBlockTokens;
  bool strict = false;
  int64_t max_prompt_tokens = 0;     // 0 = the trace's lengths
  uint32_t max_new_tokens = 16;      // cap on output_length sent to workers
  double max_duration_s = 600;
  double progress_interval_s = 5;
  bool json = false;
  std::string csv;
};

struct Record {
  size_t index = 0;
  double scheduled_s = 0;  // arrival / speed
  double sent_s = 0;       // when Route was sent (lag = sent - scheduled)
  int64_t prompt_tokens = 0;
  bool ok = false;
  bool sent = false;
  std::string error;       // "route: ..." or "worker: ..."
  std::string error_kind;  // "route CODE" / "worker CODE"
  std::string instance;
  double route_s = 0;
  uint32_t total_blocks = 0, gpu_hit_blocks = 0, pool_hit_blocks = 0;
  bool worker = false;     // a worker answered Generate
  double ttft_s = 0, queue_s = 0, local_hit_s = 0, pool_fetch_s = 0, recompute_s = 0;
  uint32_t gpu_hit_tokens = 0, pool_hit_tokens = 0, recomputed_tokens = 0, output_tokens = 0;
};

double Percentile(std::vector<double> v, double q) { return NearestRank(v, q); }

// One Worker stub per address; an address that does not answer GetStats is remembered as
// "no worker" (e.g. simulated instances registered without a server).
class Workers {
 public:
  // The stub for `address`, or null while no worker answers there. A failed probe is
  // tried again 5 s later (a worker slow or restarting at first contact is not written
  // off for the run). One probe per address at a time, run without the lock: senders to
  // other addresses do not wait for it, senders to the same one wait for its answer.
  v1::Worker::Stub* Get(const std::string& address) {
    std::unique_lock<std::mutex> l(mu_);
    Entry& e = stubs_[address];  // std::map: the reference stays valid
    cv_.wait(l, [&e] { return !e.probing; });
    if (e.stub != nullptr || (e.probed && absl::Now() < e.retry_at)) return e.stub.get();
    e.probing = true;
    l.unlock();
    std::unique_ptr<v1::Worker::Stub> probed = Probe(address);
    l.lock();
    e.probing = false;
    e.probed = true;
    e.stub = std::move(probed);
    if (e.stub == nullptr) e.retry_at = absl::Now() + absl::Seconds(5);
    cv_.notify_all();
    return e.stub.get();
  }

 private:
  static std::unique_ptr<v1::Worker::Stub> Probe(const std::string& address) {
    if (address.empty() || !AllowedHost(address)) return nullptr;
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(64 << 20);
    auto ch = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
    auto s = v1::Worker::NewStub(ch);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    v1::GetWorkerStatsRequest req;
    v1::WorkerStats stats;
    return s->GetStats(&ctx, req, &stats).ok() ? std::move(s) : nullptr;
  }
  struct Entry {
    std::unique_ptr<v1::Worker::Stub> stub;  // set once, never replaced (callers keep the pointer)
    bool probing = false;                    // a thread is probing the address now
    bool probed = false;
    absl::Time retry_at;                     // after a failed probe: the next one
  };
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, Entry> stubs_;
};

void RunReplay(const ReplayArgs& a, Io& io) {
  auto fail = [&io](absl::string_view msg, int code) {
    *io.err << "kvctl replay: " << msg << "\n";
    io.exit_code = code;
  };
  if (!AllowedHost(a.router)) {
    return fail(absl::StrCat("--router=", a.router,
                             " is not a loopback or private (test-namespace) address; replay only drives "
                             "local or test clusters"),
                2);
  }
  if (!(a.speed > 0)) return fail("--speed must be > 0", 2);
  auto spec = ResolveModelSpec(a.model);
  if (!spec.ok()) return fail(absl::StrCat("--model: ", spec.status().message()), 2);
  auto t = trace::LoadTrace(a.trace, {.trace_block_tokens = a.trace_block_tokens, .strict = a.strict, .limit = a.limit});
  if (!t.ok()) return fail(t.status().message(), t.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  ReportTraceLoad(*io.err, "replay", a.trace, a.limit, *t);
  if (t->requests.empty()) return fail(absl::StrCat("--trace=", a.trace, ": no valid request"), 1);
  auto router = router::RouterClient::Connect(a.router, absl::Seconds(5));
  if (!router.ok()) return fail(router.status().message(), 1);

  const auto& reqs = t->requests;
  const double t0_ms = reqs.front().timestamp_ms;
  const uint32_t vocab = static_cast<uint32_t>(std::max(1, spec->vocab_size));
  std::vector<Record> records(reqs.size());
  Workers workers;
  std::atomic<uint64_t> generate_skipped{0};
  std::atomic<size_t> next{0}, done{0}, errors{0};
  std::atomic<bool> stop{false};
  const auto start = Clock::now();
  auto since = [&start](Clock::time_point tp) { return std::chrono::duration<double>(tp - start).count(); };

  auto send = [&](size_t i) {
    const trace::TraceRequest& tr = reqs[i];
    Record& r = records[i];
    r.index = i;
    r.scheduled_s = (tr.timestamp_ms - t0_ms) / 1000.0 / a.speed;
    if (r.scheduled_s > a.max_duration_s) {  // bounded in time: later arrivals are not sent
      stop = true;
      return;
    }
    r.sent = true;
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                              std::chrono::duration<double>(r.scheduled_s)));
    std::vector<TokenId> tokens = trace::SynthesizeTokens(tr, a.trace_block_tokens, vocab);
    if (a.max_prompt_tokens > 0 && static_cast<int64_t>(tokens.size()) > a.max_prompt_tokens) {
      tokens.resize(static_cast<size_t>(a.max_prompt_tokens));
    }
    r.prompt_tokens = static_cast<int64_t>(tokens.size());
    v1::RouteRequest rq;
    rq.mutable_model()->set_name(spec->name);
    rq.mutable_tokens()->Add(tokens.begin(), tokens.end());
    const auto s0 = Clock::now();
    r.sent_s = since(s0);
    auto rr = (*router)->Route(rq);
    r.route_s = std::chrono::duration<double>(Clock::now() - s0).count();
    if (!rr.ok()) {
      r.error = absl::StrCat("route: ", absl::StatusCodeToString(rr.status().code()), ": ", rr.status().message());
      r.error_kind = absl::StrCat("route ", absl::StatusCodeToString(rr.status().code()));
      ++errors;
      return;
    }
    r.instance = rr->instance_id();
    r.total_blocks = rr->total_blocks();
    r.gpu_hit_blocks = rr->gpu_hit_blocks();
    r.pool_hit_blocks = rr->pool_hit_blocks();
    r.ok = true;
    v1::Worker::Stub* w = workers.Get(rr->instance_address());
    if (w == nullptr) {
      ++generate_skipped;  // routed to an instance no worker answers for (yet)
      return;
    }
    v1::GenerateRequest g;
    g.set_request_id(absl::StrCat("replay-", i));
    g.mutable_tokens()->Add(tokens.begin(), tokens.end());
    g.set_max_new_tokens(std::min<uint32_t>(a.max_new_tokens, static_cast<uint32_t>(std::max<int64_t>(1, tr.output_length))));
    g.set_router_decision_id(rr->decision_id());
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    v1::GenerateResponse resp;
    grpc::Status st = w->Generate(&ctx, g, &resp);
    if (!st.ok()) {
      r.ok = false;
      r.error = absl::StrCat("worker ", rr->instance_id(), ": ", st.error_message());
      r.error_kind = absl::StrCat("worker ", absl::StatusCodeToString(static_cast<absl::StatusCode>(st.error_code())));
      ++errors;
      return;
    }
    r.worker = true;
    r.ttft_s = resp.ttft().total_s();
    r.queue_s = resp.ttft().queue_s();
    r.local_hit_s = resp.ttft().local_hit_s();
    r.pool_fetch_s = resp.ttft().pool_fetch_s();
    r.recompute_s = resp.ttft().recompute_s();
    r.gpu_hit_tokens = resp.gpu_hit_tokens();
    r.pool_hit_tokens = resp.pool_hit_tokens();
    r.recomputed_tokens = resp.recomputed_tokens();
    r.output_tokens = static_cast<uint32_t>(resp.output_tokens_size());
  };

  std::vector<std::thread> threads;
  const int n_threads = std::max(1, std::min<int>(a.concurrency, static_cast<int>(reqs.size())));
  threads.reserve(static_cast<size_t>(n_threads));
  for (int k = 0; k < n_threads; ++k) {
    // A thread that cannot be created (a process or memory limit at --concurrency 1024)
    // must not unwind past the ones running (std::terminate): go on with those.
    try {
      threads.emplace_back([&] {
        for (;;) {
          if (stop.load()) return;
          const size_t i = next.fetch_add(1);
          if (i >= reqs.size()) return;
          // An exception must not escape a std::thread (std::terminate): record it instead.
          try {
            send(i);
          } catch (const std::exception& e) {
            records[i].sent = true;
            records[i].ok = false;
            records[i].error = absl::StrCat("replay: ", e.what());
            records[i].error_kind = "replay exception";
            ++errors;
          }
          done.fetch_add(1);
        }
      });
    } catch (const std::exception& e) {  // std::system_error (a thread limit), bad_alloc
      if (threads.empty()) return fail(absl::StrCat("cannot start a sender thread: ", e.what()), 1);
      *io.err << "kvctl replay: started " << threads.size() << " of " << n_threads << " sender threads ("
              << e.what() << "); going on with those\n";
      break;
    }
  }
  // Progress: a bar on a terminal, plain periodic lines otherwise.
  const bool tty = io.err == &std::cerr && isatty(STDERR_FILENO);
  auto last_line = Clock::now();
  while (done.load() < reqs.size()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(tty ? 200 : 50));
    const double elapsed = since(Clock::now());
    if (elapsed > a.max_duration_s && !stop.load()) {
      stop = true;
      *io.err << (tty ? "\n" : "") << "kvctl replay: --max-duration=" << a.max_duration_s
              << " s reached; finishing the requests in flight\n";
    }
    const size_t d = done.load();
    if (tty) {
      const int width = 40;
      const int fill = static_cast<int>(width * static_cast<double>(d) / static_cast<double>(reqs.size()));
      *io.err << "\r[" << std::string(static_cast<size_t>(fill), '#') << std::string(static_cast<size_t>(width - fill), '.')
              << "] " << d << "/" << reqs.size() << "  errors " << errors.load() << "  " << Fixed(elapsed, 1) << " s"
              << std::flush;
    } else if (std::chrono::duration<double>(Clock::now() - last_line).count() >= a.progress_interval_s) {
      last_line = Clock::now();
      *io.err << "kvctl replay: " << d << "/" << reqs.size() << " requests, " << errors.load() << " errors, "
              << Fixed(elapsed, 1) << " s\n";
    }
    if (stop.load()) break;  // senders pick no new request; join waits for those in flight
  }
  for (auto& th : threads) th.join();
  if (tty) *io.err << "\n";
  const double wall = since(Clock::now());
  records.erase(std::remove_if(records.begin(), records.end(), [](const Record& r) { return !r.sent; }),
                records.end());
  const size_t sent = records.size();

  // ---- summary -------------------------------------------------------------------------------
  std::vector<double> route_lat, ttft, lag;
  std::map<std::string, std::pair<uint64_t, uint64_t>> per_instance;  // requests, prompt tokens
  std::map<std::string, uint64_t> error_counts;
  uint64_t blocks = 0, gpu_blocks = 0, pool_blocks = 0, worker_prompt = 0, w_gpu = 0, w_pool = 0, w_recomp = 0;
  double q = 0, lh = 0, pf = 0, rc = 0;
  for (const Record& r : records) {
    lag.push_back(std::max(0.0, r.sent_s - r.scheduled_s));
    if (!r.error_kind.empty()) ++error_counts[r.error_kind];
    if (r.instance.empty()) continue;  // the route failed
    route_lat.push_back(r.route_s);
    blocks += r.total_blocks;
    gpu_blocks += r.gpu_hit_blocks;
    pool_blocks += r.pool_hit_blocks;
    auto& pi = per_instance[r.instance];
    ++pi.first;
    pi.second += static_cast<uint64_t>(r.prompt_tokens);
    if (r.worker) {
      ttft.push_back(r.ttft_s);
      worker_prompt += static_cast<uint64_t>(r.prompt_tokens);
      w_gpu += r.gpu_hit_tokens;
      w_pool += r.pool_hit_tokens;
      w_recomp += r.recomputed_tokens;
      q += r.queue_s;
      lh += r.local_hit_s;
      pf += r.pool_fetch_s;
      rc += r.recompute_s;
    }
  }
  double req_max = 0, req_mean = 0, tok_max = 0, tok_mean = 0;
  for (const auto& [id, v] : per_instance) {
    req_max = std::max(req_max, static_cast<double>(v.first));
    tok_max = std::max(tok_max, static_cast<double>(v.second));
    req_mean += static_cast<double>(v.first) / static_cast<double>(per_instance.size());
    tok_mean += static_cast<double>(v.second) / static_cast<double>(per_instance.size());
  }
  auto share = [](uint64_t a, uint64_t b) { return b > 0 ? static_cast<double>(a) / static_cast<double>(b) : 0.0; };
  const double nw = static_cast<double>(std::max<size_t>(1, ttft.size()));

  ordered_json j;
  j["router"] = a.router;
  j["trace"] = a.trace;
  j["requests"] = sent;
  j["skipped_trace_lines"] = t->issues.size();
  j["limited_by_limit"] = t->limited;  // --limit cut the trace
  j["generate_skipped"] = generate_skipped.load();  // routed, but no worker answered at that address
  j["errors"] = errors.load();
  j["error_kinds"] = error_counts;
  j["wall_s"] = wall;
  j["speed"] = a.speed;
  j["send_lag_p99_s"] = Percentile(lag, 0.99);
  j["router_hit_rate"] = {{"gpu", share(gpu_blocks, blocks)}, {"pool", share(pool_blocks, blocks)},
                          {"total", share(gpu_blocks + pool_blocks, blocks)}};
  j["route_latency_s"] = {{"p50", Percentile(route_lat, 0.5)}, {"p99", Percentile(route_lat, 0.99)}};
  j["worker_requests"] = ttft.size();
  if (!ttft.empty()) {
    j["worker_hit_rate"] = {{"gpu", share(w_gpu, worker_prompt)}, {"pool", share(w_pool, worker_prompt)},
                            {"recomputed", share(w_recomp, worker_prompt)}};
    j["ttft_s"] = {{"p50", Percentile(ttft, 0.5)}, {"p99", Percentile(ttft, 0.99)},
                   {"mean_queue", q / nw}, {"mean_local_hit", lh / nw}, {"mean_pool_fetch", pf / nw},
                   {"mean_recompute", rc / nw}};
  }
  ordered_json inst = ordered_json::object();
  for (const auto& [id, v] : per_instance) inst[id] = {{"requests", v.first}, {"prompt_tokens", v.second}};
  j["instances"] = inst;
  j["load"] = {{"requests_max", req_max}, {"requests_mean", req_mean}, {"tokens_max", tok_max},
               {"tokens_mean", tok_mean}};

  if (!a.csv.empty()) {
    std::ofstream f(a.csv);
    if (!f) {
      fail(absl::StrCat("--csv=", a.csv, ": cannot write the file"), 1);
    } else {
      f << "index,scheduled_s,sent_s,prompt_tokens,status,instance,route_s,total_blocks,gpu_hit_blocks,"
           "pool_hit_blocks,ttft_s,queue_s,local_hit_s,pool_fetch_s,recompute_s,gpu_hit_tokens,pool_hit_tokens,"
           "recomputed_tokens\n";
      for (const Record& r : records) {
        f << r.index << "," << r.scheduled_s << "," << r.sent_s << "," << r.prompt_tokens << ","
          << (r.ok ? "ok" : "error") << "," << r.instance << "," << r.route_s << "," << r.total_blocks << ","
          << r.gpu_hit_blocks << "," << r.pool_hit_blocks << "," << r.ttft_s << "," << r.queue_s << ","
          << r.local_hit_s << "," << r.pool_fetch_s << "," << r.recompute_s << "," << r.gpu_hit_tokens << ","
          << r.pool_hit_tokens << "," << r.recomputed_tokens << "\n";
      }
    }
  }
  if (errors.load() > 0 && errors.load() == sent && io.exit_code == 0) io.exit_code = 1;
  if (a.json) {
    *io.out << j.dump(2) << "\n";
    return;
  }
  std::ostream& out = *io.out;
  out << "kvctl replay: " << sent << " requests to " << a.router << " in " << Fixed(wall, 2) << " s (speed x" << a.speed
      << "), " << errors.load() << " errors\n";
  for (const auto& [kind, n] : error_counts) out << "  error     " << n << " x " << kind << "\n";
  for (const Record& r : records) {
    if (!r.error.empty()) {
      out << "  first     request " << r.index << ": " << r.error << "\n";
      break;
    }
  }
  out << "  hits      router-predicted gpu " << Fixed(share(gpu_blocks, blocks), 3) << "  pool "
      << Fixed(share(pool_blocks, blocks), 3) << "  total " << Fixed(share(gpu_blocks + pool_blocks, blocks), 3)
      << " of blocks\n";
  out << "  route     p50 " << FormatSeconds(Percentile(route_lat, 0.5)) << "  p99 "
      << FormatSeconds(Percentile(route_lat, 0.99)) << "  (send lag p99 " << FormatSeconds(Percentile(lag, 0.99))
      << ")\n";
  if (!ttft.empty()) {
    out << "  workers   " << ttft.size() << " answered; hit gpu " << Fixed(share(w_gpu, worker_prompt), 3) << "  pool "
        << Fixed(share(w_pool, worker_prompt), 3) << "  recomputed " << Fixed(share(w_recomp, worker_prompt), 3)
        << " of prompt tokens\n";
    out << "  TTFT      p50 " << FormatSeconds(Percentile(ttft, 0.5)) << "  p99 " << FormatSeconds(Percentile(ttft, 0.99))
        << "  mean = queue " << FormatSeconds(q / nw) << " + local hit " << FormatSeconds(lh / nw) << " + pool fetch "
        << FormatSeconds(pf / nw) << " + recompute " << FormatSeconds(rc / nw) << "\n";
  } else {
    out << "  workers   none answered kvpool.v1.Worker (route-only replay)\n";
  }
  if (generate_skipped.load() > 0 && !ttft.empty()) {
    out << "  skipped   " << generate_skipped.load()
        << " requests routed to an address no kvpool.v1.Worker answered at (Generate not sent)\n";
  }
  out << "  load      requests max/mean " << Fixed(req_max, 0) << " / " << Fixed(req_mean, 1) << "  prompt tokens max/mean "
      << Fixed(tok_max, 0) << " / " << Fixed(tok_mean, 1) << "\n";
  for (const auto& [id, v] : per_instance) {
    out << "    " << std::left << std::setw(16) << id << std::right << std::setw(8) << v.first << " requests"
        << std::setw(12) << v.second << " prompt tokens\n";
  }
}

}  // namespace

void AddReplayCommands(CLI::App& app, Io& io) {
  auto a = std::make_shared<ReplayArgs>();
  CLI::App* c = app.add_subcommand("replay", "Replay a Mooncake trace against a live (loopback or test) cluster");
  c->add_option("--trace", a->trace, "Mooncake JSONL trace")->required();
  c->add_option("--router", a->router, "Router address host:port (loopback or private)")->required();
  c->add_option("--model", a->model, "Model the cluster serves (default tiny-gqa)");
  c->add_option("--speed", a->speed, "Arrival-time speedup: 2 = twice as fast (default 1)")
      ->check(FiniteNumber())->check(CLI::PositiveNumber);
  c->add_option("--limit", a->limit, "Requests to send, at most (default 1000)")->check(CLI::Range(1, 1000000));
  c->add_option("--concurrency", a->concurrency, "Requests in flight at most (default 8)")->check(CLI::Range(1, 1024));
  c->add_option("--max-duration", a->max_duration_s, "Stop sending after this many seconds (default 600)")
      ->check(FiniteNumber())->check(CLI::Range(0.1, 86400.0));
  c->add_option("--max-prompt-tokens", a->max_prompt_tokens, "Truncate prompts to this many tokens (0 = as traced)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--max-new-tokens", a->max_new_tokens, "Cap on generated tokens per request (default 16)")
      ->check(CLI::Range(1, 4096));
  c->add_option("--trace-block-tokens", a->trace_block_tokens, "Tokens per trace hash id (default 512, at most 2^20)")
      ->check(CLI::Range(int64_t{1}, trace::kMaxTraceBlockTokens));
  c->add_option("--progress-interval", a->progress_interval_s, "Seconds between progress lines off a terminal")
      ->check(FiniteNumber())->check(CLI::PositiveNumber);
  c->add_flag("--strict", a->strict, "Fail on the first bad trace line instead of skipping it");
  c->add_flag("--json", a->json, "Print the summary as JSON");
  c->add_option("--csv", a->csv, "Write a per-request log to this CSV file");
  c->callback([a, &io] { RunReplay(*a, io); });
}

}  // namespace kvpool::kvctl
