// The forward pass of ModelRunner: one batched pass over the positions of every
// segment, layer by layer. Each position's arithmetic depends only on its own inputs
// and the cached bytes (see model_runner.h, "THE INVARIANT"): per-token matvecs with a
// fixed accumulation order, attention through the decode kernels with one row per
// position, and the KDA recurrence token by token.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <span>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/kernels/dtype.h"
#include "runner_internal.h"

namespace kvpool::model {
namespace {

constexpr float kNormEps = 1e-5f;
constexpr double kRopeTheta = 10000.0;

// Y = X @ W for n rows of X ([n][in] -> [n][out]). Each Y[t][o] accumulates
// X[t][i] * W[i][o] for i ascending, starting from 0: the same operations for a row
// whatever n and the tiling (the inner loop over o carries no reduction, so vectorizing
// it reorders nothing; -ffp-contract=off keeps a*b+c unfused everywhere). Rows go in
// tiles of 8 so each weight row is loaded once per tile.
void MatMul(const Matrix& w, const float* X, size_t n, float* Y) {
  constexpr size_t kTile = 8;
  std::fill(Y, Y + n * w.out, 0.f);
  for (size_t t0 = 0; t0 < n; t0 += kTile) {
    const size_t t1 = std::min(n, t0 + kTile);
    for (int i = 0; i < w.in; ++i) {
      const float* row = w.w.data() + static_cast<size_t>(i) * w.out;
      for (size_t t = t0; t < t1; ++t) {
        const float xi = X[t * w.in + i];
        float* y = Y + t * w.out;
        for (int o = 0; o < w.out; ++o) y[o] += xi * row[o];
      }
    }
  }
}

void MatVec(const Matrix& w, const float* x, float* y) { MatMul(w, x, 1, y); }

void RmsNorm(const float* x, const float* weight, int n, float* y) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + kNormEps);
  for (int i = 0; i < n; ++i) y[i] = x[i] * inv * (weight != nullptr ? weight[i] : 1.f);
}

// Rotate-half RoPE on `heads` vectors of `dim` at position `pos`.
void Rope(float* x, int heads, int dim, int64_t pos) {
  const int half = dim / 2;
  for (int i = 0; i < half; ++i) {
    const double freq = std::pow(kRopeTheta, -2.0 * i / dim);
    const double angle = static_cast<double>(pos) * freq;
    const float c = static_cast<float>(std::cos(angle));
    const float s = static_cast<float>(std::sin(angle));
    for (int h = 0; h < heads; ++h) {
      float* v = x + static_cast<size_t>(h) * dim;
      const float a = v[i], b = v[i + half];
      v[i] = a * c - b * s;
      v[i + half] = b * c + a * s;
    }
  }
}

float Silu(float x) { return x / (1.f + std::exp(-x)); }
float Sigmoid(float x) { return 1.f / (1.f + std::exp(-x)); }
float Softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }

void Store(std::byte* dst, DType dtype, const float* src, int n) {
  for (int i = 0; i < n; ++i) kernels::StoreFromFloat(dst, dtype, static_cast<size_t>(i), src[i]);
}

}  // namespace

