#include "kvpool/worker/model/weights.h"

#include <cmath>
#include <cstring>
#include <span>

#include "absl/strings/str_cat.h"
#include "kvpool/common/hash.h"

namespace kvpool::model {
namespace {

// Tensor tags: each tensor's stream is seeded by (seed, layer, tag), so adding a tensor
// never shifts the values of another.
enum Tag : uint64_t {
  kEmbedding = 1, kFinalNorm, kLmHead, kAttnNorm, kMlpNorm, kGate, kUp, kDown,
  kGqaQ, kGqaK, kGqaV, kGqaO,
  kMlaDkv, kMlaKr, kMlaQn, kMlaQr, kMlaUk, kMlaUv, kMlaO,
  kKdaQ, kKdaK, kKdaV, kKdaBeta, kKdaAlpha, kKdaAlphaBias, kKdaO,
};

uint64_t StreamSeed(uint64_t seed, int layer, Tag tag) {
  SplitMix64 mix(seed ^ (0x9E3779B97F4A7C15ull * (static_cast<uint64_t>(layer) + 1)));
  const uint64_t a = mix.Next();
  SplitMix64 mix2(a ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(tag)));
  return mix2.Next();
}

std::vector<float> Fill(uint64_t seed, int layer, Tag tag, size_t n, float lo, float hi) {
  SplitMix64 rng(StreamSeed(seed, layer, tag));
  std::vector<float> v(n);
  for (float& x : v) x = rng.Uniform(lo, hi);
  return v;
}

// Uniform(-a, a) with a = sqrt(3 / fan_in): unit-variance inputs give unit-variance
// outputs (times `gain`). sqrt of an exact small integer ratio is correctly rounded
// (IEEE 754 requires it), so this is portable.
Matrix Dense(uint64_t seed, int layer, Tag tag, int in, int out, float gain = 1.f) {
  const float a = gain * std::sqrt(3.f / static_cast<float>(in));
  Matrix m;
  m.in = in;
  m.out = out;
  m.w = Fill(seed, layer, tag, static_cast<size_t>(in) * out, -a, a);
  return m;
}

std::vector<float> Norm(uint64_t seed, int layer, Tag tag, int n) {
  return Fill(seed, layer, tag, static_cast<size_t>(n), 0.9f, 1.1f);
}

void Hash(std::vector<std::byte>& buf, const std::vector<float>& v) {
  const auto* p = reinterpret_cast<const std::byte*>(v.data());
  buf.insert(buf.end(), p, p + v.size() * sizeof(float));
}

}  // namespace

uint64_t SplitMix64::Next() {
  const uint64_t x = state_;
  state_ += 0x9E3779B97F4A7C15ull;
  return Mix64(x);
}

float SplitMix64::Uniform(float lo, float hi) {
  const float u = static_cast<float>(Next() >> 40) * (1.f / 16777216.f);  // [0, 1), exact
  return lo + (hi - lo) * u;
}

