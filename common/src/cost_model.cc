#include "kvpool/common/cost_model.h"

#include <cmath>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvpool {

absl::string_view FetchTierName(FetchTier tier) {
  switch (tier) {
    case FetchTier::kHbm: return "hbm";
    case FetchTier::kDram: return "dram";
    case FetchTier::kRdma: return "rdma";
    case FetchTier::kNvme: return "nvme";
  }
  return "?";
}

absl::StatusOr<FetchTier> ParseFetchTier(absl::string_view name) {
  const std::string n = absl::AsciiStrToLower(name);
  for (FetchTier t : {FetchTier::kHbm, FetchTier::kDram, FetchTier::kRdma, FetchTier::kNvme}) {
    if (n == FetchTierName(t)) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown tier '", name, "'; use one of hbm, dram, rdma, nvme"));
}

double DefaultBandwidth(FetchTier tier) {
  switch (tier) {
    case FetchTier::kHbm: return 3.35e12;
    case FetchTier::kDram: return 64e9;
    case FetchTier::kRdma: return 25e9;
    case FetchTier::kNvme: return 7e9;
  }
  return 0;
}

double CostModel::PrefillSeconds(const ModelSpec& spec, double tokens) const {
  return 2.0 * spec.active_params * tokens / achieved_flops;
}

double CostModel::FetchBytes(const ModelSpec& spec, double tokens) {
  if (tokens <= 0) return 0;
  return static_cast<double>(spec.KvBytesPerToken()) * tokens +
         static_cast<double>(spec.FixedStateBytes());
}

absl::StatusOr<TtftBreakdown> EstimateTtft(const CostModel& model, const ModelSpec& spec,
                                           const TtftInputs& in) {
  if (in.context_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("context=", in.context_tokens, " must be > 0 tokens"));
  }
  if (!(in.hit_rate >= 0.0 && in.hit_rate <= 1.0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("hit=", in.hit_rate, " is outside [0, 1]; pass a fraction of the context"));
  }
  if (!(in.bandwidth > 0)) {
    return absl::InvalidArgumentError(absl::StrCat("bandwidth=", in.bandwidth, " must be > 0 bytes/s"));
  }
  if (!(in.queue_s >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("queue=", in.queue_s, " must be >= 0 seconds"));
  }
  if (!(model.achieved_flops > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("flops=", model.achieved_flops, " must be > 0 FLOP/s"));
  }
  const double L = static_cast<double>(in.context_tokens);
  const double hit_tokens = in.hit_rate * L;
  TtftBreakdown t;
  t.queue_s = in.queue_s;
  t.recompute_s = model.PrefillSeconds(spec, L - hit_tokens);
  t.transfer_s = CostModel::TransferSeconds(CostModel::FetchBytes(spec, hit_tokens), in.bandwidth);
  t.total_s = t.queue_s + t.recompute_s + t.transfer_s;
  return t;
}

namespace {
// Solves queue + T_r - h*(T_r - T_t) = target for h, where T_t is the transfer of the
// whole context; the fixed state of hybrids is counted as per-token bytes here (it is
// small next to T_r at the contexts where this question matters).
double SolveHitRate(double t_recompute, double t_transfer, double queue_s, double k) {
  const double gain = t_recompute - t_transfer;
  if (gain <= 0) return std::numeric_limits<double>::infinity();
  const double full = queue_s + t_recompute;
  const double target = full / k;
  return (full - target) / gain;
}
}  // namespace

double HitRateForSpeedup(const CostModel& model, const ModelSpec& spec, int64_t context_tokens,
                         double bandwidth, double k) {
  return HitRateForSpeedupWithQueue(model, spec, context_tokens, bandwidth, 0.0, k);
}

double HitRateForSpeedupWithQueue(const CostModel& model, const ModelSpec& spec,
                                  int64_t context_tokens, double bandwidth, double queue_s,
                                  double k) {
  const double L = static_cast<double>(context_tokens);
  const double t_r = model.PrefillSeconds(spec, L);
  const double t_t = CostModel::TransferSeconds(CostModel::FetchBytes(spec, L), bandwidth);
  return SolveHitRate(t_r, t_t, queue_s, k);
}

double BreakEvenBandwidth(const CostModel& model, const ModelSpec& spec) {
  return static_cast<double>(spec.KvBytesPerToken()) * model.achieved_flops /
         (2.0 * spec.active_params);
}

}  // namespace kvpool
