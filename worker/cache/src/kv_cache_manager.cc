#include "kvpool/worker/cache/kv_cache_manager.h"

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "fork_check.h"
#include "kvpool/common/status.h"

namespace kvpool::cache {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// common's ByteWriter memcpy()s every span, and memcpy from a null pointer is undefined
// even for zero bytes (UBSan flags it), so an empty key list gets a non-null pointer.
std::span<const uint64_t> Keys(const std::vector<uint64_t>& keys) {
  static constexpr uint64_t kNone = 0;
  return keys.empty() ? std::span<const uint64_t>(&kNone, 0) : std::span<const uint64_t>(keys);
}

absl::Status UnknownRequest(RequestId id) {
  return absl::NotFoundError(
      absl::StrCat("request ", id, " is not known to the cache; call AddRequest first"));
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvCacheManager>> KvCacheManager::Create(CacheConfig config) {
  RETURN_IF_ERROR(config.Validate());
  // Hashing needs the model id; a metadata-only cache (hashed requests) may leave it empty.
  HashOptions hash_options = config.hash_options;
  hash_options.block_tokens = static_cast<uint32_t>(config.layout.block_tokens);
  if (hash_options.model_id.empty()) hash_options.model_id = "<hashed-requests-only>";
  ASSIGN_OR_RETURN(BlockHasher hasher, BlockHasher::Create(std::move(hash_options)));
  return std::unique_ptr<KvCacheManager>(new KvCacheManager(std::move(config), std::move(hasher)));
}

KvCacheManager::KvCacheManager(CacheConfig config, BlockHasher hasher)
    : config_(std::move(config)),
      hasher_(std::move(hasher)),
      pool_(BlockPool::Options{.num_blocks = config_.num_blocks,
                               .source_id = config_.source_id,
                               .tier = config_.tier,
                               .event_sink = config_.event_sink}) {}

KvCacheManager::Request* KvCacheManager::Find(RequestId id) {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second;
}

const KvCacheManager::Request* KvCacheManager::Find(RequestId id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? nullptr : &it->second;
}

absl::Status KvCacheManager::AddRequest(RequestSpec spec) {
  if (requests_.contains(spec.id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "request ", spec.id, " is already in the cache; Free it first or use a new id"));
  }
  const int64_t b = config_.layout.block_tokens;
  Request r;
  if (!spec.prompt_tokens.empty()) {
    if (config_.hash_options.model_id.empty()) {
      return absl::FailedPreconditionError(
          "token-mode request but the cache has no hash_options.model_id; set it to the "
          "model's name (the router hashes with the same id) or pass block_hashes");
    }
    if (!spec.block_hashes.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", spec.id, " has both prompt_tokens and block_hashes; give one of them"));
    }
    if (spec.num_prompt_tokens != 0 &&
        spec.num_prompt_tokens != static_cast<int64_t>(spec.prompt_tokens.size())) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", spec.id, ": num_prompt_tokens=", spec.num_prompt_tokens, " but ",
          spec.prompt_tokens.size(), " prompt_tokens; leave num_prompt_tokens at 0"));
    }
    r.token_mode = true;
    r.num_prompt_tokens = static_cast<int64_t>(spec.prompt_tokens.size());
    r.tokens = std::move(spec.prompt_tokens);
    r.tenant_salt = std::move(spec.tenant_salt);
    r.extra_keys = std::move(spec.extra_keys);
    r.hashes = hasher_.HashPrefix(r.tokens, r.tenant_salt, Keys(r.extra_keys));
  } else {
    if (spec.num_prompt_tokens <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", spec.id, " has no prompt: set prompt_tokens, or num_prompt_tokens > 0 "
          "with block_hashes"));
    }
    if (static_cast<int64_t>(spec.block_hashes.size()) > spec.num_prompt_tokens / b) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", spec.id, ": ", spec.block_hashes.size(), " block_hashes but ",
          spec.num_prompt_tokens, " prompt tokens make only ", spec.num_prompt_tokens / b,
          " full blocks of ", b, " tokens; pass one hash per full block"));
    }
    // A chain of distinct prefixes has distinct hashes; a repeat (a collision, or a
    // caller's bug) would cache two copies under one key, and two checkpoints.
    absl::flat_hash_set<BlockHash> seen;
    seen.reserve(spec.block_hashes.size());
    for (size_t i = 0; i < spec.block_hashes.size(); ++i) {
      if (!seen.insert(spec.block_hashes[i]).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            "request ", spec.id, ": block_hashes[", i, "] ", spec.block_hashes[i].ToHex(),
            " repeats an earlier hash of the chain; each block's hash names its whole prefix"));
      }
    }
    if (!spec.tenant_salt.empty() || !spec.extra_keys.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "request ", spec.id, " gives block_hashes with ", spec.tenant_salt.empty() ? "extra_keys" : "tenant_salt",
          ", which only token mode uses (the hashes already carry them); hash them into block_hashes, or pass "
          "prompt_tokens"));
    }
    r.num_prompt_tokens = spec.num_prompt_tokens;
    r.hashes = std::move(spec.block_hashes);
  }
  r.num_known_tokens = r.num_prompt_tokens;
  r.import_checkpoints = std::move(spec.import_checkpoints);
  requests_.emplace(spec.id, std::move(r));
  return absl::OkStatus();
}

