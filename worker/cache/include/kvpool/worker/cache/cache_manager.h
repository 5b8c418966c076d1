// CacheManager: the interface every KV cache policy implements, so a worker or the
// kvctl simulator runs the same request loop against `paged` (KvCacheManager, vLLM's
// PagedAttention design with prefix caching) or `contiguous` (ContiguousCacheManager,
// the max_len reservation of HuggingFace Transformers / FasterTransformer).
//
// The request loop (vLLM v1 scheduler names):
//
//   AddRequest(spec)                          register prompt (tokens or block hashes)
//   hit = GetComputedBlocks(id)               longest cached prefix, no side effects
//   AllocateSlots(id, prompt - hit.num_tokens, &hit)   prefill: touch hit, add blocks
//   loop: AppendTokens(id, {sampled});  AllocateSlots(id, 1)           decode
//   Fork(id, children)                        parallel samples / beams share blocks
//   Free(id)                                  release, tail of the chain first
//
// Everything is metadata: block ids index pages the caller owns. Where the caller must
// move payload (copy-on-write, forking a KDA state, saving or restoring a checkpoint),
// the result says which pages to copy from and to.
//
// Thread safety: implementations are not thread-safe; the owner serializes calls.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvpool/common/hash.h"
#include "kvpool/worker/cache/block_pool.h"
#include "kvpool/worker/cache/cache_config.h"

namespace kvpool::cache {

using RequestId = uint64_t;

struct RequestSpec {
  RequestId id = 0;
  // Token mode: the prompt; the manager hashes it (chained, tenant salt, extra keys).
  std::vector<TokenId> prompt_tokens;
  std::string tenant_salt;
  std::vector<uint64_t> extra_keys;
  // Hashed mode (metadata only, e.g. a trace's hash_ids): leave prompt_tokens empty and
  // give the prompt length and the hashes of its full blocks (at most
  // num_prompt_tokens / block_tokens; fewer means the rest is never cached).
  int64_t num_prompt_tokens = 0;
  std::vector<BlockHash> block_hashes;
  // Imports only (ModelRunner::BeginImport): the request lands fetched bytes and computes
  // nothing, so it takes no live KDA state, and it saves KDA checkpoints only at these
  // block hashes (those whose state the caller brings). nullopt: a normal request.
  std::optional<std::vector<BlockHash>> import_checkpoints;
};

// The longest cached prefix of a request (GetComputedBlocks). Pass it unchanged to the
// first AllocateSlots call of the request, with no other manager call in between that
// could evict it (a stale hit is refused with FAILED_PRECONDITION).
//
//   prompt:   [ b0 | b1 | b2 | b3 | b4 | b5 | b6 |..partial..]
//   MLA hit:  [ b0 ...................... b5 ]             m = 6 blocks
//   checkpts:           ^c=2 blocks (cached)    ^ (not cached)
//   strict:   num_tokens = c               replay: num_tokens = m, replay_tokens = m - c
struct PrefixHit {
  RequestId request_id = 0;
  std::vector<BlockId> blocks;    // the hit blocks, in order
  int64_t num_tokens = 0;         // tokens whose KV needs no compute (blocks * block_tokens)
  // Hybrid models only:
  int64_t attn_hit_tokens = 0;    // m: the paged (MLA) hit before intersecting
  int64_t checkpoint_tokens = 0;  // c: where the restored KDA state stands (0: zero state)
  BlockId checkpoint = kNoBlock;  // head page of the checkpoint to restore, or kNoBlock
  int64_t replay_tokens = 0;      // replay mode: m - c tokens through the KDA layers only
};

// Copy the payload of page(s) `src` into `dst` before writing into `dst`.
struct CopyOp {
  BlockId src = kNoBlock;
  BlockId dst = kNoBlock;
  int32_t num_pages = 1;  // > 1: src and dst are run heads (BlockPool::RunPages)
};

// After the step that computes `boundary_tokens`, copy the live KDA state into the run
// `pages_head` (a checkpoint now cached under `hash`).
struct CheckpointSave {
  int64_t boundary_tokens = 0;
  BlockHash hash;
  BlockId pages_head = kNoBlock;
};

struct SlotAllocation {
  // The request's block table gained blocks [first_new_block, end); see BlockTable().
  int32_t first_new_block = 0;
  int32_t num_new_blocks = 0;
  std::vector<CopyOp> copies;  // copy-on-write of a shared partial block
  // Hybrid, first allocation: the live KDA state slot (a run of state pages) and, on a
  // checkpoint hit, the checkpoint to restore into it (`restore.src` -> `restore.dst`).
  BlockId live_state = kNoBlock;
  CopyOp restore;
  std::vector<CheckpointSave> checkpoint_saves;
};

// Cache-wide counters (monotonic) and gauges (now).
struct CacheUsage {
  int32_t total_blocks = 0;        // usable blocks (null block excluded)
  int32_t used_blocks = 0;         // ref_cnt > 0 (paged) / reserved (contiguous)
  int32_t free_blocks = 0;
  int32_t state_pages_in_use = 0;  // of used_blocks: live KDA states and held checkpoints
  int32_t num_requests = 0;
  int64_t live_tokens = 0;         // sum over requests of tokens holding KV (slots)
  // Tokens of memory set aside for those requests' KV: used attn blocks * block_tokens
  // (paged; a shared block counts once) or reservations (contiguous).
  int64_t reserved_tokens = 0;
  uint64_t query_tokens = 0;       // GetComputedBlocks: prompt tokens asked about
  uint64_t hit_tokens = 0;         // ... and found
  uint64_t cow_copies = 0;
  uint64_t evicted_blocks = 0;
  uint64_t evicted_checkpoints = 0;
};

class CacheManager {
 public:
  virtual ~CacheManager() = default;

