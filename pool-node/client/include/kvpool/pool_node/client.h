// PoolClient: what a worker links to use a pool node. It hides the two-phase put and the
// UCX data plane behind five calls:
//
//   Connect   gRPC Connect + UCX endpoint to the node + import of its DRAM arena
//   Lookup    longest present prefix of a chain, with descriptors under one lease
//   Get       copies leased objects into local arena pages (batches of up to
//             get_batch_bytes), checks checksums
//   Put       Reserve -> UCX put of local pages -> Commit with XXH3 checksums
//   Release   ends a lease early (leases also expire on their own); ReleaseAsync: the
//             same without waiting for the node
//
// Speed: pass a whole request's blocks to one Put / Lookup / Get (one RPC each for all of
// them). On one host the node's DRAM arena is mapped into this process and put/get are
// copies by this thread (a Get of >= get_two_threads_min_bytes: by this thread and a
// helper, half each), checksummed in the same pass as the copy; a large Put is cut into
// pieces of about put_pipeline_bytes (its last two a half and a quarter of that, so
// that the wait for the node's last verification is short), reserved 64 MiB at a time a group ahead
// and committed one by one while the next piece is copied (the node verifies one piece
// while this thread copies the next);
// over TCP or RDMA two pieces are on the wire at a time. The client starts no gRPC
// threads: the calling thread drives its RPCs (a callback thread of gRPC's own used to
// take every answer off the socket and hand it over, several context switches per call).
//
// Example:
//   ASSIGN_OR_RETURN(auto kv, worker->RegisterArena(memory, 65536));
//   ASSIGN_OR_RETURN(auto pool, PoolClient::Connect({.node_address = "10.0.0.5:50061",
//                                                    .client_id = "worker-3",
//                                                    .worker = worker.get(), .local_arena = kv}));
//   ASSIGN_OR_RETURN(auto st, pool->Put({{.hash = h1, .kind = StateKind::kAttnKv,
//                                         .local_pages = {7, 8}, .length = 100000}}));
//   ASSIGN_OR_RETURN(PoolLease lease, pool->Lookup(hashes));
//   RETURN_IF_ERROR(pool->Get(lease, {{12, 13}}));   // lease.objects[0] -> pages 12, 13
//   RETURN_IF_ERROR(pool->Release(lease.lease_id));
//
// Local and node page sizes may differ (the transport scatters/gathers on both sides).
//
// Thread safety: all methods are thread-safe (gRPC stubs and transport endpoints are),
// except CloseTransport, which no Get or Put may run beside.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/pool_node/types.h"

namespace kvpool::transport {
class Worker;
class Arena;
class Endpoint;
}  // namespace kvpool::transport

namespace kvpool::v1 {
class PoolStats;
}

namespace kvpool::pool_node {

struct PoolClientOptions {
  std::string node_address;                       // kvpool-node gRPC host:port
  std::string client_id;                          // 1..128 bytes, unique per process
  transport::Worker* worker = nullptr;            // caller's UCX worker; outlives the client
  std::shared_ptr<transport::Arena> local_arena;  // registered with `worker`
  int rpc_timeout_ms = 10'000;
  // Put: bytes per pipelined piece (transfer / Commit); a Put of three pieces or more
  // ends with one of half and one of a quarter of this, the others share the rest
  // equally (as many pieces as whole put_pipeline_bytes would give). One Reserve covers the pieces of
  // up to put_reserve_group_bytes (and 4096 items), each committed on its own (a partial
  // Commit, the last one final); a piece that fails leaves earlier pieces stored: a retry
  // finds them already present.
  uint64_t put_pipeline_bytes = 8 << 20;
  // Put: one Reserve covers the pieces of about this many bytes (a group; at least one
  // piece), sent a group ahead of the copies. With a Reserve per 8 MiB piece, two pieces
  // ahead, the client waited ~0.27 ms per piece for its Reserve on a 2-core host (12% of
  // a shared-memory Put's time), and each RPC costs the calling thread ~0.1 ms there.
  uint64_t put_reserve_group_bytes = 64 << 20;
  // Where the transport copies one-sided (shared memory: the copies are made by the
  // submitting thread), a Get of two objects or more and at least this many bytes is
  // copied and checksummed by two threads at once: this one and a helper started for the
  // call (~20-50 us, against ~0.3 ms to copy 4 MiB). UINT64_MAX: always one thread.
  uint64_t get_two_threads_min_bytes = 4 << 20;
  // Get: objects move in transfer batches of up to this many bytes (an object larger
  // than it moves alone), one after another. A transfer batch has one timeout (the
  // transport's batch_timeout, e.g. a worker's --pool-transfer-timeout-ms), so a prefix
  // far larger than what the link moves in that time still arrives, batch by batch; the
  // lease is checked again before each batch. 0 is taken as 1 (one object per batch).
  uint64_t get_batch_bytes = 256 << 20;
  // Fault injection for tests: called by Put before piece k's transfer starts (once its
  // Reserve is answered), e.g. to stall past the node's reserve timeout.
  std::function<void(size_t piece)> before_piece_transfer = {};
  // Fault injection for tests: called by Put before it sends piece k's Commit; true
  // loses that Commit on the way (the node never gets it; the Put sees UNAVAILABLE).
  std::function<bool(size_t piece)> lose_commit = {};
  // Fault injection for tests: called by Get before its transfer batch k starts.
  std::function<void(size_t batch)> before_get_batch = {};
};

// An object found by Lookup: where its bytes sit in the node's arena.
struct RemoteObject {
  ObjectKey key;
  Tier found_in = Tier::kDram;
  std::vector<uint32_t> pages;  // node arena pages
  uint64_t length = 0;
  uint64_t checksum = 0;
};

struct PoolLease {
  uint32_t prefix_blocks = 0;
  std::vector<RemoteObject> objects;  // hits in chain order
  uint64_t lease_id = 0;              // 0: nothing found (nothing to release)
  int64_t expires_unix_ms = 0;        // the node host's wall clock + the lease: for display
  uint32_t other_length = 0;          // hashes present but of another length than asked (misses)
  // On this process's monotonic clock: the lease's length counted from when the Lookup
  // left, less a margin (the node's clock counts whole milliseconds). Get starts no read
  // at or after it. Unset (a node without lease_ttl_ms): Get compares expires_unix_ms with
  // this host's wall clock instead, which is only as good as the two clocks agree.
  std::optional<std::chrono::steady_clock::time_point> usable_until;
};

struct PutItem {
  BlockHash hash;
  std::optional<BlockHash> parent = {};   // nullopt: a chain start
  StateKind kind = StateKind::kAttnKv;
  std::vector<uint64_t> local_pages = {};  // pages of the local arena holding the bytes
  uint64_t length = 0;                     // object bytes
};

// Where the calling threads spent their time in Put, summed over every Put since Connect
// (seconds). transfer: starting each piece's transfer (on shared memory, the copy itself
// and its checksums) and waiting for it to finish; reserve_wait: waiting for Reserve
// answers; rpc_send: sending Reserves and Commits; final_wait: after the last Commit,
// waiting for the node's answers (its verification of the last pieces). total includes
// the rest (building requests, bookkeeping).
struct PutPhases {
  uint64_t calls = 0;
  double total_s = 0, transfer_s = 0, reserve_wait_s = 0, rpc_send_s = 0, final_wait_s = 0;
};

class PoolClient {
 public:
  static absl::StatusOr<std::unique_ptr<PoolClient>> Connect(PoolClientOptions options);
  ~PoolClient();

