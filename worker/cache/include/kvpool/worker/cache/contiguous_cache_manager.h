// ContiguousCacheManager: the baseline that paging replaces. Like HuggingFace
// Transformers' static cache and FasterTransformer, it reserves max_model_len tokens of
// contiguous KV per request when the request starts, whatever the request will use:
//
//   pool:   [null][ req A: 3 of 8 blocks used ........ ][ req B: 8 of 8 ][ free .. ]
//                       ^^^^^^^^^^^^^^^^ reserved, never used: internal fragmentation
//
// Same interface as KvCacheManager, so the simulator and the benchmark compare
// utilization (live_tokens / reserved_tokens) and batch cap on one workload. No prefix
// caching (GetComputedBlocks always misses) and no linear state (paged layouts only).
// Free ranges are kept in an address-ordered map, first fit, coalesced on free, so
// external fragmentation is real too.
//
// Thread safety: not thread-safe; the owner serializes calls.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "kvpool/worker/cache/cache_manager.h"

namespace kvpool::cache {

class ContiguousCacheManager : public CacheManager {
 public:
  // REQUIRES: config.max_model_len > 0 and a layout without linear state.
  static absl::StatusOr<std::unique_ptr<ContiguousCacheManager>> Create(CacheConfig config);

  absl::string_view policy() const override { return "contiguous"; }
  int32_t block_tokens() const override { return block_tokens_; }

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

  int32_t blocks_per_request() const { return reserve_blocks_; }

 private:
  struct Request {
    std::vector<BlockId> blocks;  // the reservation, consecutive ids (empty until allocated)
    int64_t num_prompt_tokens = 0;
    int64_t num_slots = 0;
  };

  explicit ContiguousCacheManager(CacheConfig config);
  // First fit; kNoBlock when no free range is long enough.
  BlockId Reserve();
  void Release(BlockId start);

  CacheConfig config_;
  int32_t block_tokens_;
  int32_t reserve_blocks_;
  std::map<BlockId, int32_t> free_ranges_;  // start -> length, address order
  int32_t free_blocks_;
  absl::flat_hash_map<RequestId, Request> requests_;
  int64_t live_tokens_ = 0;
  uint64_t query_tokens_ = 0;
};

}  // namespace kvpool::cache
