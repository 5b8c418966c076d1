// Kimi delta attention (KDA): the gated delta rule with a per-channel decay.
//
// Per head, the state S is d_k x d_v in fp32 and each token t brings q_t, k_t (d_k),
// v_t (d_v), a log-decay g_t (d_k, <= 0; alpha_t = exp(g_t); -inf resets the channel)
// and a write strength beta_t:
//
//   S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T
//   o_t = scale * S_t^T q_t
//
// With `l2_normalize_qk`, q_t and k_t are first multiplied by 1/sqrt(sum x^2 + 1e-6)
// (flash-linear-attention's l2norm).
//
// States live in a pool of slots, [num_slots][num_heads][d_k][d_v] fp32, addressed
// by slot index; a call touches only the slots it names, others stay bit-identical.
//
// Decode: one token per sequence, one recurrent step on its slot.
// Chunked prefill: a packed batch of token runs (cu_seqlens); each run starts from
// its slot's state and leaves its final state there. Chunks of kKdaChunk tokens are
// aligned to absolute positions (start_pos[b] is the absolute position of the run's
// first token), so a run resumed from a chunk-boundary state computes exactly the
// chunks an uninterrupted run does. When `boundary_states` is set, the state after
// every absolute position that is a multiple of kKdaChunk inside the run (i.e. after
// token p-1 for p in (start, start+len], p % 64 == 0) is copied out, in order:
//
//   start_pos 60, len 100: boundaries after absolute tokens 63 and 127 -> 2 states
//
// KdaCountBoundaries gives the count per run; boundary_indptr is its prefix sum.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace kvpool::kernels {

inline constexpr int kKdaChunk = 64;

struct KdaStatePool {
  float* states = nullptr;  // [num_slots][num_heads][d_k][d_v], updated in place
  int num_slots = 0;
  int num_heads = 0;
  int d_k = 0;              // 1..256
  int d_v = 0;              // 1..256
};

struct KdaDecodeParams {
  const float* q = nullptr;       // [batch][num_heads][d_k]
  const float* k = nullptr;       // [batch][num_heads][d_k]
  const float* v = nullptr;       // [batch][num_heads][d_v]
  const float* g = nullptr;       // [batch][num_heads][d_k] log decay, <= 0
  const float* beta = nullptr;    // [batch][num_heads]
  const int32_t* slots = nullptr; // [batch] distinct slot ids in [0, num_slots)
  float* out = nullptr;           // [batch][num_heads][d_v]
  KdaStatePool pool;
  int batch = 0;
  float scale = 0.f;              // 0 means 1/sqrt(d_k)
  bool l2_normalize_qk = false;
};

struct KdaPrefillParams {
  const float* q = nullptr;           // [total][num_heads][d_k], runs packed
  const float* k = nullptr;           // [total][num_heads][d_k]
  const float* v = nullptr;           // [total][num_heads][d_v]
  const float* g = nullptr;           // [total][num_heads][d_k] log decay, <= 0
  const float* beta = nullptr;        // [total][num_heads]
  const int32_t* cu_seqlens = nullptr;  // [batch + 1], cu_seqlens[0] == 0
  const int32_t* start_pos = nullptr;   // [batch] absolute position of each run's
                                        // first token; nullptr means all 0
  const int32_t* slots = nullptr;     // [batch] distinct slot ids
  float* out = nullptr;               // [total][num_heads][d_v]
  KdaStatePool pool;
  int batch = 0;
  float scale = 0.f;
  bool l2_normalize_qk = false;
  // Optional checkpoint hook: [boundary_indptr[batch]][num_heads][d_k][d_v].
  float* boundary_states = nullptr;
  const int32_t* boundary_indptr = nullptr;  // [batch + 1] prefix sums of the counts
};

// Number of chunk boundaries (absolute positions p % kKdaChunk == 0) in
// (start_pos, start_pos + len].
inline int KdaCountBoundaries(int64_t start_pos, int64_t len) {
  return static_cast<int>((start_pos + len) / kKdaChunk - start_pos / kKdaChunk);
}

}  // namespace kvpool::kernels
