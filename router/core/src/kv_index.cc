#include "kvpool/router/kv_index.h"

#include <algorithm>
#include <bit>

namespace kvpool::router {

absl::string_view TierName(Tier tier) {
  switch (tier) {
    case Tier::kGpu: return "gpu";
    case Tier::kDram: return "dram";
    case Tier::kNvme: return "nvme";
  }
  return "unknown";
}

KvEvent KvEvent::Stored(uint64_t seq, BlockHash parent, std::vector<BlockHash> hashes, Tier tier,
                        StateKind kind) {
  KvEvent e;
  e.sequence = seq;
  e.type = Type::kStored;
  e.parent = parent;
  e.hashes = std::move(hashes);
  e.tier = tier;
  e.kind = kind;
  return e;
}

KvEvent KvEvent::Removed(uint64_t seq, std::vector<BlockHash> hashes, Tier tier, StateKind kind) {
  KvEvent e;
  e.sequence = seq;
  e.type = Type::kRemoved;
  e.hashes = std::move(hashes);
  e.tier = tier;
  e.kind = kind;
  return e;
}

KvEvent KvEvent::Cleared(uint64_t seq) {
  KvEvent e;
  e.sequence = seq;
  e.type = Type::kCleared;
  return e;
}

// ---- MatchResult ---------------------------------------------------------------------

uint32_t MatchResult::PoolRunFrom(uint32_t first) const {
  uint32_t n = 0;
  for (uint32_t i = first; i < in_pool.size() && in_pool[i]; ++i) ++n;
  return n;
}

uint32_t MatchResult::GpuBlocks(SourceSlot source) const {
  for (const GpuMatch& m : gpu) {
    if (m.source == source) return m.blocks;
  }
  return 0;
}

void MatchResult::Clear() {
  walked_blocks = 0;
  gpu.clear();
  in_pool.clear();
  pool_prefix = 0;
}

// ---- KvIndex -------------------------------------------------------------------------

KvIndex::KvIndex(Options options) : options_(options) {
  if (options_.max_entries == 0) options_.max_entries = 1;
  if (!(options_.prune_fraction > 0 && options_.prune_fraction < 1)) options_.prune_fraction = 0.1;
}

BlockHash KvIndex::StateKey(const BlockHash& h) {
  // An involution, so Dump recovers the block hash; a real chain hash equal to a derived
  // key would need a 128-bit collision.
  return BlockHash{h.lo ^ 0x6b64612d73746174ull, h.hi ^ 0x652d636b70742d31ull};
}

KvIndex::SourceState& KvIndex::Source(SourceSlot slot) {
  if (slot >= sources_.size()) sources_.resize(slot + 1);
  return sources_[slot];
}

size_t KvIndex::source_entries(SourceSlot slot) const {
  return slot < sources_.size() ? sources_[slot].entries : 0;
}
uint64_t KvIndex::last_sequence(SourceSlot slot) const {
  return slot < sources_.size() ? sources_[slot].last_sequence : 0;
}
bool KvIndex::stale(SourceSlot slot) const {
  return slot < sources_.size() && sources_[slot].stale;
}
bool KvIndex::MarkStale(SourceSlot slot) {
  if (slot >= sources_.size() || sources_[slot].stale) return false;
  sources_[slot].stale = true;
  return true;
}

uint32_t KvIndex::NextTick() {
  if (tick_ == ~uint32_t{0}) {
    // Wrap: halve every age 16 times over (order kept, ties possible); once per 4G calls.
    for (auto& [key, e] : map_) e.age >>= 16;
    tick_ >>= 16;
  }
  return ++tick_;
}

bool KvIndex::HasGpu(const Entry& e, SourceSlot slot) {
  if (slot < 64) return (e.gpu0 >> slot) & 1;
  if (e.spill == nullptr) return false;
  for (const GpuWord& w : e.spill->gpu) {
    if (w.word == slot / 64) return (w.bits >> (slot % 64)) & 1;
  }
  return false;
}

template <typename G, typename P>
void KvIndex::ForEachHolder(const Entry& e, G&& gpu, P&& pool) {
  for (uint64_t bits = e.gpu0; bits != 0; bits &= bits - 1) gpu(static_cast<SourceSlot>(std::countr_zero(bits)));
  if (e.spill != nullptr) {
    for (const GpuWord& w : e.spill->gpu) {
      for (uint64_t bits = w.bits; bits != 0; bits &= bits - 1) {
        gpu(w.word * 64 + static_cast<SourceSlot>(std::countr_zero(bits)));
      }
    }
  }
  if (e.pool_slot != kNoSlot) pool(e.pool_slot, e.pool_tiers);
  if (e.spill != nullptr) {
    for (const PoolHolder& p : e.spill->pool) pool(p.slot, p.tiers);
  }
}

void KvIndex::FixPool(Entry& e) {
  if (e.spill != nullptr) {
    if (e.pool_slot == kNoSlot && !e.spill->pool.empty()) {
      e.pool_slot = e.spill->pool.front().slot;
      e.pool_tiers = e.spill->pool.front().tiers;
      e.spill->pool.erase(e.spill->pool.begin());
    }
    if (e.spill->gpu.empty() && e.spill->pool.empty()) e.spill.reset();
  }
  uint8_t all = e.pool_slot != kNoSlot ? e.pool_tiers : 0;
  if (e.spill != nullptr) {
    for (const PoolHolder& p : e.spill->pool) all |= p.tiers;
  }
  e.all_pool_tiers = all;
}

bool KvIndex::AddHolder(Entry& e, SourceSlot slot, Tier tier) {
  if (tier == Tier::kGpu) {
    if (slot < 64) {
      const uint64_t bit = uint64_t{1} << slot;
      if (e.gpu0 & bit) return false;
      e.gpu0 |= bit;
      return true;
    }
    if (e.spill == nullptr) e.spill = std::make_unique<Spill>();
    auto& words = e.spill->gpu;
    const uint32_t word = slot / 64;
    const uint64_t bit = uint64_t{1} << (slot % 64);
    auto it = std::lower_bound(words.begin(), words.end(), word,
                               [](const GpuWord& w, uint32_t x) { return w.word < x; });
    if (it != words.end() && it->word == word) {
      if (it->bits & bit) return false;
      it->bits |= bit;
    } else {
      words.insert(it, GpuWord{word, bit});
    }
    return true;
  }
  const uint8_t tb = static_cast<uint8_t>(1u << static_cast<int>(tier));
  e.all_pool_tiers |= tb;
  if (e.pool_slot == slot) {
    e.pool_tiers |= tb;
    return false;  // the same (hash, holder) pair, another tier
  }
  if (e.pool_slot == kNoSlot) {
    e.pool_slot = slot;
    e.pool_tiers = tb;
    return true;
  }
  if (e.spill == nullptr) e.spill = std::make_unique<Spill>();
  for (PoolHolder& p : e.spill->pool) {
    if (p.slot == slot) {
      p.tiers |= tb;
      return false;
    }
  }
  e.spill->pool.push_back(PoolHolder{slot, tb});
  return true;
}

bool KvIndex::RemoveHolder(Entry& e, SourceSlot slot, Tier tier) {
  if (tier == Tier::kGpu) {
    if (slot < 64) {
      const uint64_t bit = uint64_t{1} << slot;
      if (!(e.gpu0 & bit)) return false;
      e.gpu0 &= ~bit;
      return true;
    }
    if (e.spill == nullptr) return false;
    auto& words = e.spill->gpu;
    const uint32_t word = slot / 64;
    const uint64_t bit = uint64_t{1} << (slot % 64);
    for (auto it = words.begin(); it != words.end(); ++it) {
      if (it->word != word) continue;
      if (!(it->bits & bit)) return false;
      it->bits &= ~bit;
      if (it->bits == 0) {
        words.erase(it);
        FixPool(e);
      }
      return true;
    }
    return false;
  }
  const uint8_t tb = static_cast<uint8_t>(1u << static_cast<int>(tier));
  if (!(e.all_pool_tiers & tb)) return false;
  bool removed = false;
  if (e.pool_slot == slot) {
    e.pool_tiers &= static_cast<uint8_t>(~tb);
    if (e.pool_tiers == 0) {
      e.pool_slot = kNoSlot;
      removed = true;
    }
  } else if (e.spill != nullptr) {
    auto& pool = e.spill->pool;
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (it->slot != slot) continue;
      it->tiers &= static_cast<uint8_t>(~tb);
      if (it->tiers == 0) {
        pool.erase(it);
        removed = true;
      }
      break;
    }
  }
  FixPool(e);
  return removed;
}

