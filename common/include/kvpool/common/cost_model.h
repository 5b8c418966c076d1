// The cost model: what a hit is worth, in bytes and seconds.
//
// Prefill is compute-bound: recomputing L tokens costs 2*P*L / F seconds (P active
// parameters, F achieved FLOP/s). A hit replaces recompute with a transfer of
// bytes_per_token * L (+ the fixed KDA state for hybrids) over the tier's bandwidth.
// With hit rate h over a context of L tokens:
//
//   TTFT(h) = queue + (1 - h) * T_recompute(L) + h * T_transfer(L)
//
// Fetching beats recomputing a token iff bandwidth > bytes_per_token * F / (2P), for
// every h; the hit rate that divides the prefill part by k is
//   h_k = (1 - 1/k) * T_recompute / (T_recompute - T_transfer).
// The queue is not shortened by a hit, so "halves TTFT" means halving the part a hit
// can change (HitRateForSpeedup); HitRateForSpeedupWithQueue counts the queue too.
#pragma once

#include <cstdint>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"
#include "kvpool/common/model_spec.h"

namespace kvpool {

// Where fetched KV comes from, with the textbook default bandwidths.
enum class FetchTier : uint8_t { kHbm, kDram, kRdma, kNvme };

absl::string_view FetchTierName(FetchTier tier);  // "hbm", "dram", "rdma", "nvme"
absl::StatusOr<FetchTier> ParseFetchTier(absl::string_view name);
// HBM3 3.35 TB/s; DRAM over PCIe 5.0 x16 64 GB/s; RDMA 25 GB/s (the low end of
// 25-50 GB/s, one 200-400 Gb/s NIC); NVMe 7 GB/s (one PCIe 4.0 x4 drive). Bytes/s.
double DefaultBandwidth(FetchTier tier);

inline constexpr double kDefaultAchievedFlops = 400e12;  // H100/H200-class bf16, achieved

struct CostModel {
  double achieved_flops = kDefaultAchievedFlops;  // F, FLOP/s, > 0

  // 2*P*L / F.
  double PrefillSeconds(const ModelSpec& spec, double tokens) const;
  // Bytes to fetch `tokens` tokens of prefix: per-token cache plus, for hybrids,
  // one copy of the fixed KDA state (the checkpoint at the hit boundary).
  static double FetchBytes(const ModelSpec& spec, double tokens);
  static double TransferSeconds(double bytes, double bandwidth) { return bytes / bandwidth; }
};

struct TtftBreakdown {
  double queue_s = 0;
  double recompute_s = 0;  // (1-h) * T_recompute
  double transfer_s = 0;   // h * T_transfer
  double total_s = 0;
};

struct TtftInputs {
  int64_t context_tokens = 0;  // L, > 0
  double hit_rate = 0;         // h in [0, 1]
  double bandwidth = 0;        // bytes/s of the tier the hit comes from, > 0
  double queue_s = 0;          // >= 0
};

// Validates the inputs (errors name the field) and decomposes TTFT.
absl::StatusOr<TtftBreakdown> EstimateTtft(const CostModel& model, const ModelSpec& spec,
                                           const TtftInputs& in);

// Hit rate at which the prefill part (recompute + transfer) is k times shorter than
// full recompute; > 1 (unreachable) when the tier is too slow. REQUIRES k >= 1.
double HitRateForSpeedup(const CostModel& model, const ModelSpec& spec, int64_t context_tokens,
                         double bandwidth, double k);
// The same, for the whole TTFT including a queue the hit cannot shorten.
double HitRateForSpeedupWithQueue(const CostModel& model, const ModelSpec& spec,
                                  int64_t context_tokens, double bandwidth, double queue_s,
                                  double k);
// Bandwidth above which fetching one token beats recomputing it: bytes_per_token*F/(2P).
double BreakEvenBandwidth(const CostModel& model, const ModelSpec& spec);

}  // namespace kvpool
