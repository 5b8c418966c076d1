// kvctl simulate: a discrete-event simulation of a prefill cluster over a Mooncake trace,
// running the real router core and cache managers (kvpool::sim). --compare runs every
// policy on the same trace and writes a table plus a gnuplot PNG chart.
#include <algorithm>
#include <fstream>
#include <iomanip>
#include <memory>
#include <sstream>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "chart.h"
#include "format.h"
#include "kvctl.h"
#include "kvpool/common/units.h"
#include "kvpool/router/policy.h"
#include "kvpool/router/sim.h"
#include "kvpool/router/trace.h"
#include "nlohmann/json.hpp"

namespace kvpool::kvctl {
namespace {

using nlohmann::ordered_json;

struct SimulateArgs {
  std::string trace;
  int64_t trace_block_tokens = trace::kDefaultTraceBlockTokens;
  bool strict = false;
  size_t limit = 0;
  std::string model = sim::kDefaultModel;
  sim::SimOptions sim;
  std::string flops;
  std::string pool_bandwidth;
  bool compare = false;
  std::string chart = "kvctl-simulate.png";
  bool json = false;
  SimulateArgs() { sim.time_scale = sim::kDefaultTimeScale; }
};

double Ratio(double a, double b) { return b > 0 ? a / b : 0; }

ordered_json ResultJson(const sim::SimResult& r) {
  ordered_json j;
  j["policy"] = r.policy;
  j["instances"] = r.instances;
  j["gpu_blocks"] = r.gpu_blocks;
  j["pool_blocks"] = r.pool_blocks;
  j["requests"] = r.requests;
  j["prompt_tokens"] = r.prompt_tokens;
  j["hit_rate"] = {{"gpu", r.gpu_hit_rate}, {"pool", r.pool_hit_rate}, {"total", r.hit_rate},
                   {"upper_bound", r.upper_bound}, {"dedup", r.dedup_hit_rate},
                   {"dedup_upper_bound", r.dedup_upper_bound}, {"router_predicted", r.predicted_hit_rate}};
  j["ttft_s"] = {{"mean", r.ttft_mean_s}, {"p50", r.ttft_p50_s}, {"p99", r.ttft_p99_s},
                 {"queue_mean", r.queue_mean_s}, {"transfer_mean", r.transfer_mean_s},
                 {"prefill_mean", r.prefill_mean_s}};
  j["load"] = {{"busy_max_s", r.busy_max_s}, {"busy_mean_s", r.busy_mean_s},
               {"busy_max_over_mean", Ratio(r.busy_max_s, r.busy_mean_s)},
               {"requests_max", r.requests_max}, {"requests_mean", r.requests_mean},
               {"requests_max_over_mean", Ratio(r.requests_max, r.requests_mean)}};
  j["makespan_s"] = r.makespan_s;
  j["uncacheable_requests"] = r.uncacheable_requests;
  j["events"] = {{"simulation", r.sim_events}, {"kv", r.kv_events}, {"heartbeats", r.heartbeats},
                 {"wall_s", r.wall_s}, {"cpu_s", r.cpu_s}, {"per_s", r.events_per_s}};
  return j;
}

void PrintOne(const sim::SimResult& r, std::ostream& out) {
  auto line = [&out](const std::string& label, const std::string& value) {
    out << "  " << std::left << std::setw(10) << label << value << "\n";
  };
  line("hit rate", absl::StrCat("gpu ", Fixed(r.gpu_hit_rate, 3), "  pool ", Fixed(r.pool_hit_rate, 3), "  total ",
                                Fixed(r.hit_rate, 3), "  (upper bound ", Fixed(r.upper_bound, 3), ")"));
  line("dedup", absl::StrCat("hit rate ", Fixed(r.dedup_hit_rate, 3), " without duplicated prompts (upper bound ",
                             Fixed(r.dedup_upper_bound, 3), ")"));
  line("TTFT", absl::StrCat("mean ", FormatSeconds(r.ttft_mean_s), "  p50 ", FormatSeconds(r.ttft_p50_s), "  p99 ",
                            FormatSeconds(r.ttft_p99_s)));
  line("", absl::StrCat("mean = queue ", FormatSeconds(r.queue_mean_s), " + transfer ",
                        FormatSeconds(r.transfer_mean_s), " + prefill ", FormatSeconds(r.prefill_mean_s)));
  line("load", absl::StrCat("busy max/mean ", Fixed(Ratio(r.busy_max_s, r.busy_mean_s), 2), " (",
                            Fixed(r.busy_max_s, 0), " s / ", Fixed(r.busy_mean_s, 0), " s)  requests max/mean ",
                            Fixed(Ratio(r.requests_max, r.requests_mean), 2), " (", Fixed(r.requests_max, 0), " / ",
                            Fixed(r.requests_mean, 1), ")"));
  line("router", absl::StrCat("predicted hit ", Fixed(r.predicted_hit_rate, 3), " of prompt tokens"));
  line("speed", absl::StrCat(WithCommas(static_cast<int64_t>(r.sim_events + r.kv_events + r.heartbeats)),
                             " events (", WithCommas(static_cast<int64_t>(r.sim_events)), " simulation, ",
                             WithCommas(static_cast<int64_t>(r.kv_events)), " KV, ",
                             WithCommas(static_cast<int64_t>(r.heartbeats)), " heartbeats) in ",
                             Fixed(r.wall_s, 2), " s (", Fixed(r.cpu_s, 2), " s CPU) = ", WithCommas(static_cast<int64_t>(r.events_per_s)),
                             " events/s; simulated makespan ", Fixed(r.makespan_s, 1), " s"));
  if (r.uncacheable_requests > 0) {
    line("note", absl::StrCat(r.uncacheable_requests, " requests were larger than an instance's GPU cache"));
  }
}

void PrintTable(const std::vector<sim::SimResult>& rs, std::ostream& out) {
  out << std::left << std::setw(14) << "policy" << std::right << std::setw(10) << "TTFT mean" << std::setw(9)
      << "p50" << std::setw(9) << "p99" << std::setw(8) << "hit gpu" << std::setw(7) << "pool" << std::setw(7)
      << "total" << std::setw(13) << "busy max/mn" << std::setw(12) << "req max/mn" << "\n";
  for (const auto& r : rs) {
    out << std::left << std::setw(14) << r.policy << std::right << std::setw(10) << Fixed(r.ttft_mean_s, 2) + " s"
        << std::setw(9) << Fixed(r.ttft_p50_s, 2) + " s" << std::setw(9) << Fixed(r.ttft_p99_s, 1) + " s"
        << std::setw(8) << Fixed(r.gpu_hit_rate, 3) << std::setw(7) << Fixed(r.pool_hit_rate, 3) << std::setw(7)
        << Fixed(r.hit_rate, 3) << std::setw(13) << Fixed(Ratio(r.busy_max_s, r.busy_mean_s), 2) << std::setw(12)
        << Fixed(Ratio(r.requests_max, r.requests_mean), 2) << "\n";
  }
  if (!rs.empty()) {
    out << "upper bound (infinite cache) " << Fixed(rs[0].upper_bound, 3) << ", without duplicated prompts "
        << Fixed(rs[0].dedup_upper_bound, 3) << "\n";
  }
}

// Writes `<chart>.dat` and `<chart>.gp` and renders `<chart>` with gnuplot (no shell; see
// chart.h): mean TTFT and hit rate per policy.
absl::Status WriteChart(const std::vector<sim::SimResult>& rs, const std::string& chart, std::string title) {
  if (chart.find_first_of("\r\n") != std::string::npos) {
    return absl::InvalidArgumentError("--chart: the path has a line break; gnuplot cannot write to it");
  }
  std::replace(title.begin(), title.end(), '\n', ' ');
  std::replace(title.begin(), title.end(), '\r', ' ');
  const std::string dat = chart + ".dat";
  {
    std::ofstream f(dat);
    if (!f) return absl::FailedPreconditionError(absl::StrCat("--chart: cannot write ", dat));
    f << "# policy ttft_mean_s ttft_p50_s ttft_p99_s hit_gpu hit_pool hit_total busy_max_over_mean\n";
    for (const auto& r : rs) {
      f << r.policy << " " << r.ttft_mean_s << " " << r.ttft_p50_s << " " << r.ttft_p99_s << " " << r.gpu_hit_rate
        << " " << r.pool_hit_rate << " " << r.hit_rate << " " << Ratio(r.busy_max_s, r.busy_mean_s) << "\n";
    }
  }
  const std::string gp = chart + ".gp";
  {
    std::ofstream f(gp);
    if (!f) return absl::FailedPreconditionError(absl::StrCat("--chart: cannot write ", gp));
    f << "set terminal pngcairo size 1200,480 noenhanced\n"
      << "set output " << GnuplotQuote(chart) << "\n"
      << "set multiplot layout 1,2 title " << GnuplotQuote(title) << "\n"
      << "set style data histograms\nset style histogram clustered gap 1\nset style fill solid 0.8 border -1\n"
      << "set boxwidth 0.9\nset xtics rotate by -30\nset grid ytics\nset key top left\n"
      << "set title 'TTFT per policy'\nset ylabel 'seconds'\nset yrange [0:*]\nset key top right\n"
      << "plot " << GnuplotQuote(dat) << " using 2:xtic(1) title 'mean', '' using 3 title 'p50'\n"
      << "set title 'prefix hit rate per policy (upper bound " << Fixed(rs.empty() ? 0 : rs[0].upper_bound, 3)
      << ")'\nset ylabel 'share of prompt tokens'\nset yrange [0:1]\nset key top left\n"
      << "set style histogram rowstacked\n"
      << "plot " << GnuplotQuote(dat) << " using 5:xtic(1) title 'GPU', '' using 6 title 'pool', "
      << (rs.empty() ? 0 : rs[0].upper_bound) << " with lines lw 2 title 'upper bound'\n"
      << "unset multiplot\n";
  }
  if (absl::Status s = RunGnuplot(gp); !s.ok()) {
    return absl::UnavailableError(absl::StrCat(s.message(), "; is gnuplot-nox installed? The data is in ", dat));
  }
  return absl::OkStatus();
}

void RunSimulate(SimulateArgs& a, Io& io) {
  auto fail = [&io](const absl::Status& s, int code) {
    *io.err << "kvctl simulate: " << s.message() << "\n";
    io.exit_code = code;
  };
  if (!a.flops.empty()) {
    auto f = ParseNumberIn(a.flops, "--flops", kMinFlops, kMaxFlops);
    if (!f.ok()) return fail(f.status(), 2);
    a.sim.achieved_flops = *f;
  }
  if (!a.pool_bandwidth.empty()) {
    auto b = ParseRateIn(a.pool_bandwidth, "--pool-bandwidth", kMinBandwidth, kMaxBandwidth);
    if (!b.ok()) return fail(b.status(), 2);
    a.sim.pool_bandwidth = *b;
  }
  if (!a.compare) {
    if (auto p = router::ParsePolicy(a.sim.policy); !p.ok()) return fail(p.status(), 2);
  }
  auto t = trace::LoadTrace(a.trace, {.trace_block_tokens = a.trace_block_tokens, .strict = a.strict, .limit = a.limit});
  if (!t.ok()) return fail(t.status(), t.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  ReportTraceLoad(*io.err, "simulate", a.trace, a.limit, *t);
  if (t->requests.empty()) return fail(absl::InvalidArgumentError(absl::StrCat("--trace=", a.trace, ": no valid request")), 1);
  auto w = sim::Workload::Build(t->requests, a.trace_block_tokens, a.model);
  if (!w.ok()) return fail(w.status(), 2);

  std::vector<std::string> policies = {a.sim.policy};
  if (a.compare) policies = router::PolicyNames();
  std::vector<sim::SimResult> results;
  for (const std::string& p : policies) {
    sim::SimOptions o = a.sim;
    o.policy = p;
    auto r = sim::Simulate(*w, o);
    if (!r.ok()) return fail(r.status(), r.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
    results.push_back(*std::move(r));
  }

  const std::string scenario = absl::StrCat(
      a.sim.instances, " instances x ", WithCommas(a.sim.gpu_blocks), " GPU blocks of ", w->spec.block_tokens,
      " tokens (", w->spec.name, "), pool ",
      a.sim.pool_blocks > 0 ? absl::StrCat(WithCommas(a.sim.pool_blocks), " blocks") : std::string("none"),
      ", arrivals x", a.sim.time_scale);
  if (a.compare) {
    absl::Status chart = WriteChart(results, a.chart, scenario);
    if (!chart.ok()) {
      *io.err << "kvctl simulate: chart: " << chart.message() << "\n";
      io.exit_code = 1;
    }
  }
  if (a.json) {
    ordered_json j;
    j["trace"] = {{"path", a.trace},
                  {"requests", w->analysis.requests},
                  {"skipped_lines", t->issues.size()},
                  {"duration_s", w->analysis.duration_s},
                  {"prompt_tokens", w->analysis.prompt_tokens},
                  {"duplicate_requests", w->analysis.duplicate_requests},
                  {"upper_bound", w->analysis.upper_bound},
                  {"upper_bound_trace_blocks", w->analysis.upper_bound_trace_blocks},
                  {"dedup_upper_bound", w->analysis.dedup_upper_bound}};
    j["model"] = w->spec.name;
    j["block_tokens"] = w->spec.block_tokens;
    j["time_scale"] = a.sim.time_scale;
    j["seed"] = a.sim.seed;
    ordered_json runs = ordered_json::array();
    for (const auto& r : results) runs.push_back(ResultJson(r));
    if (a.compare) {
      j["results"] = runs;
      j["chart"] = a.chart;
    } else {
      j["result"] = runs[0];
    }
    *io.out << j.dump(2) << "\n";
    return;
  }
  const auto& an = w->analysis;
  *io.out << "kvctl simulate: " << scenario << "\n";
  *io.out << "  trace     " << WithCommas(static_cast<int64_t>(an.requests)) << " requests over "
          << Fixed(an.duration_s, 1) << " s, " << WithCommas(an.prompt_tokens) << " prompt tokens, "
          << an.duplicate_requests << " duplicated prompts, " << t->issues.size() << " bad lines skipped\n";
  *io.out << "  bound     infinite-cache hit rate " << Fixed(an.upper_bound, 3) << " of prompt tokens ("
          << Fixed(an.upper_bound_trace_blocks, 3) << " of trace blocks), " << Fixed(an.dedup_upper_bound, 3)
          << " without duplicated prompts\n";
  if (a.compare) {
    PrintTable(results, *io.out);
    *io.out << "chart: " << a.chart << " (data " << a.chart << ".dat)\n";
  } else {
    *io.out << "  policy    " << results[0].policy << " (seed " << a.sim.seed << ")\n";
    PrintOne(results[0], *io.out);
  }
}

}  // namespace

void AddSimulateCommands(CLI::App& app, Io& io) {
  auto a = std::make_shared<SimulateArgs>();
  CLI::App* c = app.add_subcommand(
      "simulate", "Simulate a prefill cluster over a Mooncake trace with the real router and cache code");
  c->add_option("--trace", a->trace, "Mooncake JSONL trace")->required();
  // Ranges, not CLI::PositiveNumber: its message ("not in range 0.000000 to 1797...")
  // read as if 0 were allowed, and --gpu-blocks 2^31-1 overflowed the cache's block count.
  c->add_option("--instances", a->sim.instances, "Prefill instances (default 16)")->check(CLI::Range(1, 4096));
  c->add_option("--gpu-blocks", a->sim.gpu_blocks,
                "KV blocks per instance (default 16384 = 262,144 tokens, 80 GiB of llama-3.3-70b KV)")
      ->check(CLI::Range(int32_t{1}, int32_t{1} << 30));
  c->add_option("--pool-blocks", a->sim.pool_blocks, "Blocks in the shared DRAM pool tier (default 0 = none)")
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 40));
  c->add_option("--policy", a->sim.policy,
                "Router policy: random, round_robin, least_load, power_of_two, session, cache_aware, ttft "
                "(default cache_aware)");
  c->add_option("--model", a->model, "Model preset or JSON spec (default llama-3.3-70b)");
  c->add_option("--seed", a->sim.seed, "Seed of the router's policy rng (default 1)");
  c->add_option("--time-scale", a->sim.time_scale, "Replay arrivals this many times faster (default 0.6: slower than recorded, see docs/SIMULATION.md)")
      ->check(CLI::Range(1e-6, 1e6));
  c->add_option("--flops", a->flops, "Achieved prefill FLOP/s per instance (default 400T)");
  c->add_option("--pool-bandwidth", a->pool_bandwidth, "Pool fetch bandwidth per instance (default 25GB/s, RDMA)");
  c->add_option("--trace-block-tokens", a->trace_block_tokens, "Tokens per trace hash id (default 512, at most 2^20)")
      ->check(CLI::Range(int64_t{1}, trace::kMaxTraceBlockTokens));
  // A size_t option would take "-1" as SIZE_MAX, i.e. silently "no limit": refused by
  // RequireDecimalIntegers (kvpool/common/cli_flags.h), which kvctl applies to every option.
  c->add_option("--limit", a->limit, "Use the first N requests only (default 0 = all)");
  c->add_flag("--strict", a->strict, "Fail on the first bad trace line instead of skipping it");
  c->add_flag("--compare", a->compare, "Run every policy and write a table and a PNG chart");
  c->add_option("--chart", a->chart, "PNG written by --compare (default kvctl-simulate.png)");
  c->add_flag("--json", a->json, "Print JSON");
  c->callback([a, &io] { RunSimulate(*a, io); });
}

}  // namespace kvpool::kvctl
