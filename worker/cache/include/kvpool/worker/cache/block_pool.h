// BlockPool: the physical blocks of one KV pool, their reference counts, the free
// queue and the prefix cache (hash -> block). Metadata only: a BlockId indexes a page in
// a payload pool the caller owns (GPU memory in the worker, nothing in the simulator).
//
//   block ids:   0      1   2   3   4   5   6   7   8   9
//              [null] [ A | B | C | D | E | F | G | H | I ]
//   ref_cnt:            1   2   0   0   0   1   0   0   0      (A, B, F in use)
//   hash:               h1  h2  h5  h6  h7  -   -   -   -
//
//   free queue (ref_cnt == 0 only; popped from the head, least recently freed first):
//
//     head -> [ H ][ G ][ I ]         [ E(h7) ][ D(h6) ][ C(h5) ] <- tail
//              ^ freed, no hash  ^ never used  ^ cached, freed chain tail first
//
// 1. Block 0 is the null block: never allocated, never freed, never in the queue.
// 2. ref_cnt == 0 <=> the block is in the free queue (an eviction candidate).
// 3. A block keeps its hash while free ("lazy eviction"); the hash leaves the cache
//    only when the block is popped for reuse (or EvictCached / ResetPrefixCache).
// 4. Freed blocks without a hash go to the head (nothing is lost by reusing them);
//    freed cached blocks go to the tail. Callers free a request's blocks in reverse, so
//    a chain's tail is evicted before its parent: leaf first, least recently used first.
// 5. One hash may map to several blocks (two requests computed the same block); the
//    hash stays cached until its last copy goes. Events announce a hash once.
// 6. A linear-state object (a KDA live state or checkpoint) is a *run* of pages: every
//    page carries the same ref_cnt, and reusing any free page of a cached run evicts the
//    whole run (its other pages move to the queue head as plain free blocks).
//
// Costs: every operation is O(1) per block (hash-map operations amortized), except
// FreeQueueOrder/CachedHashes (O(blocks)). Memory: 40 bytes per block plus one map
// entry per cached hash.
//
// Thread safety: not thread-safe; the owner (KvCacheManager) serializes calls.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/worker/cache/kv_events.h"

namespace kvpool::cache {

using BlockId = int32_t;
inline constexpr BlockId kNullBlockId = 0;  // the reserved null block
inline constexpr BlockId kNoBlock = -1;     // "no block" in links and results

// Per-block metadata (40 bytes).
struct KvCacheBlock {
  BlockHash hash;                // valid iff is_cached (for a run: on its head page)
  int32_t ref_cnt = 0;           // 0 <=> in the free queue (except the null block)
  BlockId prev_free = kNoBlock;  // free-queue links; touched only by the queue
  BlockId next_free = kNoBlock;
  // kAttnKv: the next block cached under the same hash (duplicate chain).
  // kLinearState: the next page of the same run.
  BlockId link = kNoBlock;
  BlockId run_head = kNoBlock;   // kLinearState: the run's head page
  StateKind kind = StateKind::kAttnKv;
  bool is_cached = false;
  bool in_free_queue = false;
};

struct BlockPoolStats {
  uint64_t blocks_allocated = 0;     // pops from the free queue
  uint64_t blocks_freed = 0;         // ref_cnt reached 0
  uint64_t blocks_touched = 0;       // ref_cnt increments on cache hits / shares
  uint64_t evicted_blocks = 0;       // attn blocks whose hash was dropped on reuse
  uint64_t evicted_checkpoints = 0;  // checkpoint runs dropped on reuse
  uint64_t events_published = 0;
};

class BlockPool {
 public:
  struct Options {
    int32_t num_blocks = 0;          // including the null block; >= 2
    std::string source_id = "worker";
    Tier tier = Tier::kGpu;
    KvEventSink* event_sink = nullptr;  // not owned; null: no events are built
  };

  // REQUIRES: options.num_blocks >= 2 (validated by the manager).
  explicit BlockPool(Options options);
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  int32_t num_blocks() const { return static_cast<int32_t>(blocks_.size()); }
  // Blocks a caller can get right now (free, cached or not).
  int32_t num_free_blocks() const { return num_free_; }
  int32_t num_used_blocks() const { return num_blocks() - 1 - num_free_; }
  const KvCacheBlock& block(BlockId id) const { return blocks_[id]; }
  const BlockPoolStats& stats() const { return stats_; }