absl::Status KvCacheManager::AppendTokens(RequestId id, std::span<const TokenId> tokens) {
  Request* r = Find(id);
  if (r == nullptr) return UnknownRequest(id);
  r->num_known_tokens += static_cast<int64_t>(tokens.size());
  if (r->token_mode) {
    r->tokens.insert(r->tokens.end(), tokens.begin(), tokens.end());
    hasher_.ExtendHashes(r->tokens, r->tenant_salt, Keys(r->extra_keys), r->hashes);
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefixHit> KvCacheManager::GetComputedBlocks(RequestId id) {
  const Request* r = Find(id);
  if (r == nullptr) return UnknownRequest(id);
  if (r->allocated) {
    return absl::FailedPreconditionError(absl::StrCat(
        "request ", id, " already has slots; get_computed_blocks is for a request before "
        "its first allocate_slots"));
  }
  PrefixHit hit;
  hit.request_id = id;
  query_tokens_ += static_cast<uint64_t>(r->num_known_tokens);
  if (!config_.enable_prefix_caching) return hit;
  const int64_t b = config_.layout.block_tokens;
  // The last known token is always recomputed: its logits produce the next token.
  const int64_t max_blocks =
      std::min<int64_t>(static_cast<int64_t>(r->hashes.size()), (r->num_known_tokens - 1) / b);
  for (int64_t i = 0; i < max_blocks; ++i) {
    const BlockId block = pool_.GetCachedBlock(r->hashes[i]);
    if (block == kNoBlock) break;
    if (i == 0) hit.blocks.reserve(static_cast<size_t>(max_blocks));
    hit.blocks.push_back(block);
  }
  const int64_t m = static_cast<int64_t>(hit.blocks.size()) * b;
  hit.num_tokens = m;
  if (config_.layout.hybrid()) {
    // Intersect with the KDA checkpoints: only boundaries inside the MLA hit count, so a
    // checkpoint is never a hit without its MLA prefix.
    const int64_t step = config_.layout.checkpoint_tokens;
    int64_t c = 0;
    for (int64_t k = m / step; k >= 1; --k) {
      const BlockId head = pool_.GetCachedCheckpoint(r->hashes[k * step / b - 1]);
      if (head != kNoBlock) {
        c = k * step;
        hit.checkpoint = head;
        break;
      }
    }
    hit.attn_hit_tokens = m;
    hit.checkpoint_tokens = c;
    if (config_.hybrid_mode == HybridHitMode::kStrict) {
      hit.blocks.resize(static_cast<size_t>(c / b));
      hit.num_tokens = c;
    } else {
      hit.replay_tokens = m - c;
    }
  }
  hit_tokens_ += static_cast<uint64_t>(hit.num_tokens);
  return hit;
}

absl::Status KvCacheManager::ValidateHit(const Request& r, const PrefixHit& hit) const {
  auto stale = [&](absl::string_view why) {
    return absl::FailedPreconditionError(absl::StrCat(
        "prefix hit for request ", hit.request_id, " is stale or malformed (", why,
        "); call GetComputedBlocks again right before AllocateSlots"));
  };
  const int64_t b = config_.layout.block_tokens;
  if (static_cast<int64_t>(hit.blocks.size()) * b != hit.num_tokens) {
    return stale("num_tokens does not match the number of blocks");
  }
  if (hit.blocks.size() > r.hashes.size()) return stale("more blocks than the prompt has");
  // The last known token is always computed (its logits give the next token).
  if (hit.num_tokens > r.num_known_tokens - 1) return stale("covers the last known token, which must be computed");
  for (size_t i = 0; i < hit.blocks.size(); ++i) {
    const BlockId id = hit.blocks[i];
    if (id <= kNullBlockId || id >= pool_.num_blocks()) return stale("block id out of range");
    const KvCacheBlock& block = pool_.block(id);
    if (!block.is_cached || block.kind != StateKind::kAttnKv || block.hash != r.hashes[i]) {
      return stale(absl::StrCat("block ", id, " no longer holds prefix block ", i));
    }
  }
  if (hit.checkpoint == kNoBlock) {
    // No checkpoint: the KDA state starts at zero, so nothing may claim otherwise, and a
    // strict hit (which stops at its checkpoint) has no blocks.
    if (hit.checkpoint_tokens != 0 ||
        (config_.layout.hybrid() && config_.hybrid_mode == HybridHitMode::kStrict && hit.num_tokens != 0)) {
      return stale("checkpoint fields are inconsistent");
    }
  } else {
    const int64_t c = hit.checkpoint_tokens;
    const int64_t step = config_.layout.checkpoint_tokens;
    if (!config_.layout.hybrid() || c <= 0 || c % step != 0 || c > hit.num_tokens ||
        (config_.hybrid_mode == HybridHitMode::kStrict && c != hit.num_tokens) ||
        hit.checkpoint <= kNullBlockId || hit.checkpoint >= pool_.num_blocks()) {
      return stale("checkpoint fields are inconsistent");
    }
    const KvCacheBlock& head = pool_.block(hit.checkpoint);
    if (!head.is_cached || head.kind != StateKind::kLinearState ||
        head.run_head != hit.checkpoint || head.hash != r.hashes[c / b - 1]) {
      return stale("the checkpoint was evicted");
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> KvCacheManager::CheckpointsToSave(const Request& r, int64_t from,
                                                       int64_t to) const {
  std::vector<int64_t> out;
  if (!config_.layout.hybrid() || !config_.enable_prefix_caching) return out;
  const int64_t step = config_.layout.checkpoint_tokens;
  const int64_t b = config_.layout.block_tokens;
  const int64_t known = static_cast<int64_t>(r.hashes.size()) * b;
  for (int64_t boundary = (from / step + 1) * step; boundary <= std::min(to, known);
       boundary += step) {
    if (!pool_.IsCached(r.hashes[boundary / b - 1], StateKind::kLinearState)) {
      out.push_back(boundary);
    }
  }
  return out;
}

void KvCacheManager::CacheFullBlocks(Request& r) {
  const int64_t b = config_.layout.block_tokens;
  const int32_t full = static_cast<int32_t>(
      std::min<int64_t>(r.num_slots / b, static_cast<int64_t>(r.hashes.size())));
  if (full <= r.num_cached_blocks) return;
  const size_t first = static_cast<size_t>(r.num_cached_blocks);
  const size_t n = static_cast<size_t>(full) - first;
  std::optional<BlockHash> parent;
  if (first > 0) parent = r.hashes[first - 1];
  pool_.CacheFullBlocks(std::span<const BlockId>(r.blocks).subspan(first, n),
                        std::span<const BlockHash>(r.hashes).subspan(first, n), parent);
  r.num_cached_blocks = full;
}

absl::StatusOr<SlotAllocation> KvCacheManager::AllocateSlots(RequestId id,
                                                             int64_t num_new_tokens,
                                                             const PrefixHit* hit) {
  Request* r = Find(id);
  if (r == nullptr) return UnknownRequest(id);
  if (num_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_new_tokens=", num_new_tokens, " for request ", id, "; must be >= 0"));
  }
  // Bounded before any arithmetic on it (base + n and the block count would overflow).
  const int64_t capacity_tokens = int64_t{pool_.num_blocks()} * config_.layout.block_tokens;
  if (num_new_tokens > capacity_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("num_new_tokens=", num_new_tokens, " for request ", id,
                                                     " exceeds the whole cache (", capacity_tokens, " tokens)"));
  }
  const bool has_hit = hit != nullptr && (!hit->blocks.empty() || hit->checkpoint != kNoBlock);
  if (has_hit) {
    if (hit->request_id != id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "prefix hit belongs to request ", hit->request_id, ", not ", id));
    }
    if (r->allocated) {
      return absl::FailedPreconditionError(absl::StrCat(
          "request ", id, " already has slots; a prefix hit only goes with its first "
          "AllocateSlots call"));
    }
    RETURN_IF_ERROR(ValidateHit(*r, *hit));
  }
  const int64_t b = config_.layout.block_tokens;
  const int32_t state_pages = config_.layout.state_pages;
  const int64_t base = r->allocated ? r->num_slots : (has_hit ? hit->num_tokens : 0);
  const int64_t total = base + num_new_tokens;
  const int64_t existing_blocks =
      r->allocated ? static_cast<int64_t>(r->blocks.size())
                   : (has_hit ? static_cast<int64_t>(hit->blocks.size()) : 0);
  const int64_t new_blocks = std::max<int64_t>(0, CeilDiv(total, b) - existing_blocks);
  // The first write into a shared, partially filled block copies it.
  const bool cow = r->allocated && num_new_tokens > 0 && r->num_slots % b != 0 &&
                   pool_.block(r->blocks.back()).ref_cnt > 1;
  const bool first = !r->allocated;
  // An import computes nothing: no live state.
  const int64_t live_pages = first && config_.layout.hybrid() && !r->import_checkpoints ? state_pages : 0;
  // The KDA state stands at the restored checkpoint (or 0) before the first step.
  const int64_t state_from = first ? (has_hit ? hit->checkpoint_tokens : 0) : r->num_slots;
  std::vector<int64_t> saves = CheckpointsToSave(*r, state_from, total);
  if (r->import_checkpoints) {  // an import saves only the checkpoints it brings bytes for
    const std::vector<BlockHash>& keep = *r->import_checkpoints;
    std::erase_if(saves, [&](int64_t boundary) {
      return std::find(keep.begin(), keep.end(), r->hashes[static_cast<size_t>(boundary / b - 1)]) == keep.end();
    });
  }
  // Touching a free hit block takes it off the free queue, so it counts against supply.
  int64_t touch_free = 0;
  if (has_hit) {
    for (BlockId blk : hit->blocks) touch_free += pool_.block(blk).ref_cnt == 0 ? 1 : 0;
    if (hit->checkpoint != kNoBlock && pool_.block(hit->checkpoint).ref_cnt == 0) {
      touch_free += state_pages;
    }
  }
  // Checkpoints are a cache: the slots and the live state must fit, the checkpoint runs
  // only as far as free pages last (the latest boundaries first: they make the longest
  // hits). Counting them as required failed a decode step that needed no new block.
  const int64_t need = new_blocks + (cow ? 1 : 0) + live_pages;
  const int64_t supply = pool_.num_free_blocks() - touch_free;
  if (!saves.empty() && state_pages > 0) {
    const int64_t fit = std::max<int64_t>(0, (supply - need) / state_pages);
    if (static_cast<int64_t>(saves.size()) > fit) {
      saves.erase(saves.begin(), saves.end() - fit);
    }
  }
  if (need > supply) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "allocate_slots(request ", id, ", num_new_tokens=", num_new_tokens, ") needs ", need,
        " free blocks but ", supply, " of ", pool_.num_blocks() - 1,
        " are free; free or preempt a request and retry, or raise num_blocks"));
  }

  SlotAllocation out;
  if (first) {
    r->allocated = true;
    if (has_hit) {
      for (BlockId blk : hit->blocks) {
        pool_.Touch(blk);
        r->blocks.push_back(blk);
      }
      r->num_cached_blocks = static_cast<int32_t>(hit->blocks.size());
      r->num_slots = hit->num_tokens;
      live_tokens_ += hit->num_tokens;
      if (hit->checkpoint != kNoBlock) {
        if (pool_.block(hit->checkpoint).ref_cnt == 0) state_pages_in_use_ += state_pages;
        pool_.TouchRun(hit->checkpoint);
        r->checkpoints.push_back({hit->checkpoint_tokens, hit->checkpoint});
      }
    }
    if (live_pages > 0) {
      r->live_state = pool_.GetNewRun(state_pages);
      state_pages_in_use_ += state_pages;
      out.live_state = r->live_state;
      if (has_hit && hit->checkpoint != kNoBlock) {
        out.restore = {hit->checkpoint, r->live_state, state_pages};
      }
    }
  }
  if (cow) {
    const BlockId src = r->blocks.back();
    const BlockId dst = pool_.GetNewBlock();
    pool_.FreeBlock(src);  // ref_cnt > 1: stays with the other holders
    r->blocks.back() = dst;
    out.copies.push_back({src, dst, 1});
    ++cow_copies_;
  }
  r->blocks.reserve(static_cast<size_t>(CeilDiv(total, b)));
  out.first_new_block = static_cast<int32_t>(r->blocks.size());
  out.num_new_blocks = static_cast<int32_t>(new_blocks);
  for (int64_t i = 0; i < new_blocks; ++i) r->blocks.push_back(pool_.GetNewBlock());
  live_tokens_ += total - r->num_slots;
  r->num_slots = total;
  if (config_.enable_prefix_caching) CacheFullBlocks(*r);
  for (int64_t boundary : saves) {
    const size_t idx = static_cast<size_t>(boundary / b - 1);
    const BlockId head = pool_.GetNewRun(state_pages);
    state_pages_in_use_ += state_pages;
    std::optional<BlockHash> parent;
    if (idx > 0) parent = r->hashes[idx - 1];
    pool_.CacheCheckpoint(head, r->hashes[idx], parent);
    r->checkpoints.push_back({boundary, head});
    out.checkpoint_saves.push_back({boundary, r->hashes[idx], head});
  }
  pool_.FlushEvents();
  return out;
}

