#include "kvpool/worker/cache/contiguous_cache_manager.h"

#include <iterator>
#include <utility>

#include "absl/strings/str_cat.h"
#include "fork_check.h"
#include "kvpool/common/status.h"

namespace kvpool::cache {
namespace {

// Blocks reserved per request: max_model_len tokens rounded up to whole blocks, without
// the (max_model_len + block_tokens - 1) that overflows for a huge max_model_len.
int64_t ReserveBlocks(const CacheConfig& c) {
  const int64_t bt = c.layout.block_tokens;
  return c.max_model_len / bt + (c.max_model_len % bt != 0 ? 1 : 0);
}

}  // namespace

absl::StatusOr<std::unique_ptr<ContiguousCacheManager>> ContiguousCacheManager::Create(
    CacheConfig config) {
  RETURN_IF_ERROR(config.Validate());
  if (config.max_model_len <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_model_len=", config.max_model_len, ": the contiguous policy reserves "
        "max_model_len tokens per request; set it to prompt + longest output"));
  }
  if (config.layout.hybrid()) {
    return absl::InvalidArgumentError(
        "the contiguous policy models paged attention only; use policy 'paged' for hybrid "
        "(KDA) layouts");
  }
  const int64_t reserve = ReserveBlocks(config);
  if (reserve > config.num_blocks - 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_model_len=", config.max_model_len, " needs ", reserve, " blocks per request but "
        "the pool has ", config.num_blocks - 1, "; raise num_blocks or lower max_model_len"));
  }
  return std::unique_ptr<ContiguousCacheManager>(new ContiguousCacheManager(std::move(config)));
}

ContiguousCacheManager::ContiguousCacheManager(CacheConfig config)
    : config_(std::move(config)),
      block_tokens_(config_.layout.block_tokens),
      reserve_blocks_(static_cast<int32_t>(ReserveBlocks(config_))),
      free_blocks_(config_.num_blocks - 1) {
  free_ranges_.emplace(1, config_.num_blocks - 1);  // block 0 stays the null block
}

BlockId ContiguousCacheManager::Reserve() {
  for (auto it = free_ranges_.begin(); it != free_ranges_.end(); ++it) {
    if (it->second < reserve_blocks_) continue;
    const BlockId start = it->first;
    const int32_t left = it->second - reserve_blocks_;
    free_ranges_.erase(it);
    if (left > 0) free_ranges_.emplace(start + reserve_blocks_, left);
    free_blocks_ -= reserve_blocks_;
    return start;
  }
  return kNoBlock;
}

void ContiguousCacheManager::Release(BlockId start) {
  BlockId s = start;
  int32_t len = reserve_blocks_;
  auto next = free_ranges_.lower_bound(start);
  if (next != free_ranges_.end() && next->first == s + len) {  // merge with the right
    len += next->second;
    next = free_ranges_.erase(next);
  }
  if (next != free_ranges_.begin()) {  // merge with the left
    auto prev = std::prev(next);
    if (prev->first + prev->second == s) {
      s = prev->first;
      len += prev->second;
      free_ranges_.erase(prev);
    }
  }
  free_ranges_.emplace(s, len);
  free_blocks_ += reserve_blocks_;
}

absl::Status ContiguousCacheManager::AddRequest(RequestSpec spec) {
  if (requests_.contains(spec.id)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "request ", spec.id, " is already in the cache; Free it first or use a new id"));
  }
  const int64_t prompt = spec.prompt_tokens.empty()
                             ? spec.num_prompt_tokens
                             : static_cast<int64_t>(spec.prompt_tokens.size());
  if (prompt <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", spec.id, " has no prompt: set prompt_tokens or num_prompt_tokens > 0"));
  }
  if (prompt > config_.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request ", spec.id, " has a ", prompt, "-token prompt but the contiguous policy "
        "reserves max_model_len=", config_.max_model_len, "; raise max_model_len"));
  }
  Request r;
  r.num_prompt_tokens = prompt;
  requests_.emplace(spec.id, std::move(r));
  return absl::OkStatus();
}