int KvIndex::RemoveAllHolders(Entry& e, SourceSlot slot) {
  // Counted apart: a worker's GPU copy and its own host-tier copy of one hash are two
  // (source, tier) pairs in entries_, as Store counted them.
  int removed = RemoveHolder(e, slot, Tier::kGpu) ? 1 : 0;
  if (e.pool_slot == slot) {
    e.pool_slot = kNoSlot;
    e.pool_tiers = 0;
    FixPool(e);
    return removed + 1;
  }
  if (e.spill != nullptr) {
    auto& pool = e.spill->pool;
    for (auto it = pool.begin(); it != pool.end(); ++it) {
      if (it->slot == slot) {
        pool.erase(it);
        FixPool(e);
        return removed + 1;
      }
    }
  }
  return removed;
}

void KvIndex::ResetSource(SourceSlot slot) {
  ClearSource(slot);
  SourceState& s = Source(slot);
  s = SourceState{};
  s.present = true;
}

void KvIndex::RemoveSource(SourceSlot slot) {
  ClearSource(slot);
  if (slot < sources_.size()) sources_[slot] = SourceState{};
}

void KvIndex::ClearSource(SourceSlot slot) {
  SourceState& s = Source(slot);
  if (s.entries == 0) return;
  map_.EraseIf([&](const BlockHash&, Entry& e) {
    const int removed = TrackSpill(e, [&] { return RemoveAllHolders(e, slot); });
    if (removed == 0) return false;
    entries_ -= removed;
    return e.empty();
  });
  s.entries = 0;
}

