// KvIndex against a reference model: random stored/removed/cleared events from several
// sources (slots spanning more than one 64-bit mask word), with gaps, duplicates and
// full dumps (whole, or in parts as RouterHost applies a large one); every lookup, count,
// sequence and dump must agree.
#include "kvpool/common/hash.h"
#include "kvpool/router/kv_index.h"

#include <algorithm>
#include <map>
#include <random>
#include <set>

#include <gtest/gtest.h>

namespace kvpool::router {
namespace {

BlockHash H(uint64_t x) { return BlockHash{Mix64(x), Mix64(x ^ 0xabcdefull)}; }

// What a router should know: per source, (hash -> tier bits), the sequence and staleness.
struct RefSource {
  std::map<BlockHash, uint8_t> held;
  uint64_t last = 0;
  bool stale = false;
};

struct Reference {
  std::map<SourceSlot, RefSource> sources;

  static void Apply(RefSource& s, const KvEvent& e) {
    const uint8_t bit = static_cast<uint8_t>(1u << static_cast<int>(e.tier));
    switch (e.type) {
      case KvEvent::Type::kStored:
        for (const BlockHash& h : e.hashes) s.held[h] |= bit;
        break;
      case KvEvent::Type::kRemoved:
        for (const BlockHash& h : e.hashes) {
          auto it = s.held.find(h);
          if (it == s.held.end()) continue;
          it->second &= static_cast<uint8_t>(~bit);
          if (it->second == 0) s.held.erase(it);
        }
        break;
      case KvEvent::Type::kCleared:
        s.held.clear();
        break;
    }
  }

  void ApplyBatch(SourceSlot slot, const EventBatch& b) {
    RefSource& s = sources[slot];
    if (b.full_dump) {
      s.held.clear();
      for (const KvEvent& e : b.events) Apply(s, e);
      s.stale = false;
      s.last = b.dump_sequence != 0 ? b.dump_sequence : (b.events.empty() ? s.last : b.events.back().sequence);
      return;
    }
    for (const KvEvent& e : b.events) {
      if (s.stale) return;
      if (e.sequence <= s.last) continue;
      if (e.sequence != s.last + 1) {
        s.stale = true;
        return;
      }
      Apply(s, e);
      s.last = e.sequence;
    }
  }

  size_t Entries() const {
    size_t n = 0;
    for (const auto& [slot, s] : sources) n += s.held.size();
    return n;
  }

  MatchResult Find(const std::vector<BlockHash>& hashes) const {
    MatchResult r;
    uint32_t walked = 0;
    for (; walked < hashes.size(); ++walked) {
      bool any = false;
      uint8_t pool = 0;
      for (const auto& [slot, s] : sources) {
        auto it = s.held.find(hashes[walked]);
        if (it == s.held.end()) continue;
        any = true;
        pool |= it->second & static_cast<uint8_t>(~1u);
      }
      if (!any) break;
      r.in_pool.push_back(pool);
    }
    r.walked_blocks = walked;
    for (const auto& [slot, s] : sources) {
      uint32_t g = 0;
      while (g < walked) {
        auto it = s.held.find(hashes[g]);
        if (it == s.held.end() || !(it->second & 1)) break;
        ++g;
      }
      if (g > 0) r.gpu.push_back(GpuMatch{slot, g});
    }
    r.pool_prefix = r.PoolRunFrom(0);
    return r;
  }
};

void ExpectSame(const MatchResult& got, const MatchResult& want, const std::string& where) {
  EXPECT_EQ(got.walked_blocks, want.walked_blocks) << where;
  EXPECT_EQ(got.gpu, want.gpu) << where;
  EXPECT_EQ(got.in_pool, want.in_pool) << where;
  EXPECT_EQ(got.pool_prefix, want.pool_prefix) << where;
}

class KvIndexDifferentialTest : public ::testing::TestWithParam<uint64_t> {};

TEST_P(KvIndexDifferentialTest, RandomEventsMatchReference) {
  std::mt19937_64 rng(GetParam());
  // 12 chains of 16 blocks in 4 groups sharing 6-block prefixes.
  std::vector<std::vector<BlockHash>> chains(12);
  for (size_t c = 0; c < chains.size(); ++c) {
    for (uint64_t i = 0; i < 16; ++i) chains[c].push_back(i < 6 ? H((c % 4) * 1000 + i) : H(c * 100000 + i));
  }
  const std::vector<SourceSlot> workers = {0, 1, 63, 64, 130};
  const std::vector<SourceSlot> pools = {2, 200};
  std::vector<SourceSlot> all = workers;
  all.insert(all.end(), pools.begin(), pools.end());

  KvIndex index;
  Reference ref;
  std::map<SourceSlot, RefSource> truth;  // what each source really holds
  std::map<SourceSlot, uint64_t> next_seq;
  for (SourceSlot s : all) {
    index.ResetSource(s);
    ref.sources[s] = RefSource{};
    truth[s] = RefSource{};
    next_seq[s] = 1;
  }
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };

