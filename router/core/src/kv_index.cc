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

bool KvIndex::AddHolder(Entry& e, SourceSlot slot, Tier tier) {
  if (tier == Tier::kGpu) {
    const uint32_t word = slot / 64;
    const uint64_t bit = uint64_t{1} << (slot % 64);
    auto it = std::lower_bound(e.gpu.begin(), e.gpu.end(), word,
                               [](const GpuWord& w, uint32_t x) { return w.word < x; });
    if (it != e.gpu.end() && it->word == word) {
      if (it->bits & bit) return false;
      it->bits |= bit;
    } else {
      e.gpu.insert(it, GpuWord{word, bit});
    }
    return true;
  }
  const uint8_t tb = static_cast<uint8_t>(1u << static_cast<int>(tier));
  for (PoolHolder& p : e.pool) {
    if (p.slot == slot) {
      p.tiers |= tb;
      return false;  // the same (hash, holder) pair, another tier
    }
  }
  e.pool.push_back(PoolHolder{slot, tb});
  return true;
}

bool KvIndex::RemoveHolder(Entry& e, SourceSlot slot, Tier tier) {
  if (tier == Tier::kGpu) {
    const uint32_t word = slot / 64;
    const uint64_t bit = uint64_t{1} << (slot % 64);
    for (auto it = e.gpu.begin(); it != e.gpu.end(); ++it) {
      if (it->word != word) continue;
      if (!(it->bits & bit)) return false;
      it->bits &= ~bit;
      if (it->bits == 0) e.gpu.erase(it);
      return true;
    }
    return false;
  }
  const uint8_t tb = static_cast<uint8_t>(1u << static_cast<int>(tier));
  for (auto it = e.pool.begin(); it != e.pool.end(); ++it) {
    if (it->slot != slot) continue;
    it->tiers &= static_cast<uint8_t>(~tb);
    if (it->tiers != 0) return false;
    e.pool.erase(it);
    return true;
  }
  return false;
}

bool KvIndex::RemoveAllHolders(Entry& e, SourceSlot slot) {
  bool removed = RemoveHolder(e, slot, Tier::kGpu);
  for (auto it = e.pool.begin(); it != e.pool.end(); ++it) {
    if (it->slot == slot) {
      e.pool.erase(it);
      return true;
    }
  }
  return removed;
}

void KvIndex::EraseEntry(Map::iterator it) {
  const BlockHash parent = it->second.parent;
  map_.erase(it);
  if (!parent.IsZero()) {
    auto p = map_.find(parent);
    if (p != map_.end() && p->second.num_children > 0) --p->second.num_children;
  }
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
  for (auto it = map_.begin(); it != map_.end();) {
    auto cur = it++;
    if (RemoveAllHolders(cur->second, slot)) {
      --entries_;
      if (cur->second.empty()) {
        // Parent bookkeeping without invalidating `it`: erase never moves other slots.
        const BlockHash parent = cur->second.parent;
        map_.erase(cur);
        if (!parent.IsZero()) {
          auto p = map_.find(parent);
          if (p != map_.end() && p->second.num_children > 0) --p->second.num_children;
        }
      }
    }
  }
  s.entries = 0;
}

void KvIndex::Store(SourceSlot slot, const BlockHash& parent, std::span<const BlockHash> hashes,
                    Tier tier, StateKind kind) {
  SourceState& s = Source(slot);
  ++tick_;
  const bool state = kind == StateKind::kLinearState;
  BlockHash prev = parent;
  Entry* prev_entry = nullptr;  // valid while the table does not rehash
  size_t prev_capacity = 0;
  for (const BlockHash& h : hashes) {
    auto [it, inserted] = map_.try_emplace(state ? StateKey(h) : h);
    Entry& e = it->second;
    if (inserted) {
      e.is_state = state;
      if (!state && !prev.IsZero()) {
        e.parent = prev;
        Entry* p = (prev_entry != nullptr && map_.capacity() == prev_capacity) ? prev_entry : nullptr;
        if (p == nullptr) {
          auto pit = map_.find(prev);
          if (pit != map_.end()) p = &pit->second;
        }
        if (p != nullptr) ++p->num_children;
      }
    }
    e.last_used = tick_;
    if (AddHolder(e, slot, tier)) {
      ++entries_;
      ++s.entries;
    }
    prev = h;
    prev_entry = &e;
    prev_capacity = map_.capacity();
  }
  MaybePrune();
}

