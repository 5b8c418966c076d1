// PoolTier: the worker's view of the pool nodes. Blocks are placed by rendezvous
// hashing over the configured node addresses (common/placement.h), so every worker
// computes the same owner for a hash without asking anyone; a node that is down is
// skipped (its blocks are misses: the worker recomputes them) and retried later.
//
//   Lookup(hashes)  one Lookup RPC per owning node (allow_gaps), each under a lease
//   Get(found, dst) per node, transfer batches of up to 256 MiB, straight into the
//                   worker's registered KV arena pages (dst), checksums verified by the client
//   Put(items)      one Reserve -> UCX put -> Commit per owning node and state kind;
//                   a parent owned by another node is not named (each node links the
//                   chain segments it holds, so its leaf-first eviction and its
//                   "checkpoint visible only with its KV prefix" rule see local chains)
//
// Thread safety: not thread-safe; the worker's engine thread makes every call. The
// counters are atomics (read from the stats RPC).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/common/placement.h"
#include "kvpool/pool_node/client.h"

namespace kvpool::transport {
class Context;
class Worker;
class Arena;
}  // namespace kvpool::transport

namespace kvpool::worker {

struct PoolTierOptions {
  std::vector<std::string> node_addresses;  // kvpool-node gRPC host:port, >= 1
  std::string client_id;                    // the worker's instance id
  int rpc_timeout_ms = 2000;
  // A failed node is skipped this long, doubling with each failure in a row up to
  // max_retry_after (a Get or Put that moved bytes ends the row, as does a failure more
  // than twice max_retry_after after the last; a Connect does not, since it proves gRPC,
  // not the transport): reconnecting runs on the engine thread
  // and may wait rpc_timeout_ms on a node that hangs, so a node that stays down must not
  // stall the engine every 2 s.
  absl::Duration retry_after = absl::Seconds(2);
  absl::Duration max_retry_after = absl::Seconds(60);
  // A transfer batch still running after this fails (the transport closes its endpoint
  // and the node is marked down): the engine, which waits for its step's transfers,
  // stalls this long at most on a hung node, not the transport's default of 30 s.
  absl::Duration transfer_timeout = absl::Seconds(10);
  // An object whose bytes did not match its checksum on a Get, while its lease held, is a
  // miss on its node for this long: it would otherwise be found, fetched and thrown away
  // on every request. (Not for good: a replaced node copy would be hidden too.)
  absl::Duration mismatch_quarantine = absl::Seconds(60);
};

// Where one looked-up hash was found.
struct PoolFound {
  size_t node = 0;  // index into node_addresses
  pool_node::RemoteObject object;
  size_t lease = SIZE_MAX;  // index into PoolLookup::leases (SIZE_MAX: none)
};

struct PoolLookup {
  std::vector<std::optional<PoolFound>> found;  // [hashes.size()]
  // One per Lookup RPC answered with a lease (a node gets one RPC per
  // PoolClient::kMaxLookupHashes of its hashes), to Release; lease_nodes[i] is leases[i]'s.
  std::vector<pool_node::PoolLease> leases;
  std::vector<size_t> lease_nodes;
};

struct PoolPut {
  BlockHash hash;
  std::optional<BlockHash> parent;
  StateKind kind = StateKind::kAttnKv;
  std::vector<uint64_t> local_pages;  // arena pages holding the bytes
  uint64_t length = 0;
};

class PoolTier {
 public:
  // Registers `arena_memory` (the worker's KV arena, pages of `page_bytes`) with UCX once
  // and connects to every node that answers (the others are retried on use).
  static absl::StatusOr<std::unique_ptr<PoolTier>> Create(PoolTierOptions options,
                                                          std::span<std::byte> arena_memory,
                                                          uint64_t page_bytes);
  ~PoolTier();

  // Presence of each hash (of one kind) on its owner node. Unreachable nodes: misses.
  // So are objects of another length than `length` (the bytes of one block or state of
  // this worker's model): a writer whose model shares the name but not the shape put
  // them, and a Get of fewer bytes would leave the rest of the page stale, cached as KV.
  PoolLookup Lookup(std::span<const BlockHash> hashes, StateKind kind, uint64_t length);
  // Copies found[i] (i in `which`) into dst[k] pages of the arena. An error means
  // nothing usable landed (the caller drops the import and recomputes). An object that
  // arrived with other bytes than its checksum while its lease held is quarantined
  // (mismatch_quarantine).
  absl::Status Get(const PoolLookup& lookup, std::span<const size_t> which,
                   std::span<const std::vector<uint64_t>> dst);
  void Release(PoolLookup& lookup);
  // Stores items on their owner nodes; returns the bytes of the items the pool holds
  // after it: written by this call, or already there (the node answers those without a
  // transfer, and the count does not tell them apart). Failures are logged and counted,
  // never fatal (offload is best effort: the GPU copy is intact).
  uint64_t Put(std::span<const PoolPut> items);

  size_t num_nodes() const { return nodes_.size(); }
  size_t live_nodes() const;
  // One line per node: address, id, DRAM capacity, state.
  std::string Describe();

  uint64_t rpc_failures() const { return rpc_failures_.load(); }
  // Objects that failed their checksum on a Get, since start.
  uint64_t mismatched_objects() const { return mismatched_objects_.load(); }

 private:
  struct Node {
    std::string address;
    std::unique_ptr<pool_node::PoolClient> client;
    // The client MarkDown took away, its transport closed, kept to release the leases
    // taken through it: a node marked down for a transport failure (a Get that timed
    // out, or a node restarted at the same address) may still answer gRPC. Replaced at
    // the next MarkDown.
    std::unique_ptr<pool_node::PoolClient> retired;
    absl::Time down_until = absl::InfinitePast();
    absl::Duration next_retry = absl::ZeroDuration();  // the next failure's wait (0: retry_after)
    absl::Time last_failure = absl::InfinitePast();     // of MarkDown, on MonotonicNow()
    std::string last_error;
    std::string alias_of;  // another entry's address that reached the same node process
    bool warned_length = false;  // logged an object of another length than ours
  };
  PoolTier() = default;
  pool_node::PoolClient* Client(size_t node);  // connects lazily; null while down
  void MarkDown(size_t node, const absl::Status& why);
  // Whatever client can still send `node` a Release: its current one, else the retired.
  pool_node::PoolClient* ReleaseClient(size_t node);
  // Drops what `out` found on `node` and releases its leases there (a node failing in the
  // middle of a Lookup: the Get of its objects would fail, and with it the other nodes').
  void ForgetNode(PoolLookup& out, size_t node);
  bool Quarantined(size_t node, const pool_node::ObjectKey& key);

  PoolTierOptions opts_;
  RendezvousRing ring_;
  std::shared_ptr<transport::Context> ucx_;
  std::unique_ptr<transport::Worker> worker_;
  std::shared_ptr<transport::Arena> arena_;
  std::vector<Node> nodes_;
  // Retired clients replaced while releases were still in flight: destroyed once those
  // are answered (their destructor would wait for them on the engine thread).
  std::vector<std::unique_ptr<pool_node::PoolClient>> reaping_;
  std::atomic<uint64_t> rpc_failures_{0};
  std::atomic<uint64_t> mismatched_objects_{0};
  // (node, object) -> until when it is a miss; at most kMaxQuarantined entries.
  static constexpr size_t kMaxQuarantined = 1 << 16;
  absl::flat_hash_map<std::pair<size_t, pool_node::ObjectKey>, absl::Time> quarantined_;
};

}  // namespace kvpool::worker
