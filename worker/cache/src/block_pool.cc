#include "kvpool/worker/cache/block_pool.h"

#include <algorithm>
#include <cassert>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvpool::cache {

absl::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kGpu: return "gpu";
    case Tier::kDram: return "dram";
    case Tier::kNvme: return "nvme";
  }
  return "unknown";
}

absl::string_view EventTypeName(KvEvent::Type type) {
  switch (type) {
    case KvEvent::Type::kStored: return "stored";
    case KvEvent::Type::kRemoved: return "removed";
    case KvEvent::Type::kCleared: return "cleared";
  }
  return "unknown";
}

static_assert(sizeof(KvCacheBlock) == 40, "keep per-block metadata at 40 bytes: the simulator "
                                           "holds one pool per instance");

BlockPool::BlockPool(Options options) : options_(std::move(options)) {
  assert(options_.num_blocks >= 2);
  blocks_.resize(static_cast<size_t>(options_.num_blocks));
  // Every block but the null block starts free, in id order ("never used").
  for (BlockId id = 1; id < num_blocks(); ++id) QueuePushBack(id);
}

// --- the intrusive free queue ------------------------------------------------------

void BlockPool::QueuePushBack(BlockId id) {
  KvCacheBlock& b = blocks_[id];
  assert(!b.in_free_queue && id != kNullBlockId);
  b.prev_free = free_tail_;
  b.next_free = kNoBlock;
  if (free_tail_ != kNoBlock) blocks_[free_tail_].next_free = id;
  else free_head_ = id;
  free_tail_ = id;
  b.in_free_queue = true;
  ++num_free_;
}

void BlockPool::QueuePushFront(BlockId id) {
  KvCacheBlock& b = blocks_[id];
  assert(!b.in_free_queue && id != kNullBlockId);
  b.next_free = free_head_;
  b.prev_free = kNoBlock;
  if (free_head_ != kNoBlock) blocks_[free_head_].prev_free = id;
  else free_tail_ = id;
  free_head_ = id;
  b.in_free_queue = true;
  ++num_free_;
}

void BlockPool::QueueRemove(BlockId id) {
  KvCacheBlock& b = blocks_[id];
  assert(b.in_free_queue);
  if (b.prev_free != kNoBlock) blocks_[b.prev_free].next_free = b.next_free;
  else free_head_ = b.next_free;
  if (b.next_free != kNoBlock) blocks_[b.next_free].prev_free = b.prev_free;
  else free_tail_ = b.prev_free;
  b.prev_free = b.next_free = kNoBlock;
  b.in_free_queue = false;
  --num_free_;
}

std::vector<BlockId> BlockPool::FreeQueueOrder() const {
  std::vector<BlockId> order;
  order.reserve(static_cast<size_t>(num_free_));
  for (BlockId id = free_head_; id != kNoBlock; id = blocks_[id].next_free) order.push_back(id);
  return order;
}

// --- eviction ----------------------------------------------------------------------

void BlockPool::UnlinkDuplicate(BlockId id) {
  KvCacheBlock& b = blocks_[id];
  auto it = attn_cache_.find(b.hash);
  assert(it != attn_cache_.end());
  if (it->second == id) {
    if (b.link == kNoBlock) {
      attn_cache_.erase(it);
      ++stats_.evicted_blocks;
      if (options_.event_sink != nullptr) {
        pending_removed_attn_.push_back(b.hash);
        pending_removed_attn_pages_.push_back(id);
      }
    } else {
      it->second = b.link;  // another copy keeps the hash cached: no event
    }
  } else {
    BlockId prev = it->second;
    while (blocks_[prev].link != id) prev = blocks_[prev].link;
    blocks_[prev].link = b.link;
  }
  b.link = kNoBlock;
  b.is_cached = false;
}

