// PoolCore: the pool node's tiers, leases and reservations, with no RPC types.
//
// Pipeline of one object (see pool-node/README.md):
//
//   Reserve --> [reserved pages] --(client writes over UCX)--> Commit (XXH3 verified)
//                     | timeout: reclaimed                        |
//                                                                 v
//   Lookup <-- lease -- [DRAM copy] --(demotion, watermarks)--> [NVMe copy] (+ journal)
//                ^                                                 |
//                +------------ promotion on an NVMe hit -----------+
//
// Objects are keyed by (block hash, state kind) and immutable once committed. An object
// has a DRAM copy, an NVMe copy, or both. Per tier, eviction takes leaves first (an
// object none of whose children has a copy in that tier) and the least recently used
// among them; it never takes a leased object, one being moved, or reserved pages (those
// are not objects yet). A LINEAR_STATE checkpoint at h_i is visible (to Lookup and in
// events) only while the ATTN_KV chain h_1..h_i is present on this node.
//
// Example:
//   ASSIGN_OR_RETURN(auto core, PoolCore::Create({.dram_bytes = 1 << 30, .page_bytes = 1 << 16}));
//   ASSIGN_OR_RETURN(Reservation r, core->Reserve({{.hash = h, .kind = StateKind::kAttnKv,
//                                                   .length = bytes.size()}}));
//   core->CopyToRun(r.slots[0].run, bytes);          // a worker does this over UCX
//   ASSIGN_OR_RETURN(auto out, core->Commit(r.id, {{h, Checksum64(bytes)}}));
//   ASSIGN_OR_RETURN(LookupAnswer a, core->Lookup({.hashes = {h}}));
//   ... read a.objects[0].run ...; core->Release(a.lease_id);
//
// Thread safety: every method is thread-safe. One mutex guards the index; it is never
// held across an io_uring wait or a checksum of object bytes (the pages involved are
// pinned instead). The EventSink is called with that mutex held, in the order changes
// happen, so it must only queue.
#pragma once

#include <array>
#include <atomic>
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

namespace kvpool::pool_node {

// Milliseconds on the node's clock (SystemClock: monotonic, not the Unix epoch);
// injectable so tests drive expiry deterministically.
class Clock {
 public:
  virtual ~Clock() = default;
  virtual int64_t NowMs() const = 0;
};

// The node's clock: kvpool::MonotonicNow (kvpool/common/clock.h) in milliseconds. A
// wall-clock step (NTP, an operator's `date -s`) moves no expiry: a jump forward would
// otherwise end every reservation and its held-back window at once, while a slow writer
// may still be writing into those pages.
Clock* SystemClock();

// A clock that moves only when told to (tests).
class ManualClock : public Clock {
 public:
  explicit ManualClock(int64_t start_ms = 1'700'000'000'000) : now_(start_ms) {}
  int64_t NowMs() const override { return now_.load(std::memory_order_relaxed); }
  void AdvanceMs(int64_t ms) { now_.fetch_add(ms, std::memory_order_relaxed); }

