#include "kvpool/common/placement.h"

#include <algorithm>
#include <numeric>

#include "xxhash.h"

namespace kvpool {

RendezvousRing::RendezvousRing(std::vector<std::string> node_ids) : node_ids_(std::move(node_ids)) {
  seeds_.reserve(node_ids_.size());
  for (const auto& id : node_ids_) seeds_.push_back(XXH3_64bits(id.data(), id.size()));
}

uint64_t RendezvousRing::Score(const BlockHash& hash, size_t node) const {
  const uint64_t words[2] = {hash.lo, hash.hi};
  return XXH3_64bits_withSeed(words, sizeof(words), seeds_[node]);
}

size_t RendezvousRing::Owner(const BlockHash& hash) const {
  size_t best = 0;
  uint64_t best_score = Score(hash, 0);
  for (size_t i = 1; i < node_ids_.size(); ++i) {
    const uint64_t s = Score(hash, i);
    if (s > best_score) {
      best = i;
      best_score = s;
    }
  }
  return best;
}

std::vector<size_t> RendezvousRing::Owners(const BlockHash& hash, size_t r) const {
  std::vector<std::pair<uint64_t, size_t>> scored;
  scored.reserve(node_ids_.size());
  for (size_t i = 0; i < node_ids_.size(); ++i) scored.emplace_back(Score(hash, i), i);
  r = std::min(r, scored.size());
  std::partial_sort(scored.begin(), scored.begin() + r, scored.end(),
                    [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<size_t> out;
  out.reserve(r);
  for (size_t i = 0; i < r; ++i) out.push_back(scored[i].second);
  return out;
}

}  // namespace kvpool