void KvIndex::ClearSources(std::span<const SourceSlot> slots) {
  std::vector<SourceSlot> with_entries;
  for (SourceSlot slot : slots) {
    if (Source(slot).entries != 0) with_entries.push_back(slot);
  }
  if (with_entries.size() <= 1) {
    for (SourceSlot slot : with_entries) ClearSource(slot);
    return;
  }
  map_.EraseIf([&](const BlockHash&, Entry& e) {
    const int removed = TrackSpill(e, [&] {
      int n = 0;
      for (SourceSlot slot : with_entries) n += RemoveAllHolders(e, slot);
      return n;
    });
    if (removed == 0) return false;
    entries_ -= removed;
    return e.empty();
  });
  for (SourceSlot slot : with_entries) Source(slot).entries = 0;
}

void KvIndex::Store(SourceSlot slot, const BlockHash& parent, std::span<const BlockHash> hashes,
                    Tier tier, StateKind kind) {
  SourceState& s = Source(slot);
  const uint32_t tick = NextTick();
  const bool state = kind == StateKind::kLinearState;
  BlockHash prev = parent;
  size_t added = 0;
  const uint64_t gpu_bit = (tier == Tier::kGpu && slot < 64) ? uint64_t{1} << slot : 0;
  for (const BlockHash& h : hashes) {
    auto [it, inserted] = map_.try_emplace(state ? StateKey(h) : h);
    Entry& e = it->second;
    if (inserted) e.is_state = state;
    // A block first stored with an unknown parent (a pool node's chain start, a sliced
    // event) learns it from a later event: otherwise its real parent looks like a leaf
    // to pruning and could go before it, a hole in the chain.
    if (!state && e.parent.IsZero() && !(prev == h)) e.parent = prev;
    e.age = tick;
    if (gpu_bit != 0) {  // inline fast path: a GPU holder in slots [0, 64)
      added += (e.gpu0 & gpu_bit) == 0 ? 1 : 0;
      e.gpu0 |= gpu_bit;
    } else {
      added += TrackSpill(e, [&] { return AddHolder(e, slot, tier); }) ? 1 : 0;
    }
    prev = h;
  }
  entries_ += added;
  s.entries += added;
  MaybePrune();
}