  int gaps = 0, dumps = 0;
  for (int step = 0; step < 3000; ++step) {
    const SourceSlot slot = all[pick(all.size())];
    const bool is_pool = slot == 2 || slot == 200;
    EventBatch batch;
    if (ref.sources[slot].stale && chance(0.5)) {
      // The source answers the router's request with the truth.
      batch.full_dump = true;
      batch.dump_sequence = next_seq[slot] - 1;
      uint64_t s = 0;
      for (const auto& [h, tiers] : truth[slot].held) {
        for (int t = 0; t < kNumTiers; ++t) {
          if (tiers & (1u << t)) batch.events.push_back(KvEvent::Stored(++s, BlockHash{}, {h}, static_cast<Tier>(t)));
        }
      }
      ++dumps;
    } else if (chance(0.02)) {
      // Removal and re-registration; sometimes of several sources at once, as a Tick
      // drops those that timed out together (one pass: ClearSources).
      std::vector<SourceSlot> gone = {slot};
      if (chance(0.5)) {
        for (SourceSlot other : all) {
          if (other != slot && chance(0.4)) gone.push_back(other);
        }
        index.ClearSources(gone);
      }
      for (SourceSlot g : gone) {
        index.RemoveSource(g);
        index.ResetSource(g);
        ref.sources[g] = RefSource{};
        truth[g] = RefSource{};
        next_seq[g] = 1;
      }
      ASSERT_EQ(index.entries(), ref.Entries()) << "step " << step;
      ASSERT_EQ(index.MemoryBytes(), index.MemoryBytesByWalk()) << "step " << step;
      continue;
    } else {
      const int n = 1 + static_cast<int>(pick(4));
      for (int k = 0; k < n; ++k) {
        KvEvent e;
        const double r = std::uniform_real_distribution<double>(0, 1)(rng);
        const Tier tier = is_pool ? (chance(0.5) ? Tier::kDram : Tier::kNvme) : Tier::kGpu;
        const auto& chain = chains[pick(chains.size())];
        if (r < 0.6) {
          const size_t start = pick(chain.size());
          const size_t len = 1 + pick(chain.size() - start);
          e = KvEvent::Stored(0, start == 0 ? BlockHash{} : chain[start - 1],
                              {chain.begin() + static_cast<ptrdiff_t>(start),
                               chain.begin() + static_cast<ptrdiff_t>(start + len)},
                              tier);
        } else if (r < 0.97) {
          std::vector<BlockHash> hs;
          for (int j = 0; j < 3; ++j) hs.push_back(chain[pick(chain.size())]);
          e = KvEvent::Removed(0, hs, tier);
        } else {
          e = KvEvent::Cleared(0);
        }
        e.sequence = next_seq[slot]++;
        Reference::Apply(truth[slot], e);
        truth[slot].last = e.sequence;
        if (chance(0.03)) {  // lost on the way: a gap for the router
          ++gaps;
          continue;
        }
        batch.events.push_back(e);
        if (chance(0.03)) batch.events.push_back(e);  // duplicate delivery
      }
    }
    ApplyResult r;
    if (batch.full_dump && chance(0.5)) {
      // In random parts, as RouterHost applies a large dump: the same end state.
      size_t begin = 0;
      do {
        const size_t end = std::min(batch.events.size(), begin + pick(4));
        r = index.ApplyDumpPart(slot, batch, begin, end);
        begin = end;
      } while (begin < batch.events.size());
    } else {
      r = index.ApplyBatch(slot, batch);
    }
    ref.ApplyBatch(slot, batch);
    ASSERT_EQ(index.stale(slot), ref.sources[slot].stale) << "step " << step;
    ASSERT_EQ(r.full_dump_requested, ref.sources[slot].stale) << "step " << step;
    ASSERT_EQ(index.last_sequence(slot), ref.sources[slot].last) << "step " << step;
    ASSERT_EQ(index.entries(), ref.Entries()) << "step " << step;
    ASSERT_EQ(index.source_entries(slot), ref.sources[slot].held.size()) << "step " << step;
    // The kept count of holder-list bytes (slots 64, 130 and 200, second pool holders).
    ASSERT_EQ(index.MemoryBytes(), index.MemoryBytesByWalk()) << "step " << step;
    for (int q = 0; q < 4; ++q) {
      const auto& chain = chains[pick(chains.size())];
      std::vector<BlockHash> query(chain.begin(), chain.begin() + static_cast<ptrdiff_t>(1 + pick(chain.size())));
      ExpectSame(index.FindMatches(query), ref.Find(query), "step " + std::to_string(step));
    }
    if (step % 100 == 0) {
      // Dump reproduces the reference's view of every source.
      for (SourceSlot s : all) {
        std::map<BlockHash, uint8_t> dumped;
        for (const KvEvent& e : index.Dump(s).events) dumped[e.hashes.at(0)] |= static_cast<uint8_t>(1u << static_cast<int>(e.tier));
        ASSERT_EQ(dumped, ref.sources[s].held) << "dump of slot " << s << " at step " << step;
      }
    }
  }
  EXPECT_GT(gaps, 10);
  EXPECT_GT(dumps, 5);
}

INSTANTIATE_TEST_SUITE_P(Seeds, KvIndexDifferentialTest, ::testing::Values(1, 2, 3, 42));

TEST(KvIndexTest, LookupStopsAtFirstMissingBlockAndCombinesPool) {
  KvIndex index;
  for (SourceSlot s : {0u, 1u, 5u}) index.ResetSource(s);
  std::vector<BlockHash> c = {H(1), H(2), H(3), H(4), H(5)};
  index.Store(0, {}, std::span(c).first(3), Tier::kGpu);              // w0: 3 on GPU
  index.Store(1, {}, std::span(c).first(1), Tier::kGpu);              // w1: 1 on GPU
  index.Store(5, {}, std::span(c).first(4), Tier::kDram);             // pool: 4 in DRAM
  index.Store(0, c[3], std::span(c).subspan(4, 1), Tier::kGpu);       // h4 on w0, h3 not
  MatchResult m = index.FindMatches(c);
  EXPECT_EQ(m.walked_blocks, 5u);
  EXPECT_EQ(m.GpuBlocks(0), 3u);
  EXPECT_EQ(m.GpuBlocks(1), 1u);
  EXPECT_EQ(m.pool_prefix, 4u);
  EXPECT_EQ(m.PoolRunFrom(3), 1u);  // w0 reuses 3 from GPU + 1 from the pool
  auto runs = index.PoolLocations(c, 3, 1);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].holder, 5u);
  EXPECT_EQ(runs[0].tier, Tier::kDram);
  EXPECT_EQ(runs[0].first_block, 3u);
}

