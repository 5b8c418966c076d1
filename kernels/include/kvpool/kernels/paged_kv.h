// Paged K/V layouts shared by the GQA and MLA kernels (all backends).
//
// A cache is a pool of `num_pages` fixed-size pages of `page_size` tokens. A sequence's
// tokens live in the pages its block-table row lists, in order:
//
//   token t of sequence b  ->  page  block_table[b * max_blocks + t / page_size]
//                              slot  t % page_size
//
//   block_table row b:  [ p7 | p2 | p9 | unused ... ]     seq_lens[b] = 40, page_size 16
//                         0-15  16-31 32-39 (slots 8..15 of p9 are never read)
//
// Entries at and past ceil(seq_lens[b] / page_size) are never read (they may hold
// anything, e.g. -1). Pages and slots that no sequence covers are never read either:
// tests fill them with NaN to prove it. A sequence with seq_lens[b] == 0 produces
// zeros (and, for KDA-free attention, no NaN).
//
// Memory space: CPU backends take host pointers; the CUDA backend takes device (or
// managed) pointers for every array here, including the block table and seq_lens.
#pragma once

#include <cstdint>

#include "kvpool/kernels/dtype.h"

namespace kvpool::kernels {

// Per-sequence block tables (the layout vLLM and FlashMLA use).
// Most tokens one sequence (or a KDA prefill's cu_seqlens) may hold: token indices are
// int32 and loops step past the end by a tile, so lengths stay well below INT_MAX.
inline constexpr int kMaxSeqLen = 1 << 30;

struct BlockTable {
  const int32_t* block_table = nullptr;  // [batch][max_blocks] page ids in [0, num_pages)
  const int32_t* seq_lens = nullptr;     // [batch] tokens in the cache, incl. new ones
  int batch = 0;                         // number of sequences
  int max_blocks = 0;                    // row stride of block_table, >= ceil(len/page)
};

// GQA K/V pages, token-major inside a page (FlashInfer's "NHD" layout):
//   k, v: [num_pages][page_size][num_kv_heads][head_dim] of `dtype`.
struct GqaPagedKv {
  const void* k = nullptr;  // [num_pages][page_size][num_kv_heads][head_dim]
  const void* v = nullptr;  // [num_pages][page_size][num_kv_heads][head_dim]
  DType dtype = DType::kBf16;
  int num_pages = 0;
  int page_size = 16;    // 1, 16 or 64
  int num_kv_heads = 0;  // >= 1
  int head_dim = 0;      // 64 or 128
};

// MLA latent pages: one shared entry per token, [latent (kv_lora_rank) | rope].
//   entries: [num_pages][page_size][kv_lora_rank + rope_dim] of `dtype`.
struct MlaPagedKv {
  const void* entries = nullptr;  // [num_pages][64][512 + 64]
  DType dtype = DType::kBf16;
  int num_pages = 0;
  int page_size = 64;       // must be 64 (FlashMLA's page size)
  int kv_lora_rank = 512;   // latent dim, must be 512
  int rope_dim = 64;        // decoupled rope dim, must be 64
  int EntryDim() const { return kv_lora_rank + rope_dim; }
};

}  // namespace kvpool::kernels