 private:
  std::atomic<int64_t> now_;  // relaxed: tests advance it from the test thread only
};

// Receives stored/removed notifications per tier. Called with the core's mutex held and
// in order; implementations only queue (never call back into the core, never block).
class EventSink {
 public:
  virtual ~EventSink() = default;
  virtual void OnStored(const ObjectKey& key, const std::optional<BlockHash>& parent, Tier tier) = 0;
  virtual void OnRemoved(const ObjectKey& key, Tier tier) = 0;
};

struct PoolOptions {
  std::string node_id = "pool-node";
  uint64_t dram_bytes = 0;     // --dram: rounded down to whole pages, >= 1 page
  uint64_t page_bytes = 65536; // --page-bytes: power of two, 4096 .. 64 MiB
  std::string nvme_dir = {};   // --nvme-dir: empty = no NVMe tier
  uint64_t nvme_bytes = 0;     // --nvme
  unsigned io_queue_depth = 32;
  // Maintenance rewrites the NVMe journal once it holds more than this many bytes and
  // 4x what its last rewrite wrote (it grows with every demotion and NVMe eviction).
  uint64_t journal_compact_min_bytes = 16 << 20;
  // Background demotion starts above high and stops at low (fractions of DRAM pages).
  double demote_high_watermark = 0.90;
  double demote_low_watermark = 0.75;
  int64_t reserve_timeout_ms = 30'000;  // uncommitted reserves are reclaimed after this
  uint32_t default_lease_ms = 30'000;
  uint32_t max_lease_ms = 600'000;
  // Optional DRAM quota per state kind, bytes (0 = none), indexed by KindIndex().
  std::array<uint64_t, kNumKinds> dram_quota_bytes = {0, 0};
  // Optional cap on the DRAM one client (client_id) holds under its leases and
  // reservations, bytes (0 = none; rounded down to pages): a Lookup or Reserve that would
  // pass it is RESOURCE_EXHAUSTED, so one client cannot pin the tier for everyone else.
  uint64_t max_client_pinned_bytes = 0;
  // Run expiry and demotion on a background thread every maintenance_interval_ms.
  // Tests turn it off and call RunMaintenance() themselves.
  bool background = true;
  int64_t maintenance_interval_ms = 50;
  Clock* clock = nullptr;       // default: SystemClock()
  // Fault injection (tests): called before each NVMe journal append and each journal
  // rewrite (compaction) while the node runs; an error fails that write as a failed
  // write(2) would. Empty: none.
  std::function<absl::Status(JournalWrite)> journal_write_fault = {};
  // Tests: called by each Lookup between its first locked part (hits found, pinned, the
  // per-client cap checked) and the last (the lease made), with no lock held: where
  // another call may run between the two. Empty: none.
  std::function<void()> lookup_between_locks = {};
  // May be null. Must outlive the core's last call to it: the end of the last API call
  // and StopBackground() (or the destructor), whichever comes later.
  EventSink* events = nullptr;
  // Memory for the DRAM arena (4096-aligned, dram_bytes long) owned by the caller, e.g.
  // already registered with UCX. Null: the core maps its own.
  std::byte* arena_memory = nullptr;
};

struct ReserveEntrySpec {
  BlockHash hash;
  std::optional<BlockHash> parent = {};  // nullopt: a chain start
  StateKind kind = StateKind::kAttnKv;
  uint64_t length = 0;  // 1 .. 2^32
};

struct ReserveSlot {
  BlockHash hash;
  bool already_present = false;  // committed earlier: nothing to write
  PageRunDesc run;               // where to write (empty when already_present or !status.ok())
  // ALREADY_EXISTS: the node holds (hash, kind) at another length (objects are
  // immutable); nothing is reserved or to be written, and a Commit naming the entry gets
  // this status.
  absl::Status status;
};

struct Reservation {
  uint64_t id = 0;
  std::vector<ReserveSlot> slots;  // one per entry, in request order
  // On the core's Clock (monotonic for SystemClock, despite the name: the proto's field
  // of that name is filled from ttl_ms by the service). Compare with Clock::NowMs only.
  int64_t expires_unix_ms = 0;
  int64_t ttl_ms = 0;  // time left when made: reserve_timeout_ms
};

struct CommitEntrySpec {
  BlockHash hash;
  uint64_t checksum = 0;  // XXH3-64 (Checksum64) of the bytes written
};

struct CommitOutcome {
  BlockHash hash;
  // OK, DATA_LOSS (checksum mismatch: the pages are held back one reserve timeout, a late
  // writer may still be writing into them, then freed), NOT_FOUND, INVALID_ARGUMENT.
  absl::Status status;
};

struct LookupSpec {
  std::vector<BlockHash> hashes = {};  // a chain, in order, 1..4096
  StateKind kind = StateKind::kAttnKv;
  uint32_t lease_ms = 0;          // 0: default_lease_ms
  bool allow_gaps = false;        // also return hits after the first miss
  // UNAVAILABLE, changing nothing, where the answer needs NVMe reads (a promotion, or
  // another Lookup's promotion to wait for): for callers that must not block (a gRPC
  // reactor), which then call again where blocking is fine.
  bool never_block = false;
  // Bytes the caller can use; 0 = any. An object of another length is a miss: not
  // promoted, leased or made more recent (LookupAnswer::other_length counts them).
  uint64_t object_length = 0;
  // The lease's owner (LookupRequest.client_id): only a Release naming it ends the lease.
  std::string client = {};
};

struct LookupAnswer {
  uint32_t prefix_blocks = 0;       // hits before the first miss
  std::vector<ObjectDesc> objects;  // hits in chain order
  uint64_t lease_id = 0;            // 0 when nothing was found
  int64_t lease_expires_unix_ms = 0;  // on the core's Clock, as Reservation::expires_unix_ms
  int64_t lease_ttl_ms = 0;  // time left when made: the lease's length
  // Hashes present but of another length than object_length (up to the first miss; all
  // of them with allow_gaps).
  uint32_t other_length = 0;
};

struct TierStatsSnapshot {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t objects = 0;
  uint64_t evictions = 0;
  std::array<uint64_t, kNumKinds> bytes_by_kind = {0, 0};
};

struct PoolStatsSnapshot {
  std::string node_id;
  bool has_nvme = false;
  std::array<TierStatsSnapshot, kNumTiers> tiers;
  uint64_t reserved_bytes = 0;
  uint64_t active_leases = 0;
  uint64_t pending_reservations = 0;
  uint64_t checksum_failures = 0;   // at Commit and on NVMe read-back
  uint64_t demotions = 0;
  uint64_t promotions = 0;
  uint64_t reclaimed_reservations = 0;
  uint64_t expired_leases = 0;
  // NVMe pages kept unused after a failed journal DEL until the journal is rewritten
  // (not in tiers[kNvme].used_bytes).
  uint64_t nvme_held_back_bytes = 0;
  // DRAM pages of reservations reclaimed at their timeout, kept unused for one more
  // reserve timeout in case their client still writes (not in tiers[kDram].used_bytes).
  uint64_t dram_held_back_bytes = 0;
};

// Where an object's copies are (tests, debugging).
struct ObjectInfo {
  bool in_dram = false;
  bool on_nvme = false;
  std::vector<uint32_t> dram_pages;
  std::vector<uint32_t> nvme_pages;
  uint32_t leases = 0;
  bool visible = false;  // ATTN_KV: always; LINEAR_STATE: while its ATTN_KV prefix is present
  uint64_t length = 0;
  uint64_t checksum = 0;
};

class PoolCore {
 public:
  // Validates `options` (messages name the flag), maps the arena and opens the NVMe tier
  // (recovering its journal).
  static absl::StatusOr<std::unique_ptr<PoolCore>> Create(PoolOptions options);
  ~PoolCore();
  PoolCore(const PoolCore&) = delete;
  PoolCore& operator=(const PoolCore&) = delete;

