// Helpers shared by the worker/cache tests.
#pragma once

#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/worker/cache/kv_cache_manager.h"
#include "kvpool/worker/cache/kv_events.h"

namespace kvpool::cache::testing {

// A non-null empty key list and salt: common/'s hasher memcpy()s its inputs, and a
// null source pointer is undefined behaviour even for zero bytes.
inline std::span<const uint64_t> NoKeys() {
  static constexpr uint64_t kNone = 0;
  return {&kNone, 0};
}

inline std::vector<BlockHash> HashPrefix(const BlockHasher& h, const std::vector<TokenId>& t) {
  return h.HashPrefix(t, "", NoKeys());
}

inline CacheConfig PagedConfig(int32_t num_blocks, int32_t block_tokens,
                               KvEventSink* sink = nullptr) {
  CacheConfig c;
  c.num_blocks = num_blocks;
  c.layout = CacheLayout::Paged(block_tokens);
  c.hash_options.model_id = "test-model";
  c.event_sink = sink;
  c.source_id = "test-worker";
  return c;
}

inline std::unique_ptr<KvCacheManager> MakeManager(CacheConfig config) {
  auto m = KvCacheManager::Create(std::move(config));
  EXPECT_TRUE(m.ok()) << m.status();
  return m.ok() ? *std::move(m) : nullptr;
}

// Tokens start, start + 1, ..., start + n - 1.
inline std::vector<TokenId> Seq(TokenId start, int n) {
  std::vector<TokenId> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = start + static_cast<TokenId>(i);
  return t;
}

inline std::vector<TokenId> Concat(std::vector<TokenId> a, const std::vector<TokenId>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline RequestSpec TokenRequest(RequestId id, std::vector<TokenId> prompt,
                                std::string salt = "") {
  RequestSpec s;
  s.id = id;
  s.prompt_tokens = std::move(prompt);
  s.tenant_salt = std::move(salt);
  return s;
}

// AddRequest + GetComputedBlocks + AllocateSlots(prompt - hit): one prefill step.
// Returns the hit that was used.
inline PrefixHit Prefill(CacheManager& m, RequestSpec spec) {
  const RequestId id = spec.id;
  const int64_t n = spec.prompt_tokens.empty() ? spec.num_prompt_tokens
                                               : static_cast<int64_t>(spec.prompt_tokens.size());
  absl::Status s = m.AddRequest(std::move(spec));
  EXPECT_TRUE(s.ok()) << s;
  auto hit = m.GetComputedBlocks(id);
  EXPECT_TRUE(hit.ok()) << hit.status();
  if (!hit.ok()) return {};
  auto alloc = m.AllocateSlots(id, n - hit->num_tokens, &*hit);
  EXPECT_TRUE(alloc.ok()) << alloc.status();
  return *hit;
}

inline std::vector<BlockId> Table(const CacheManager& m, RequestId id) {
  auto t = m.BlockTable(id);
  return {t.begin(), t.end()};
}

// Replays an event stream into the set of (hash, kind) a consumer believes is cached,
// checking sequence numbers as it goes.
class EventReplayer {
 public:
  void Apply(const std::vector<KvEvent>& events) {
    for (; applied_ < events.size(); ++applied_) {
      const KvEvent& e = events[applied_];
      EXPECT_EQ(e.sequence, applied_ + 1) << "sequence numbers must be 1, 2, 3, ...";
      switch (e.type) {
        case KvEvent::Type::kStored:
          for (const BlockHash& h : e.hashes) {
            EXPECT_TRUE(held_.insert({h, e.kind}).second) << "stored twice: " << h.ToHex();
          }
          break;
        case KvEvent::Type::kRemoved:
          for (const BlockHash& h : e.hashes) {
            EXPECT_EQ(held_.erase({h, e.kind}), 1u) << "removed but not held: " << h.ToHex();
          }
          break;
        case KvEvent::Type::kCleared:
          held_.clear();
          break;
      }
    }
  }
  std::set<BlockHash> Held(StateKind kind) const {
    std::set<BlockHash> out;
    for (const auto& [h, k] : held_) {
      if (k == kind) out.insert(h);
    }
    return out;
  }

 private:
  size_t applied_ = 0;
  std::set<std::pair<BlockHash, StateKind>> held_;
};

inline std::set<BlockHash> CachedSet(const BlockPool& pool, StateKind kind) {
  auto v = pool.CachedHashes(kind);
  return {v.begin(), v.end()};
}

}  // namespace kvpool::cache::testing