void BlockPool::EvictBlock(BlockId id, BlockId keep_in_place) {
  KvCacheBlock& b = blocks_[id];
  if (b.kind == StateKind::kAttnKv) {
    UnlinkDuplicate(id);
    if (id != keep_in_place && b.in_free_queue) {
      QueueRemove(id);
      QueuePushFront(id);
    }
    return;
  }
  // A page of a cached checkpoint run: the run goes as a unit.
  const BlockId head = b.run_head;
  const BlockHash hash = blocks_[head].hash;
  checkpoint_cache_.erase(hash);
  ++stats_.evicted_checkpoints;
  if (options_.event_sink != nullptr) pending_removed_state_.push_back(hash);
  for (BlockId p = head; p != kNoBlock;) {
    KvCacheBlock& page = blocks_[p];
    const BlockId next = page.link;
    page.is_cached = false;
    page.link = kNoBlock;
    page.run_head = kNoBlock;
    page.kind = StateKind::kAttnKv;
    if (p != keep_in_place && page.in_free_queue) {
      QueueRemove(p);
      QueuePushFront(p);
    }
    p = next;
  }
}

// --- allocation and reference counts -----------------------------------------------

BlockId BlockPool::GetNewBlock() {
  assert(num_free_ > 0);
  const BlockId id = free_head_;
  QueueRemove(id);
  // Memory latency dominates: start loading what the next pop will touch (the block
  // after next, and the map slot of the next block's hash) while this one is handled.
  if (free_head_ != kNoBlock) {
    const KvCacheBlock& next = blocks_[free_head_];
    if (next.next_free != kNoBlock) __builtin_prefetch(&blocks_[next.next_free], 1);
    if (next.is_cached && next.kind == StateKind::kAttnKv) attn_cache_.prefetch(next.hash);
  }
  KvCacheBlock& b = blocks_[id];
  if (b.is_cached) EvictBlock(id, id);
  b.ref_cnt = 1;
  b.kind = StateKind::kAttnKv;
  b.link = kNoBlock;
  b.run_head = kNoBlock;
  ++stats_.blocks_allocated;
  return id;
}

BlockId BlockPool::GetNewRun(int32_t num_pages) {
  assert(num_pages >= 1 && num_free_ >= num_pages);
  const BlockId head = GetNewBlock();
  BlockId prev = head;
  for (int32_t i = 1; i < num_pages; ++i) {
    const BlockId p = GetNewBlock();
    blocks_[prev].link = p;
    blocks_[p].kind = StateKind::kLinearState;
    blocks_[p].run_head = head;
    prev = p;
  }
  blocks_[head].kind = StateKind::kLinearState;
  blocks_[head].run_head = head;
  return head;
}

std::vector<BlockId> BlockPool::RunPages(BlockId head) const {
  std::vector<BlockId> pages;
  for (BlockId p = head; p != kNoBlock; p = blocks_[p].link) pages.push_back(p);
  return pages;
}

void BlockPool::Touch(BlockId id) {
  KvCacheBlock& b = blocks_[id];
  if (b.ref_cnt == 0) QueueRemove(id);  // a free-but-cached block becomes in use
  ++b.ref_cnt;
  ++stats_.blocks_touched;
}

void BlockPool::TouchRun(BlockId head) {
  for (BlockId p = head; p != kNoBlock; p = blocks_[p].link) Touch(p);
}

void BlockPool::FreeBlock(BlockId id) {
  KvCacheBlock& b = blocks_[id];
  assert(b.ref_cnt > 0 && id != kNullBlockId);
  if (--b.ref_cnt > 0) return;
  ++stats_.blocks_freed;
  // A cached block stays findable until reused; an uncached one is worth nothing.
  if (b.is_cached) QueuePushBack(id);
  else QueuePushFront(id);
}

void BlockPool::FreeRun(BlockId head) {
  const bool cached = blocks_[head].is_cached;
  for (BlockId p = head; p != kNoBlock;) {
    KvCacheBlock& page = blocks_[p];
    const BlockId next = page.link;
    assert(page.ref_cnt > 0);
    if (--page.ref_cnt == 0) {
      ++stats_.blocks_freed;
      if (cached) {
        QueuePushBack(p);
      } else {
        // An uncached run (a live state) dissolves into plain free blocks.
        page.link = kNoBlock;
        page.run_head = kNoBlock;
        page.kind = StateKind::kAttnKv;
        QueuePushFront(p);
      }
    }
    p = next;
  }
}

