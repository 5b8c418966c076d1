#include "kvpool/worker/cache/cache_config.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/worker/cache/cache_manager.h"
#include "kvpool/worker/cache/contiguous_cache_manager.h"
#include "kvpool/worker/cache/kv_cache_manager.h"

namespace kvpool::cache {

absl::StatusOr<CacheLayout> CacheLayout::FromModelSpec(const ModelSpec& spec) {
  RETURN_IF_ERROR(spec.Validate());
  CacheLayout layout;
  layout.block_tokens = spec.block_tokens;
  layout.page_bytes = spec.BlockBytes();
  for (AttentionKind kind : {AttentionKind::kGqa, AttentionKind::kMla}) {
    const int n = spec.NumLayers(kind);
    if (n == 0) continue;
    layout.groups.push_back({.attention = kind,
                             .state = StateKind::kAttnKv,
                             .num_layers = n,
                             .bytes = spec.KvBytesPerTokenPerLayer(kind) * n * spec.block_tokens});
  }
  if (spec.IsHybrid()) {
    const int64_t state = spec.FixedStateBytes();
    layout.groups.push_back({.attention = AttentionKind::kKda,
                             .state = StateKind::kLinearState,
                             .num_layers = spec.NumLayers(AttentionKind::kKda),
                             .bytes = state});
    if (layout.page_bytes <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", spec.name, "' has KDA layers but no paged layers; the pool's page size "
          "comes from the paged (GQA/MLA) layers, so add at least one"));
    }
    layout.state_pages = static_cast<int32_t>((state + layout.page_bytes - 1) / layout.page_bytes);
    layout.checkpoint_tokens = spec.checkpoint_tokens;
  }
  return layout;
}

CacheLayout CacheLayout::Paged(int32_t block_tokens) {
  CacheLayout layout;
  layout.block_tokens = block_tokens;
  return layout;
}

CacheLayout CacheLayout::Hybrid(int32_t block_tokens, int32_t state_pages,
                                int32_t checkpoint_tokens) {
  CacheLayout layout;
  layout.block_tokens = block_tokens;
  layout.state_pages = state_pages;
  layout.checkpoint_tokens = checkpoint_tokens;
  return layout;
}

absl::string_view HybridHitModeName(HybridHitMode mode) {
  return mode == HybridHitMode::kStrict ? "strict" : "replay";
}

absl::StatusOr<HybridHitMode> ParseHybridHitMode(absl::string_view name) {
  if (name == "strict") return HybridHitMode::kStrict;
  if (name == "replay") return HybridHitMode::kReplay;
  return absl::InvalidArgumentError(
      absl::StrCat("hybrid hit mode '", name, "' is unknown; use 'strict' or 'replay'"));
}

absl::Status CacheConfig::Validate() const {
  if (num_blocks < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_blocks=", num_blocks, " leaves no usable block (block 0 is the null block); "
        "set num_blocks >= 2"));
  }
  if (layout.block_tokens <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout.block_tokens=", layout.block_tokens, " must be > 0; e.g. 16 (GQA) or 64 (MLA)"));
  }
  if (layout.state_pages < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout.state_pages=", layout.state_pages, " must be >= 0"));
  }
  if (layout.hybrid()) {
    if (layout.checkpoint_tokens <= 0 || layout.checkpoint_tokens % layout.block_tokens != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layout.checkpoint_tokens=", layout.checkpoint_tokens,
          " must be a positive multiple of block_tokens=", layout.block_tokens,
          "; e.g. 6144 with 64-token blocks"));
    }
    if (layout.state_pages >= num_blocks - 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "num_blocks=", num_blocks, " cannot hold one KDA state of ", layout.state_pages,
          " pages plus a block; raise num_blocks"));
    }
  }
  if (max_model_len < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_model_len=", max_model_len, " must be >= 0"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<CacheManager>> CreateCacheManager(absl::string_view policy,
                                                                 CacheConfig config) {
  if (policy == "paged") {
    ASSIGN_OR_RETURN(auto m, KvCacheManager::Create(std::move(config)));
    return std::unique_ptr<CacheManager>(std::move(m));
  }
  if (policy == "contiguous") {
    ASSIGN_OR_RETURN(auto m, ContiguousCacheManager::Create(std::move(config)));
    return std::unique_ptr<CacheManager>(std::move(m));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("cache policy '", policy, "' is unknown; use 'paged' or 'contiguous'"));
}

}  // namespace kvpool::cache