TEST(KvIndexTest, GapMarksStaleUntilFullDump) {
  KvIndex index;
  index.ResetSource(0);
  EventBatch b;
  b.events.push_back(KvEvent::Stored(1, {}, {H(1)}));
  b.events.push_back(KvEvent::Stored(3, H(1), {H(2)}));  // 2 is missing
  ApplyResult r = index.ApplyBatch(0, b);
  EXPECT_TRUE(r.gap);
  EXPECT_TRUE(r.full_dump_requested);
  EXPECT_EQ(r.applied, 1u);
  EXPECT_EQ(r.ignored, 1u);
  EXPECT_TRUE(index.stale(0));
  // Later events are ignored until the dump.
  EventBatch later;
  later.events.push_back(KvEvent::Stored(4, H(2), {H(3)}));
  r = index.ApplyBatch(0, later);
  EXPECT_EQ(r.applied, 0u);
  EXPECT_EQ(r.ignored, 1u);
  EXPECT_EQ(index.FindMatches(std::vector<BlockHash>{H(1)}).GpuBlocks(0), 1u);  // kept meanwhile
  EventBatch dump;
  dump.full_dump = true;
  dump.dump_sequence = 4;
  dump.events.push_back(KvEvent::Stored(1, {}, {H(1), H(2), H(3)}));
  r = index.ApplyBatch(0, dump);
  EXPECT_FALSE(index.stale(0));
  EXPECT_EQ(index.last_sequence(0), 4u);
  EXPECT_EQ(index.FindMatches(std::vector<BlockHash>{H(1), H(2), H(3)}).GpuBlocks(0), 3u);
  EventBatch next;
  next.events.push_back(KvEvent::Removed(5, {H(3)}));
  r = index.ApplyBatch(0, next);
  EXPECT_EQ(r.applied, 1u);
  EXPECT_EQ(index.FindMatches(std::vector<BlockHash>{H(1), H(2), H(3)}).GpuBlocks(0), 2u);
}

