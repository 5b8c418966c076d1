// KvIndex: which sources hold which blocks, and the longest prefix each can reuse.
//
// The index maps a block hash to its holders: workers holding it on GPU (a bitmask of
// source slots) and sources holding it in DRAM/NVMe (pool nodes, or a worker's own host
// tier). A lookup walks a request's hash chain once:
//
//   chain:     h0   h1   h2   h3   h4   (h5 not in the index: the walk stops)
//   w0 GPU:    x    x    x    .    x    -> gpu prefix 3 (h4 is unreachable without h3)
//   w1 GPU:    x    .    x              -> gpu prefix 1
//   pool:      x    x    x    x    .    -> pool prefix 4; w0 reuses 3 from GPU + 1 from pool
//
// The contract is Dynamo's indexer's, narrowed: ApplyBatch/ApplyEvent (per-source
// events in sequence order), FindMatches, RemoveSource, Dump.
//
// Invariants:
//  1. Events of a source apply in sequence order: the event after `last_sequence` must
//     be last_sequence + 1; older ones are duplicates and are skipped.
//  2. A gap marks the source stale (so does MarkStale: events may have been lost where
//     the index cannot see a gap): later non-dump batches are ignored (counted) until
//     a full dump arrives; the source's entries are kept meanwhile.
//  3. A full dump replaces everything the index attributes to the source.
//  4. entries() <= max_entries after every call: above it, the index prunes leaf blocks
//     (no stored child) first, oldest first (last stored or looked up), to
//     max_entries * (1 - prune_fraction).
//
// LINEAR_STATE (KDA checkpoint) objects are kept under a key derived from the boundary
// block's hash, so they never match as KV; see HasState.
//
// Cost: FindMatches is one hash probe per block plus one AND per 64 sources per block
// (a 64-bit mask inline in the entry for slots < 64); Store and Remove are one probe per
// block, no allocation for slots < 64 and one DRAM/NVMe holder per block. Pruning
// recounts children then (O(entries)); RemoveSource, cleared events, full dumps (their
// first part) and Dump scan the whole index (O(entries)). A per-source list of keys
// would make dropping a source O(its entries), but it cost every Store: 256 -> 320 bytes
// per entry in router_bench, and 0.41-0.44 -> 0.27-0.34 of a bare hash map's throughput
// in 3 alternated runs (the code without it later read 0.34-0.36 too: noisy), for
// events that come only after a source is lost or falls behind.
//
// Thread safety: none. A KvIndex is owned by one thread or guarded by its owner's mutex
// (RouterCore's owner holds one). FindMatches mutates (it refreshes entry ages).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "kvpool/common/hash.h"
#include "kvpool/router/block_map.h"
#include "kvpool/router/events.h"

namespace kvpool::router {

// Dense id of a source inside the index; RouterCore reuses freed slots.
using SourceSlot = uint32_t;

struct GpuMatch {
  SourceSlot source;
  uint32_t blocks;  // leading blocks of the request on the source's GPU, > 0
  friend bool operator==(const GpuMatch&, const GpuMatch&) = default;
};

// A run of the request's blocks on one holder.
struct PoolRun {
  SourceSlot holder;
  Tier tier;  // kDram or kNvme
  uint32_t first_block;
  uint32_t num_blocks;
};

struct MatchResult {
  uint32_t walked_blocks = 0;    // leading blocks present anywhere in the index
  std::vector<GpuMatch> gpu;     // sources with a GPU prefix > 0, ascending by source
  std::vector<uint8_t> in_pool;  // [walked_blocks]: tiers (bit 1 << Tier) held in DRAM/NVMe, 0 = none
  uint32_t pool_prefix = 0;      // leading blocks resident in DRAM/NVMe

  // Blocks resident in DRAM/NVMe from block `first` on (contiguous), 0 past the walk.
  uint32_t PoolRunFrom(uint32_t first) const;
  // GPU prefix of `source` (0 when absent). O(gpu.size()).
  uint32_t GpuBlocks(SourceSlot source) const;
  void Clear();
};

struct ApplyResult {
  uint64_t applied = 0;     // events applied
  uint64_t duplicates = 0;  // events at or below last_sequence, skipped
  uint64_t ignored = 0;     // events dropped because the source is (or became) stale
  bool gap = false;         // this batch revealed a gap
  bool full_dump_requested = false;  // the source is stale after this batch
  uint64_t last_sequence = 0;
};

class KvIndex {
 public:
  struct Options {
    size_t max_entries = 1u << 24;  // (hash, holder) pairs; > 0
    double prune_fraction = 0.1;    // prune this much below max_entries, (0, 1)
  };

