#include "kvpool/worker/model/kv_arena.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kvpool/kernels/dtype.h"

namespace kvpool::model {
namespace {

// Page-aligned, so the region can be registered with UCX / pinned as is.
constexpr size_t kAlign = 4096;

}  // namespace

absl::StatusOr<std::unique_ptr<KvArena>> KvArena::Create(const ModelSpec& spec,
                                                         int32_t num_blocks) {
  if (num_blocks < 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "num_blocks=", num_blocks, " leaves no usable page (page 0 is the null block); "
        "set num_blocks >= 2"));
  }
  if (absl::Status s = kernels::CheckCacheDType(spec.kv_dtype, "kv_dtype"); !s.ok()) return s;
  if (spec.IsHybrid() && spec.state_dtype != DType::kFp32) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", spec.name, "': state_dtype=", DTypeName(spec.state_dtype),
        " but the runner keeps KDA states and checkpoints in fp32 (bit-exact restore); "
        "set state_dtype to fp32"));
  }
  std::unique_ptr<KvArena> a(new KvArena());
  a->page_bytes_ = spec.BlockBytes();
  a->block_tokens_ = spec.block_tokens;
  a->kv_dtype_ = spec.kv_dtype;
  a->gqa_ = spec.gqa;
  a->mla_ = spec.mla;
  if (a->page_bytes_ <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", spec.name, "' has no paged (GQA/MLA) layers; the arena's page size "
        "comes from them"));
  }
  const int64_t elem = static_cast<int64_t>(kernels::ElementBytes(spec.kv_dtype));
  int64_t offset = 0;
  for (int l = 0; l < spec.NumLayers(); ++l) {
    const AttentionKind kind = spec.layers[static_cast<size_t>(l)];
    if (kind == AttentionKind::kKda) {
      a->section_of_layer_.push_back(-1);
      continue;
    }
    PagedLayerSection s;
    s.layer = l;
    s.kind = kind;
    s.offset = offset;
    if (kind == AttentionKind::kGqa) {
      s.kernel_page_bytes =
          int64_t{spec.block_tokens} * spec.gqa.num_kv_heads * spec.gqa.head_dim * elem;
      s.bytes = 2 * s.kernel_page_bytes;
    } else {
      s.kernel_page_bytes = int64_t{spec.block_tokens} * spec.mla.EntryDim() * elem;
      s.bytes = s.kernel_page_bytes;
    }
    if (a->page_bytes_ % s.kernel_page_bytes != 0) {
      return absl::UnimplementedError(absl::StrCat(
          "model '", spec.name, "': layer ", l, "'s kernel page (", s.kernel_page_bytes,
          " B) does not divide the block (", a->page_bytes_,
          " B); the runner's kernel views need it to (mixing GQA and MLA layers is not "
          "supported)"));
    }
    s.pages_per_block = static_cast<int32_t>(a->page_bytes_ / s.kernel_page_bytes);
    if (int64_t{num_blocks} * s.pages_per_block > std::numeric_limits<int32_t>::max()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "num_blocks=", num_blocks, " is too large for int32 kernel page ids; lower it"));
    }
    offset += s.bytes;
    a->section_of_layer_.push_back(static_cast<int>(a->sections_.size()));
    a->sections_.push_back(s);
  }
  if (offset != a->page_bytes_) {
    return absl::InternalError(absl::StrCat("block layout adds up to ", offset,
                                            " B but spec.BlockBytes() is ", a->page_bytes_));
  }
  a->state_bytes_ = spec.IsHybrid() ? spec.FixedStateBytes() : 0;
  a->state_pages_ = static_cast<int32_t>((a->state_bytes_ + a->page_bytes_ - 1) / a->page_bytes_);
  a->num_pages_ = num_blocks;
  const size_t bytes = static_cast<size_t>(a->page_bytes_) * static_cast<size_t>(num_blocks);
  const size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded);
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "cannot allocate the KV arena (", bytes, " B for ", num_blocks,
        " blocks); lower num_blocks"));
  }
  std::memset(p, 0, rounded);
  a->base_ = static_cast<std::byte*>(p);
  return a;
}