  // At most kMaxLookupHashes hashes per call (the node's limit; split longer chains).
  static constexpr size_t kMaxLookupHashes = 4096;
  // object_length: the bytes the caller can use (0: any); objects of another length are
  // misses the node neither leases nor makes more recent (PoolLease::other_length).
  absl::StatusOr<PoolLease> Lookup(std::span<const BlockHash> chain,
                                   StateKind kind = StateKind::kAttnKv, uint32_t lease_ms = 0,
                                   bool allow_gaps = false, uint64_t object_length = 0);
  // Copies lease.objects[i] into local pages dst[i] (enough pages for its length), in
  // transfer batches of up to get_batch_bytes, then checks each object's checksum.
  // FAILED_PRECONDITION when the lease ran out before a batch started (objects of
  // earlier batches are in place and intact); DATA_LOSS when bytes do not match (e.g.
  // the lease ran out during the transfer and the node reused the pages): Lookup again.
  // On DATA_LOSS, `mismatched` (when given) lists the index in lease.objects of each object
  // of the failed batch whose bytes did not match.
  absl::Status Get(const PoolLease& lease, std::span<const std::vector<uint64_t>> dst,
                   std::vector<size_t>* mismatched = nullptr);
  // Stores objects: one status per item (OK: stored or already present; DATA_LOSS: the
  // node saw other bytes than the checksum says). RESOURCE_EXHAUSTED etc. for the call.
  // *moved (if given) is set to the bytes this call transferred (0 when every item was
  // present or refused: the transport was not used).
  absl::StatusOr<std::vector<absl::Status>> Put(std::span<const PutItem> items, uint64_t* moved = nullptr);
  absl::Status Release(uint64_t lease_id);
  // Release without waiting for the answer (errors are dropped: leases expire anyway).
  // The request leaves before this returns; answers are collected by later calls, and
  // the client waits for outstanding ones when destroyed.
  void ReleaseAsync(uint64_t lease_id);
  // ReleaseAsync calls not answered yet (answered ones are collected first). The
  // destructor waits for these (each at most rpc_timeout_ms).
  int PendingReleases();
  // The transport endpoint to the node: OK while usable, else the error that broke it
  // (the node process died, or its UCX worker is gone). gRPC may still reach a node
  // restarted at the same address; this endpoint never will again.
  // After CloseTransport: FAILED_PRECONDITION.
  absl::Status transport_health() const;
  // Closes the transport endpoint (and with it the node's imported arena: a same-host
  // node's shared-memory segment mapped through it is unmapped soon after, on the
  // transport's thread) and keeps the gRPC channel, for a client kept only to send
  // Releases. Get and Put fail with FAILED_PRECONDITION after. Not while a Get or Put
  // runs.
  void CloseTransport();
  absl::StatusOr<v1::PoolStats> GetStats();
  PutPhases put_phases() const;

  const std::string& node_id() const;
  // The node process's UCX worker address (from Connect): equal for two clients only if
  // they reached the same node process, whatever address each was given.
  const std::string& node_worker_address() const;
  uint64_t node_page_bytes() const;
  uint64_t node_pages() const;
  // XXH3-64 of `length` bytes spread over local pages (what Put sends as the checksum).
  uint64_t LocalChecksum(std::span<const uint64_t> pages, uint64_t length) const;

 private:
  struct State;
  PoolClient();
  void ReapReleases();  // frees answered ReleaseAsync calls without waiting
  std::unique_ptr<State> s_;
};

}  // namespace kvpool::pool_node