  // Longest present prefix of `spec.hashes` (unknown hashes are misses, not errors),
  // with DRAM descriptors under one lease. NVMe hits are promoted into DRAM first; one
  // whose bytes fail their checksum is dropped and ends the prefix. Blocks on io_uring
  // for promotions unless spec.never_block (then UNAVAILABLE instead).
  absl::StatusOr<LookupAnswer> Lookup(const LookupSpec& spec);
  // Allocates page runs for the entries not already present, evicting if needed;
  // RESOURCE_EXHAUSTED (nothing reserved) when they do not fit even after eviction. The
  // reservation belongs to `client` (ReserveRequest.client_id): Commits must name it.
  absl::StatusOr<Reservation> Reserve(std::span<const ReserveEntrySpec> entries, absl::string_view client = {});
  // Verifies and publishes the named entries of a reservation. A final Commit (`partial`
  // false) says how many Commits the reservation gets in all, itself included
  // (`commits`, 0 counts as 1); once that many are done the reservation ends and entries
  // no Commit named are abandoned (pages freed). A partial Commit leaves the entries it
  // does not name reserved. Commits of one reservation may overlap and come in any order
  // (a client commits a large put piece by piece under one Reserve). `end_now` (final
  // Commits only; CommitRequest.end_now): the reservation ends once the Commits that
  // already came are done, even after an earlier final Commit counted more. NOT_FOUND
  // for an unknown, ended or reclaimed reservation; PERMISSION_DENIED (nothing changed)
  // when `client` is not the one that reserved it.
  absl::StatusOr<std::vector<CommitOutcome>> Commit(uint64_t reservation_id,
                                                    std::span<const CommitEntrySpec> entries,
                                                    bool partial = false, uint32_t commits = 1,
                                                    bool end_now = false, absl::string_view client = {});
  // Ends a lease. NOT_FOUND when it is unknown, expired or already released;
  // PERMISSION_DENIED (the lease stays) when `client` is not the one that took it.
  absl::Status Release(uint64_t lease_id, absl::string_view client = {});

