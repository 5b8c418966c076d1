// Differential (property) test: thousands of random operations against KvCacheManager
// and a deliberately simple reference model (std::list free queue, std::map cache,
// linear scans), checking after every operation:
//   - every block's ref_cnt, and that it equals the number of tables holding the block
//   - block tables, prefix hits and RESOURCE_EXHAUSTED decisions
//   - the free-queue order (hence eviction order) and the sequence of evicted hashes
//   - that the set of hashes announced by events equals the cached set
//   - leaf-first: without explicit evictions, every cached block's parent is cached
#include <algorithm>
#include <list>
#include <map>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::cache {
namespace {

using testing::EventReplayer;

class ReferenceCache {
 public:
  ReferenceCache(int32_t num_blocks, int32_t block_tokens, const BlockHasher* hasher)
      : b_(block_tokens), hasher_(hasher), ref_(static_cast<size_t>(num_blocks), 0),
        hash_(static_cast<size_t>(num_blocks)) {
    for (BlockId id = 1; id < num_blocks; ++id) free_.push_back(id);
  }

  struct Req {
    std::vector<TokenId> tokens;
    std::vector<BlockHash> hashes;
    std::vector<BlockId> blocks;
    int64_t slots = 0;
    size_t cached = 0;
    bool allocated = false;
  };

  void Add(RequestId id, std::vector<TokenId> prompt) {
    Req r;
    r.tokens = std::move(prompt);
    r.hashes = testing::HashPrefix(*hasher_, r.tokens);
    reqs_[id] = std::move(r);
  }

  void Append(RequestId id, const std::vector<TokenId>& t) {
    Req& r = reqs_.at(id);
    r.tokens.insert(r.tokens.end(), t.begin(), t.end());
    r.hashes = testing::HashPrefix(*hasher_, r.tokens);
  }

  std::vector<BlockId> Hit(RequestId id) const {
    const Req& r = reqs_.at(id);
    std::vector<BlockId> hit;
    const size_t max_blocks =
        std::min(r.hashes.size(), static_cast<size_t>((r.tokens.size() - 1) / b_));
    for (size_t i = 0; i < max_blocks; ++i) {
      const BlockId x = CachedCopy(r.hashes[i]);
      if (x < 0) break;
      hit.push_back(x);
    }
    return hit;
  }

  // Mirrors BlockPool::GetCachedBlock: the newest copy in use, else the newest; -1 if none.
  BlockId CachedCopy(const BlockHash& h) const {
    auto it = cache_.find(h);
    if (it == cache_.end()) return -1;
    for (BlockId x : it->second) {
      if (ref_[x] > 0) return x;
    }
    return it->second.front();
  }

  // Returns false (changing nothing) when the pool is short.
  bool Allocate(RequestId id, int64_t n, const std::vector<BlockId>& hit) {
    Req& r = reqs_.at(id);
    const int64_t base = r.allocated ? r.slots : static_cast<int64_t>(hit.size()) * b_;
    const int64_t total = base + n;
    const int64_t have = r.allocated ? static_cast<int64_t>(r.blocks.size())
                                     : static_cast<int64_t>(hit.size());
    const int64_t fresh = std::max<int64_t>(0, (total + b_ - 1) / b_ - have);
    const bool cow = r.allocated && n > 0 && r.slots % b_ != 0 && ref_[r.blocks.back()] > 1;
    int64_t touch_free = 0;
    if (!r.allocated) {
      for (BlockId x : hit) touch_free += ref_[x] == 0 ? 1 : 0;
    }
    if (fresh + (cow ? 1 : 0) > static_cast<int64_t>(free_.size()) - touch_free) return false;
    if (!r.allocated) {
      r.allocated = true;
      for (BlockId x : hit) {
        if (ref_[x]++ == 0) free_.remove(x);
        r.blocks.push_back(x);
      }
      r.cached = hit.size();
      r.slots = base;
    }
    if (cow) {
      const BlockId dst = Pop();
      --ref_[r.blocks.back()];
      r.blocks.back() = dst;
    }
    for (int64_t i = 0; i < fresh; ++i) r.blocks.push_back(Pop());
    r.slots = total;
    const size_t full = std::min(static_cast<size_t>(r.slots / b_), r.hashes.size());
    for (size_t i = r.cached; i < full; ++i) {
      const BlockId x = r.blocks[i];
      if (hash_[x].has_value()) continue;  // cached by a fork sibling
      hash_[x] = r.hashes[i];
      parent_[r.hashes[i]] = i == 0 ? std::nullopt : std::optional<BlockHash>(r.hashes[i - 1]);
      auto& copies = cache_[r.hashes[i]];
      copies.insert(copies.begin(), x);
    }
    r.cached = std::max(r.cached, full);
    return true;
  }