  KvIndex() : KvIndex(Options{}) {}
  explicit KvIndex(Options options);

  // Starts (or restarts) a source at slot: drops its entries, last_sequence = 0, not stale.
  void ResetSource(SourceSlot slot);
  // Drops a source's entries and forgets it. O(entries).
  void RemoveSource(SourceSlot slot);

  // Applies one batch of `slot`'s events (invariants 1-3). REQUIRES: ResetSource(slot) ran.
  ApplyResult ApplyBatch(SourceSlot slot, const EventBatch& batch);
  // Applies events that are not a full dump in sequence order (invariants 1-2): ApplyBatch
  // of such a batch. Consecutive parts of a batch end where the whole batch in one call
  // ends (`ignored` counts the part's events from the gap on).
  ApplyResult ApplyInOrder(SourceSlot slot, std::span<const KvEvent> events);
  // Applies events [begin, end) of the full dump `batch`, so that an owner can release its
  // lock between parts of a large dump (RouterHost does). The part that starts at 0 drops
  // the source's entries and clears stale (the dump is landing: heartbeats stop asking for
  // one); the part that ends at the last event sets last_sequence. Between parts the
  // source holds the events applied so far: for a dump of stored events, a subset of what
  // it will hold. ApplyBatch of a dump is the one part [0, size).
  // REQUIRES: batch.full_dump; parts in order, begin <= end <= batch.events.size().
  ApplyResult ApplyDumpPart(SourceSlot slot, const EventBatch& batch, size_t begin, size_t end);
  // Applies one event ignoring sequence numbers (the indexer contract's apply_event).
  void ApplyEvent(SourceSlot slot, const KvEvent& event);
  // Marks the source at `slot` stale (invariant 2) as a gap would: its events may have
  // been lost after the last one applied. Returns whether it became stale (false when it
  // was already, or the slot was never started).
  bool MarkStale(SourceSlot slot);

  // Direct mutations (no sequence check): approximate mode and the simulator use these.
  void Store(SourceSlot slot, const BlockHash& parent, std::span<const BlockHash> hashes, Tier tier,
             StateKind kind = StateKind::kAttnKv);
  void Remove(SourceSlot slot, std::span<const BlockHash> hashes, Tier tier,
              StateKind kind = StateKind::kAttnKv);
  void ClearSource(SourceSlot slot);
  // ClearSource of each, in one pass over the table (a Tick that drops 64 timed-out
  // sources scanned the whole table 64 times under the core lock).
  void ClearSources(std::span<const SourceSlot> slots);

  // Walks `hashes` (a chain, block 0 first). Reuses `out`'s buffers.
  void FindMatches(std::span<const BlockHash> hashes, MatchResult* out);
  MatchResult FindMatches(std::span<const BlockHash> hashes) {
    MatchResult r;
    FindMatches(hashes, &r);
    return r;
  }
  // Where blocks [first, first + num) of `hashes` live in DRAM/NVMe: one holder per block,
  // preferring DRAM, then the previous block's holder; merged into runs.
  std::vector<PoolRun> PoolLocations(std::span<const BlockHash> hashes, uint32_t first,
                                     uint32_t num) const;
  // Whether the KDA checkpoint at boundary block `h` is on `slot`'s GPU / in DRAM/NVMe.
  bool HasState(const BlockHash& h, SourceSlot slot) const;
  bool PoolHasState(const BlockHash& h) const;
  // Whether any source (GPU or pool) holds the KDA state at block hash h.
  bool AnyHasState(const BlockHash& h) const;

  // Everything `slot` holds as a full-dump batch (stored events of one block each,
  // unordered; dump_sequence = last_sequence). O(entries).
  EventBatch Dump(SourceSlot slot) const;

  size_t entries() const { return entries_; }     // (hash, holder) pairs
  size_t blocks() const { return map_.size(); }   // distinct keys
  size_t source_entries(SourceSlot slot) const;
  uint64_t last_sequence(SourceSlot slot) const;
  bool stale(SourceSlot slot) const;
  uint64_t pruned_entries() const { return pruned_; }
  size_t max_entries() const { return options_.max_entries; }
  // Memory the index uses: table slots + out-of-line holder lists. O(1): the lists'
  // bytes are kept up to date as they change (GetStats and metric scrapes read this
  // under the router's lock, which Route needs too).
  size_t MemoryBytes() const;
  // The same by walking every block (tests compare the two). O(blocks).
  size_t MemoryBytesByWalk() const;

