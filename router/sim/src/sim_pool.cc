#include "kvpool/router/sim_pool.h"

#include <algorithm>

namespace kvpool::sim {

using router::kMaxEventHashes;

uint32_t PoolTier::RunFrom(std::span<const BlockHash> chain, uint32_t first, uint32_t max_blocks) const {
  uint32_t n = 0;
  while (first + n < chain.size() && n < max_blocks && where_.contains(chain[first + n])) ++n;
  return n;
}

void PoolTier::Put(std::span<const BlockHash> chain, uint64_t* next_sequence,
                   std::vector<router::KvEvent>* events) {
  chain = chain.first(std::min<size_t>(chain.size(), static_cast<size_t>(capacity_)));
  // 1. Move the chain's resident blocks to the MRU end first, so making room below
  //    never evicts a block of this very chain.
  missing_.assign(chain.size(), false);
  size_t num_missing = 0;
  for (size_t i = chain.size(); i-- > 0;) {
    auto it = where_.find(chain[i]);
    if (it == where_.end()) {
      missing_[i] = true;
      ++num_missing;
    } else {
      lru_.splice(lru_.begin(), lru_, it->second);
    }
  }
  // 2. Make room: LRU end first (a leaf of the least recently used chain).
  std::vector<BlockHash> removed;
  while (static_cast<int64_t>(where_.size() + num_missing) > capacity_) {
    const BlockHash victim = lru_.back();
    lru_.pop_back();
    where_.erase(victim);
    removed.push_back(victim);
    ++evicted_;
  }
  // 3. Insert / refresh leaf to root: the root ends up most recent.
  for (size_t i = chain.size(); i-- > 0;) {
    if (missing_[i]) {
      lru_.push_front(chain[i]);
      where_[chain[i]] = lru_.begin();
    } else {
      lru_.splice(lru_.begin(), lru_, where_.find(chain[i])->second);
    }
  }
  // Events: removals, then each run of new blocks with the hash before it as parent.
  for (size_t at = 0; at < removed.size(); at += kMaxEventHashes) {
    const size_t n = std::min(kMaxEventHashes, removed.size() - at);
    events->push_back(router::KvEvent::Removed(
        (*next_sequence)++, std::vector<BlockHash>(removed.begin() + at, removed.begin() + at + n),
        router::Tier::kDram));
  }
  for (size_t i = 0; i < chain.size();) {
    if (!missing_[i]) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < chain.size() && missing_[j] && j - i < kMaxEventHashes) ++j;
    events->push_back(router::KvEvent::Stored((*next_sequence)++, i == 0 ? BlockHash{} : chain[i - 1],
                                              std::vector<BlockHash>(chain.begin() + i, chain.begin() + j),
                                              router::Tier::kDram));
    i = j;
  }
}

}  // namespace kvpool::sim
