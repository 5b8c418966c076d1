// How a model's attention state maps onto the pages of one KV pool, and the options of
// a cache manager.
//
// A model spec yields cache groups:
//   paged groups         GQA K/V or MLA latent+rope, per token, in blocks of block_tokens
//   linear-state group   KDA: a fixed-size state per request (d_k x d_v per head per layer)
//
// One pool of fixed-size pages holds them all, so one allocator accounts for every
// kind. A page is one block of every paged layer (ModelSpec::BlockBytes()); a KDA state
// (the live slot of a running request, or a checkpoint) is a run of
// ceil(FixedStateBytes / page_bytes) pages:
//
//   kimi-k3:  page = 64 tokens x 27,648 B = 1.69 MiB;  KDA state = 207 MiB = 123 pages
//   tiny-hybrid: page = 64 tokens x 1,152 B = 72 KiB;  KDA state = 96 KiB = 2 pages
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvpool/common/hash.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/worker/cache/kv_events.h"

namespace kvpool::cache {

struct CacheGroup {
  AttentionKind attention = AttentionKind::kGqa;
  StateKind state = StateKind::kAttnKv;
  int num_layers = 0;
  // kAttnKv: bytes of one block of this group (all its layers); kLinearState: bytes of
  // one whole state (all its layers).
  int64_t bytes = 0;
};

struct CacheLayout {
  int32_t block_tokens = 16;      // tokens per page of the paged groups
  int64_t page_bytes = 0;         // bytes of one page; 0 when only metadata matters
  int32_t state_pages = 0;        // pages per KDA state; 0: no linear-state group
  int32_t checkpoint_tokens = 0;  // KDA checkpoint interval, a multiple of block_tokens
  std::vector<CacheGroup> groups;

  bool hybrid() const { return state_pages > 0; }

  // Derives the layout of `spec` (validated first).
  static absl::StatusOr<CacheLayout> FromModelSpec(const ModelSpec& spec);
  // A plain paged layout (no linear state), for metadata-only use.
  static CacheLayout Paged(int32_t block_tokens);
  // A hybrid layout with explicit state size and checkpoint interval.
  static CacheLayout Hybrid(int32_t block_tokens, int32_t state_pages,
                            int32_t checkpoint_tokens);
};

// How a hybrid (MLA + KDA) prefix hit is taken. With MLA hit m and last checkpoint c <= m:
enum class HybridHitMode : uint8_t {
  kStrict,  // hit = c: restore the checkpoint, recompute everything after it
  kReplay,  // hit = m: restore the checkpoint, replay m - c tokens through KDA layers only
};
absl::string_view HybridHitModeName(HybridHitMode mode);  // "strict", "replay"
absl::StatusOr<HybridHitMode> ParseHybridHitMode(absl::string_view name);

struct CacheConfig {
  // Pages in the pool, including the reserved null block 0. >= 2.
  int32_t num_blocks = 0;
  CacheLayout layout;
  bool enable_prefix_caching = true;
  HybridHitMode hybrid_mode = HybridHitMode::kReplay;
  // Hashing of token-carrying requests. hash_options.block_tokens must equal
  // layout.block_tokens; model_id must be set (the model's name).
  HashOptions hash_options;
  // Events: the source id the router knows this cache by, the tier it reports, and the
  // sink (not owned, outlives the manager; null: no events are built).
  std::string source_id = "worker";
  Tier tier = Tier::kGpu;
  KvEventSink* event_sink = nullptr;
  // contiguous policy only: tokens reserved per request (prompt + longest output).
  int64_t max_model_len = 0;

  // Checks every field; errors name the field and the fix.
  absl::Status Validate() const;
};

}  // namespace kvpool::cache
