// PoolCore::Impl: the index behind PoolCore (private to pool-node/).
//
// Invariants (all under mu_):
//  1. An object in objects_ has a DRAM copy, an NVMe copy, or both; with neither it is
//     erased. Reserved pages belong to a ReservationState, never to an object.
//  2. leaves_[t] holds (tick, key) for exactly the objects with a copy in tier t and no
//     child (same kind, parent == its hash) with a copy in t; tick is the object's last
//     use, so begin() is the least recently used leaf.
//  3. An object with leases > 0 or pins > 0 keeps its DRAM copy (eviction and demotion
//     skip it); one with nvme_busy keeps its NVMe copy.
//  4. A LINEAR_STATE object is `announced` iff the ATTN_KV chain ending at its hash is
//     present (every link up to a chain start); only announced ones are looked up or
//     reported to the EventSink.
//  5. held_by_kind_[k] is the sum of held_pages over objects of kind k, and an object's
//     held_pages is its DRAM page count while it has a DRAM copy that eviction must skip
//     (!Evictable), else 0. SyncHeld(o) restores this after any change to o's copies,
//     leases, pins, demoting or promotion, so a Reserve can tell in O(1) that eviction
//     cannot make room and fail without evicting anything.
//  6. The parent links of one kind form no cycle (Insert drops a link that would close
//     one), so every chain ends and every object can become a leaf.
//  7. An object's kids_in[t] is the number of its children (children_) with a copy in
//     tier t: AddCopy and DropCopy move the parent's count, Insert counts a new
//     object's children once. So a leaf test costs O(1), not a walk over every child
//     (a shared prefix with 20k continuations made each sibling's change O(20k)).
#pragma once

#include <atomic>
#include <deque>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "kvpool/pool_node/page_allocator.h"
#include "kvpool/pool_node/pool_core.h"
#include "nvme_store.h"

namespace kvpool::pool_node {

struct Object {
  ObjectKey key;
  std::optional<BlockHash> parent;
  uint64_t length = 0;
  uint64_t checksum = 0;
  bool copy[kNumTiers] = {false, false};
  std::vector<uint32_t> pages[kNumTiers];  // DRAM arena pages / NVMe file pages
  uint64_t tick = 0;                       // last use (LRU)
  bool in_leaves[kNumTiers] = {false, false};
  uint32_t leases = 0;    // active leases naming this object
  uint32_t pins = 0;      // DRAM copy in use by a demotion write or a Lookup in progress
  bool nvme_busy = false; // NVMe copy being read by a promotion
  bool demoting = false;
  uint8_t failed_reads = 0;  // promotions in a row whose NVMe read failed (kMaxFailedReads)
  int64_t last_failed_read_ms = 0;  // when the last one counted (a burst counts once)
  std::shared_ptr<absl::Notification> promotion;  // set while being promoted
  bool announced = false;  // LINEAR_STATE only (invariant 4)
  uint64_t held_pages = 0;  // DRAM pages counted in Impl::held_by_kind_ (invariant 5)
  uint64_t kids_in[kNumTiers] = {0, 0};  // children with a copy in each tier (invariant 7)
};

struct ReservedEntry {
  ReserveEntrySpec spec;
  bool already_present = false;
  absl::Status refused;  // ReserveSlot::status: no pages, and a Commit naming it gets this
  bool claimed = false;  // named by a Commit (verifying or done)
  std::vector<uint32_t> pages;
  // Entries of the same reservation whose parent this one is, not yet stored: while
  // there are any, this one (once stored) stays pinned (pinned_for_children).
  uint32_t children_pending = 0;
  bool pinned_for_children = false;
};

struct ReservationState {
  std::string client;  // ReserveRequest.client_id: only its Commits settle it
  uint64_t pages = 0;  // DRAM pages its entries still hold (in Impl::pinned_by_client_)
  int64_t expires_ms = 0;
  uint32_t committing = 0;  // Commits between their claim and their publish: no expiry
  uint32_t claimed = 0;     // Commits that came (claimed their entries)
  uint32_t done = 0;        // Commits published
  uint32_t last = 0;        // from a final Commit: the reservation's Commits in all (0: none yet)
  bool ended_early = false; // an end_now Commit came: unnamed entries' pages are held back
  std::vector<ReservedEntry> entries;
  // Index of each entry by block hash (unique in a reservation): a Commit of a few
  // entries of a large reservation claims them without scanning it under the lock.
  absl::flat_hash_map<BlockHash, uint32_t> by_hash;
  // Stored objects its new entries hang from (a parent; a checkpoint's KV block), pinned
  // in DRAM until it ends (FreeReservation unpins them). Its own entries, once stored,
  // stay pinned only while a child of theirs in it is still to come.
  std::vector<ObjectKey> held_parents;
};

struct LeaseState {
  std::string client;  // LookupRequest.client_id: only its Release ends it
  uint64_t pages = 0;  // DRAM pages of its objects (in Impl::pinned_by_client_)
  int64_t expires_ms = 0;
  std::vector<ObjectKey> keys;
};

// Eviction victims of one tier, chosen without dropping anything (Impl::PlanVictims), so
// that a Reserve, promotion or demotion that cannot make room fails before it evicts:
// leaves in LRU order, and parents once every child they have in the tier is chosen.
struct EvictionPlan {
  int tier = 0;
  std::vector<ObjectKey> victims;  // in drop order
  absl::flat_hash_set<ObjectKey> chosen;
  // Parents all of whose children in the tier are chosen: leaves once those are dropped.
  std::set<std::pair<uint64_t, ObjectKey>> exposed;
  absl::flat_hash_map<ObjectKey, size_t> children_left;  // in the tier, not chosen yet
  uint64_t pages = 0;  // the victims' pages in the tier
  // Objects whose drop from the plan's tier would erase them while a child has a copy in
  // the other tier (Impl::Strands: a DRAM-only parent of an NVMe chain, an NVMe-only
  // parent of a DRAM chain), putting that chain out of reach of prefix Lookups until the
  // parent is put again (demotion moves chains out whole instead), are passed over and
  // kept here, least recently used first, up to kMaxSpared per plan; they are taken only
  // once nothing else is left. Past that bound (a tier of many split chains) they are
  // taken in LRU order like any leaf, so a plan never walks more than kMaxSpared extra
  // leaves.
  std::vector<std::pair<uint64_t, ObjectKey>> spared;
  absl::flat_hash_set<ObjectKey> spared_keys;  // those in `spared` (a plan walks its leaves once per PlanVictims call)
  static constexpr size_t kMaxSpared = 256;
};

class PoolCore::Impl {
 public:
  Impl(PoolCore* core, const PoolOptions& o);

