// Contiguous vs paged KV memory on one workload: a continuous-batching loop that runs
// the same requests through either CacheManager policy and measures how much of the
// memory set aside for KV holds tokens (utilization) and how many requests run at once
// (batch cap).
//
//   every step:  admit queued requests FIFO while AllocateSlots(prompt) succeeds
//                decode one token for every running request (AllocateSlots(id, 1));
//                paged: when the pool is short, preempt the youngest (free + requeue)
//                free requests that produced their output
//
// The queue never runs dry (requests cycle through the trace), so the batch is bounded
// by memory alone. Averages are taken over the second half of the steps.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvpool::cache::bench {

struct TraceRequest {
  int64_t input_length = 0;
  int64_t output_length = 0;
};

// Reads a Mooncake-format JSONL trace (input_length, output_length per line).
absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path);

struct SimOptions {
  std::string policy;          // "paged" | "contiguous"
  int32_t num_blocks = 16384;  // pool size, including the null block
  int32_t block_tokens = 16;
  // Prompt length for every request; <= 0: use the trace's input_length.
  int64_t prompt_tokens = 0;
  // contiguous: tokens reserved per request.
  int64_t max_model_len = 0;
  int64_t steps = 4000;
};

struct SimResult {
  double utilization = 0;  // sum over steps of live tokens / sum of reserved tokens
  double mean_batch = 0;   // running requests, averaged over steps
  int64_t max_batch = 0;
  int64_t finished = 0;
  int64_t preemptions = 0;
};

absl::StatusOr<SimResult> SimulateUtilization(const std::vector<TraceRequest>& trace,
                                              const SimOptions& options);

}  // namespace kvpool::cache::bench