KvArena::~KvArena() { std::free(base_); }

const PagedLayerSection* KvArena::SectionOf(int layer) const {
  if (layer < 0 || layer >= static_cast<int>(section_of_layer_.size())) return nullptr;
  const int i = section_of_layer_[static_cast<size_t>(layer)];
  return i < 0 ? nullptr : &sections_[static_cast<size_t>(i)];
}

std::byte* KvArena::GqaK(int32_t block, const PagedLayerSection& s, int slot) const {
  const int64_t row = int64_t{gqa_.num_kv_heads} * gqa_.head_dim *
                      static_cast<int64_t>(kernels::ElementBytes(kv_dtype_));
  return PageAddress(block) + s.offset + slot * row;
}

std::byte* KvArena::GqaV(int32_t block, const PagedLayerSection& s, int slot) const {
  return GqaK(block, s, slot) + s.kernel_page_bytes;
}

std::byte* KvArena::MlaEntry(int32_t block, const PagedLayerSection& s, int slot) const {
  const int64_t row =
      int64_t{mla_.EntryDim()} * static_cast<int64_t>(kernels::ElementBytes(kv_dtype_));
  return PageAddress(block) + s.offset + slot * row;
}

kernels::GqaPagedKv KvArena::GqaView(const PagedLayerSection& s) const {
  kernels::GqaPagedKv v;
  v.k = base_ + s.offset;
  v.v = base_ + s.offset + s.kernel_page_bytes;
  v.dtype = kv_dtype_;
  // The last block's section must end inside the arena: ids up to (n-1) * R.
  v.num_pages = (num_pages_ - 1) * s.pages_per_block + 1;
  v.page_size = block_tokens_;
  v.num_kv_heads = gqa_.num_kv_heads;
  v.head_dim = gqa_.head_dim;
  return v;
}

kernels::MlaPagedKv KvArena::MlaView(const PagedLayerSection& s) const {
  kernels::MlaPagedKv v;
  v.entries = base_ + s.offset;
  v.dtype = kv_dtype_;
  v.num_pages = (num_pages_ - 1) * s.pages_per_block + 1;
  v.page_size = block_tokens_;
  v.kv_lora_rank = mla_.kv_lora_rank;
  v.rope_dim = mla_.rope_dim;
  return v;
}

void KvArena::CopyPage(int32_t src, int32_t dst) const {
  if (src == dst) return;
  std::memcpy(PageAddress(dst), PageAddress(src), static_cast<size_t>(page_bytes_));
}

void KvArena::ReadState(std::span<const int32_t> run, int64_t offset,
                        std::span<std::byte> out) const {
  int64_t done = 0;
  const int64_t n = static_cast<int64_t>(out.size());
  while (done < n) {
    const int64_t pos = offset + done;
    const int64_t in_page = pos % page_bytes_;
    const int64_t chunk = std::min(n - done, page_bytes_ - in_page);
    std::memcpy(out.data() + done, PageAddress(run[static_cast<size_t>(pos / page_bytes_)]) + in_page,
                static_cast<size_t>(chunk));
    done += chunk;
  }
}

void KvArena::WriteState(std::span<const int32_t> run, int64_t offset,
                         std::span<const std::byte> in) const {
  int64_t done = 0;
  const int64_t n = static_cast<int64_t>(in.size());
  while (done < n) {
    const int64_t pos = offset + done;
    const int64_t in_page = pos % page_bytes_;
    const int64_t chunk = std::min(n - done, page_bytes_ - in_page);
    std::memcpy(PageAddress(run[static_cast<size_t>(pos / page_bytes_)]) + in_page,
                in.data() + done, static_cast<size_t>(chunk));
    done += chunk;
  }
}

}  // namespace kvpool::model
