// Nearest-rank percentiles of samples (latencies, TTFTs) for reports.
//
//   NearestRank({1, 2}, 0.5) == 1, NearestRank(v, 0.99) of 100 samples is the 99th
//   smallest, not the largest.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

namespace kvpool {

// The index of the q-quantile (q in [0, 1]) among n sorted samples: ceil(q * n) - 1,
// clamped to [0, n - 1]. REQUIRES n > 0.
inline size_t NearestRankIndex(size_t n, double q) {
  const double rank = std::ceil(q * static_cast<double>(n));
  if (!(rank >= 1)) return 0;
  return std::min(n - 1, static_cast<size_t>(rank) - 1);
}

// Of a sorted vector; 0 when empty.
inline double NearestRankSorted(const std::vector<double>& sorted, double q) {
  return sorted.empty() ? 0 : sorted[NearestRankIndex(sorted.size(), q)];
}

// Of an unsorted vector (reordered); 0 when empty.
inline double NearestRank(std::vector<double>& v, double q) {
  if (v.empty()) return 0;
  const size_t k = NearestRankIndex(v.size(), q);
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end());
  return v[k];
}

}  // namespace kvpool