  virtual absl::string_view policy() const = 0;  // "paged" | "contiguous"
  virtual int32_t block_tokens() const = 0;

  // INVALID_ARGUMENT on a malformed spec; ALREADY_EXISTS for a live id.
  virtual absl::Status AddRequest(RequestSpec spec) = 0;
  // Decode: tokens sampled for the request (token mode); full blocks get hashed.
  virtual absl::Status AppendTokens(RequestId id, std::span<const TokenId> tokens) = 0;
  // vLLM get_computed_blocks: prefix-only, block-granular, capped so the last prompt
  // token is recomputed. No side effects (blocks are touched by AllocateSlots).
  virtual absl::StatusOr<PrefixHit> GetComputedBlocks(RequestId id) = 0;
  // vLLM allocate_slots: room for `num_new_tokens` more tokens after the hit (first
  // call) or after the tokens already allocated. RESOURCE_EXHAUSTED when the pool is
  // short, with every reference count exactly as before.
  virtual absl::StatusOr<SlotAllocation> AllocateSlots(RequestId id, int64_t num_new_tokens,
                                                       const PrefixHit* hit = nullptr) = 0;
  // n parallel samples / beams: each child shares every block of `parent` read-only.
  // Returns the payload copies the caller must do (e.g. a KDA live state per child).
  // FAILED_PRECONDITION (paged) while `parent` holds slots ahead of its known tokens:
  // each holder would write its own tokens into those shared slots.
  virtual absl::StatusOr<std::vector<CopyOp>> Fork(RequestId parent,
                                                   std::span<const RequestId> children) = 0;
  // Releases the request's blocks in reverse order. NOT_FOUND for an unknown id.
  virtual absl::Status Free(RequestId id) = 0;
  // Forgets every cached prefix; FAILED_PRECONDITION while any block is in use.
  virtual absl::Status ResetPrefixCache() = 0;

  // The request's block table (empty for an unknown id). Valid until the next call.
  virtual std::span<const BlockId> BlockTable(RequestId id) const = 0;
  // Tokens with slots allocated for the request (0 for an unknown id).
  virtual int64_t NumTokens(RequestId id) const = 0;
  virtual CacheUsage Usage() const = 0;
};

// "paged" -> KvCacheManager, "contiguous" -> ContiguousCacheManager.
absl::StatusOr<std::unique_ptr<CacheManager>> CreateCacheManager(absl::string_view policy,
                                                                 CacheConfig config);

}  // namespace kvpool::cache
