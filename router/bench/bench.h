// Shared bits of router_bench: percentiles and the gRPC Route load generator.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace kvpool::router::bench {

inline double Percentile(std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5));
  std::nth_element(v.begin(), v.begin() + static_cast<ptrdiff_t>(k), v.end());
  return v[k];
}

struct GrpcBenchOptions {
  double rate = 10000;       // open-loop requests/s
  double seconds = 3;        // per phase
  int channels = 16;         // concurrent client connections
  int outstanding = 64;      // closed-loop concurrency
  int instances = 16;
  int prompt_blocks = 64;    // tiny-gqa: 16 tokens per block
};

// Starts a RouterServer on 127.0.0.1:0 and measures Route: open loop at `rate` and closed
// loop at `outstanding` concurrent calls. Returns the JSON section.
nlohmann::ordered_json RunGrpcBench(const GrpcBenchOptions& o);

}  // namespace kvpool::router::bench
