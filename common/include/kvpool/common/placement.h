// Placement: which pool node owns a block, without a metadata master.
//
// Rendezvous (highest-random-weight) hashing: every node gets a score
// XXH3-64(block hash, seed = hash of the node's name) and the block lives on the node
// with the highest score (and on the next r-1 with replication). Any process computes
// the same owners from the same list of names; a name taken out of the list moves only
// the blocks it owned. kvpool-worker names nodes by their --pool-nodes addresses as
// written (so every worker must spell them alike) and keeps the whole configured list:
// a node that stops answering keeps its blocks, which are misses (recomputed) until it
// is back.
//
// Example:
//   RendezvousRing ring({"node-a", "node-b", "node-c"});
//   size_t owner = ring.Owner(hash);           // index into the node list
//   auto owners = ring.Owners(hash, 2);        // replicated on 2 nodes
//
// Thread safety: immutable after construction.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvpool/common/hash.h"

namespace kvpool {

class RendezvousRing {
 public:
  RendezvousRing() = default;
  explicit RendezvousRing(std::vector<std::string> node_ids);

  size_t size() const { return node_ids_.size(); }
  bool empty() const { return node_ids_.empty(); }
  const std::vector<std::string>& node_ids() const { return node_ids_; }

  // Index of the owning node. REQUIRES: !empty().
  size_t Owner(const BlockHash& hash) const;
  // Indices of the min(r, size()) highest-scoring nodes, best first.
  std::vector<size_t> Owners(const BlockHash& hash, size_t r) const;

 private:
  uint64_t Score(const BlockHash& hash, size_t node) const;

  std::vector<std::string> node_ids_;
  std::vector<uint64_t> seeds_;  // XXH3-64 of each node id
};

}  // namespace kvpool