TEST(KvIndexTest, PruningKeepsBoundAndRemovesLeavesFirst) {
  KvIndex index(KvIndex::Options{.max_entries = 1000, .prune_fraction = 0.1});
  index.ResetSource(0);
  // 50 chains of 40 blocks: 2000 entries offered, at most 1000 kept.
  std::vector<std::vector<BlockHash>> chains;
  for (uint64_t c = 0; c < 50; ++c) {
    std::vector<BlockHash> chain;
    for (uint64_t i = 0; i < 40; ++i) chain.push_back(H(c * 1000 + i));
    index.Store(0, {}, chain, Tier::kGpu);
    ASSERT_LE(index.entries(), 1000u);
    chains.push_back(std::move(chain));
  }
  EXPECT_GT(index.pruned_entries(), 0u);
  EXPECT_EQ(index.entries(), index.source_entries(0));
  // Leaf-first: every surviving chain is a prefix (no holes), so lookups still work.
  size_t kept = 0;
  for (const auto& chain : chains) {
    const MatchResult m = index.FindMatches(chain);
    kept += m.GpuBlocks(0);
    for (uint32_t i = m.walked_blocks; i < chain.size(); ++i) {
      ASSERT_EQ(index.FindMatches(std::vector<BlockHash>{chain[i]}).walked_blocks, 0u)
          << "block " << i << " survived although its parent was pruned";
    }
  }
  EXPECT_EQ(kept, index.entries());
  // By age: the most recent chain is intact.
  EXPECT_EQ(index.FindMatches(chains.back()).GpuBlocks(0), 40u);
  EXPECT_GT(index.MemoryBytes(), 0u);
}

// Blocks linked both ways by two events (a hash collision, or a confused source) are
// never leaves; once only they are left above the bound, pruning goes by age alone
// instead of leaving the index above max_entries (and every later Store rescanning it).
TEST(KvIndexTest, PruningKeepsTheBoundWhenEventsLinkBlocksInACycle) {
  KvIndex index(KvIndex::Options{.max_entries = 8, .prune_fraction = 0.5});
  index.ResetSource(0);
  index.Store(0, {}, std::vector<BlockHash>{H(999)}, Tier::kGpu);  // the one real leaf
  for (uint64_t i = 0; i < 50; ++i) {
    const BlockHash p = H(3 * i), a = H(3 * i + 1), b = H(3 * i + 2);
    index.Store(0, b, std::vector<BlockHash>{p}, Tier::kGpu);     // p's parent b, not stored yet
    index.Store(0, p, std::vector<BlockHash>{a, b}, Tier::kGpu);  // p -> a -> b -> p: no leaf
    ASSERT_LE(index.entries(), 8u) << "after cycle " << i;
  }
  EXPECT_EQ(index.entries(), index.source_entries(0));
}

