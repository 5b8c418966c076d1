// Multi-head latent attention (DeepSeek MLA) over paged latent entries.
//
// Each cached token is one entry c = [latent (512) | k_rope (64)] (576 elements),
// shared by every head. Two modes compute the same attention:
//
// Absorbed decode (FlashMLA's mode; what decode uses): query head h brings
//   q_h = [W_UK_h^T q_nope_h (512) | q_rope_h (64)]       (576, absorbed by the caller)
// and scores every entry with one 576-wide dot product; the output accumulates the
// 512-wide latents: o_h = sum_t softmax_t(scale * q_h . c_t) * c_t[0:512]. The caller
// applies W_UV_h to get the per-head value. Page size must be 64.
//
// Materialized (MHA) mode (what prefill uses): K and V are up-projected first,
//   k_h(t) = [W_UK_h c_t[0:512] (qk_nope_dim) | c_t[512:576] (rope)],
//   v_h(t) = W_UV_h c_t[0:512]                                   (v_head_dim)
// and ordinary causal attention runs per head over packed queries (q_indptr as in
// GqaPrefillParams: the new tokens are the last q_len of seq_lens). With
// q_abs = W_UK_h^T q_nope the two modes are equal up to rounding; a test checks it.
#pragma once

#include <cstdint>

#include "kvpool/kernels/paged_kv.h"

namespace kvpool::kernels {

inline constexpr int kMlaPageSize = 64;
inline constexpr int kMlaSplitTokens = 1024;  // split-K chunk of an absorbed decode

struct MlaDecodeParams {
  const float* q = nullptr;  // [batch][num_heads][576]: absorbed q_nope | q_rope
  float* out = nullptr;      // [batch][num_heads][512]: softmax-weighted latents
  MlaPagedKv kv;
  BlockTable table;          // seq_lens include the new token
  int num_heads = 0;         // >= 1
  float scale = 0.f;         // required (> 0): 1/sqrt(qk_nope_dim + rope_dim) upstream
};

struct MlaMaterializedParams {
  const float* q_nope = nullptr;    // [total_q][num_heads][qk_nope_dim]
  const float* q_rope = nullptr;    // [total_q][num_heads][rope_dim]
  const int32_t* q_indptr = nullptr;  // [batch + 1]
  const float* w_uk = nullptr;      // [num_heads][qk_nope_dim][512]  k_nope = W_UK c
  const float* w_uv = nullptr;      // [num_heads][v_head_dim][512]   v = W_UV c
  float* out = nullptr;             // [total_q][num_heads][v_head_dim]
  MlaPagedKv kv;
  BlockTable table;
  int num_heads = 0;
  int qk_nope_dim = 0;              // 1..256
  int v_head_dim = 0;               // 1..256
  float scale = 0.f;                // required (> 0)
};

}  // namespace kvpool::kernels