absl::Status ContiguousCacheManager::AppendTokens(RequestId id, std::span<const TokenId>) {
  if (!requests_.contains(id)) {
    return absl::NotFoundError(absl::StrCat("request ", id, " is not known to the cache"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PrefixHit> ContiguousCacheManager::GetComputedBlocks(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", id, " is not known to the cache"));
  }
  query_tokens_ += static_cast<uint64_t>(it->second.num_prompt_tokens);
  PrefixHit hit;
  hit.request_id = id;
  return hit;  // no prefix caching in the baseline
}

absl::StatusOr<SlotAllocation> ContiguousCacheManager::AllocateSlots(RequestId id,
                                                                     int64_t num_new_tokens,
                                                                     const PrefixHit* hit) {
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", id, " is not known to the cache"));
  }
  if (num_new_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_new_tokens=", num_new_tokens, " for request ", id, "; must be >= 0"));
  }
  if (hit != nullptr && (!hit->blocks.empty() || hit->checkpoint != kNoBlock)) {
    return absl::InvalidArgumentError(
        "the contiguous policy has no prefix cache; pass the (empty) hit it returned");
  }
  Request& r = it->second;
  // Compared without adding (num_new_tokens near INT64_MAX overflowed the sum).
  if (num_new_tokens > config_.max_model_len - r.num_slots) {
    return absl::OutOfRangeError(absl::StrCat(
        "request ", id, " needs ", r.num_slots, " + ", num_new_tokens,
        " tokens but the contiguous policy reserved max_model_len=", config_.max_model_len,
        "; stop generation there or raise max_model_len"));
  }
  SlotAllocation out;
  if (r.blocks.empty()) {
    const BlockId start = Reserve();
    if (start == kNoBlock) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "no contiguous range of ", reserve_blocks_, " blocks is free (", free_blocks_,
          " free blocks in all); free a request and retry"));
    }
    r.blocks.resize(static_cast<size_t>(reserve_blocks_));
    for (int32_t i = 0; i < reserve_blocks_; ++i) r.blocks[i] = start + i;
    out.num_new_blocks = reserve_blocks_;
  }
  r.num_slots += num_new_tokens;
  live_tokens_ += num_new_tokens;
  return out;
}

absl::StatusOr<std::vector<CopyOp>> ContiguousCacheManager::Fork(
    RequestId parent, std::span<const RequestId> children) {
  auto it = requests_.find(parent);
  if (it == requests_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", parent, " is not known to the cache"));
  }
  RETURN_IF_ERROR(CheckForkChildren(parent, children, [&](RequestId c) { return requests_.contains(c); }));
  const Request proto = it->second;
  const bool reserved = !proto.blocks.empty();
  if (reserved && static_cast<int64_t>(children.size()) * reserve_blocks_ > free_blocks_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "fork of request ", parent, " into ", children.size(), " needs ",
        children.size() * reserve_blocks_, " blocks but ", free_blocks_, " are free"));
  }
  std::vector<CopyOp> copies;
  std::vector<RequestId> made;
  for (RequestId c : children) {
    Request child = proto;
    if (reserved) {
      const BlockId start = Reserve();
      if (start == kNoBlock) {  // fragmented: undo what this call did
        for (RequestId m : made) {
          Release(requests_[m].blocks.front());
          live_tokens_ -= requests_[m].num_slots;
          requests_.erase(m);
        }
        return absl::ResourceExhaustedError(absl::StrCat(
            "fork of request ", parent, ": no contiguous range of ", reserve_blocks_,
            " blocks is free; free a request and retry"));
      }
      // No sharing: every used block of the parent is copied up front.
      const int64_t used = (proto.num_slots + block_tokens_ - 1) / block_tokens_;
      for (int32_t i = 0; i < reserve_blocks_; ++i) child.blocks[i] = start + i;
      for (int64_t i = 0; i < used; ++i) copies.push_back({proto.blocks[i], child.blocks[i], 1});
    }
    live_tokens_ += child.num_slots;
    requests_.emplace(c, std::move(child));
    made.push_back(c);
  }
  return copies;
}

absl::Status ContiguousCacheManager::Free(RequestId id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) {
    return absl::NotFoundError(absl::StrCat("request ", id, " is not known to the cache"));
  }
  if (!it->second.blocks.empty()) Release(it->second.blocks.front());
  live_tokens_ -= it->second.num_slots;
  requests_.erase(it);
  return absl::OkStatus();
}

absl::Status ContiguousCacheManager::ResetPrefixCache() {
  if (free_blocks_ != config_.num_blocks - 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "reset_prefix_cache refused: ", config_.num_blocks - 1 - free_blocks_,
        " block(s) are in use; free every running request first"));
  }
  return absl::OkStatus();  // nothing is cached
}

std::span<const BlockId> ContiguousCacheManager::BlockTable(RequestId id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? std::span<const BlockId>()
                               : std::span<const BlockId>(it->second.blocks);
}

int64_t ContiguousCacheManager::NumTokens(RequestId id) const {
  auto it = requests_.find(id);
  return it == requests_.end() ? 0 : it->second.num_slots;
}

CacheUsage ContiguousCacheManager::Usage() const {
  CacheUsage u;
  u.total_blocks = config_.num_blocks - 1;
  u.free_blocks = free_blocks_;
  u.used_blocks = u.total_blocks - free_blocks_;
  u.num_requests = static_cast<int32_t>(requests_.size());
  u.live_tokens = live_tokens_;
  u.reserved_tokens = static_cast<int64_t>(u.used_blocks) * block_tokens_;
  u.query_tokens = query_tokens_;
  return u;
}

}  // namespace kvpool::cache