absl::Status ModelRunner::RunForward(std::vector<Segment>& segments) {
  const int H = spec_.hidden_size;
  const int64_t bt = spec_.block_tokens;
  const DType kv_dtype = spec_.kv_dtype;
  // Rows: every position of every segment, segment by segment.
  struct Row {
    int seg;
    int64_t pos;
  };
  std::vector<Row> rows;
  std::vector<int> seg_row0(segments.size());
  for (size_t s = 0; s < segments.size(); ++s) {
    Segment& seg = segments[s];
    const std::span<const cache::BlockId> table = cache_->BlockTable(seg.seq->id);
    seg.blocks.assign(table.begin(), table.end());
    seg_row0[s] = static_cast<int>(rows.size());
    for (int64_t p = seg.start; p < seg.end; ++p) rows.push_back({static_cast<int>(s), p});
  }
  const size_t N = rows.size();
  std::vector<float> x(N * H);
  for (size_t r = 0; r < N; ++r) {
    const TokenId t = segments[rows[r].seg].seq->tokens[static_cast<size_t>(rows[r].pos)];
    std::memcpy(&x[r * H], &weights_.embedding[static_cast<size_t>(t) * H], H * sizeof(float));
  }
  int last_kda = -1;
  for (int l = 0; l < spec_.NumLayers(); ++l) {
    if (spec_.layers[static_cast<size_t>(l)] == AttentionKind::kKda) last_kda = l;
  }
  // KDA: states of the running sequences into their scratch slots.
  const int kda_layers = spec_.NumLayers(AttentionKind::kKda);
  const size_t state_floats = static_cast<size_t>(arena_->state_bytes() / sizeof(float));
  if (kda_layers > 0) {
    for (const Segment& seg : segments) {
      std::span<std::byte> slot(
          reinterpret_cast<std::byte*>(&kda_scratch_[seg.seq->state_slot * state_floats]),
          state_floats * sizeof(float));
      arena_->ReadState(cache_->block_pool().RunPages(seg.seq->live_state), 0, slot);
    }
  }
  // A kernel block table with one row per active position, for the active rows
  // act[first, first + count).
  std::vector<int32_t> table, seq_lens;
  auto blocks_of_row = [&](size_t r) { return static_cast<int>((rows[r].pos + 1 + bt - 1) / bt); };
  auto build_table = [&](const std::vector<size_t>& act, size_t first, size_t count, int32_t pages_per_block,
                         int* max_blocks) {
    *max_blocks = 1;
    for (size_t i = first; i < first + count; ++i) *max_blocks = std::max(*max_blocks, blocks_of_row(act[i]));
    table.assign(count * static_cast<size_t>(*max_blocks), 0);
    seq_lens.resize(count);
    for (size_t i = 0; i < count; ++i) {
      const Row& row = rows[act[first + i]];
      const Segment& seg = segments[row.seg];
      const int nb = blocks_of_row(act[first + i]);
      for (int j = 0; j < nb; ++j) {
        table[i * *max_blocks + j] = seg.blocks[static_cast<size_t>(j)] * pages_per_block;
      }
      seq_lens[i] = static_cast<int32_t>(row.pos + 1);
    }
  };
  // Runs `launch(first, count, max_blocks)` over the active rows in chunks whose table
  // stays within options_.max_table_entries: a table of every row of a long prefill
  // grows with the square of its length (1M tokens: ~250 GB).
  auto for_each_table_chunk = [&](const std::vector<size_t>& act, int32_t pages_per_block,
                                  const std::function<absl::Status(size_t, size_t, int)>& launch) -> absl::Status {
    const int64_t limit = std::max<int64_t>(1, options_.max_table_entries);
    for (size_t first = 0; first < act.size();) {
      size_t count = 0;
      int64_t widest = 1;
      while (first + count < act.size()) {
        const int64_t w = std::max<int64_t>(widest, blocks_of_row(act[first + count]));
        if (count > 0 && static_cast<int64_t>(count + 1) * w > limit) break;
        widest = w;
        ++count;
      }
      int max_blocks = 0;
      build_table(act, first, count, pages_per_block, &max_blocks);
      RETURN_IF_ERROR(launch(first, count, max_blocks));
      first += count;
    }
    return absl::OkStatus();
  };
  int kda_index = 0;
  std::vector<size_t> act;
  // xa: the active rows' normed inputs, packed [A][H]; ya: their branch output [A][H].
  std::vector<float> xa, ya;
  auto add_branch = [&](const std::vector<size_t>& rows_of) {
    for (size_t i = 0; i < rows_of.size(); ++i) {
      float* xr = &x[rows_of[i] * H];
      const float* yr = &ya[i * H];
      for (int j = 0; j < H; ++j) xr[j] += yr[j];
    }
  };
  for (int l = 0; l < spec_.NumLayers(); ++l) {
    const LayerWeights& lw = weights_.layers[static_cast<size_t>(l)];
    act.clear();
    for (size_t r = 0; r < N; ++r) {
      if (rows[r].pos >= segments[rows[r].seg].replay_end || l <= last_kda) act.push_back(r);
    }
    if (act.empty()) continue;
    auto full = [&](size_t r) { return rows[r].pos >= segments[rows[r].seg].replay_end; };
    auto block_of = [&](size_t r) {
      return segments[rows[r].seg].blocks[static_cast<size_t>(rows[r].pos / bt)];
    };
    const size_t A = act.size();
    xa.resize(A * H);
    ya.resize(A * H);
    for (size_t i = 0; i < A; ++i) RmsNorm(&x[act[i] * H], lw.attn_norm.data(), H, &xa[i * H]);
    switch (lw.kind) {
      case AttentionKind::kGqa: {
        const GqaDims& g = spec_.gqa;
        const int qd = g.num_q_heads * g.head_dim, kd = g.num_kv_heads * g.head_dim;
        const PagedLayerSection& sec = *arena_->SectionOf(l);
        std::vector<float> q(A * qd), out(A * qd), k(A * kd), v(A * kd);
        MatMul(lw.gqa.wq, xa.data(), A, q.data());
        MatMul(lw.gqa.wk, xa.data(), A, k.data());
        MatMul(lw.gqa.wv, xa.data(), A, v.data());
        for (size_t i = 0; i < A; ++i) {
          const size_t r = act[i];
          Rope(&q[i * qd], g.num_q_heads, g.head_dim, rows[r].pos);
          if (!full(r)) continue;  // replay: the cached K/V stays as it is
          Rope(&k[i * kd], g.num_kv_heads, g.head_dim, rows[r].pos);
          const int slot = static_cast<int>(rows[r].pos % bt);
          Store(arena_->GqaK(block_of(r), sec, slot), kv_dtype, &k[i * kd], kd);
          Store(arena_->GqaV(block_of(r), sec, slot), kv_dtype, &v[i * kd], kd);
        }
        RETURN_IF_ERROR(for_each_table_chunk(act, sec.pages_per_block, [&](size_t first, size_t count, int max_blocks) {
          kernels::GqaDecodeParams p;
          p.q = q.data() + first * qd;
          p.out = out.data() + first * qd;
          p.kv = arena_->GqaView(sec);
          p.table = {table.data(), seq_lens.data(), static_cast<int>(count), max_blocks};
          p.num_q_heads = g.num_q_heads;
          return backend_->GqaDecode(p);
        }));
        MatMul(lw.gqa.wo, out.data(), A, ya.data());
        add_branch(act);
        break;
      }
      case AttentionKind::kMla: {
        const MlaDims& m = spec_.mla;
        const int R = m.kv_lora_rank, E = m.EntryDim(), nh = m.num_heads;
        const int qnd = nh * m.qk_nope_dim, qrd = nh * m.rope_dim, vd = nh * m.v_head_dim;
        const PagedLayerSection& sec = *arena_->SectionOf(l);
        std::vector<float> lat(A * R), kr(A * m.rope_dim), qn(A * qnd), qr(A * qrd),
            qabs(A * nh * E), out(A * nh * R), vcat(A * vd), entry(E);
        MatMul(lw.mla.w_dkv, xa.data(), A, lat.data());
        MatMul(lw.mla.w_kr, xa.data(), A, kr.data());
        MatMul(lw.mla.w_qn, xa.data(), A, qn.data());
        MatMul(lw.mla.w_qr, xa.data(), A, qr.data());
        for (size_t i = 0; i < A; ++i) {
          const size_t r = act[i];
          const int64_t pos = rows[r].pos;
          if (full(r)) {
            RmsNorm(&lat[i * R], nullptr, R, entry.data());
            std::memcpy(entry.data() + R, &kr[i * m.rope_dim], m.rope_dim * sizeof(float));
            Rope(entry.data() + R, 1, m.rope_dim, pos);
            Store(arena_->MlaEntry(block_of(r), sec, static_cast<int>(pos % bt)), kv_dtype,
                  entry.data(), E);
          }
          Rope(&qr[i * qrd], nh, m.rope_dim, pos);
          for (int h = 0; h < nh; ++h) {
            float* q = &qabs[(i * nh + h) * E];
            std::fill(q, q + R, 0.f);
            // Absorb: q_abs = W_UK_h^T q_nope_h, accumulated over n ascending.
            for (int n = 0; n < m.qk_nope_dim; ++n) {
              const float a = qn[i * qnd + static_cast<size_t>(h * m.qk_nope_dim + n)];
              const float* wrow =
                  &lw.mla.w_uk[(static_cast<size_t>(h) * m.qk_nope_dim + n) * R];
              for (int j = 0; j < R; ++j) q[j] += a * wrow[j];
            }
            std::memcpy(q + R, &qr[i * qrd + static_cast<size_t>(h) * m.rope_dim],
                        m.rope_dim * sizeof(float));
          }
        }
        RETURN_IF_ERROR(for_each_table_chunk(act, sec.pages_per_block, [&](size_t first, size_t count, int max_blocks) {
          kernels::MlaDecodeParams p;
          p.q = qabs.data() + first * nh * E;
          p.out = out.data() + first * nh * R;
          p.kv = arena_->MlaView(sec);
          p.table = {table.data(), seq_lens.data(), static_cast<int>(count), max_blocks};
          p.num_heads = nh;
          p.scale = 1.f / std::sqrt(static_cast<float>(m.qk_nope_dim + m.rope_dim));
          return backend_->MlaDecodeAbsorbed(p);
        }));
        // v_h = W_UV_h o_h: a dot product per output, j ascending.
        for (size_t i = 0; i < A; ++i) {
          for (int h = 0; h < nh; ++h) {
            const float* o = &out[(i * nh + h) * R];
            for (int e = 0; e < m.v_head_dim; ++e) {
              const float* wrow = &lw.mla.w_uv[(static_cast<size_t>(h) * m.v_head_dim + e) * R];
              float acc = 0.f;
              for (int j = 0; j < R; ++j) acc += wrow[j] * o[j];
              vcat[i * vd + static_cast<size_t>(h * m.v_head_dim + e)] = acc;
            }
          }
        }
        MatMul(lw.mla.wo, vcat.data(), A, ya.data());
        add_branch(act);
        break;
      }
      case AttentionKind::kKda: {
        const KdaDims& kd = spec_.kda;
        const int nh = kd.num_heads, dk = kd.head_k_dim, dv = kd.head_v_dim;
        const int qk = nh * dk, vd = nh * dv;
        // Every row is active in a KDA layer (l <= last_kda): act[i] == i.
        std::vector<float> q(N * qk), k(N * qk), v(N * vd), gl(N * qk), beta(N * nh),
            out(N * vd);
        MatMul(lw.kda.wq, xa.data(), N, q.data());
        MatMul(lw.kda.wk, xa.data(), N, k.data());
        MatMul(lw.kda.wv, xa.data(), N, v.data());
        MatMul(lw.kda.w_beta, xa.data(), N, beta.data());
        MatMul(lw.kda.w_alpha, xa.data(), N, gl.data());
        for (size_t r = 0; r < N; ++r) {
          for (int h = 0; h < nh; ++h) beta[r * nh + h] = Sigmoid(beta[r * nh + h]);
          for (int c = 0; c < qk; ++c) {
            gl[r * qk + c] = -Softplus(gl[r * qk + c] + lw.kda.alpha_bias[static_cast<size_t>(c)]);
          }
        }
        const int64_t layer_state = int64_t{nh} * dk * dv;  // floats per KDA layer
        int64_t max_len = 0;
        for (const Segment& seg : segments) max_len = std::max(max_len, seg.end - seg.start);
        std::vector<float> bq, bk, bv, bg, bb, bo;
        std::vector<int32_t> slots;
        std::vector<size_t> brow;
        for (int64_t t = 0; t < max_len; ++t) {
          brow.clear();
          slots.clear();
          for (size_t s = 0; s < segments.size(); ++s) {
            if (segments[s].start + t >= segments[s].end) continue;
            brow.push_back(static_cast<size_t>(seg_row0[s] + t));
            slots.push_back(segments[s].seq->state_slot * kda_layers + kda_index);
          }
          const size_t B = brow.size();
          bq.resize(B * qk); bk.resize(B * qk); bg.resize(B * qk);
          bv.resize(B * vd); bo.resize(B * vd); bb.resize(B * nh);
          for (size_t i = 0; i < B; ++i) {
            const size_t r = brow[i];
            std::memcpy(&bq[i * qk], &q[r * qk], qk * sizeof(float));
            std::memcpy(&bk[i * qk], &k[r * qk], qk * sizeof(float));
            std::memcpy(&bg[i * qk], &gl[r * qk], qk * sizeof(float));
            std::memcpy(&bv[i * vd], &v[r * vd], vd * sizeof(float));
            std::memcpy(&bb[i * nh], &beta[r * nh], nh * sizeof(float));
          }
          kernels::KdaDecodeParams p;
          p.q = bq.data();
          p.k = bk.data();
          p.v = bv.data();
          p.g = bg.data();
          p.beta = bb.data();
          p.slots = slots.data();
          p.out = bo.data();
          p.pool = {kda_scratch_.data(), num_state_slots_ * kda_layers, nh, dk, dv};
          p.batch = static_cast<int>(B);
          p.l2_normalize_qk = true;
          RETURN_IF_ERROR(backend_->KdaDecode(p));
          for (size_t i = 0; i < B; ++i) {
            std::memcpy(&out[brow[i] * vd], &bo[i * vd], vd * sizeof(float));
          }
          // Checkpoints: after position boundary - 1, this layer's part of the state.
          for (Segment& seg : segments) {
            const int64_t pos = seg.start + t;
            if (pos >= seg.end) continue;
            for (const cache::CheckpointSave& save : seg.saves) {
              if (save.boundary_tokens != pos + 1) continue;
              const float* st = &kda_scratch_[(static_cast<size_t>(seg.seq->state_slot) *
                                                   kda_layers + kda_index) * layer_state];
              arena_->WriteState(cache_->block_pool().RunPages(save.pages_head),
                                 kda_index * layer_state * int64_t{sizeof(float)},
                                 std::span<const std::byte>(
                                     reinterpret_cast<const std::byte*>(st),
                                     static_cast<size_t>(layer_state) * sizeof(float)));
            }
          }
        }
        MatMul(lw.kda.wo, out.data(), N, ya.data());
        add_branch(act);
        ++kda_index;
        break;
      }
    }
    // SwiGLU MLP.
    std::vector<float> gate(A * 2 * H), up(A * 2 * H);
    for (size_t i = 0; i < A; ++i) RmsNorm(&x[act[i] * H], lw.mlp_norm.data(), H, &xa[i * H]);
    MatMul(lw.mlp.gate, xa.data(), A, gate.data());
    MatMul(lw.mlp.up, xa.data(), A, up.data());
    for (size_t j = 0; j < gate.size(); ++j) gate[j] = Silu(gate[j]) * up[j];
    MatMul(lw.mlp.down, gate.data(), A, ya.data());
    add_branch(act);
  }
  // KDA: live states back into their pages.
  if (kda_layers > 0) {
    for (const Segment& seg : segments) {
      std::span<const std::byte> slot(
          reinterpret_cast<const std::byte*>(&kda_scratch_[seg.seq->state_slot * state_floats]),
          state_floats * sizeof(float));
      arena_->WriteState(cache_->block_pool().RunPages(seg.seq->live_state), 0, slot);
    }
  }
  // Final norm, LM head, greedy sampling for the last position of each segment.
  std::vector<float> hidden(H), logits(static_cast<size_t>(spec_.vocab_size));
  for (size_t s = 0; s < segments.size(); ++s) {
    Segment& seg = segments[s];
    const size_t r = static_cast<size_t>(seg_row0[s] + (seg.end - seg.start) - 1);
    RmsNorm(&x[r * H], weights_.final_norm.data(), H, hidden.data());
    MatVec(weights_.lm_head, hidden.data(), logits.data());
    seg.next_token = static_cast<TokenId>(
        std::max_element(logits.begin(), logits.end()) - logits.begin());  // first max
    seg.hidden_digest = Digest128(std::span<const std::byte>(
        reinterpret_cast<const std::byte*>(hidden.data()), hidden.size() * sizeof(float)));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::model