  // Copies an object's bytes out of the arena while its lease holds (tests and local
  // readers). FAILED_PRECONDITION once the lease expired or was released.
  absl::StatusOr<std::string> ReadObject(uint64_t lease_id, const ObjectKey& key);

  // The DRAM arena.
  std::byte* arena_base() const { return arena_; }
  uint64_t arena_bytes() const { return uint64_t{dram_pages_} * page_bytes_; }
  uint64_t page_bytes() const { return page_bytes_; }
  uint32_t dram_pages() const { return dram_pages_; }
  uint32_t nvme_pages() const;
  std::string nvme_data_path() const;
  // Bytes <-> a run of the arena (REQUIRES: bytes.size() == run.length).
  void CopyToRun(const PageRunDesc& run, std::span<const std::byte> bytes) const;
  void CopyFromRun(const PageRunDesc& run, std::span<std::byte> bytes) const;
  uint64_t RunChecksum(const PageRunDesc& run) const;

  // Expires leases and reservations, compacts the NVMe journal when it has outgrown its
  // live records, then demotes between the watermarks. The background thread calls
  // this; tests call it directly.
  void RunMaintenance();
  // Stops and joins the background thread (idempotent). After it, and once no call is
  // in progress, the core calls its EventSink no more: a node stops it before it
  // destroys the sink, while the core itself stays usable for the sink's full dump.
  // A demotion pass under way ends after its current rounds (RequestStop); once the
  // thread has stopped, Demote and RunMaintenance work again.
  void StopBackground();
  // Asks demotion passes under way (background or Demote) to end after their current
  // rounds, and later ones not to start, until StopBackground returns; does not wait.
  // For a node about to stop: it calls this first, then shuts its server down.
  void RequestStop();
  // Demotes up to `max_objects` DRAM objects to NVMe regardless of the watermarks, in
  // rounds of 64 (two in flight) of the coldest leaves and the parents that become
  // leaves with them; DRAM copies drop leaf-first. Returns how many moved. 0 without an
  // NVMe tier.
  size_t Demote(size_t max_objects);

  PoolStatsSnapshot Stats() const;
  std::optional<ObjectInfo> Inspect(const ObjectKey& key) const;
  // Walks the whole index and checks what the core keeps incrementally: every object has
  // a copy, the leaf sets, the per-tier child counts (core_impl.h, invariants 1, 2 and 7),
  // and the DRAM pages each client holds under leases and reservations.
  // INTERNAL naming the first object that breaks one. O(objects x children): for tests.
  absl::Status CheckIndex() const;
  // Every visible copy, for a full event dump: fn(key, parent, tier).
  void ForEachVisible(
      const std::function<void(const ObjectKey&, const std::optional<BlockHash>&, Tier)>& fn) const;
  // Multi-line configuration summary (capacity in pages and bytes per tier).
  std::string DescribeConfig() const;
  // Renames the node (Stats, DescribeConfig): NodeServer names it pool-<port> once its
  // port is bound. options().node_id keeps the name given at Create.
  void SetNodeId(std::string node_id);
  const PoolOptions& options() const { return options_; }

 private:
  class Impl;
  explicit PoolCore(PoolOptions options);

  PoolOptions options_;
  std::byte* arena_ = nullptr;
  bool owns_arena_ = false;
  uint64_t page_bytes_ = 0;
  uint32_t dram_pages_ = 0;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvpool::pool_node
