// KvCacheManager: the paged KV cache manager of one worker (vLLM v1's KVCacheManager
// with SGLang-style leaf-first eviction and a dual cache for hybrid MLA + KDA models).
//
// Token ranges of one request during a prefill step (b = block_tokens):
//
//   |<------------------ num_prompt_tokens ------------------>|
//   |<--- hit.num_tokens --->|<--------- num_new_tokens ------>|
//   [ cached | cached | cached | new    | new    | new  ...    ]
//     touched (ref_cnt += 1)     popped from the free queue
//   |<-- full blocks are hashed and cached (cache_full_blocks) -->|<-partial->|
//
// Decode: AllocateSlots(id, 1) pops a block only when the last one is full; the step
// that fills a block caches it (its hash is known once AppendTokens saw its tokens).
//
// Fork + copy-on-write:
//
//   parent  [ P0 | P1 | P2(partial, ref 3) ]          after Fork(parent, {c1, c2})
//   c1      [ P0 | P1 | P2 ]   -- AllocateSlots(c1, 1) --> [ P0 | P1 | C1' ] copy P2 -> C1'
//
// Hybrid dual cache (layout.hybrid()): per request a live KDA state slot (a run of
// state pages); each time the computed tokens reach a multiple of checkpoint_tokens, a
// checkpoint run is cached under the hash of the block ending there, if free pages
// allow (checkpoints are a cache: an allocation never fails for one; the latest
// boundaries go first) (SlotAllocation::checkpoint_saves says where the caller copies
// the live state). A hit
// is the MLA hit m intersected with the last cached checkpoint c <= m: strict takes c,
// replay takes m and reports m - c tokens to replay through the KDA layers. A
// checkpoint is only found through its MLA prefix, so it is never a hit without it.
//
// Invariants (checked by the differential test):
// 1. A block's ref_cnt equals the number of live requests whose table holds it (plus,
//    for state pages, holders of the live state or checkpoint).
// 2. A block with ref_cnt > 0 is never evicted; RESOURCE_EXHAUSTED changes nothing.
// 3. Free releases the tail of the chain first, so among free cached blocks the leaves
//    go first, least recently used first.
// 4. The set announced by events equals the cached set at the end of every call.
//
// Thread safety: not thread-safe; the owner serializes calls.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/common/hash.h"
#include "kvpool/worker/cache/block_pool.h"
#include "kvpool/worker/cache/cache_config.h"
#include "kvpool/worker/cache/cache_manager.h"

namespace kvpool::cache {

class KvCacheManager : public CacheManager {
 public:
  // Validates `config`. Construction is O(num_blocks) and allocates 40 B per block.
  static absl::StatusOr<std::unique_ptr<KvCacheManager>> Create(CacheConfig config);

  absl::string_view policy() const override { return "paged"; }
  int32_t block_tokens() const override { return config_.layout.block_tokens; }

  absl::Status AddRequest(RequestSpec spec) override;
  absl::Status AppendTokens(RequestId id, std::span<const TokenId> tokens) override;
  absl::StatusOr<PrefixHit> GetComputedBlocks(RequestId id) override;
  absl::StatusOr<SlotAllocation> AllocateSlots(RequestId id, int64_t num_new_tokens,
                                               const PrefixHit* hit = nullptr) override;
  absl::StatusOr<std::vector<CopyOp>> Fork(RequestId parent,
                                           std::span<const RequestId> children) override;
  absl::Status Free(RequestId id) override;
  absl::Status ResetPrefixCache() override;

  std::span<const BlockId> BlockTable(RequestId id) const override;
  int64_t NumTokens(RequestId id) const override;
  CacheUsage Usage() const override;

  // Drops the free copies of a cached block / a cached checkpoint now (see
  // BlockPool::EvictCached); for invalidation and tests.
  absl::StatusOr<int> EvictCached(const BlockHash& hash, StateKind kind);
  // Drops one free cached attn block (BlockPool::EvictCachedBlock).
  absl::Status EvictCachedBlock(BlockId id);
  // The block hashes the request knows (full blocks of its known tokens).
  std::span<const BlockHash> BlockHashes(RequestId id) const;
  // The head of the request's live KDA state run, or kNoBlock.
  BlockId LiveState(RequestId id) const;
  // Checkpoints the request holds a reference on (restored or saved), by boundary.
  struct HeldCheckpoint {
    int64_t boundary_tokens;
    BlockId head;
  };
  std::span<const HeldCheckpoint> Checkpoints(RequestId id) const;

  const BlockPool& block_pool() const { return pool_; }
  const CacheConfig& config() const { return config_; }

 private:
  struct Request {
    std::vector<BlockId> blocks;        // block table
    std::vector<BlockHash> hashes;      // hashes of full known blocks
    std::vector<TokenId> tokens;        // token mode: every known token
    std::string tenant_salt;
    std::vector<uint64_t> extra_keys;
    std::vector<HeldCheckpoint> checkpoints;  // ascending boundary; ref held
    int64_t num_prompt_tokens = 0;
    int64_t num_known_tokens = 0;       // prompt + appended
    int64_t num_slots = 0;              // tokens with slots allocated
    int32_t num_cached_blocks = 0;      // blocks[0..n) are cached (or hits)
    BlockId live_state = kNoBlock;
    std::optional<std::vector<BlockHash>> import_checkpoints;  // RequestSpec's
    bool token_mode = false;
    bool allocated = false;             // AllocateSlots ran at least once
  };

  KvCacheManager(CacheConfig config, BlockHasher hasher);

  Request* Find(RequestId id);
  const Request* Find(RequestId id) const;
  // Checkpoint boundaries in (from, to] whose block hash is known and not yet cached.
  std::vector<int64_t> CheckpointsToSave(const Request& r, int64_t from, int64_t to) const;
  absl::Status ValidateHit(const Request& r, const PrefixHit& hit) const;
  // Caches r's full blocks up to `num_slots` tokens whose hashes are known.
  void CacheFullBlocks(Request& r);

  CacheConfig config_;
  BlockHasher hasher_;
  BlockPool pool_;
  absl::flat_hash_map<RequestId, Request> requests_;
  int32_t state_pages_in_use_ = 0;
  int64_t live_tokens_ = 0;
  uint64_t query_tokens_ = 0;
  uint64_t hit_tokens_ = 0;
  uint64_t cow_copies_ = 0;
};

}  // namespace kvpool::cache