  void Fork(RequestId parent, const std::vector<RequestId>& children) {
    for (RequestId c : children) {
      reqs_[c] = reqs_.at(parent);
      for (BlockId x : reqs_[c].blocks) ++ref_[x];
    }
  }

  void Free(RequestId id) {
    Req& r = reqs_.at(id);
    for (auto it = r.blocks.rbegin(); it != r.blocks.rend(); ++it) {
      if (--ref_[*it] == 0) {
        if (hash_[*it].has_value()) free_.push_back(*it);
        else free_.push_front(*it);
      }
    }
    reqs_.erase(id);
  }

  // Mirrors BlockPool::EvictCached; returns the status code it should produce.
  absl::StatusCode Evict(const BlockHash& h) {
    auto it = cache_.find(h);
    if (it == cache_.end()) return absl::StatusCode::kNotFound;
    std::vector<BlockId> free_copies;
    for (BlockId x : it->second) {
      if (ref_[x] == 0) free_copies.push_back(x);
    }
    if (free_copies.empty()) return absl::StatusCode::kFailedPrecondition;
    for (BlockId x : free_copies) {
      DropHash(x);
      free_.remove(x);
      free_.push_front(x);
    }
    return absl::StatusCode::kOk;
  }

  bool Reset() {
    if (static_cast<int32_t>(free_.size()) != static_cast<int32_t>(ref_.size()) - 1) return false;
    cache_.clear();
    for (auto& h : hash_) h.reset();
    return true;
  }

  const std::map<RequestId, Req>& reqs() const { return reqs_; }
  const std::vector<int32_t>& refs() const { return ref_; }
  std::vector<BlockId> free_order() const { return {free_.begin(), free_.end()}; }
  const std::map<BlockHash, std::vector<BlockId>>& cache() const { return cache_; }
  const std::map<BlockHash, std::optional<BlockHash>>& parents() const { return parent_; }
  std::vector<BlockHash>& removed() { return removed_; }

 private:
  BlockId Pop() {
    const BlockId x = free_.front();
    free_.pop_front();
    if (hash_[x].has_value()) DropHash(x);
    ref_[x] = 1;
    return x;
  }

  void DropHash(BlockId x) {
    auto it = cache_.find(*hash_[x]);
    auto& copies = it->second;
    copies.erase(std::find(copies.begin(), copies.end(), x));
    if (copies.empty()) {
      removed_.push_back(it->first);
      cache_.erase(it);
    }
    hash_[x].reset();
  }

