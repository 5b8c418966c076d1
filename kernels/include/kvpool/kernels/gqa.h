// Paged grouped-query attention (GQA; MHA and MQA are the group sizes 1 and n_q).
//
// Query head h reads K/V head h / (num_q_heads / num_kv_heads). Scores are
// scale * q.k, softmax in fp32 with a running max (online softmax), and the output is
// the fp32 softmax-weighted sum of V. Outputs of zero-length sequences, and of rows whose
// every score is -inf (q.k overflowed), are zeros.
//
// Decode: one new query token per sequence, whose K/V is already in the cache (so it
// attends to all seq_lens[b] tokens). Long contexts are split into chunks of
// `kGqaSplitTokens` tokens that are reduced independently and merged in a fixed order,
// so results do not depend on the thread count.
//
// Prefill: q_len[b] = q_indptr[b+1] - q_indptr[b] new tokens per sequence, already
// appended to the cache (they are the last q_len[b] of seq_lens[b] tokens). Query i
// of sequence b sits at position p = seq_lens[b] - q_len[b] + i and attends causally
// to cache positions 0..p (the cached prefix plus the new tokens up to itself).
//
//   cache positions: [ cached prefix .......... | new 0 | new 1 | new 2 ]
//   query new 1 sees: ^-------------------------------------^
#pragma once

#include <cstdint>

#include "kvpool/kernels/paged_kv.h"

namespace kvpool::kernels {

// Tokens per split-K chunk of a decode; a multiple of every supported page size.
inline constexpr int kGqaSplitTokens = 1024;

struct GqaDecodeParams {
  const float* q = nullptr;  // [batch][num_q_heads][head_dim]
  float* out = nullptr;      // [batch][num_q_heads][head_dim]
  GqaPagedKv kv;
  BlockTable table;          // table.batch rows; seq_lens include the new token
  int num_q_heads = 0;       // a multiple of kv.num_kv_heads
  float scale = 0.f;         // softmax scale, >= 0; 0 means 1/sqrt(head_dim)
};

struct GqaPrefillParams {
  const float* q = nullptr;         // [total_q][num_q_heads][head_dim], sequences packed
  const int32_t* q_indptr = nullptr;  // [batch + 1], q_indptr[0] == 0, nondecreasing
  float* out = nullptr;             // [total_q][num_q_heads][head_dim]
  GqaPagedKv kv;
  BlockTable table;                 // seq_lens[b] >= q_len[b]
  int num_q_heads = 0;
  float scale = 0.f;                // >= 0; 0 means 1/sqrt(head_dim)
};

}  // namespace kvpool::kernels
