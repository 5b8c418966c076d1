// The scalar reference backend: the most direct reading of the math in gqa.h, mla.h
// and kda.h, single-threaded, two-pass softmax, fp32 accumulation. It is the oracle the
// tests compare every other backend with, so it favours clarity over speed.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "backends.h"
#include "kda_common.h"

namespace kvpool::kernels::internal {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Rows of a paged cache: token t's slot starts `token_stride` elements per slot into
// page block_table[t / page_size], slot t % page_size.
struct PagedRows {
  const void* base;
  DType dtype;
  int page_size;
  int64_t token_stride;  // elements per token slot
  const int32_t* table_row;
  // Element index of token t's slot start.
  int64_t Slot(int t) const {
    const int64_t page = table_row[t / page_size];
    return (page * page_size + t % page_size) * token_stride;
  }
  float At(int t, int64_t offset, int i) const {
    return LoadAsFloat(base, dtype, Slot(t) + offset + i);
  }
};

// softmax(scores) . values for one query over tokens [0, n): out[dv].
// score(t) and value(t, j) are callables; n == 0, or every score -inf, gives zeros (as
// the optimized backend's tiles do: no token has any weight).
template <typename ScoreFn, typename ValueFn>
void Attend(int n, int dv, ScoreFn score, ValueFn value, float* out) {
  std::fill(out, out + dv, 0.f);
  if (n == 0) return;
  std::vector<float> s(n);
  float m = kNegInf;
  for (int t = 0; t < n; ++t) {
    s[t] = score(t);
    m = std::max(m, s[t]);
  }
  if (m == kNegInf) return;  // exp(-inf - -inf) would be NaN
  float l = 0.f;
  for (int t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    l += s[t];
  }
  for (int t = 0; t < n; ++t) {
    for (int j = 0; j < dv; ++j) out[j] += s[t] * value(t, j);
  }
  for (int j = 0; j < dv; ++j) out[j] /= l;
}

void GqaOneQuery(const float* q, const GqaPagedKv& kv, const int32_t* table_row, int kv_head,
                 int n, float scale, float* out) {
  const int d = kv.head_dim;
  const int64_t stride = int64_t{kv.num_kv_heads} * d;
  const PagedRows k{kv.k, kv.dtype, kv.page_size, stride, table_row};
  const PagedRows v{kv.v, kv.dtype, kv.page_size, stride, table_row};
  const int64_t off = int64_t{kv_head} * d;
  Attend(
      n, d,
      [&](int t) {
        const int64_t row = k.Slot(t) + off;
        float dot = 0.f;
        for (int i = 0; i < d; ++i) dot += q[i] * LoadAsFloat(kv.k, kv.dtype, row + i);
        return scale * dot;
      },
      [&](int t, int j) { return v.At(t, off, j); }, out);
}

class CpuReferenceBackend final : public KernelBackend {
 public:
  Backend kind() const override { return Backend::kCpuReference; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  int num_threads() const override { return 1; }
  std::string Describe() const override { return "scalar reference x 1 thread"; }

 protected:
  absl::Status DoGqaDecode(const GqaDecodeParams& p) override {
    const int d = p.kv.head_dim, group = p.num_q_heads / p.kv.num_kv_heads;
    for (int b = 0; b < p.table.batch; ++b) {
      const int32_t* row = p.table.block_table + int64_t{b} * p.table.max_blocks;
      for (int h = 0; h < p.num_q_heads; ++h) {
        const int64_t at = (int64_t{b} * p.num_q_heads + h) * d;
        GqaOneQuery(p.q + at, p.kv, row, h / group, p.table.seq_lens[b], p.scale, p.out + at);
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoGqaPrefill(const GqaPrefillParams& p) override {
    const int d = p.kv.head_dim, group = p.num_q_heads / p.kv.num_kv_heads;
    for (int b = 0; b < p.table.batch; ++b) {
      const int32_t* row = p.table.block_table + int64_t{b} * p.table.max_blocks;
      const int q_len = p.q_indptr[b + 1] - p.q_indptr[b];
      const int prefix = p.table.seq_lens[b] - q_len;
      for (int i = 0; i < q_len; ++i) {
        for (int h = 0; h < p.num_q_heads; ++h) {
          const int64_t at = (int64_t{p.q_indptr[b] + i} * p.num_q_heads + h) * d;
          // Causal: query i sits at position prefix + i and sees prefix + i + 1 tokens.
          GqaOneQuery(p.q + at, p.kv, row, h / group, prefix + i + 1, p.scale, p.out + at);
        }
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoMlaDecodeAbsorbed(const MlaDecodeParams& p) override {
    const int entry = p.kv.EntryDim(), rank = p.kv.kv_lora_rank;
    for (int b = 0; b < p.table.batch; ++b) {
      const PagedRows c{p.kv.entries, p.kv.dtype, p.kv.page_size, entry,
                        p.table.block_table + int64_t{b} * p.table.max_blocks};
      for (int h = 0; h < p.num_heads; ++h) {
        const float* q = p.q + (int64_t{b} * p.num_heads + h) * entry;
        Attend(
            p.table.seq_lens[b], rank,
            [&](int t) {
              const int64_t row = c.Slot(t);
              float dot = 0.f;
              for (int i = 0; i < entry; ++i) dot += q[i] * LoadAsFloat(c.base, c.dtype, row + i);
              return p.scale * dot;
            },
            [&](int t, int j) { return c.At(t, 0, j); },
            p.out + (int64_t{b} * p.num_heads + h) * rank);
      }
    }
    return absl::OkStatus();
  }

  absl::Status DoMlaMaterialized(const MlaMaterializedParams& p) override {
    const int entry = p.kv.EntryDim(), rank = p.kv.kv_lora_rank, rope = p.kv.rope_dim;
    const int nope = p.qk_nope_dim, dv = p.v_head_dim, H = p.num_heads;
    for (int b = 0; b < p.table.batch; ++b) {
      const PagedRows c{p.kv.entries, p.kv.dtype, p.kv.page_size, entry,
                        p.table.block_table + int64_t{b} * p.table.max_blocks};
      const int n = p.table.seq_lens[b];
      const int q_len = p.q_indptr[b + 1] - p.q_indptr[b];
      for (int h = 0; h < H; ++h) {
        // Up-project every token of the sequence for head h: K = [W_UK c | rope], V = W_UV c.
        std::vector<float> k(static_cast<size_t>(n) * (nope + rope)), v(static_cast<size_t>(n) * dv);
        const float* wk = p.w_uk + int64_t{h} * nope * rank;
        const float* wv = p.w_uv + int64_t{h} * dv * rank;
        std::vector<float> e(entry);  // token t's entry in fp32
        for (int t = 0; t < n; ++t) {
          for (int i = 0; i < entry; ++i) e[i] = c.At(t, 0, i);
          for (int j = 0; j < nope; ++j) {
            float acc = 0.f;
            for (int i = 0; i < rank; ++i) acc += wk[int64_t{j} * rank + i] * e[i];
            k[int64_t{t} * (nope + rope) + j] = acc;
          }
          for (int j = 0; j < rope; ++j) k[int64_t{t} * (nope + rope) + nope + j] = e[rank + j];
          for (int j = 0; j < dv; ++j) {
            float acc = 0.f;
            for (int i = 0; i < rank; ++i) acc += wv[int64_t{j} * rank + i] * e[i];
            v[int64_t{t} * dv + j] = acc;
          }
        }
        for (int i = 0; i < q_len; ++i) {
          const int64_t qi = int64_t{p.q_indptr[b] + i} * H + h;
          const float* qn = p.q_nope + qi * nope;
          const float* qr = p.q_rope + qi * rope;
          Attend(
              n - q_len + i + 1, dv,
              [&](int t) {
                const float* kt = k.data() + int64_t{t} * (nope + rope);
                float dot = 0.f;
                for (int j = 0; j < nope; ++j) dot += qn[j] * kt[j];
                for (int j = 0; j < rope; ++j) dot += qr[j] * kt[nope + j];
                return p.scale * dot;
              },
              [&](int t, int j) { return v[int64_t{t} * dv + j]; }, p.out + qi * dv);
        }
      }
    }
    return absl::OkStatus();
  }

  // One token of the gated delta rule, written as in kda.h:
  //   S' = Diag(alpha) S;  S = S' - beta k (k^T S') + beta k v^T;  o = scale S^T q.
  static void Step(float* S, int dk, int dv, const float* q_in, const float* k_in,
                   const float* v, const float* g, float beta, float scale, bool l2, float* o) {
    std::vector<float> q(q_in, q_in + dk), k(k_in, k_in + dk), ktS(dv, 0.f);
    if (l2) {
      L2NormalizeInPlace(q.data(), dk);
      L2NormalizeInPlace(k.data(), dk);
    }
    for (int i = 0; i < dk; ++i) {
      const float alpha = std::exp(g[i]);
      for (int j = 0; j < dv; ++j) S[i * dv + j] *= alpha;
    }
    for (int i = 0; i < dk; ++i) {
      for (int j = 0; j < dv; ++j) ktS[j] += k[i] * S[i * dv + j];
    }
    for (int i = 0; i < dk; ++i) {
      for (int j = 0; j < dv; ++j) S[i * dv + j] += beta * k[i] * (v[j] - ktS[j]);
    }
    for (int j = 0; j < dv; ++j) {
      float acc = 0.f;
      for (int i = 0; i < dk; ++i) acc += S[i * dv + j] * q[i];
      o[j] = scale * acc;
    }
  }

  absl::Status DoKdaDecode(const KdaDecodeParams& p) override {
    const KdaStatePool& pool = p.pool;
    const int H = pool.num_heads, dk = pool.d_k, dv = pool.d_v;
    for (int b = 0; b < p.batch; ++b) {
      for (int h = 0; h < H; ++h) {
        const int64_t bh = int64_t{b} * H + h;
        float* S = pool.states + (int64_t{p.slots[b]} * H + h) * dk * dv;
        Step(S, dk, dv, p.q + bh * dk, p.k + bh * dk, p.v + bh * dv, p.g + bh * dk, p.beta[bh],
             p.scale, p.l2_normalize_qk, p.out + bh * dv);
      }
    }
    return absl::OkStatus();
  }

  // The reference "chunked" prefill is the recurrence itself, token by token; the
  // chunk grid only decides where boundary states are copied out.
  absl::Status DoKdaChunkedPrefill(const KdaPrefillParams& p) override {
    const KdaStatePool& pool = p.pool;
    const int H = pool.num_heads, dk = pool.d_k, dv = pool.d_v;
    const int64_t state_elems = int64_t{H} * dk * dv;
    for (int b = 0; b < p.batch; ++b) {
      float* S = pool.states + int64_t{p.slots[b]} * state_elems;
      const int64_t start = p.start_pos ? p.start_pos[b] : 0;
      int boundary = p.boundary_states ? p.boundary_indptr[b] : 0;
      for (int t = p.cu_seqlens[b]; t < p.cu_seqlens[b + 1]; ++t) {
        for (int h = 0; h < H; ++h) {
          const int64_t th = int64_t{t} * H + h;
          Step(S + int64_t{h} * dk * dv, dk, dv, p.q + th * dk, p.k + th * dk, p.v + th * dv,
               p.g + th * dk, p.beta[th], p.scale, p.l2_normalize_qk, p.out + th * dv);
        }
        const int64_t pos = start + (t - p.cu_seqlens[b]) + 1;  // tokens seen so far
        if (p.boundary_states != nullptr && pos % kKdaChunk == 0) {
          std::memcpy(p.boundary_states + boundary * state_elems, S, state_elems * sizeof(float));
          ++boundary;
        }
      }
    }
    return absl::OkStatus();
  }
};

}  // namespace

absl::StatusOr<std::unique_ptr<KernelBackend>> CreateCpuReferenceBackend() {
  return std::make_unique<CpuReferenceBackend>();
}

}  // namespace kvpool::kernels::internal