// A block first stored without its parent (a pool node announcing a chain piece) learns
// the parent from a later event, so pruning takes the chain from its tail: the parent
// is no longer a leaf to be pruned before it (a hole that lost the prefix).
TEST(KvIndexTest, ABlockStoredFirstWithoutItsParentLearnsItLater) {
  KvIndex index(KvIndex::Options{.max_entries = 4, .prune_fraction = 0.5});
  index.ResetSource(0);
  index.ResetSource(1);
  index.Store(0, {}, std::vector<BlockHash>{H(0), H(1)}, Tier::kGpu);
  index.Store(1, {}, std::vector<BlockHash>{H(2)}, Tier::kDram);     // parent unknown
  index.Store(0, H(1), std::vector<BlockHash>{H(2), H(3)}, Tier::kGpu);  // 5 pairs: pruned to 2
  EXPECT_EQ(index.entries(), 2u);
  EXPECT_EQ(index.FindMatches(std::vector<BlockHash>{H(0), H(1), H(2), H(3)}).GpuBlocks(0), 2u);
}

TEST(KvIndexTest, LinearStateIsKeptApartFromKv) {
  KvIndex index;
  index.ResetSource(3);
  index.Store(3, {}, std::vector<BlockHash>{H(7)}, Tier::kGpu, StateKind::kLinearState);
  EXPECT_TRUE(index.HasState(H(7), 3));
  EXPECT_FALSE(index.HasState(H(7), 4));
  EXPECT_EQ(index.FindMatches(std::vector<BlockHash>{H(7)}).walked_blocks, 0u);
  const EventBatch d = index.Dump(3);
  ASSERT_EQ(d.events.size(), 1u);
  EXPECT_EQ(d.events[0].hashes[0], H(7));
  EXPECT_EQ(d.events[0].kind, StateKind::kLinearState);
}

// A worker that holds a block on GPU and in its own host tier has two (hash, holder)
// pairs; clearing the source removed one, so entries() drifted up with every full dump
// or re-register until the index pruned live entries.
TEST(KvIndexTest, ClearingASourceCountsEveryPairItHeld) {
  KvIndex index(KvIndex::Options{.max_entries = 20});
  std::vector<BlockHash> c = {H(1), H(2), H(3)};
  for (int round = 0; round < 10; ++round) {
    EventBatch b;
    b.full_dump = true;
    b.events.push_back(KvEvent::Stored(1, {}, c, Tier::kGpu));
    b.events.push_back(KvEvent::Stored(2, {}, c, Tier::kDram));
    index.ApplyBatch(0, b);
    ASSERT_EQ(index.entries(), 6u) << round;
    ASSERT_EQ(index.source_entries(0), 6u) << round;
  }
  EXPECT_EQ(index.pruned_entries(), 0u) << "live entries pruned though only 6 pairs exist";
  index.ResetSource(0);
  EXPECT_EQ(index.blocks(), 0u);
  EXPECT_EQ(index.entries(), 0u);
}

// What Dump says `slot` holds: (hash, kind) -> tier bits.
std::map<std::pair<BlockHash, StateKind>, uint8_t> Held(const KvIndex& index, SourceSlot slot) {
  std::map<std::pair<BlockHash, StateKind>, uint8_t> held;
  for (const KvEvent& e : index.Dump(slot).events) {
    held[{e.hashes.at(0), e.kind}] |= static_cast<uint8_t>(1u << static_cast<int>(e.tier));
  }
  return held;
}

// (hash, holder) pairs in `held`: a GPU copy and a DRAM/NVMe copy of one hash are two.
size_t Pairs(const std::map<std::pair<BlockHash, StateKind>, uint8_t>& held) {
  size_t n = 0;
  for (const auto& [key, tiers] : held) n += ((tiers & 1) ? 1 : 0) + ((tiers & ~1) ? 1 : 0);
  return n;
}