void KvIndex::Remove(SourceSlot slot, std::span<const BlockHash> hashes, Tier tier, StateKind kind) {
  SourceState& s = Source(slot);
  const bool state = kind == StateKind::kLinearState;
  size_t removed = 0;
  const uint64_t gpu_bit = (tier == Tier::kGpu && slot < 64) ? uint64_t{1} << slot : 0;
  for (const BlockHash& h : hashes) {
    auto it = map_.find(state ? StateKey(h) : h);
    if (it == map_.end()) continue;
    if (gpu_bit != 0) {  // inline fast path: a GPU holder in slots [0, 64)
      Entry& e = it->second;
      if ((e.gpu0 & gpu_bit) == 0) continue;
      e.gpu0 &= ~gpu_bit;
      ++removed;
      if (e.gpu0 == 0 && e.pool_slot == kNoSlot && e.spill == nullptr) map_.erase(it);
      continue;
    }
    if (TrackSpill(it->second, [&] { return RemoveHolder(it->second, slot, tier); })) {
      ++removed;
      if (it->second.empty()) map_.erase(it);
    }
  }
  entries_ -= removed;
  s.entries -= removed;
}

void KvIndex::ApplyEvent(SourceSlot slot, const KvEvent& event) {
  switch (event.type) {
    case KvEvent::Type::kStored:
      Store(slot, event.parent, event.hashes, event.tier, event.kind);
      break;
    case KvEvent::Type::kRemoved:
      Remove(slot, event.hashes, event.tier, event.kind);
      break;
    case KvEvent::Type::kCleared:
      ClearSource(slot);
      break;
  }
}

ApplyResult KvIndex::ApplyBatch(SourceSlot slot, const EventBatch& batch) {
  if (batch.full_dump) return ApplyDumpPart(slot, batch, 0, batch.events.size());
  return ApplyInOrder(slot, batch.events);
}

ApplyResult KvIndex::ApplyInOrder(SourceSlot slot, std::span<const KvEvent> events) {
  ApplyResult r;
  for (size_t i = 0; i < events.size(); ++i) {
    const KvEvent& e = events[i];
    SourceState& s = Source(slot);
    if (s.stale) {
      r.ignored += events.size() - i;
      break;
    }
    if (e.sequence <= s.last_sequence) {
      ++r.duplicates;
      continue;
    }
    if (e.sequence != s.last_sequence + 1) {
      s.stale = true;
      r.gap = true;
      r.ignored += events.size() - i;
      break;
    }
    ApplyEvent(slot, e);
    Source(slot).last_sequence = e.sequence;
    ++r.applied;
  }
  r.full_dump_requested = stale(slot);
  r.last_sequence = last_sequence(slot);
  return r;
}

ApplyResult KvIndex::ApplyDumpPart(SourceSlot slot, const EventBatch& batch, size_t begin, size_t end) {
  if (begin == 0) {
    ClearSource(slot);
    SourceState& s = Source(slot);
    s.present = true;
    s.stale = false;
  }
  for (size_t i = begin; i < end; ++i) ApplyEvent(slot, batch.events[i]);
  SourceState& s = Source(slot);  // after the events: Source() may grow sources_
  if (end == batch.events.size()) {
    if (batch.dump_sequence != 0) {
      s.last_sequence = batch.dump_sequence;
    } else if (!batch.events.empty()) {
      s.last_sequence = batch.events.back().sequence;
    }
  }
  ApplyResult r;
  r.applied = end - begin;
  r.last_sequence = s.last_sequence;
  return r;
}