void KvIndex::Remove(SourceSlot slot, std::span<const BlockHash> hashes, Tier tier, StateKind kind) {
  SourceState& s = Source(slot);
  const bool state = kind == StateKind::kLinearState;
  for (const BlockHash& h : hashes) {
    auto it = map_.find(state ? StateKey(h) : h);
    if (it == map_.end()) continue;
    if (RemoveHolder(it->second, slot, tier)) {
      --entries_;
      --s.entries;
      if (it->second.empty()) EraseEntry(it);
    }
  }
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
  ApplyResult r;
  if (batch.full_dump) {
    ClearSource(slot);
    for (const KvEvent& e : batch.events) ApplyEvent(slot, e);
    SourceState& s = Source(slot);
    s.present = true;
    s.stale = false;
    if (batch.dump_sequence != 0) {
      s.last_sequence = batch.dump_sequence;
    } else if (!batch.events.empty()) {
      s.last_sequence = batch.events.back().sequence;
    }
    r.applied = batch.events.size();
    r.last_sequence = s.last_sequence;
    return r;
  }
  for (size_t i = 0; i < batch.events.size(); ++i) {
    const KvEvent& e = batch.events[i];
    SourceState& s = Source(slot);
    if (s.stale) {
      r.ignored += batch.events.size() - i;
      break;
    }
    if (e.sequence <= s.last_sequence) {
      ++r.duplicates;
      continue;
    }
    if (e.sequence != s.last_sequence + 1) {
      s.stale = true;
      r.gap = true;
      r.ignored += batch.events.size() - i;
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

void KvIndex::FindMatches(std::span<const BlockHash> hashes, MatchResult* out) {
  out->Clear();
  ++tick_;
  absl::InlinedVector<GpuWord, 4> active;
  uint32_t i = 0;
  const uint32_t n = static_cast<uint32_t>(hashes.size());
  for (; i < n; ++i) {
    auto it = map_.find(hashes[i]);
    if (it == map_.end()) break;
    Entry& e = it->second;
    e.last_used = tick_;
    uint8_t tiers = 0;
    for (const PoolHolder& p : e.pool) tiers |= p.tiers;
    out->in_pool.push_back(tiers);
    if (i == 0) {
      active.assign(e.gpu.begin(), e.gpu.end());
      continue;
    }
    if (active.empty()) continue;
    // active &= e.gpu (both sorted by word); sources dropping out end their prefix at i.
    size_t k = 0, out_n = 0;
    for (size_t a = 0; a < active.size(); ++a) {
      while (k < e.gpu.size() && e.gpu[k].word < active[a].word) ++k;
      const uint64_t keep =
          (k < e.gpu.size() && e.gpu[k].word == active[a].word) ? active[a].bits & e.gpu[k].bits : 0;
      uint64_t dropped = active[a].bits & ~keep;
      while (dropped != 0) {
        const int b = std::countr_zero(dropped);
        dropped &= dropped - 1;
        out->gpu.push_back(GpuMatch{active[a].word * 64 + static_cast<uint32_t>(b), i});
      }
      if (keep != 0) active[out_n++] = GpuWord{active[a].word, keep};
    }
    active.resize(out_n);
  }
  out->walked_blocks = i;
  for (const GpuWord& w : active) {
    uint64_t bits = w.bits;
    while (bits != 0) {
      const int b = std::countr_zero(bits);
      bits &= bits - 1;
      out->gpu.push_back(GpuMatch{w.word * 64 + static_cast<uint32_t>(b), i});
    }
  }
  std::sort(out->gpu.begin(), out->gpu.end(),
            [](const GpuMatch& a, const GpuMatch& b) { return a.source < b.source; });
  out->pool_prefix = out->PoolRunFrom(0);
}

std::vector<PoolRun> KvIndex::PoolLocations(std::span<const BlockHash> hashes, uint32_t first,
                                            uint32_t num) const {
  std::vector<PoolRun> runs;
  const uint32_t end = std::min<uint32_t>(first + num, static_cast<uint32_t>(hashes.size()));
  for (uint32_t i = first; i < end; ++i) {
    auto it = map_.find(hashes[i]);
    if (it == map_.end() || it->second.pool.empty()) break;
    const auto& pool = it->second.pool;
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
  if (it == map_.end()) return false;
  for (const GpuWord& w : it->second.gpu) {
    if (w.word == slot / 64) return (w.bits >> (slot % 64)) & 1;
  }
  return false;
}

bool KvIndex::PoolHasState(const BlockHash& h) const {
  auto it = map_.find(StateKey(h));
  return it != map_.end() && !it->second.pool.empty();
}

EventBatch KvIndex::Dump(SourceSlot slot) const {
  EventBatch b;
  b.full_dump = true;
  b.dump_sequence = last_sequence(slot);
  uint64_t seq = 0;
  const uint32_t word = slot / 64;
  const uint64_t bit = uint64_t{1} << (slot % 64);
  for (const auto& [key, e] : map_) {
    const BlockHash h = e.is_state ? StateKey(key) : key;
    const StateKind kind = e.is_state ? StateKind::kLinearState : StateKind::kAttnKv;
    for (const GpuWord& w : e.gpu) {
      if (w.word == word && (w.bits & bit)) {
        b.events.push_back(KvEvent::Stored(++seq, e.parent, {h}, Tier::kGpu, kind));
      }
    }
    for (const PoolHolder& p : e.pool) {
      if (p.slot != slot) continue;
      for (Tier t : {Tier::kDram, Tier::kNvme}) {
        if (p.tiers & (1u << static_cast<int>(t))) {
          b.events.push_back(KvEvent::Stored(++seq, e.parent, {h}, t, kind));
        }
      }
    }
  }
  return b;
}

size_t KvIndex::MemoryBytes() const {
  size_t bytes = map_.capacity() * (sizeof(Map::value_type) + 1) + sources_.capacity() * sizeof(SourceState);
  for (const auto& [key, e] : map_) {
    if (e.gpu.size() > 1) bytes += e.gpu.capacity() * sizeof(GpuWord);
    if (e.pool.size() > 1) bytes += e.pool.capacity() * sizeof(PoolHolder);
  }
  return bytes;
}

void KvIndex::MaybePrune() {
  if (entries_ <= options_.max_entries) return;
  const size_t target =
      static_cast<size_t>(static_cast<double>(options_.max_entries) * (1.0 - options_.prune_fraction));
  // A min-heap of leaves by age; erasing a leaf can make its parent a leaf, which then
  // competes by its own age. So a cold chain is eaten from its tail before any block of
  // a hot chain, and no chain gets a hole.
  using Item = std::pair<uint64_t, BlockHash>;
  auto older = [](const Item& a, const Item& b) { return a.first > b.first; };
  std::vector<Item> heap;
  for (const auto& [key, e] : map_) {
    if (e.num_children == 0) heap.emplace_back(e.last_used, key);
  }
  if (heap.empty()) {  // only with inconsistent child counts: age alone
    for (const auto& [key, e] : map_) heap.emplace_back(e.last_used, key);
  }
  std::make_heap(heap.begin(), heap.end(), older);
  while (entries_ > target && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), older);
    const BlockHash key = heap.back().second;
    heap.pop_back();
    auto it = map_.find(key);
    if (it == map_.end()) continue;
    Entry& e = it->second;
    size_t n = e.pool.size();
    for (const GpuWord& w : e.gpu) {
      uint64_t bits = w.bits;
      while (bits != 0) {
        const int b = std::countr_zero(bits);
        bits &= bits - 1;
        --sources_[w.word * 64 + static_cast<uint32_t>(b)].entries;
      }
      n += static_cast<size_t>(std::popcount(w.bits));
    }
    for (const PoolHolder& p : e.pool) --sources_[p.slot].entries;
    entries_ -= n;
    pruned_ += n;
    const BlockHash parent = e.parent;
    EraseEntry(it);
    if (!parent.IsZero()) {
      auto p = map_.find(parent);
      if (p != map_.end() && p->second.num_children == 0) {
        heap.emplace_back(p->second.last_used, parent);
        std::push_heap(heap.begin(), heap.end(), older);
      }
    }
  }
}

}  // namespace kvpool::router
