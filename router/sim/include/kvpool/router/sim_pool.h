// PoolTier: the shared DRAM tier of a simulated cluster, metadata only.
//
// Every block a prefill instance computes is written through to the pool when the
// prefill ends (Mooncake's design: prefill output goes to the distributed store), so any
// instance can fetch a prefix another one computed. Capacity is in blocks; eviction is
// least recently used, leaf first:
//
//   Put(chain [h0 h1 h2]) refreshes leaf to root, so the MRU end reads  h0 h1 h2 ... older
//   eviction pops the LRU end: the tail of the oldest chain goes before its parent, and a
//   parent is never evicted while a child of it is more recent (a child's Put or hit
//   always refreshes its ancestors after it).
//
// The pool reports what it stores and drops as router events (tier DRAM), which the
// simulator applies to the router's index like a pool node's event stream.
//
// Costs: Put is O(chain) hash operations; RunFrom is O(run).
// Thread safety: none; owned by one simulation.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "kvpool/common/hash.h"
#include "kvpool/router/events.h"

namespace kvpool::sim {

class PoolTier {
 public:
  // REQUIRES: capacity_blocks > 0.
  explicit PoolTier(int64_t capacity_blocks) : capacity_(capacity_blocks) {}

  // Blocks of `chain` resident from index `first` on, contiguous, at most `max_blocks`.
  uint32_t RunFrom(std::span<const BlockHash> chain, uint32_t first, uint32_t max_blocks) const;
  // Stores (or refreshes) the chain's first min(size, capacity) blocks, evicting LRU
  // leaves. Appends the resulting router events (removed first, then stored runs with
  // their parents) numbered from *next_sequence, which it advances.
  void Put(std::span<const BlockHash> chain, uint64_t* next_sequence, std::vector<router::KvEvent>* events);

  bool Contains(const BlockHash& h) const { return where_.contains(h); }
  int64_t size() const { return static_cast<int64_t>(where_.size()); }
  int64_t capacity() const { return capacity_; }
  uint64_t evicted() const { return evicted_; }
  // The resident blocks, most recently used first (tests).
  std::vector<BlockHash> LruOrder() const { return {lru_.begin(), lru_.end()}; }

 private:
  int64_t capacity_;
  std::list<BlockHash> lru_;  // front = most recently used
  absl::flat_hash_map<BlockHash, std::list<BlockHash>::iterator, BlockHashHasher> where_;
  uint64_t evicted_ = 0;
  std::vector<bool> missing_;  // scratch of Put
};

}  // namespace kvpool::sim
