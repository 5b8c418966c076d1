// Deterministic seeded weights for the computable (tiny-*) model presets.
//
// Every process that calls ModelWeights::Generate(spec, seed) with the same spec and
// seed gets the same weights, bit for bit: each tensor draws from its own SplitMix64
// stream, seeded by (seed, layer, tensor tag), and floats come from the top 24 bits of
// each draw (exact in fp32). No libm call is involved, so the bits do not depend on the
// host's math library either.
//
// The model (pre-norm residual decoder, RMSNorm eps 1e-5, hidden H = spec.hidden_size):
//
//   x = embedding[token]
//   per layer:  x += Attn(RMSNorm(x) * attn_norm)        GQA | MLA | KDA (below)
//               x += W_down (silu(W_gate xn) * W_up xn)  SwiGLU MLP, intermediate 2H
//   hidden = RMSNorm(x) * final_norm;  logits = hidden @ lm_head;  next = argmax
//
//   GQA  q = W_q xn [Hq][d], k = W_k xn, v = W_v xn [Hkv][d]; RoPE(q, k) at the token's
//        position (theta 10000, rotate-half); paged causal attention; out @ W_o.
//   MLA  latent c = RMSNorm(W_dkv xn) [512] (unit weight), k_rope = RoPE(W_kr xn) [64];
//        cache entry = [c | k_rope]. q_nope_h = W_qn xn [nope], q_rope_h = RoPE(W_qr xn);
//        absorbed q_h = [W_UK_h^T q_nope_h | q_rope_h] (576); latent attention; then
//        v_h = W_UV_h o_h [dv]; concat heads @ W_o. scale = 1/sqrt(nope + rope).
//   KDA  q, k = W_q xn, W_k xn [heads][d_k] (l2-normalised by the kernel), v = W_v xn,
//        beta = sigmoid(W_b xn) [heads], g = -softplus(W_a xn + a_bias) [heads][d_k];
//        gated delta rule; out @ W_o.
//
// Matrices are stored input-major ([in][out], y = x @ W) so a matvec walks contiguous
// rows and accumulates each output in a fixed order, independent of batching.
//
// Thread safety: immutable after Generate; share freely.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvpool/common/model_spec.h"

namespace kvpool::model {

// SplitMix64: a tiny, fixed, portable PRNG (Steele et al. 2014).
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next();
  // Uniform in [lo, hi), from the top 24 bits of one draw.
  float Uniform(float lo, float hi);

 private:
  uint64_t state_;
};

// A dense matrix, input-major: w[i * out + o]; y = x @ W.
struct Matrix {
  int in = 0;
  int out = 0;
  std::vector<float> w;  // [in][out]
};

struct GqaWeights {
  Matrix wq;  // H -> num_q_heads * head_dim
  Matrix wk;  // H -> num_kv_heads * head_dim
  Matrix wv;  // H -> num_kv_heads * head_dim
  Matrix wo;  // num_q_heads * head_dim -> H
};

struct MlaWeights {
  Matrix w_dkv;               // H -> kv_lora_rank (the latent)
  Matrix w_kr;                // H -> rope_dim (the shared rope key)
  Matrix w_qn;                // H -> num_heads * qk_nope_dim
  Matrix w_qr;                // H -> num_heads * rope_dim
  std::vector<float> w_uk;    // [num_heads][qk_nope_dim][kv_lora_rank]  k_nope = W_UK c
  std::vector<float> w_uv;    // [num_heads][v_head_dim][kv_lora_rank]   v = W_UV c
  Matrix wo;                  // num_heads * v_head_dim -> H
};

struct KdaWeights {
  Matrix wq;                     // H -> num_heads * d_k
  Matrix wk;                     // H -> num_heads * d_k
  Matrix wv;                     // H -> num_heads * d_v
  Matrix w_beta;                 // H -> num_heads
  Matrix w_alpha;                // H -> num_heads * d_k
  std::vector<float> alpha_bias; // [num_heads * d_k]
  Matrix wo;                     // num_heads * d_v -> H
};

struct MlpWeights {
  Matrix gate;  // H -> 2H
  Matrix up;    // H -> 2H
  Matrix down;  // 2H -> H
};

struct LayerWeights {
  AttentionKind kind = AttentionKind::kGqa;
  std::vector<float> attn_norm;  // [H]
  std::vector<float> mlp_norm;   // [H]
  GqaWeights gqa;                // kind == kGqa
  MlaWeights mla;                // kind == kMla
  KdaWeights kda;                // kind == kKda
  MlpWeights mlp;
};

struct ModelWeights {
  // FAILED_PRECONDITION for a spec that is not computable (real-shape presets run in
  // accounting mode); INVALID_ARGUMENT for dims the runner does not support.
  static absl::StatusOr<ModelWeights> Generate(const ModelSpec& spec, uint64_t seed);

  uint64_t seed = 0;
  int hidden = 0;
  int vocab = 0;
  std::vector<float> embedding;   // [vocab][H]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // [H]
  Matrix lm_head;                 // H -> vocab

  // XXH3-64 over every tensor in a fixed order: equal in every process that generated
  // the same weights (a cheap cross-process check).
  uint64_t Fingerprint() const;
  // Number of parameters.
  int64_t NumParameters() const;
};

}  // namespace kvpool::model
