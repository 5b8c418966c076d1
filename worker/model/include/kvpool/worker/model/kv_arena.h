// KvArena: the worker's KV pool payload — one contiguous, page-aligned buffer of
// `num_blocks` pages, indexed by the cache manager's block ids. Later it is registered
// with UCX once, so pages fetched from a pool node land in place (no staging copy).
//
//   base                                                     page_bytes = spec.BlockBytes()
//   | page 0 (null) | page 1 | page 2 | ... | page num_blocks-1 |
//     address(id) = base + id * page_bytes
//
// A page is either a KV block (all paged layers of block_tokens tokens) or one page of
// a KDA state run (a request's live state or a checkpoint), exactly as the cache
// manager (worker/cache) lays them out.
//
// BLOCK BYTE LAYOUT (what pool nodes store and fetch for one block hash). Paged layers
// (GQA, MLA; KDA layers take no bytes in a block) in model order, each a section of
// block_tokens tokens, element type spec.kv_dtype (bf16 for the tiny presets), little
// endian, no padding:
//
//   GQA layer section: K [block_tokens][num_kv_heads][head_dim], then V, same shape
//                      (FlashInfer "NHD"; K/V after RoPE)
//   MLA layer section: [block_tokens][kv_lora_rank + rope_dim]  (latent | rope key)
//
//   tiny-gqa  : 4 x (K 16x2x64 + V 16x2x64) bf16 = 4 x 8 KiB = 32 KiB per block
//   tiny-mla  : 2 x 64x576 bf16              = 2 x 72 KiB = 144 KiB per block
//   tiny-hybrid: 1 x 64x576 bf16             = 72 KiB per block
//
// STATE BYTE LAYOUT (a KDA live state or checkpoint, keyed by the hash of the block that
// ends at its boundary): [kda_layer][num_heads][d_k][d_v] fp32, kda_layer counting KDA
// layers in model order; spec.FixedStateBytes() bytes spread over the run's pages in
// order (byte j in run page j / page_bytes at offset j % page_bytes; the tail of the
// last page is unused). tiny-hybrid: 3 x 2 x 64 x 64 x 4 = 96 KiB in 2 pages.
//
// Kernel views: the kernels want each layer's pages as [num_pages][page][...] with a
// fixed stride. A layer section of block b starts at base + b * page_bytes + offset, so
// a view whose pointer is base + offset and whose page size is the section (or K/V
// half) size addresses block b as kernel page b * R, R = page_bytes / section bytes.
// Create refuses specs where R is not an integer (no tiny preset is such a spec).
//
// Thread safety: the buffer is plain memory; the owner (ModelRunner) serializes writes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "absl/status/statusor.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/kernels/paged_kv.h"

namespace kvpool::model {

// One paged layer's section inside a block.
struct PagedLayerSection {
  int layer = 0;                 // index in spec.layers
  AttentionKind kind = AttentionKind::kGqa;
  int64_t offset = 0;            // bytes from the start of the block
  int64_t bytes = 0;             // GQA: K + V; MLA: the entries
  // Bytes of one kernel page: GQA K (or V) half, MLA the whole section.
  int64_t kernel_page_bytes = 0;
  int32_t pages_per_block = 0;   // R: kernel page id of block b is b * R
};

class KvArena {
 public:
  // Page bytes = spec.BlockBytes(); num_blocks >= 2 (page 0 is the null block).
  static absl::StatusOr<std::unique_ptr<KvArena>> Create(const ModelSpec& spec,
                                                         int32_t num_blocks);
  ~KvArena();
  KvArena(const KvArena&) = delete;
  KvArena& operator=(const KvArena&) = delete;

  // --- the registered region -------------------------------------------------------
  std::byte* base() const { return base_; }
  int64_t page_bytes() const { return page_bytes_; }
  int32_t num_pages() const { return num_pages_; }
  int64_t size_bytes() const { return page_bytes_ * num_pages_; }
  // REQUIRES: 0 <= id < num_pages().
  std::byte* PageAddress(int32_t id) const { return base_ + id * page_bytes_; }
  std::span<std::byte> Page(int32_t id) const {
    return {PageAddress(id), static_cast<size_t>(page_bytes_)};
  }

  // --- layouts ---------------------------------------------------------------------
  const std::vector<PagedLayerSection>& sections() const { return sections_; }
  // The section of model layer `layer`, or nullptr for a KDA layer.
  const PagedLayerSection* SectionOf(int layer) const;
  int64_t state_bytes() const { return state_bytes_; }   // spec.FixedStateBytes()
  int32_t state_pages() const { return state_pages_; }   // pages per KDA state run

  // Address of token slot `slot` of block `block` in a GQA section (K or V) or MLA
  // section; element type spec.kv_dtype.
  std::byte* GqaK(int32_t block, const PagedLayerSection& s, int slot) const;
  std::byte* GqaV(int32_t block, const PagedLayerSection& s, int slot) const;
  std::byte* MlaEntry(int32_t block, const PagedLayerSection& s, int slot) const;

  // Kernel views of one section over the whole arena (kernel page id = block * R).
  kernels::GqaPagedKv GqaView(const PagedLayerSection& s) const;
  kernels::MlaPagedKv MlaView(const PagedLayerSection& s) const;

  // --- payload moves ---------------------------------------------------------------
  void CopyPage(int32_t src, int32_t dst) const;
  // State bytes [offset, offset + bytes.size()) of a run (pages head first) from / to
  // a flat buffer.
  void ReadState(std::span<const int32_t> run, int64_t offset, std::span<std::byte> out) const;
  void WriteState(std::span<const int32_t> run, int64_t offset,
                  std::span<const std::byte> in) const;

 private:
  KvArena() = default;

  std::byte* base_ = nullptr;
  int64_t page_bytes_ = 0;
  int32_t num_pages_ = 0;
  int block_tokens_ = 0;
  DType kv_dtype_ = DType::kBf16;
  GqaDims gqa_;
  MlaDims mla_;
  std::vector<PagedLayerSection> sections_;
  std::vector<int> section_of_layer_;  // -1 for KDA layers
  int64_t state_bytes_ = 0;
  int32_t state_pages_ = 0;
};

}  // namespace kvpool::model
