// kvpool::sim: a discrete-event simulation of a prefill cluster behind the router, at
// scale, running the real code: the router is a kvpool::router::RouterCore (index, load
// tracking, policies), each instance is a real kvpool::cache::KvCacheManager (metadata
// only), and an optional shared pool tier (PoolTier) holds blocks for every instance.
// Only time is modelled, by the cost model (common/cost_model.h).
//
// One request's life (all times simulated, seconds):
//
//   arrival ─► RouterCore::Route ─► instance FIFO ─► prefill start:
//                 (hashes, load)      (queue_s)        KvCacheManager::GetComputedBlocks = g
//                                                      PoolTier::RunFrom(g)            = p
//                                                      AllocateSlots (stored events ─► router)
//            ─► busy for transfer(p) + prefill(L - (g + p)) ─► prefill end: Free, pool Put
//                                                                (pool events ─► router)
//   TTFT = queue_s + transfer_s + prefill_s
//
// Model of an instance (documented in docs/SIMULATION.md):
//  - Instances are prefill instances (Mooncake's disaggregated prefill): decode runs
//    elsewhere and is not simulated; output_length is only reported.
//  - Prefill is compute-bound, so continuous batching does not add throughput: an
//    instance's prefill work is served FIFO, one request at a time, 2*P*L/F seconds per
//    request (chunked prefill would interleave the same work; FIFO gives the same mean
//    busy time and a slightly better TTFT for the head of the queue).
//  - A pool fetch occupies the instance for bytes/bandwidth (not overlapped with compute)
//    and is taken only when it beats recomputing those blocks.
//  - Instances report their load to the router on every change (a zero-delay heartbeat
//    that also completes the router's optimistic decision), so the router's load view is
//    exact; its cache view comes only from events, as in the real service.
//
// Determinism: the event order is (time, insertion order) and the only randomness is the
// router's policy rng, seeded by SimOptions::seed: equal inputs give equal results.
//
// Thread safety: Simulate is reentrant; a Workload is immutable and may be shared.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvpool/common/cost_model.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/router/trace.h"

namespace kvpool::sim {

// Defaults: a realistic 16-instance Mooncake-like scenario (docs/SIMULATION.md).
inline constexpr char kDefaultModel[] = "llama-3.3-70b";
inline constexpr int32_t kDefaultGpuBlocks = 16384;  // 262,144 tokens = 80 GiB of llama-3.3-70b KV
// kvctl simulate replays the synthetic trace at 0.6x its arrival rate: at 1x, 16 instances
// of 400 TFLOP/s have 76% of the prefill capacity the trace needs without reuse; at 0.6x,
// 126% (docs/SIMULATION.md).
inline constexpr double kDefaultTimeScale = 0.6;

// The trace prepared for one model: arrival times, block hashes, the trace's own analysis.
struct Workload {
  struct Request {
    double arrival_s = 0;           // from the first arrival, before time_scale
    int64_t prompt_tokens = 0;
    int64_t output_tokens = 0;
    std::vector<BlockHash> hashes;  // the cache's chained hashes of the synthesized prompt
    bool duplicate = false;         // same prompt as an earlier request
  };
  ModelSpec spec;
  std::string model;                // as given (preset name or spec path)
  int64_t trace_block_tokens = trace::kDefaultTraceBlockTokens;
  std::vector<Request> requests;
  trace::TraceAnalysis analysis;

  // Hashes every request with the router's hashing of `model` (preset or JSON path).
  static absl::StatusOr<Workload> Build(std::span<const trace::TraceRequest> requests,
                                        int64_t trace_block_tokens, const std::string& model);
};

struct SimOptions {
  int instances = 16;                      // >= 1
  int32_t gpu_blocks = kDefaultGpuBlocks;  // per instance, >= 1
  int64_t pool_blocks = 0;                 // shared pool tier; 0 = none
  std::string policy = "cache_aware";      // a router policy name
  uint64_t seed = 1;
  double time_scale = 1.0;                 // arrivals happen time_scale times faster, > 0
  double achieved_flops = kDefaultAchievedFlops;
  double pool_bandwidth = DefaultBandwidth(FetchTier::kRdma);  // bytes/s, > 0
};

struct SimResult {
  std::string policy;
  int instances = 0;
  int32_t gpu_blocks = 0;
  int64_t pool_blocks = 0;
  uint64_t requests = 0;
  int64_t prompt_tokens = 0;
  // Prompt tokens reused from the instance's GPU cache / fetched from the pool.
  int64_t gpu_hit_tokens = 0;
  int64_t pool_hit_tokens = 0;
  double gpu_hit_rate = 0;
  double pool_hit_rate = 0;
  double hit_rate = 0;             // gpu + pool
  double upper_bound = 0;          // infinite-cache bound of hit_rate, from the trace
  double dedup_hit_rate = 0;       // hit_rate over requests that are not duplicated prompts
  double dedup_upper_bound = 0;
  // Router's predicted hit (gpu + pool) for the instance it chose, as a share of prompt
  // tokens: how well the event-fed index tracks the caches.
  double predicted_hit_rate = 0;
  double ttft_mean_s = 0, ttft_p50_s = 0, ttft_p99_s = 0;
  double queue_mean_s = 0, transfer_mean_s = 0, prefill_mean_s = 0;
  // Load balance: per-instance busy seconds and requests, max and mean.
  double busy_max_s = 0, busy_mean_s = 0;
  double requests_max = 0, requests_mean = 0;
  double makespan_s = 0;           // last prefill end
  uint64_t uncacheable_requests = 0;  // larger than an instance's GPU cache
  // Work: simulation events (arrivals, prefill starts/ends), KV events applied to the
  // router index, heartbeats; and the wall time of the run.
  uint64_t sim_events = 0;
  uint64_t kv_events = 0;
  uint64_t heartbeats = 0;
  double wall_s = 0;
  double cpu_s = 0;                // process CPU time of the run
  double events_per_s = 0;         // (sim + kv + heartbeats) / wall_s
  std::vector<uint64_t> instance_requests;
  std::vector<double> instance_busy_s;
};

absl::StatusOr<SimResult> Simulate(const Workload& workload, const SimOptions& options);

}  // namespace kvpool::sim