absl::StatusOr<std::vector<CopyOp>> KvCacheManager::Fork(RequestId parent,
                                                         std::span<const RequestId> children) {
  const Request* p = Find(parent);
  if (p == nullptr) return UnknownRequest(parent);
  RETURN_IF_ERROR(CheckForkChildren(parent, children, [&](RequestId c) { return requests_.contains(c); }));
  // Slots allocated ahead of the known tokens (speculative or lookahead slots) are
  // written later by each holder, into blocks the children would share: copy-on-write
  // only guards the write that adds slots to a shared partial block.
  if (p->num_slots > p->num_known_tokens) {
    return absl::FailedPreconditionError(absl::StrCat(
        "fork of request ", parent, ": it holds slots for ", p->num_slots, " tokens but knows ",
        p->num_known_tokens, "; the ", p->num_slots - p->num_known_tokens,
        " slots ahead would be written by every child into shared blocks; fork before allocating "
        "slots ahead (or AppendTokens for them first)"));
  }
  const int32_t state_pages = config_.layout.state_pages;
  const bool copy_state = p->live_state != kNoBlock;
  const int64_t need = copy_state ? static_cast<int64_t>(children.size()) * state_pages : 0;
  if (need > pool_.num_free_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fork of request ", parent, " into ", children.size(), " needs ", need,
        " free blocks for KDA states but ", pool_.num_free_blocks(),
        " are free; fork fewer or free a request"));
  }
  const Request proto = *p;  // copy: emplace below may move *p
  std::vector<CopyOp> copies;
  for (RequestId c : children) {
    Request child = proto;
    for (BlockId blk : child.blocks) pool_.Touch(blk);
    for (const HeldCheckpoint& cp : child.checkpoints) pool_.TouchRun(cp.head);
    if (copy_state) {
      child.live_state = pool_.GetNewRun(state_pages);
      state_pages_in_use_ += state_pages;
      copies.push_back({proto.live_state, child.live_state, state_pages});
    }
    live_tokens_ += child.num_slots;
    requests_.emplace(c, std::move(child));
  }
  pool_.FlushEvents();
  return copies;
}