  int32_t b_;
  const BlockHasher* hasher_;
  std::vector<int32_t> ref_;
  std::vector<std::optional<BlockHash>> hash_;
  std::list<BlockId> free_;
  std::map<BlockHash, std::vector<BlockId>> cache_;
  std::map<BlockHash, std::optional<BlockHash>> parent_;
  std::map<RequestId, Req> reqs_;
  std::vector<BlockHash> removed_;
};

struct DiffParams {
  uint32_t seed;
  bool explicit_evictions;
};

void PrintTo(const DiffParams& p, std::ostream* os) {
  *os << "seed=" << p.seed << (p.explicit_evictions ? " with explicit evictions" : "");
}

class DifferentialTest : public ::testing::TestWithParam<DiffParams> {};

TEST_P(DifferentialTest, RandomOperationsMatchTheReferenceModel) {
  constexpr int32_t kBlocks = 40;
  constexpr int32_t kB = 4;
  constexpr int kOps = 4000;
  const DiffParams p = GetParam();
  std::mt19937 rng(p.seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };

  RecordingEventSink sink;
  auto m = testing::MakeManager(testing::PagedConfig(kBlocks, kB, &sink));
  ASSERT_NE(m, nullptr);
  auto hasher = BlockHasher::Create({.model_id = "test-model", .block_tokens = kB});
  ASSERT_TRUE(hasher.ok());
  ReferenceCache ref(kBlocks, kB, &*hasher);
  EventReplayer replay;

  // Prompts are prefixes of a few documents plus a short suffix from a two-token
  // vocabulary, so prefixes are shared and the same block is often computed twice.
  std::vector<std::vector<TokenId>> docs(4);
  for (auto& d : docs) {
    for (int i = 0; i < 48; ++i) d.push_back(static_cast<TokenId>(uniform(0, 1000)));
  }
  std::vector<RequestId> live;
  RequestId next_id = 1;
  size_t removed_seen = 0;
  std::vector<BlockHash> removed_events;
  bool evicted_explicitly = false;
  int hits = 0, exhausted = 0, forks = 0;

  auto free_request = [&](RequestId id) {
    ASSERT_TRUE(m->Free(id).ok());
    ref.Free(id);
    live.erase(std::find(live.begin(), live.end(), id));
  };

  for (int op = 0; op < kOps; ++op) {
    SCOPED_TRACE(::testing::Message() << "seed " << p.seed << " op " << op);
    const int dice = uniform(0, 99);
    if (dice < 30 && live.size() < 12) {  // a new request: prefill
      const RequestId id = next_id++;
      const auto& doc = docs[static_cast<size_t>(uniform(0, 3))];
      std::vector<TokenId> prompt(doc.begin(), doc.begin() + uniform(1, 40));
      for (int i = uniform(0, 6); i > 0; --i) prompt.push_back(static_cast<TokenId>(uniform(0, 1)));
      ASSERT_TRUE(m->AddRequest(testing::TokenRequest(id, prompt)).ok());
      ref.Add(id, prompt);
      auto hit = m->GetComputedBlocks(id);
      ASSERT_TRUE(hit.ok());
      const std::vector<BlockId> want = ref.Hit(id);
      ASSERT_EQ(hit->blocks, want);
      hits += want.empty() ? 0 : 1;
      const int64_t n = static_cast<int64_t>(prompt.size()) - hit->num_tokens;
      auto a = m->AllocateSlots(id, n, &*hit);
      const bool ok = ref.Allocate(id, n, want);
      ASSERT_EQ(a.ok(), ok) << a.status();
      live.push_back(id);
      if (!ok) {
        ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
        ++exhausted;
        free_request(id);  // the scheduler would keep it waiting; drop it here
      }
    } else if (dice < 60 && !live.empty()) {  // decode 1..3 tokens
      const RequestId id = live[static_cast<size_t>(uniform(0, static_cast<int>(live.size()) - 1))];
      std::vector<TokenId> t;
      for (int i = uniform(1, 3); i > 0; --i) t.push_back(static_cast<TokenId>(uniform(0, 1)));
      ASSERT_TRUE(m->AppendTokens(id, t).ok());
      ref.Append(id, t);
      auto a = m->AllocateSlots(id, static_cast<int64_t>(t.size()));
      const bool ok = ref.Allocate(id, static_cast<int64_t>(t.size()), {});
      ASSERT_EQ(a.ok(), ok) << a.status();
      if (!ok) {
        ASSERT_EQ(a.status().code(), absl::StatusCode::kResourceExhausted);
        ++exhausted;
        free_request(id);  // preempt
      }
    } else if (dice < 66 && !live.empty() && live.size() < 12) {  // fork
      const RequestId parent =
          live[static_cast<size_t>(uniform(0, static_cast<int>(live.size()) - 1))];
      std::vector<RequestId> children;
      for (int i = uniform(1, 3); i > 0; --i) children.push_back(next_id++);
      auto copies = m->Fork(parent, children);
      ASSERT_TRUE(copies.ok()) << copies.status();
      EXPECT_TRUE(copies->empty());
      ref.Fork(parent, children);
      live.insert(live.end(), children.begin(), children.end());
      ++forks;
    } else if (dice < 92 && !live.empty()) {  // free
      free_request(live[static_cast<size_t>(uniform(0, static_cast<int>(live.size()) - 1))]);
    } else if (dice < 97 && p.explicit_evictions && !ref.cache().empty()) {
      auto it = ref.cache().begin();
      std::advance(it, uniform(0, static_cast<int>(ref.cache().size()) - 1));
      const BlockHash h = it->first;
      const absl::StatusCode want = ref.Evict(h);
      EXPECT_EQ(m->EvictCached(h, StateKind::kAttnKv).status().code(), want);
      evicted_explicitly |= want == absl::StatusCode::kOk;
    } else if (dice >= 99) {
      const bool ok = ref.Reset();
      ASSERT_EQ(m->ResetPrefixCache().ok(), ok);
      if (ok) evicted_explicitly = false;
    }

    // --- invariants ----------------------------------------------------------------
    const BlockPool& pool = m->block_pool();
    std::vector<int32_t> holders(kBlocks, 0);
    for (const auto& [id, r] : ref.reqs()) {
      ASSERT_EQ(testing::Table(*m, id), r.blocks) << "request " << id;
      ASSERT_EQ(m->NumTokens(id), r.slots);
      for (BlockId x : r.blocks) ++holders[x];
    }
    for (BlockId x = 0; x < kBlocks; ++x) {
      ASSERT_EQ(pool.block(x).ref_cnt, ref.refs()[x]) << "block " << x;
      ASSERT_EQ(pool.block(x).ref_cnt, holders[x]) << "block " << x;
    }
    ASSERT_EQ(pool.FreeQueueOrder(), ref.free_order());
    std::set<BlockHash> want_cached;
    for (const auto& [h, copies] : ref.cache()) {
      want_cached.insert(h);
      ASSERT_EQ(pool.GetCachedBlock(h), ref.CachedCopy(h));
    }
    ASSERT_EQ(testing::CachedSet(pool, StateKind::kAttnKv), want_cached);
    replay.Apply(sink.events());
    ASSERT_EQ(replay.Held(StateKind::kAttnKv), want_cached) << "events != cached set";
    for (; removed_seen < sink.events().size(); ++removed_seen) {
      const KvEvent& e = sink.events()[removed_seen];
      if (e.type == KvEvent::Type::kRemoved) {
        removed_events.insert(removed_events.end(), e.hashes.begin(), e.hashes.end());
      }
    }
    ASSERT_EQ(removed_events, ref.removed()) << "eviction order differs";
    if (!evicted_explicitly) {
      for (const BlockHash& h : want_cached) {
        const auto& parent = ref.parents().at(h);
        if (parent.has_value()) {
          ASSERT_TRUE(want_cached.contains(*parent)) << "a parent was evicted before its child";
        }
      }
    }
  }
  // The run exercised what it is meant to.
  EXPECT_GT(hits, 50);
  EXPECT_GT(exhausted, 0);
  EXPECT_GT(forks, 20);
  EXPECT_GT(ref.removed().size(), 100u);
  for (RequestId id : std::vector<RequestId>(live)) free_request(id);
  EXPECT_EQ(m->block_pool().num_free_blocks(), kBlocks - 1);
}

INSTANTIATE_TEST_SUITE_P(Seeds, DifferentialTest,
                         ::testing::Values(DiffParams{1, false}, DiffParams{2, false},
                                           DiffParams{3, false}, DiffParams{4, true},
                                           DiffParams{5, true}, DiffParams{6, true}),
                         [](const ::testing::TestParamInfo<DiffParams>& info) {
                           return absl::StrCat("seed", info.param.seed,
                                               info.param.explicit_evictions ? "_evict" : "");
                         });

}  // namespace
}  // namespace kvpool::cache