// Dropping a source's entries walks the source's key list instead of the index, so the
// list must reach every entry the source holds however it came there (stored again after
// a removal, on GPU and in its own host tier, as a spilled GPU holder, a KDA state key,
// next to pruning), and the walk must leave every other source's entries alone.
TEST(KvIndexTest, DroppingASourceRemovesExactlyItsEntriesAfterChurnAndPruning) {
  std::mt19937_64 rng(7);
  auto pick = [&](size_t n) { return std::uniform_int_distribution<size_t>(0, n - 1)(rng); };
  auto chance = [&](double p) { return std::uniform_real_distribution<double>(0, 1)(rng) < p; };
  std::vector<std::vector<BlockHash>> chains(40);
  for (size_t c = 0; c < chains.size(); ++c) {
    for (uint64_t i = 0; i < 10; ++i) chains[c].push_back(H(77000 + c * 100 + i));
  }
  KvIndex index(KvIndex::Options{.max_entries = 150, .prune_fraction = 0.25});
  const std::vector<SourceSlot> slots = {0, 1, 2, 70};  // 70: a GPU holder in the spill
  for (SourceSlot s : slots) index.ResetSource(s);
  // Rounds of churn long enough for the key lists to be compacted several times, then
  // each source dropped in a random way.
  for (int round = 0; round < 30; ++round) {
    for (int step = 0; step < 2000; ++step) {
      const SourceSlot slot = slots[pick(slots.size())];
      const Tier tier = static_cast<Tier>(pick(kNumTiers));
      const auto& chain = chains[pick(chains.size())];
      const size_t start = pick(chain.size());
      const size_t len = 1 + pick(std::min<size_t>(4, chain.size() - start));
      const std::span<const BlockHash> hs(chain.data() + start, len);
      const StateKind kind = chance(0.05) ? StateKind::kLinearState : StateKind::kAttnKv;
      if (chance(0.6)) {
        index.Store(slot, start == 0 ? BlockHash{} : chain[start - 1], hs, tier, kind);
      } else {
        index.Remove(slot, hs, tier, kind);
      }
    }
    std::vector<SourceSlot> order = slots;
    std::shuffle(order.begin(), order.end(), rng);
    for (SourceSlot slot : order) {
      SCOPED_TRACE("round " + std::to_string(round) + ", slot " + std::to_string(slot));
      std::map<SourceSlot, std::map<std::pair<BlockHash, StateKind>, uint8_t>> before;
      for (SourceSlot s : slots) before[s] = Held(index, s);
      ASSERT_EQ(index.source_entries(slot), Pairs(before[slot]));
      const size_t entries = index.entries();
      switch (pick(4)) {
        case 0: {
          EventBatch cleared;
          cleared.events.push_back(KvEvent::Cleared(index.last_sequence(slot) + 1));
          ASSERT_EQ(index.ApplyBatch(slot, cleared).applied, 1u);
          break;
        }
        case 1: {
          EventBatch empty_dump;  // its one part drops the source's entries
          empty_dump.full_dump = true;
          index.ApplyBatch(slot, empty_dump);
          break;
        }
        case 2:
          index.ResetSource(slot);
          break;
        default:
          index.RemoveSource(slot);
          index.ResetSource(slot);
          break;
      }
      EXPECT_TRUE(Held(index, slot).empty()) << "entries of the source outlived the drop";
      EXPECT_EQ(index.source_entries(slot), 0u);
      EXPECT_EQ(index.entries(), entries - Pairs(before[slot]));
      EXPECT_EQ(index.MemoryBytes(), index.MemoryBytesByWalk());  // with pruning in the churn
      for (SourceSlot s : slots) {
        if (s == slot) continue;
        ASSERT_EQ(Held(index, s), before[s]) << "dropping the source changed slot " << s;
      }
    }
  }
  EXPECT_GT(index.pruned_entries(), 0u);
}

}  // namespace
}  // namespace kvpool::router