// --- the prefix cache --------------------------------------------------------------

void BlockPool::CacheFullBlocks(std::span<const BlockId> blocks,
                                std::span<const BlockHash> hashes,
                                std::optional<BlockHash> parent) {
  assert(blocks.size() == hashes.size());
  FlushEvents();  // a hash removed earlier in this operation is announced first
  const bool emit = options_.event_sink != nullptr;
  size_t run_start = 0;  // first index of the current run of newly cached hashes
  auto publish_run = [&](size_t end) {
    if (!emit || end == run_start) return;
    KvEvent e;
    e.type = KvEvent::Type::kStored;
    e.kind = StateKind::kAttnKv;
    e.parent = run_start == 0 ? parent : std::optional<BlockHash>(hashes[run_start - 1]);
    e.hashes.assign(hashes.begin() + static_cast<ptrdiff_t>(run_start),
                    hashes.begin() + static_cast<ptrdiff_t>(end));
    Publish(std::move(e));
  };
  constexpr size_t kPrefetchDistance = 8;
  for (size_t i = 0; i < std::min(kPrefetchDistance, hashes.size()); ++i) {
    attn_cache_.prefetch(hashes[i]);
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (i + kPrefetchDistance < hashes.size()) attn_cache_.prefetch(hashes[i + kPrefetchDistance]);
    KvCacheBlock& b = blocks_[blocks[i]];
    assert(b.ref_cnt > 0);
    if (b.is_cached) {
      // Shared with a sibling fork that cached it first: same tokens, same hash.
      assert(b.hash == hashes[i]);
      publish_run(i);
      run_start = i + 1;
      continue;
    }
    b.hash = hashes[i];
    b.is_cached = true;
    auto [it, inserted] = attn_cache_.try_emplace(hashes[i], blocks[i]);
    if (!inserted) {
      // Newest copy first: a later hit takes a copy in use and leaves the free one
      // evictable.
      b.link = it->second;
      it->second = blocks[i];
      publish_run(i);
      run_start = i + 1;
    }
  }
  publish_run(blocks.size());
}

void BlockPool::CacheCheckpoint(BlockId head, const BlockHash& hash,
                                std::optional<BlockHash> parent) {
  assert(blocks_[head].run_head == head);
  FlushEvents();
  for (BlockId p = head; p != kNoBlock; p = blocks_[p].link) blocks_[p].is_cached = true;
  blocks_[head].hash = hash;
  const bool inserted = checkpoint_cache_.try_emplace(hash, head).second;
  assert(inserted);
  (void)inserted;
  if (options_.event_sink != nullptr) {
    KvEvent e;
    e.type = KvEvent::Type::kStored;
    e.kind = StateKind::kLinearState;
    e.parent = parent;
    e.hashes.push_back(hash);
    Publish(std::move(e));
  }
}

BlockId BlockPool::GetCachedBlock(const BlockHash& hash) const {
  auto it = attn_cache_.find(hash);
  if (it == attn_cache_.end()) return kNoBlock;
  // A copy in use first: sharing it takes no page off the free queue, while touching a
  // free copy would. The chain head is the newest copy, in use when it was cached, so the
  // walk only goes on after that copy was freed while an older one is still held.
  for (BlockId id = it->second; id != kNoBlock; id = blocks_[id].link) {
    if (blocks_[id].ref_cnt > 0) return id;
  }
  return it->second;
}

BlockId BlockPool::GetCachedCheckpoint(const BlockHash& hash) const {
  auto it = checkpoint_cache_.find(hash);
  return it == checkpoint_cache_.end() ? kNoBlock : it->second;
}

bool BlockPool::IsCached(const BlockHash& hash, StateKind kind) const {
  return kind == StateKind::kAttnKv ? attn_cache_.contains(hash)
                                    : checkpoint_cache_.contains(hash);
}

size_t BlockPool::num_cached_hashes(StateKind kind) const {
  return kind == StateKind::kAttnKv ? attn_cache_.size() : checkpoint_cache_.size();
}

