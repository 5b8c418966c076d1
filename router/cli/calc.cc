// kvctl calc: the cost-model calculators (kv footprint, paging utilization, TTFT).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <memory>
#include <optional>
#include <sstream>

#include <CLI/CLI.hpp>

#include "absl/strings/str_cat.h"
#include "format.h"
#include "kvctl.h"
#include "kvpool/common/cost_model.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/common/units.h"
#include "nlohmann/json.hpp"

namespace kvpool::kvctl {
namespace {

using nlohmann::ordered_json;

// Resolves --model (and --kv-dtype); on error reports it naming the flag.
std::optional<ModelSpec> LoadModel(Io& io, const std::string& model, const std::string& kv_dtype) {
  auto spec = ResolveModelSpec(model);
  if (!spec.ok()) {
    *io.err << "--model: " << spec.status().message() << "\n";
    io.exit_code = 2;
    return std::nullopt;
  }
  if (!kv_dtype.empty()) {
    auto d = ParseDType(kv_dtype);
    if (!d.ok()) {
      *io.err << "--kv-dtype: " << d.status().message() << "\n";
      io.exit_code = 2;
      return std::nullopt;
    }
    spec->kv_dtype = *d;
  }
  return *spec;
}

void Fail(Io& io, const absl::Status& s) {
  *io.err << s.message() << "\n";
  io.exit_code = 2;
}

// ---- calc kv -------------------------------------------------------------------------

struct KvArgs {
  std::string model;
  std::string kv_dtype;
  int64_t context = 0;
  bool json = false;
};

void RunKv(const KvArgs& a, Io& io) {
  auto spec = LoadModel(io, a.model, a.kv_dtype);
  if (!spec) return;
  ordered_json j;
  j["model"] = spec->name;
  j["kv_dtype"] = DTypeName(spec->kv_dtype);
  j["block_tokens"] = spec->block_tokens;
  ordered_json layers = ordered_json::object();
  for (AttentionKind k : {AttentionKind::kGqa, AttentionKind::kMla, AttentionKind::kKda}) {
    const int n = spec->NumLayers(k);
    if (n == 0) continue;
    ordered_json l;
    l["layers"] = n;
    if (k == AttentionKind::kKda) {
      l["state_bytes_per_layer"] = spec->StateBytesPerLayer();
    } else {
      l["bytes_per_token_per_layer"] = spec->KvBytesPerTokenPerLayer(k);
    }
    layers[std::string(AttentionKindName(k))] = l;
  }
  j["layers"] = layers;
  j["bytes_per_token"] = spec->KvBytesPerToken();
  j["fixed_state_bytes_per_request"] = spec->FixedStateBytes();
  j["block_bytes"] = spec->BlockBytes();
  if (a.context > 0) {
    // Bytes past 2^63 overflowed into a negative footprint.
    if (a.context > (INT64_MAX - spec->FixedStateBytes()) / std::max<int64_t>(1, spec->KvBytesPerToken())) {
      Fail(io, absl::InvalidArgumentError(absl::StrCat(
                   "--context=", a.context, " tokens of ", spec->name, " would take more than 2^63 bytes; give a "
                   "context length a model can have")));
      return;
    }
    j["context_tokens"] = a.context;
    j["footprint_bytes"] = spec->KvBytesPerToken() * a.context + spec->FixedStateBytes();
  }
  if (spec->IsHybrid()) j["crossover_tokens"] = spec->CrossoverTokens();

  if (a.json) {
    *io.out << j.dump(2) << "\n";
    return;
  }
  Report r;
  r.Line(absl::StrCat("KV footprint of ", spec->name, " (", DTypeName(spec->kv_dtype), ")"), "");
  for (const auto& [kind, l] : layers.items()) {
    if (l.contains("bytes_per_token_per_layer")) {
      r.Line(absl::StrCat(kind, " layers"),
             absl::StrCat(l["layers"].get<int>(), " x ",
                          WithCommas(l["bytes_per_token_per_layer"].get<int64_t>()), " B/token"));
    } else {
      r.Line(absl::StrCat(kind, " layers"),
             absl::StrCat(l["layers"].get<int>(), " x ",
                          FormatBytes(static_cast<double>(l["state_bytes_per_layer"].get<int64_t>())),
                          " fixed state"));
    }
  }
  r.Line("bytes per token", absl::StrCat(WithCommas(spec->KvBytesPerToken()), " B (",
                                         FormatBytes(static_cast<double>(spec->KvBytesPerToken())), ")"));
  r.Line("fixed state per request",
         absl::StrCat(WithCommas(spec->FixedStateBytes()), " B (",
                      FormatBytes(static_cast<double>(spec->FixedStateBytes())), ")"));
  r.Line(absl::StrCat("block (", spec->block_tokens, " tokens)"),
         FormatBytes(static_cast<double>(spec->BlockBytes())));
  if (a.context > 0) {
    r.Line(absl::StrCat("footprint at ", WithCommas(a.context), " tokens"),
           FormatBytes(j["footprint_bytes"].get<double>()));
  }
  if (spec->IsHybrid()) {
    r.Line("crossover (state == per-token cache)",
           absl::StrCat(WithCommas(static_cast<int64_t>(std::llround(spec->CrossoverTokens()))),
                        " tokens"));
  }
  r.Print(*io.out);
}

// ---- calc util -----------------------------------------------------------------------

struct UtilArgs {
  int64_t max_len = 0;
  double mean_len = 0;  // 0 = uniform lengths in [1, max_len]
  int64_t page_size = 16;
  std::string hbm_free;
  std::string model;
  std::string kv_dtype;
  bool json = false;
};

void RunUtil(const UtilArgs& a, Io& io) {
  if (a.mean_len > static_cast<double>(a.max_len)) {
    Fail(io, absl::InvalidArgumentError(absl::StrCat("--mean-len=", a.mean_len,
                                                     " exceeds --max-len=", a.max_len,
                                                     "; the mean cannot exceed the maximum")));
    return;
  }
  if (!a.hbm_free.empty() && a.model.empty()) {
    Fail(io, absl::InvalidArgumentError("--hbm-free needs --model to size a token; add --model"));
    return;
  }
  const double R = static_cast<double>(a.max_len);
  const double b = static_cast<double>(a.page_size);
  // Uniform lengths 1..R have mean (R+1)/2.
  const double mean = a.mean_len > 0 ? a.mean_len : (R + 1.0) / 2.0;
  const bool uniform = a.mean_len <= 0;
  // Expected tokens wasted in the last block: (b-1)/2 when the fill is uniform.
  const double waste = (b - 1.0) / 2.0;
  const double contiguous_util = mean / R;
  const double paged_util = mean / (mean + waste);
  const int64_t table_max = static_cast<int64_t>(std::ceil(R / b)) * 4;
  const double table_mean = std::ceil(mean / b) * 4;

  ordered_json j;
  j["max_len"] = a.max_len;
  j["mean_len"] = mean;
  j["lengths"] = uniform ? "uniform in [1, max_len]" : "given mean";
  j["page_size"] = a.page_size;
  j["contiguous_utilization"] = contiguous_util;
  j["paged_expected_waste_tokens"] = waste;
  j["paged_utilization"] = paged_util;
  j["block_table_bytes_max"] = table_max;
  j["block_table_bytes_mean"] = table_mean;
  if (!a.hbm_free.empty()) {
    auto hbm = ParseBytes(a.hbm_free, "--hbm-free");
    if (!hbm.ok()) return Fail(io, hbm.status());
    auto spec = LoadModel(io, a.model, a.kv_dtype);
    if (!spec) return;
    const double bpt = static_cast<double>(spec->KvBytesPerToken());
    const double fixed = static_cast<double>(spec->FixedStateBytes());
    const double H = static_cast<double>(*hbm);
    j["model"] = spec->name;
    j["hbm_free_bytes"] = *hbm;
    j["batch_cap_contiguous"] = static_cast<int64_t>(std::floor(H / (R * bpt + fixed)));
    j["batch_cap_paged"] = static_cast<int64_t>(std::floor(H / ((mean + waste) * bpt + fixed)));
  }
  if (a.json) {
    *io.out << j.dump(2) << "\n";
    return;
  }
  Report r;
  r.Line(absl::StrCat("Memory utilization, max_len=", a.max_len, ", mean_len=", Fixed(mean, 1),
                      uniform ? " (uniform lengths)" : ""), "");
  r.Line("contiguous max_len reservations", absl::StrCat(Fixed(contiguous_util, 4), " used"));
  r.Line(absl::StrCat("paged, b=", a.page_size),
         absl::StrCat(Fixed(paged_util, 4), " used (", Fixed(waste, 1),
                      " tokens wasted per request on average)"));
  r.Line("block table per request",
         absl::StrCat(table_max, " B max, ", Fixed(table_mean, 0), " B mean (int32 ids)"));
  if (j.contains("batch_cap_paged")) {
    r.Line(absl::StrCat("batch cap in ", FormatBytes(j["hbm_free_bytes"].get<double>()), " (",
                        j["model"].get<std::string>(), ")"),
           absl::StrCat(j["batch_cap_contiguous"].get<int64_t>(), " contiguous vs ",
                        j["batch_cap_paged"].get<int64_t>(), " paged"));
  }
  r.Print(*io.out);
}

// ---- calc ttft -----------------------------------------------------------------------

struct TtftArgs {
  std::string model;
  std::string kv_dtype;
  int64_t context = 0;
  double hit = 0;
  std::string tier = "dram";
  double queue = 0;
  std::string flops;
  std::string bandwidth;
  bool json = false;
};

void RunTtft(const TtftArgs& a, Io& io) {
  auto spec = LoadModel(io, a.model, a.kv_dtype);
  if (!spec) return;
  auto tier = ParseFetchTier(a.tier);
  if (!tier.ok()) return Fail(io, absl::InvalidArgumentError(absl::StrCat("--tier: ", tier.status().message())));
  CostModel cm;
  if (!a.flops.empty()) {
    auto f = ParseNumberIn(a.flops, "--flops", kMinFlops, kMaxFlops);
    if (!f.ok()) return Fail(io, f.status());
    cm.achieved_flops = *f;
  }
  double bw = DefaultBandwidth(*tier);
  if (!a.bandwidth.empty()) {
    auto b = ParseRateIn(a.bandwidth, "--bandwidth", kMinBandwidth, kMaxBandwidth);
    if (!b.ok()) return Fail(io, b.status());
    bw = *b;
  }
  auto hit = EstimateTtft(cm, *spec, {a.context, a.hit, bw, a.queue});
  if (!hit.ok()) return Fail(io, hit.status());
  auto full = EstimateTtft(cm, *spec, {a.context, 0.0, bw, a.queue});
  if (!full.ok()) return Fail(io, full.status());
  const double h2 = HitRateForSpeedup(cm, *spec, a.context, bw, 2.0);
  const double h2q = HitRateForSpeedupWithQueue(cm, *spec, a.context, bw, a.queue, 2.0);

  ordered_json j;
  j["model"] = spec->name;
  j["context_tokens"] = a.context;
  j["hit_rate"] = a.hit;
  j["tier"] = FetchTierName(*tier);
  j["bandwidth_bytes_per_s"] = bw;
  j["achieved_flops"] = cm.achieved_flops;
  j["fetched_bytes"] = CostModel::FetchBytes(*spec, a.hit * static_cast<double>(a.context));
  j["with_hit"] = {{"queue_s", hit->queue_s}, {"recompute_s", hit->recompute_s},
                   {"transfer_s", hit->transfer_s}, {"total_s", hit->total_s}};
  j["full_recompute"] = {{"queue_s", full->queue_s}, {"recompute_s", full->recompute_s},
                         {"total_s", full->total_s}};
  j["speedup"] = full->total_s / hit->total_s;
  j["hit_rate_to_halve_prefill"] = std::isfinite(h2) ? ordered_json(h2) : ordered_json(nullptr);
  j["hit_rate_to_halve_ttft_with_queue"] = std::isfinite(h2q) ? ordered_json(h2q) : ordered_json(nullptr);
  j["break_even_bandwidth_bytes_per_s"] = BreakEvenBandwidth(cm, *spec);
  if (a.json) {
    *io.out << j.dump(2) << "\n";
    return;
  }
  auto rate = [](double h) { return h <= 1.0 ? Fixed(h, 3) : std::string("unreachable (tier too slow)"); };
  Report r;
  r.Line(absl::StrCat("TTFT of ", WithCommas(a.context), " tokens of ", spec->name, ", ",
                      Fixed(a.hit * 100, 1), "% hit from ", FetchTierName(*tier), " at ",
                      FormatRate(bw), ", ", Fixed(cm.achieved_flops / 1e12, 0), " TFLOP/s"), "");
  r.Line("queue", FormatSeconds(hit->queue_s));
  r.Line("recompute of the miss", FormatSeconds(hit->recompute_s));
  r.Line(absl::StrCat("transfer of the hit (", FormatBytes(j["fetched_bytes"].get<double>()), ")"),
         FormatSeconds(hit->transfer_s));
  r.Line("TTFT with the hit", FormatSeconds(hit->total_s));
  r.Line("TTFT with full recompute", FormatSeconds(full->total_s));
  r.Line("speedup", absl::StrCat(Fixed(j["speedup"].get<double>(), 2), "x"));
  r.Line("hit rate that halves prefill", rate(h2));
  r.Line("hit rate that halves TTFT incl. queue", rate(h2q));
  r.Line("fetch beats recompute above", FormatRate(BreakEvenBandwidth(cm, *spec)));
  r.Print(*io.out);
}

}  // namespace

void AddCalcCommands(CLI::App& app, Io& io) {
  CLI::App* calc = app.add_subcommand("calc", "Cost-model calculators: KV footprint, paging, TTFT");
  calc->require_subcommand(1);

  auto kv = std::make_shared<KvArgs>();
  CLI::App* kvc = calc->add_subcommand("kv", "Bytes of KV per token and per request for a model");
  kvc->add_option("--model", kv->model, "Preset name or path to a JSON spec")->required();
  kvc->add_option("--kv-dtype", kv->kv_dtype, "Override the cache dtype: fp32, bf16, fp16, fp8");
  kvc->add_option("--context", kv->context, "Context length for the footprint, tokens")
      ->check(CLI::NonNegativeNumber);
  kvc->add_flag("--json", kv->json, "Print JSON");
  kvc->callback([kv, &io] { RunKv(*kv, io); });

  auto util = std::make_shared<UtilArgs>();
  CLI::App* uc = calc->add_subcommand("util", "Utilization of contiguous reservations vs paging");
  uc->add_option("--max-len", util->max_len, "Maximum sequence length R, tokens (at most 2^40)")
      ->required()->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  uc->add_option("--mean-len", util->mean_len, "Mean sequence length D (default: uniform in [1, R])")
      ->check(FiniteNumber())->check(CLI::PositiveNumber);
  uc->add_option("--page-size", util->page_size, "Tokens per page b")->check(CLI::PositiveNumber);
  uc->add_option("--hbm-free", util->hbm_free, "Free HBM for KV, e.g. 40GiB (needs --model)");
  uc->add_option("--model", util->model, "Preset name or JSON spec (for --hbm-free)");
  uc->add_option("--kv-dtype", util->kv_dtype, "Override the cache dtype");
  uc->add_flag("--json", util->json, "Print JSON");
  uc->callback([util, &io] { RunUtil(*util, io); });

  auto ttft = std::make_shared<TtftArgs>();
  CLI::App* tc = calc->add_subcommand("ttft", "TTFT of a hit fetched from a tier vs recompute");
  tc->add_option("--model", ttft->model, "Preset name or JSON spec")->required();
  tc->add_option("--context", ttft->context, "Prompt length L, tokens")
      ->required()->check(CLI::PositiveNumber);
  tc->add_option("--hit", ttft->hit, "Hit rate h in [0, 1]")->required()->check(FiniteNumber())->check(CLI::Range(0.0, 1.0));
  tc->add_option("--tier", ttft->tier, "Where the hit comes from: hbm, dram, rdma, nvme")
      ->check(CLI::IsMember({"hbm", "dram", "rdma", "nvme"}));
  tc->add_option("--queue", ttft->queue, "Queueing delay, seconds")->check(FiniteNumber())->check(CLI::NonNegativeNumber);
  tc->add_option("--flops", ttft->flops, "Achieved FLOP/s (default 400T)");
  tc->add_option("--bandwidth", ttft->bandwidth, "Tier bandwidth, e.g. 64GB/s (default per tier)");
  tc->add_option("--kv-dtype", ttft->kv_dtype, "Override the cache dtype");
  tc->add_flag("--json", ttft->json, "Print JSON");
  tc->callback([ttft, &io] { RunTtft(*ttft, io); });
}

}  // namespace kvpool::kvctl