void KvIndex::FindMatches(std::span<const BlockHash> hashes, MatchResult* out) {
  out->gpu.clear();
  const uint32_t tick = NextTick();
  // Pass 1: probe the table for the chain, nothing else, so the probes overlap.
  const uint32_t n = static_cast<uint32_t>(hashes.size());
  if (walk_.size() < n) walk_.resize(n);
  Entry** walk = walk_.data();
  uint32_t i = 0;
  for (; i < n; ++i) {
    Entry* e = map_.FindValue(hashes[i]);
    if (e == nullptr) break;
    walk[i] = e;
  }
  out->walked_blocks = i;
  out->in_pool.resize(i);
  std::vector<GpuMatch>& gpu = out->gpu;
  if (i == 0) {
    out->pool_prefix = 0;
    return;
  }
  // Pass 2: intersect the GPU holders along the walk. Slots < 64 are one mask; the blocks
  // where it shrinks are logged without a branch (drops_), then expanded.
  uint8_t* in_pool = out->in_pool.data();
  if (drops_.size() < i) drops_.resize(i);
  Drop* drops = drops_.data();
  uint32_t num_drops = 0;
  const uint64_t matched0 = walk[0]->gpu0;
  uint64_t active0 = matched0;
  // Slots >= 64 (rare): words of the first block's spill, ANDed likewise.
  absl::InlinedVector<GpuWord, 2> active_hi;
  if (walk[0]->spill != nullptr) active_hi.assign(walk[0]->spill->gpu.begin(), walk[0]->spill->gpu.end());
  walk[0]->age = tick;
  in_pool[0] = walk[0]->all_pool_tiers;
  for (uint32_t b = 1; b < i; ++b) {
    Entry& e = *walk[b];
    e.age = tick;
    in_pool[b] = e.all_pool_tiers;
    const uint64_t dropped = active0 & ~e.gpu0;
    active0 &= e.gpu0;
    drops[num_drops] = Drop{b, dropped};
    num_drops += dropped != 0;
    if (!active_hi.empty()) [[unlikely]] {
      // active_hi &= the entry's words (both sorted by word); dropped sources end at b.
      const GpuWord* w = e.spill != nullptr ? e.spill->gpu.data() : nullptr;
      const size_t nw = e.spill != nullptr ? e.spill->gpu.size() : 0;
      size_t k = 0, out_n = 0;
      for (size_t a = 0; a < active_hi.size(); ++a) {
        while (k < nw && w[k].word < active_hi[a].word) ++k;
        const uint64_t keep = (k < nw && w[k].word == active_hi[a].word) ? active_hi[a].bits & w[k].bits : 0;
        for (uint64_t d = active_hi[a].bits & ~keep; d != 0; d &= d - 1) {
          gpu.push_back(GpuMatch{active_hi[a].word * 64 + static_cast<uint32_t>(std::countr_zero(d)), b});
        }
        if (keep != 0) active_hi[out_n++] = GpuWord{active_hi[a].word, keep};
      }
      active_hi.resize(out_n);
    }
  }
  // end0[s] = the block where slot s's GPU prefix ends.
  uint32_t end0[64];
  for (uint32_t d = 0; d < num_drops; ++d) {
    for (uint64_t m = drops[d].mask; m != 0; m &= m - 1) end0[std::countr_zero(m)] = drops[d].block;
  }
  for (uint64_t m = active0; m != 0; m &= m - 1) end0[std::countr_zero(m)] = i;
  for (const GpuWord& w : active_hi) {
    for (uint64_t m = w.bits; m != 0; m &= m - 1) {
      gpu.push_back(GpuMatch{w.word * 64 + static_cast<uint32_t>(std::countr_zero(m)), i});
    }
  }
  if (!gpu.empty()) {  // slots >= 64: sort them, then put slots < 64 (ascending) in front
    std::sort(gpu.begin(), gpu.end(), [](const GpuMatch& a, const GpuMatch& b) { return a.source < b.source; });
    gpu.insert(gpu.begin(), static_cast<size_t>(std::popcount(matched0)), GpuMatch{0, 0});
    size_t k = 0;
    for (uint64_t m = matched0; m != 0; m &= m - 1) {
      const int s = std::countr_zero(m);
      gpu[k++] = GpuMatch{static_cast<SourceSlot>(s), end0[s]};
    }
  } else {
    for (uint64_t m = matched0; m != 0; m &= m - 1) {
      const int s = std::countr_zero(m);
      gpu.push_back(GpuMatch{static_cast<SourceSlot>(s), end0[s]});
    }
  }
  uint32_t p = 0;
  while (p < i && in_pool[p] != 0) ++p;
  out->pool_prefix = p;
}