 private:
  struct GpuWord {
    uint32_t word;  // sources [64*word, 64*word + 64)
    uint64_t bits;
  };
  struct PoolHolder {
    SourceSlot slot;
    uint8_t tiers;  // bit (1 << Tier)
  };
  static constexpr SourceSlot kNoSlot = ~SourceSlot{0};
  // Out of line, rare: GPU holders in slots >= 64 and more than one DRAM/NVMe holder.
  struct Spill {
    absl::InlinedVector<GpuWord, 1> gpu;  // words >= 1, sorted by word, bits != 0
    std::vector<PoolHolder> pool;         // holders after Entry::pool_slot
  };
  // 48 bytes: with the key, one 64-byte BlockMap slot (one cache line per block). What a
  // lookup reads comes first; parent (read by pruning only) last.
  struct Entry {
    uint64_t gpu0 = 0;              // GPU holders in slots [0, 64)
    std::unique_ptr<Spill> spill;
    uint32_t age = 0;               // tick_ of the last store or lookup
    SourceSlot pool_slot = kNoSlot; // first DRAM/NVMe holder
    uint8_t pool_tiers = 0;         // its tiers, bit (1 << Tier)
    uint8_t all_pool_tiers = 0;     // OR over every DRAM/NVMe holder
    bool is_state = false;          // a LINEAR_STATE key (derived from the block hash)
    uint8_t slot_state = 0;         // owned by BlockMap
    BlockHash parent;               // chain predecessor, zero for a chain start or a state key
    bool empty() const { return gpu0 == 0 && pool_slot == kNoSlot && spill == nullptr; }
  };
  struct SourceState {
    bool present = false;
    bool stale = false;
    uint64_t last_sequence = 0;
    size_t entries = 0;  // (hash, this source) pairs in the index
  };
  // Block hashes are uniform already: one multiply keeps hand-made small hashes spread.
  struct Hasher {
    size_t operator()(const BlockHash& h) const { return static_cast<size_t>(h.lo * 0x9E3779B97F4A7C15ull); }
  };
  using Map = BlockMap<Entry>;

  static BlockHash StateKey(const BlockHash& h);
  SourceState& Source(SourceSlot slot);
  // Adds/removes one holder of `e`; returns whether a (hash, holder) pair was added/removed.
  bool AddHolder(Entry& e, SourceSlot slot, Tier tier);
  bool RemoveHolder(Entry& e, SourceSlot slot, Tier tier);
  int RemoveAllHolders(Entry& e, SourceSlot slot);  // (source, tier) pairs removed
  static void FixPool(Entry& e);  // refills pool_slot from the spill, recomputes all_pool_tiers
  static size_t SpillBytes(const Entry& e);  // heap bytes of e's spill
  // Runs change() (which may grow, shrink or drop e's spill) and keeps spill_bytes_ true.
  template <typename F>
  auto TrackSpill(Entry& e, F&& change) {
    const size_t before = SpillBytes(e);
    auto result = change();
    spill_bytes_ = spill_bytes_ - before + SpillBytes(e);
    return result;
  }
  static bool HasGpu(const Entry& e, SourceSlot slot);
  // Calls f(slot) for each GPU holder, then each DRAM/NVMe holder (f(slot, tiers)).
  template <typename G, typename P>
  static void ForEachHolder(const Entry& e, G&& gpu, P&& pool);
  uint32_t NextTick();
  void MaybePrune();

  Options options_;
  Map map_;
  std::vector<SourceState> sources_;  // by slot
  size_t entries_ = 0;
  size_t spill_bytes_ = 0;  // SpillBytes summed over the entries
  // FindMatches scratch: the entries along the walk, and the blocks where GPU holders drop.
  struct Drop {
    uint32_t block;
    uint64_t mask;
  };
  std::vector<Entry*> walk_;
  std::vector<Drop> drops_;
  uint32_t tick_ = 0;  // ages: one tick per Store/Remove call and per lookup, renormalised at wrap
  uint64_t pruned_ = 0;
};

}  // namespace kvpool::router