absl::Status KvCacheManager::Free(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return UnknownRequest(id);
  Request& r = it->second;
  const int32_t state_pages = config_.layout.state_pages;
  if (r.live_state != kNoBlock) {
    pool_.FreeRun(r.live_state);
    state_pages_in_use_ -= state_pages;
  }
  auto release_checkpoint = [&](BlockId head) {
    if (pool_.block(head).ref_cnt == 1) state_pages_in_use_ -= state_pages;
    pool_.FreeRun(head);
  };
  // Reverse order: the chain's tail enters the free queue first and is evicted first.
  // A checkpoint goes just before the block that ends at its boundary.
  const int64_t b = config_.layout.block_tokens;
  int64_t j = static_cast<int64_t>(r.checkpoints.size()) - 1;
  for (int64_t i = static_cast<int64_t>(r.blocks.size()) - 1; i >= 0; --i) {
    if (i >= 8) pool_.Prefetch(r.blocks[i - 8]);
    while (j >= 0 && r.checkpoints[j].boundary_tokens >= (i + 1) * b) {
      release_checkpoint(r.checkpoints[j--].head);
    }
    pool_.FreeBlock(r.blocks[i]);
  }
  for (; j >= 0; --j) release_checkpoint(r.checkpoints[j].head);
  live_tokens_ -= r.num_slots;
  requests_.erase(it);
  pool_.FlushEvents();
  return absl::OkStatus();
}