std::vector<PoolRun> KvIndex::PoolLocations(std::span<const BlockHash> hashes, uint32_t first,
                                            uint32_t num) const {
  std::vector<PoolRun> runs;
  const uint32_t end = std::min<uint32_t>(first + num, static_cast<uint32_t>(hashes.size()));
  absl::InlinedVector<PoolHolder, 4> pool;
  for (uint32_t i = first; i < end; ++i) {
    auto it = map_.find(hashes[i]);
    if (it == map_.end() || it->second.pool_slot == kNoSlot) break;
    const Entry& e = it->second;
    pool.clear();
    pool.push_back(PoolHolder{e.pool_slot, e.pool_tiers});
    if (e.spill != nullptr) pool.insert(pool.end(), e.spill->pool.begin(), e.spill->pool.end());
    const PoolHolder* pick = nullptr;
    auto tier_of = [](const PoolHolder& p) {
      return (p.tiers & (1u << static_cast<int>(Tier::kDram))) ? Tier::kDram : Tier::kNvme;
    };
    if (!runs.empty()) {
      for (const PoolHolder& p : pool) {
        if (p.slot == runs.back().holder && tier_of(p) == runs.back().tier) pick = &p;
      }
    }
    if (pick == nullptr) {
      for (const PoolHolder& p : pool) {
        if (tier_of(p) == Tier::kDram) {
          pick = &p;
          break;
        }
      }
    }
    if (pick == nullptr) pick = &pool.front();
    const Tier t = tier_of(*pick);
    if (!runs.empty() && runs.back().holder == pick->slot && runs.back().tier == t &&
        runs.back().first_block + runs.back().num_blocks == i) {
      ++runs.back().num_blocks;
    } else {
      runs.push_back(PoolRun{pick->slot, t, i, 1});
    }
  }
  return runs;
}

bool KvIndex::HasState(const BlockHash& h, SourceSlot slot) const {
  auto it = map_.find(StateKey(h));
  return it != map_.end() && HasGpu(it->second, slot);
}

bool KvIndex::PoolHasState(const BlockHash& h) const {
  auto it = map_.find(StateKey(h));
  return it != map_.end() && it->second.pool_slot != kNoSlot;
}

bool KvIndex::AnyHasState(const BlockHash& h) const {
  auto it = map_.find(StateKey(h));
  return it != map_.end() && !it->second.empty();
}

EventBatch KvIndex::Dump(SourceSlot slot) const {
  EventBatch b;
  b.full_dump = true;
  b.dump_sequence = last_sequence(slot);
  uint64_t seq = 0;
  for (const Map::Slot& kv : map_) {
    // Named, not a structured binding: the lambda below uses the entry, and capturing a
    // structured binding needs clang 16 (C++20 allows it; clang 14 rejects it).
    const BlockHash& key = kv.first;
    const Entry& e = kv.second;
    const BlockHash h = e.is_state ? StateKey(key) : key;
    const StateKind kind = e.is_state ? StateKind::kLinearState : StateKind::kAttnKv;
    if (HasGpu(e, slot)) b.events.push_back(KvEvent::Stored(++seq, e.parent, {h}, Tier::kGpu, kind));
    ForEachHolder(
        e, [](SourceSlot) {},
        [&](SourceSlot s, uint8_t tiers) {
          if (s != slot) return;
          for (Tier t : {Tier::kDram, Tier::kNvme}) {
            if (tiers & (1u << static_cast<int>(t))) {
              b.events.push_back(KvEvent::Stored(++seq, e.parent, {h}, t, kind));
            }
          }
        });
  }
  return b;
}