std::vector<BlockHash> BlockPool::CachedHashes(StateKind kind) const {
  const auto& map = kind == StateKind::kAttnKv ? attn_cache_ : checkpoint_cache_;
  std::vector<BlockHash> out;
  out.reserve(map.size());
  for (const auto& [hash, id] : map) out.push_back(hash);
  return out;
}

absl::StatusOr<int> BlockPool::EvictCached(const BlockHash& hash, StateKind kind) {
  int dropped = 0;
  if (kind == StateKind::kLinearState) {
    const BlockId head = GetCachedCheckpoint(hash);
    if (head == kNoBlock) {
      return absl::NotFoundError(
          absl::StrCat("no checkpoint is cached under hash ", hash.ToHex()));
    }
    if (blocks_[head].ref_cnt > 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "checkpoint ", hash.ToHex(), " is in use by ", blocks_[head].ref_cnt,
          " request(s); free them before evicting it"));
    }
    EvictBlock(head, kNoBlock);
    dropped = 1;
  } else {
    std::vector<BlockId> free_copies;
    auto it = attn_cache_.find(hash);
    if (it == attn_cache_.end()) {
      return absl::NotFoundError(absl::StrCat("no block is cached under hash ", hash.ToHex()));
    }
    for (BlockId id = it->second; id != kNoBlock; id = blocks_[id].link) {  // every copy
      if (blocks_[id].ref_cnt == 0) free_copies.push_back(id);
    }
    if (free_copies.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "every block cached under hash ", hash.ToHex(),
          " is in use; free the requests holding it before evicting it"));
    }
    for (BlockId c : free_copies) EvictBlock(c, kNoBlock);
    dropped = static_cast<int>(free_copies.size());
  }
  FlushEvents();
  return dropped;
}

absl::Status BlockPool::EvictCachedBlock(BlockId id) {
  if (id <= 0 || static_cast<size_t>(id) >= blocks_.size() || !blocks_[id].is_cached ||
      blocks_[id].kind != StateKind::kAttnKv) {
    return absl::NotFoundError(absl::StrCat("block ", id, " is not a cached attn block"));
  }
  if (blocks_[id].ref_cnt > 0) {
    return absl::FailedPreconditionError(absl::StrCat("block ", id, " is in use by ", blocks_[id].ref_cnt,
                                                      " request(s); free them before evicting it"));
  }
  EvictBlock(id, kNoBlock);
  FlushEvents();
  return absl::OkStatus();
}

absl::Status BlockPool::ResetPrefixCache() {
  if (num_used_blocks() > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "reset_prefix_cache refused: ", num_used_blocks(),
        " block(s) are in use; free every running request first"));
  }
  FlushEvents();
  for (KvCacheBlock& b : blocks_) {
    b.is_cached = false;
    b.link = kNoBlock;
    b.run_head = kNoBlock;
    b.kind = StateKind::kAttnKv;
  }
  attn_cache_.clear();
  checkpoint_cache_.clear();
  if (options_.event_sink != nullptr) {
    KvEvent e;
    e.type = KvEvent::Type::kCleared;
    Publish(std::move(e));
  }
  return absl::OkStatus();
}

// --- events ------------------------------------------------------------------------

void BlockPool::Publish(KvEvent event) {
  event.sequence = next_sequence_++;
  event.tier = options_.tier;
  ++stats_.events_published;
  options_.event_sink->Publish(options_.source_id, event);
}

void BlockPool::FlushEvents() {
  if (options_.event_sink == nullptr) return;
  for (StateKind kind : {StateKind::kAttnKv, StateKind::kLinearState}) {
    auto& pending =
        kind == StateKind::kAttnKv ? pending_removed_attn_ : pending_removed_state_;
    if (pending.empty()) continue;
    KvEvent e;
    e.type = KvEvent::Type::kRemoved;
    e.kind = kind;
    e.hashes = std::move(pending);
    pending.clear();
    if (kind == StateKind::kAttnKv) {
      e.pages = std::move(pending_removed_attn_pages_);
      pending_removed_attn_pages_.clear();
    }
    Publish(std::move(e));
  }
}

}  // namespace kvpool::cache