  PoolCore* core_;
  const PoolOptions& opt_;
  Clock* clock_;
  uint64_t page_bytes_;
  std::unique_ptr<NvmeStore> nvme_;  // set at Create, then immutable

  mutable absl::Mutex mu_;
  std::string node_id_ ABSL_GUARDED_BY(mu_);  // options.node_id until SetNodeId
  absl::flat_hash_map<ObjectKey, std::unique_ptr<Object>> objects_ ABSL_GUARDED_BY(mu_);
  // (parent hash, kind) -> child hashes of committed objects (parent may be absent).
  absl::flat_hash_map<ObjectKey, absl::flat_hash_set<BlockHash>> children_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<uint64_t, ObjectKey>> leaves_[kNumTiers] ABSL_GUARDED_BY(mu_);
  std::unique_ptr<PageAllocator> alloc_[kNumTiers] ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, ReservationState> reservations_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, LeaseState> leases_ ABSL_GUARDED_BY(mu_);
  std::set<std::pair<int64_t, uint64_t>> lease_expiry_ ABSL_GUARDED_BY(mu_);
  // (expires_ms, id) of the reservations no Commit is verifying (committing == 0), so
  // ExpireLocked visits only the timed-out ones: a Commit takes its reservation out
  // while it verifies and puts it back after (ExpiryOff / ExpiryOn).
  std::set<std::pair<int64_t, uint64_t>> reservation_expiry_ ABSL_GUARDED_BY(mu_);
  // Reservation and lease ids: random, non-zero, unique among the live ones (a client
  // cannot guess another's id; the owner check in Commit and Release stops it anyway).
  uint64_t NewId() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::mt19937_64 id_gen_ ABSL_GUARDED_BY(mu_);
  // DRAM pages each client holds under its leases and reservations, and those held back
  // from its reservations (no entry at 0), for PoolOptions::max_client_pinned_bytes.
  absl::flat_hash_map<std::string, uint64_t> pinned_by_client_ ABSL_GUARDED_BY(mu_);
  // OK when `client` may pin `pages` more DRAM pages (`what`: "Lookup" or "Reserve"),
  // else RESOURCE_EXHAUSTED naming the client, its pages and the cap.
  absl::Status CheckClientRoom(const std::string& client, uint64_t pages, absl::string_view what) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PinnedByClient(const std::string& client, uint64_t pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnpinnedByClient(const std::string& client, uint64_t pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  uint64_t tick_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t used_by_kind_[kNumTiers][kNumKinds] ABSL_GUARDED_BY(mu_) = {};  // pages
  uint64_t reserved_by_kind_[kNumKinds] ABSL_GUARDED_BY(mu_) = {};        // pages
  uint64_t held_by_kind_[kNumKinds] ABSL_GUARDED_BY(mu_) = {};            // pages (inv. 5)
  // DRAM pages allocated for promotions under way (counted in used_by_kind_ once they land).
  uint64_t promoting_by_kind_[kNumKinds] ABSL_GUARDED_BY(mu_) = {};
  uint64_t objects_in_[kNumTiers] ABSL_GUARDED_BY(mu_) = {};
  uint64_t evictions_[kNumTiers] ABSL_GUARDED_BY(mu_) = {};
  uint64_t checksum_failures_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t demotions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t demoting_pages_ ABSL_GUARDED_BY(mu_) = 0;  // DRAM pages of objects being written out
  // NVMe pages of copies dropped while their journal DEL could not be written: the
  // journal still names them, so they are not reused until a compaction rewrote it.
  std::vector<uint32_t> nvme_quarantine_ ABSL_GUARDED_BY(mu_);
  // After a failed compaction, maintenance compacts again (for any reason) no sooner than
  // this: a failing disk gets a retry every kCompactionRetryMs, not a full rewrite and an
  // error line every maintenance tick.
  int64_t next_compaction_ms_ ABSL_GUARDED_BY(mu_) = 0;
  static constexpr int64_t kCompactionRetryMs = 10'000;
  // DRAM pages of reservations reclaimed at their timeout, unused for one more
  // reserve_timeout_ms: their client may still be writing (one-sided: nothing stops a
  // late write), and that write must land in no other object. (release time, pages).
  // Still charged to the client whose reservation they were (pinned_by_client_): one
  // that lets its reservations lapse must not reserve its cap again meanwhile.
  struct HeldBack {
    int64_t release_ms = 0;
    std::vector<uint32_t> pages;
    std::string client;
  };
  std::deque<HeldBack> dram_quarantine_ ABSL_GUARDED_BY(mu_);
  uint64_t dram_quarantined_pages_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t promotions_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reclaimed_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t expired_leases_ ABSL_GUARDED_BY(mu_) = 0;

  // Background maintenance.
  absl::Mutex bg_mu_;
  bool stop_ ABSL_GUARDED_BY(bg_mu_) = false;
  // Set with stop_: a demotion pass under way ends after its current rounds (a node
  // told to stop does not first write up to 64K objects to NVMe).
  std::atomic<bool> stopping_{false};
  std::thread bg_;

  // --- bookkeeping (core_objects.cc) ---
  Object* Find(const ObjectKey& k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Visible(const Object& o) const { return o.key.kind == StateKind::kAttnKv || o.announced; }
  // Children of `o` with a copy in t, counted by walking them (Insert's count of a new
  // object's children; everything else reads o.kids_in, invariant 7).
  size_t CountChildrenIn(const Object& o, int t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  size_t ChildrenIn(const Object& o, int t) const { return o.kids_in[t]; }
  bool HasChildIn(const Object& o, int t) const { return o.kids_in[t] != 0; }
  // A child's copy in t came (+1) or went (-1): its parent's count follows.
  void CountInParent(const Object& child, int t, int delta) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshLeaf(Object& o, int t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefreshParent(const Object& o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Touch(Object& o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Inserts a new object that has no copy yet; the caller adds copies next.
  Object* Insert(std::unique_ptr<Object> o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AddCopy(Object& o, int t, std::vector<uint32_t> pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops a copy (frees pages, journals NVMe removals); erases the object when it was
  // the last one. `o` is invalid afterwards in that case.
  void DropCopy(Object& o, int t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool KvPrefixPresent(const BlockHash& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Pins the DRAM copies of the ATTN_KV chain ending at `h` (a checkpoint's prefix,
  // invariant 4) and appends their keys to `pinned` (the caller unpins them). While
  // pinned, making room in DRAM cannot erase a link and so hide the checkpoint;
  // NVMe-only links are never erased by DRAM eviction. `seen` (one per call) ends a
  // walk at a link an earlier walk of the same call reached.
  void PinKvPrefix(const BlockHash& h, std::vector<ObjectKey>& pinned, absl::flat_hash_set<BlockHash>& seen)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Announce(Object& lin, bool on) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AnnounceBelow(const BlockHash& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void UnannounceBelow(const BlockHash& h) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Evicts leaves of tier t until `free_pages` are free. False, with nothing evicted, if
  // eviction cannot make that much room (or false after an NVMe journal failure, see
  // DropVictims).
  bool Evict(int t, uint64_t free_pages) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Plans DRAM victims (into a DRAM plan) so that `need` more pages fit, need_kind[k] of
  // them of kind k, each kind within its quota (counting its reserved and held pages and
  // its promotions under way): first what each kind's quota needs, then what the tier
  // still needs beyond the room those make. Drops nothing (DropVictims does). On a
  // shortfall, says which and of what kind (-1: the tier).
  enum class RoomShort {
    kNone,
    kQuota,      // the kind's quota cannot fit it even after evicting every unheld object
    kQuotaHeld,  // the kind's evictable leaves (and parents they expose) fall short
    kTier,       // the tier cannot fit it even after evicting every unheld object
    kTierHeld,   // the tier's evictable leaves fall short
  };
  struct RoomPlan {
    RoomShort shortfall = RoomShort::kNone;
    int kind = -1;
  };
  RoomPlan PlanDramRoom(EvictionPlan& plan, const uint64_t (&need_kind)[kNumKinds], uint64_t need)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Adds victims of plan.tier (of `kind` only, if given) to `plan` until the ones this
  // call adds hold `pages` pages of the tier. False if the tier's evictable leaves, and
  // the parents they expose, fall short (the plan then holds all it could add).
  bool PlanVictims(EvictionPlan& plan, std::optional<StateKind> kind, uint64_t pages)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the plan's victims' copies in order (nothing may have changed since it was
  // planned). False if one's pages stayed held back (its NVMe journal DEL failed): the
  // room it was to make is not there.
  bool DropVictims(const EvictionPlan& plan) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Evictable(const Object& o, int t) const;
  // Dropping o's copy in tier t would erase o (it has no copy in the other tier) while a
  // child of it has a copy in the other tier: that child, and the chain below it, could
  // no longer be reached by a prefix Lookup.
  bool Strands(const Object& o, int t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const int other = 1 - t;
    return !o.copy[other] && HasChildIn(o, other);
  }
  // Restores invariant 5 for `o`; call after changing its DRAM copy, leases, pins,
  // demoting or promotion.
  void SyncHeld(Object& o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Pin(Object& o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Unpin(Object& o) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // DRAM pages that eviction could free at most (of one kind, or of all kinds with
  // kind < 0): pages of DRAM copies not held (invariant 5). An upper bound: an unheld
  // parent of a held child is not evictable either.
  uint64_t EvictableDramPages(int kind) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the leases and reservations whose time is up, and frees the held-back pages
  // whose hold is over: O(what expires), not O(what is open).
  void ExpireLocked(int64_t now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ExpiryOn(uint64_t id, const ReservationState& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    reservation_expiry_.emplace(r.expires_ms, id);
  }
  void ExpiryOff(uint64_t id, const ReservationState& r) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    reservation_expiry_.erase({r.expires_ms, id});
  }
  // For RESOURCE_EXHAUSTED messages: ", and N pages held back from timed-out reservations
  // (free again by T ms)" while there are any, else empty.
  std::string HeldBackNote() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EndLease(uint64_t id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the entries' reservation of their pages; the pages go back to the allocator, or
  // to `held` (appended) when given: the timeout's hold-back. They leave the count of r's
  // client (pinned_by_client_).
  void FreeReservedEntry(ReservationState& r, ReservedEntry& e, std::vector<uint32_t>* held = nullptr)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void FreeReservation(ReservationState& r, std::vector<uint32_t>* held = nullptr) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // `child`, an entry of `r`, was stored: its parent in `r` has one child fewer to wait
  // for, and is unpinned once none is left (ReservedEntry::children_pending).
  void ChildStored(ReservationState& r, const ReservedEntry& child) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Keeps reserved pages out of use for one more reserve timeout from `now`: a
  // one-sided write may still land in them (dram_held_back_bytes). They stay charged to
  // `client` (the reservation's) until then.
  void HoldBack(std::vector<uint32_t> pages, int64_t now, const std::string& client)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::byte*> Addresses(const std::vector<uint32_t>& dram_pages) const;
  uint64_t Checksum(const std::vector<uint32_t>& dram_pages, uint64_t length) const;
  uint64_t PagesFor(uint64_t bytes) const { return (bytes + page_bytes_ - 1) / page_bytes_; }

  // Rewrites the NVMe journal from the objects on NVMe (NvmeStore::BeginRewrite); mu_
  // is held only for the snapshot.
  void CompactJournal() ABSL_LOCKS_EXCLUDED(mu_);

  // --- demotion (core_objects.cc) ---
  size_t DemoteBatch(size_t max_objects, uint64_t stop_at_used_pages);
  // Rounds of DemoteBatch (64 objects each) until `max_objects` left DRAM or a round
  // moves none, two rounds at a time when there is more than one: one round's writes are
  // in flight while the other picks its objects and journals them, so the io_uring
  // queue does not drain between rounds. Returns how many objects left DRAM.
  size_t DemotePipelined(size_t max_objects, uint64_t stop_at_used_pages);
  void BackgroundLoop();
};

}  // namespace kvpool::pool_node