  // --- allocation -------------------------------------------------------------------
  // Pops the least recently freed block (evicting its hash lazily) with ref_cnt = 1.
  // REQUIRES: num_free_blocks() >= 1.
  BlockId GetNewBlock();
  // A run of `num_pages` pages for a linear state, ref_cnt = 1; returns its head.
  // REQUIRES: num_free_blocks() >= num_pages >= 1.
  BlockId GetNewRun(int32_t num_pages);
  // The pages of a run, head first.
  std::vector<BlockId> RunPages(BlockId head) const;

  // --- reference counts ------------------------------------------------------------
  // A hit or a share: ref_cnt += 1, taking a free block off the queue.
  void Touch(BlockId id);
  void TouchRun(BlockId head);
  // ref_cnt -= 1; at 0 the block enters the queue (tail if cached, head if not).
  void FreeBlock(BlockId id);
  // A hint: the caller will soon touch or free `id`.
  void Prefetch(BlockId id) const { __builtin_prefetch(&blocks_[id], 1); }
  void FreeRun(BlockId head);

  // --- prefix cache ----------------------------------------------------------------
  // Registers full attn blocks under their hashes; `parent` is the hash before
  // hashes[0] (nullopt at a chain start). Emits `stored` for hashes not yet cached.
  // REQUIRES: blocks.size() == hashes.size(); each block is in use. A block already
  // cached (shared with a fork sibling that cached it first) is skipped.
  void CacheFullBlocks(std::span<const BlockId> blocks, std::span<const BlockHash> hashes,
                       std::optional<BlockHash> parent);
  // Registers a checkpoint run under the hash of the block ending at its boundary.
  // REQUIRES: no checkpoint cached under `hash`.
  void CacheCheckpoint(BlockId head, const BlockHash& hash, std::optional<BlockHash> parent);
  // A block cached under `hash` (a copy in use if there is one), or kNoBlock.
  BlockId GetCachedBlock(const BlockHash& hash) const;
  // The head of the checkpoint run cached under `hash`, or kNoBlock.
  BlockId GetCachedCheckpoint(const BlockHash& hash) const;
  bool IsCached(const BlockHash& hash, StateKind kind) const;
  size_t num_cached_hashes(StateKind kind) const;
  // Every cached hash of `kind` (O(cached); for dumps and tests).
  std::vector<BlockHash> CachedHashes(StateKind kind) const;

  // Drops the *free* copies of `hash` from the cache now (they stay free, moved to the
  // queue head). Copies in use keep the hash. Returns how many copies were dropped;
  // NOT_FOUND when nothing is cached under `hash`, FAILED_PRECONDITION when every copy
  // is in use.
  absl::StatusOr<int> EvictCached(const BlockHash& hash, StateKind kind);
  // Drops one free cached attn block, `id`, from the cache (other copies of its hash stay
  // cached). NOT_FOUND when `id` is not a cached attn block, FAILED_PRECONDITION when it
  // is in use.
  absl::Status EvictCachedBlock(BlockId id);
  // Forgets every hash and emits `cleared`. FAILED_PRECONDITION while a block is in use.
  absl::Status ResetPrefixCache();

  // The free queue, head first (O(blocks); tests and debugging).
  std::vector<BlockId> FreeQueueOrder() const;

  // Publishes removals gathered since the last flush as one `removed` event per kind.
  // Called at the end of each manager operation, and before every `stored` event so a
  // hash removed and re-stored in one operation is announced in that order.
  void FlushEvents();

 private:
  void QueuePushBack(BlockId id);
  void QueuePushFront(BlockId id);
  void QueueRemove(BlockId id);
  // Drops the hash of a free cached block that is being reused or explicitly evicted.
  void EvictBlock(BlockId id, BlockId keep_in_place);
  void UnlinkDuplicate(BlockId id);
  void Publish(KvEvent event);

  Options options_;
  std::vector<KvCacheBlock> blocks_;
  BlockId free_head_ = kNoBlock;
  BlockId free_tail_ = kNoBlock;
  int32_t num_free_ = 0;
  // hash -> first block of its duplicate chain (attn) / head page of the run (state).
  absl::flat_hash_map<BlockHash, BlockId> attn_cache_;
  absl::flat_hash_map<BlockHash, BlockId> checkpoint_cache_;
  std::vector<BlockHash> pending_removed_attn_;
  std::vector<BlockId> pending_removed_attn_pages_;  // parallel to pending_removed_attn_
  std::vector<BlockHash> pending_removed_state_;
  uint64_t next_sequence_ = 1;
  BlockPoolStats stats_;
};

}  // namespace kvpool::cache