absl::Status KvCacheManager::ResetPrefixCache() { return pool_.ResetPrefixCache(); }

absl::StatusOr<int> KvCacheManager::EvictCached(const BlockHash& hash, StateKind kind) {
  return pool_.EvictCached(hash, kind);
}

absl::Status KvCacheManager::EvictCachedBlock(BlockId id) { return pool_.EvictCachedBlock(id); }

std::span<const BlockId> KvCacheManager::BlockTable(RequestId id) const {
  const Request* r = Find(id);
  return r == nullptr ? std::span<const BlockId>() : std::span<const BlockId>(r->blocks);
}

std::span<const BlockHash> KvCacheManager::BlockHashes(RequestId id) const {
  const Request* r = Find(id);
  return r == nullptr ? std::span<const BlockHash>() : std::span<const BlockHash>(r->hashes);
}

int64_t KvCacheManager::NumTokens(RequestId id) const {
  const Request* r = Find(id);
  return r == nullptr ? 0 : r->num_slots;
}

BlockId KvCacheManager::LiveState(RequestId id) const {
  const Request* r = Find(id);
  return r == nullptr ? kNoBlock : r->live_state;
}

std::span<const KvCacheManager::HeldCheckpoint> KvCacheManager::Checkpoints(RequestId id) const {
  const Request* r = Find(id);
  return r == nullptr ? std::span<const HeldCheckpoint>()
                      : std::span<const HeldCheckpoint>(r->checkpoints);
}

CacheUsage KvCacheManager::Usage() const {
  CacheUsage u;
  u.total_blocks = pool_.num_blocks() - 1;
  u.used_blocks = pool_.num_used_blocks();
  u.free_blocks = pool_.num_free_blocks();
  u.state_pages_in_use = state_pages_in_use_;
  u.num_requests = static_cast<int32_t>(requests_.size());
  u.live_tokens = live_tokens_;
  u.reserved_tokens =
      static_cast<int64_t>(u.used_blocks - state_pages_in_use_) * config_.layout.block_tokens;
  u.query_tokens = query_tokens_;
  u.hit_tokens = hit_tokens_;
  u.cow_copies = cow_copies_;
  u.evicted_blocks = pool_.stats().evicted_blocks;
  u.evicted_checkpoints = pool_.stats().evicted_checkpoints;
  return u;
}

}  // namespace kvpool::cache