size_t KvIndex::SpillBytes(const Entry& e) {
  if (e.spill == nullptr) return 0;
  size_t bytes = sizeof(Spill) + e.spill->pool.capacity() * sizeof(PoolHolder);
  if (e.spill->gpu.capacity() > 1) bytes += e.spill->gpu.capacity() * sizeof(GpuWord);  // on the heap
  return bytes;
}

size_t KvIndex::MemoryBytes() const {
  return map_.capacity() * sizeof(Map::Slot) + sources_.capacity() * sizeof(SourceState) + spill_bytes_;
}

size_t KvIndex::MemoryBytesByWalk() const {
  size_t bytes = map_.capacity() * sizeof(Map::Slot) + sources_.capacity() * sizeof(SourceState);
  for (const auto& [key, e] : map_) bytes += SpillBytes(e);
  return bytes;
}

void KvIndex::MaybePrune() {
  if (entries_ <= options_.max_entries) return;
  const size_t target =
      static_cast<size_t>(static_cast<double>(options_.max_entries) * (1.0 - options_.prune_fraction));
  // Children per block, counted now (lookups and events never pay for it): a block is a
  // leaf when no stored block names it as parent.
  absl::flat_hash_map<BlockHash, uint32_t, Hasher> children;
  for (const auto& [key, e] : map_) {
    if (!e.parent.IsZero() && map_.contains(e.parent)) ++children[e.parent];
  }
  // A min-heap of leaves by age; erasing a leaf can make its parent a leaf, which then
  // competes by its own age. So a cold chain is eaten from its tail before any block of
  // a hot chain, and no chain gets a hole.
  using Item = std::pair<uint32_t, BlockHash>;
  auto older = [](const Item& a, const Item& b) { return a.first > b.first; };
  std::vector<Item> heap;
  for (const auto& [key, e] : map_) {
    if (!children.contains(key)) heap.emplace_back(e.age, key);
  }
  std::make_heap(heap.begin(), heap.end(), older);
  bool age_alone = false;
  while (entries_ > target) {
    if (heap.empty()) {
      // Only blocks on parent cycles are left above the target: none of them is ever a
      // leaf (a hash collision, or sources that linked blocks both ways in separate
      // events). Age alone then, or the index would stay above max_entries and every
      // later Store would scan it again.
      if (age_alone) break;
      age_alone = true;
      for (const auto& [key, e] : map_) heap.emplace_back(e.age, key);
      std::make_heap(heap.begin(), heap.end(), older);
      continue;
    }
    std::pop_heap(heap.begin(), heap.end(), older);
    const BlockHash key = heap.back().second;
    heap.pop_back();
    auto it = map_.find(key);
    if (it == map_.end()) continue;
    Entry& e = it->second;
    size_t n = 0;
    ForEachHolder(
        e,
        [&](SourceSlot s) {
          --sources_[s].entries;
          ++n;
        },
        [&](SourceSlot s, uint8_t) {
          --sources_[s].entries;
          ++n;
        });
    entries_ -= n;
    pruned_ += n;
    const BlockHash parent = e.parent;
    spill_bytes_ -= SpillBytes(e);
    map_.erase(it);
    if (!parent.IsZero() && !age_alone) {
      auto c = children.find(parent);
      if (c != children.end() && --c->second == 0) {
        auto p = map_.find(parent);
        if (p != map_.end()) {
          heap.emplace_back(p->second.age, parent);
          std::push_heap(heap.begin(), heap.end(), older);
        }
      }
    }
  }
}

}  // namespace kvpool::router