absl::StatusOr<ModelWeights> ModelWeights::Generate(const ModelSpec& spec, uint64_t seed) {
  if (!spec.computable) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", spec.name, "' has real shapes and runs in accounting mode only (no "
        "weights); the model runner computes the tiny-* presets (tiny-gqa, tiny-mla, "
        "tiny-hybrid)"));
  }
  if (absl::Status s = spec.Validate(); !s.ok()) return s;
  if (spec.hidden_size <= 0 || spec.vocab_size <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model '", spec.name, "': hidden_size=", spec.hidden_size, " and vocab_size=",
        spec.vocab_size, " must be > 0"));
  }
  const int H = spec.hidden_size;
  ModelWeights w;
  w.seed = seed;
  w.hidden = H;
  w.vocab = spec.vocab_size;
  w.embedding = Fill(seed, -1, kEmbedding, static_cast<size_t>(spec.vocab_size) * H, -1.f, 1.f);
  w.final_norm = Norm(seed, -1, kFinalNorm, H);
  w.lm_head = Dense(seed, -1, kLmHead, H, spec.vocab_size);
  // Residual branches are scaled down so the stream stays well conditioned.
  const float branch_gain = 0.5f;
  for (int l = 0; l < spec.NumLayers(); ++l) {
    LayerWeights lw;
    lw.kind = spec.layers[static_cast<size_t>(l)];
    lw.attn_norm = Norm(seed, l, kAttnNorm, H);
    lw.mlp_norm = Norm(seed, l, kMlpNorm, H);
    lw.mlp.gate = Dense(seed, l, kGate, H, 2 * H);
    lw.mlp.up = Dense(seed, l, kUp, H, 2 * H);
    lw.mlp.down = Dense(seed, l, kDown, 2 * H, H, branch_gain);
    switch (lw.kind) {
      case AttentionKind::kGqa: {
        const GqaDims& g = spec.gqa;
        lw.gqa.wq = Dense(seed, l, kGqaQ, H, g.num_q_heads * g.head_dim);
        lw.gqa.wk = Dense(seed, l, kGqaK, H, g.num_kv_heads * g.head_dim);
        lw.gqa.wv = Dense(seed, l, kGqaV, H, g.num_kv_heads * g.head_dim);
        lw.gqa.wo = Dense(seed, l, kGqaO, g.num_q_heads * g.head_dim, H, branch_gain);
        break;
      }
      case AttentionKind::kMla: {
        const MlaDims& m = spec.mla;
        lw.mla.w_dkv = Dense(seed, l, kMlaDkv, H, m.kv_lora_rank);
        lw.mla.w_kr = Dense(seed, l, kMlaKr, H, m.rope_dim);
        lw.mla.w_qn = Dense(seed, l, kMlaQn, H, m.num_heads * m.qk_nope_dim);
        lw.mla.w_qr = Dense(seed, l, kMlaQr, H, m.num_heads * m.rope_dim);
        const float au = std::sqrt(3.f / static_cast<float>(m.kv_lora_rank));
        lw.mla.w_uk = Fill(seed, l, kMlaUk,
                           static_cast<size_t>(m.num_heads) * m.qk_nope_dim * m.kv_lora_rank,
                           -au, au);
        lw.mla.w_uv = Fill(seed, l, kMlaUv,
                           static_cast<size_t>(m.num_heads) * m.v_head_dim * m.kv_lora_rank,
                           -au, au);
        lw.mla.wo = Dense(seed, l, kMlaO, m.num_heads * m.v_head_dim, H, branch_gain);
        break;
      }
      case AttentionKind::kKda: {
        const KdaDims& k = spec.kda;
        lw.kda.wq = Dense(seed, l, kKdaQ, H, k.num_heads * k.head_k_dim);
        lw.kda.wk = Dense(seed, l, kKdaK, H, k.num_heads * k.head_k_dim);
        lw.kda.wv = Dense(seed, l, kKdaV, H, k.num_heads * k.head_v_dim);
        lw.kda.w_beta = Dense(seed, l, kKdaBeta, H, k.num_heads);
        lw.kda.w_alpha = Dense(seed, l, kKdaAlpha, H, k.num_heads * k.head_k_dim, 0.5f);
        // softplus(x - 4) ~ 0.02: decays close to 1, so the state remembers ~50 tokens.
        lw.kda.alpha_bias = Fill(seed, l, kKdaAlphaBias,
                                 static_cast<size_t>(k.num_heads) * k.head_k_dim, -5.f, -3.f);
        lw.kda.wo = Dense(seed, l, kKdaO, k.num_heads * k.head_v_dim, H, branch_gain);
        break;
      }
    }
    w.layers.push_back(std::move(lw));
  }
  return w;
}

uint64_t ModelWeights::Fingerprint() const {
  std::vector<std::byte> buf;
  Hash(buf, embedding);
  for (const LayerWeights& l : layers) {
    for (const auto* v : {&l.attn_norm, &l.mlp_norm, &l.mlp.gate.w, &l.mlp.up.w, &l.mlp.down.w,
                          &l.gqa.wq.w, &l.gqa.wk.w, &l.gqa.wv.w, &l.gqa.wo.w, &l.mla.w_dkv.w,
                          &l.mla.w_kr.w, &l.mla.w_qn.w, &l.mla.w_qr.w, &l.mla.w_uk, &l.mla.w_uv,
                          &l.mla.wo.w, &l.kda.wq.w, &l.kda.wk.w, &l.kda.wv.w, &l.kda.w_beta.w,
                          &l.kda.w_alpha.w, &l.kda.alpha_bias, &l.kda.wo.w}) {
      Hash(buf, *v);
    }
  }
  Hash(buf, final_norm);
  Hash(buf, lm_head.w);
  return Checksum64(buf);
}

int64_t ModelWeights::NumParameters() const {
  int64_t n = static_cast<int64_t>(embedding.size() + final_norm.size() + lm_head.w.size());
  for (const LayerWeights& l : layers) {
    for (const auto* v : {&l.attn_norm, &l.mlp_norm, &l.mlp.gate.w, &l.mlp.up.w, &l.mlp.down.w,
                          &l.gqa.wq.w, &l.gqa.wk.w, &l.gqa.wv.w, &l.gqa.wo.w, &l.mla.w_dkv.w,
                          &l.mla.w_kr.w, &l.mla.w_qn.w, &l.mla.w_qr.w, &l.mla.w_uk, &l.mla.w_uv,
                          &l.mla.wo.w, &l.kda.wq.w, &l.kda.wk.w, &l.kda.wv.w, &l.kda.w_beta.w,
                          &l.kda.w_alpha.w, &l.kda.alpha_bias, &l.kda.wo.w}) {
      n += static_cast<int64_t>(v->size());
    }
  }
  return n;
}

}  // namespace kvpool::model
