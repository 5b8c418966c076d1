// CPU optimized KDA: the recurrent decode step per (sequence, head), and the
// chunkwise-parallel prefill per (run, head).
//
// Chunk form (per head, a chunk of C tokens starting from state S0). With the
// in-chunk cumulative log decay G_t = g_1 + ... + g_t (a d_k vector, G_0 = 0):
//
//   L[t][s] = sum_i k_t[i] k_s[i] exp(G_t[i] - G_s[i])            (s < t)
//   M[t][s] = sum_i q_t[i] k_s[i] exp(G_t[i] - G_s[i])            (s <= t)
//   u_t     = beta_t (v_t - S0^T (exp(G_t) * k_t)) - beta_t sum_{s<t} L[t][s] u_s
//   o_t     = scale (S0^T (exp(G_t) * q_t) + sum_{s<=t} M[t][s] u_s)
//   S_C     = Diag(exp(G_C)) S0 + sum_s (exp(G_C - G_s) * k_s) u_s^T
//
// which is the recurrence of kda.h rewritten with S_t = Diag(exp(G_t)) S~_t, where
// S~_t = S~_{t-1} + (exp(-G_t) * k_t) u_t^T. Every exponent used is a difference
// G_t - G_s with t >= s, hence <= 0: nothing overflows however strong the decay
// (the reason for pairwise exponents instead of exp(G) / exp(G) products).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_optimized.h"
#include "kda_common.h"

namespace kvpool::kernels::internal {

// Decode items are runs of (sequence, head) steps, kKdaDecodeGroupBytes of state each
// (at least one step): a 64x64 head's step is ~1 us of work, and claimed one at a time
// the two threads contended for the pool's counter at every step. Within a run each
// step prefetches the state of the next. kernels_bench --only=kda, tiny-hybrid (2 heads
// of 64x64), 2 threads, 2 runs each (2026-12-01): 19-25 GB/s per step; 33-39 in runs;
// 36-47 with the vector exp below and the prefetch (each alone within 0-15%).
// Larger states (kimi-k3-tp8, 128x128) stay one step per item, as before (38-44).
constexpr int64_t kKdaDecodeGroupBytes = 64 << 10;

void CpuKdaDecode(const CpuContext& cx, const KdaDecodeParams& p) {
  const KdaStatePool& pool = p.pool;
  const int H = pool.num_heads, dk = pool.d_k, dv = pool.d_v;
  const int64_t n = int64_t{p.batch} * H;
  const int64_t group = std::max<int64_t>(1, kKdaDecodeGroupBytes / (int64_t{dk} * dv * 4));
  auto state = [&](int64_t bh) { return pool.states + (int64_t{p.slots[bh / H]} * H + bh % H) * dk * dv; };
  cx.pool->ParallelFor((n + group - 1) / group, [&](int64_t gi) {
    const int64_t end = std::min(n, (gi + 1) * group);
    for (int64_t bh = gi * group; bh < end; ++bh) {
      float q[256], k[256], alpha[256], u[256];
      std::memcpy(q, p.q + bh * dk, dk * sizeof(float));
      std::memcpy(k, p.k + bh * dk, dk * sizeof(float));
      if (p.l2_normalize_qk) {
        L2NormalizeInPlace(q, dk);
        L2NormalizeInPlace(k, dk);
      }
      // alpha = exp(g): g <= 0 is the contract (kda.h), and then the vector exp serves
      // (one call instead of d_k scalar std::exp); any other g takes std::exp.
      const float* g = p.g + bh * dk;
      bool nonpos = true;
      for (int i = 0; i < dk; ++i) {
        alpha[i] = g[i];
        nonpos &= g[i] <= 0.f;  // NaN too takes std::exp (and stays NaN)
      }
      if (nonpos) {
        cx.ops->exp_nonpos(alpha, dk);
      } else {
        for (int i = 0; i < dk; ++i) alpha[i] = std::exp(g[i]);
      }
      cx.ops->kda_step(state(bh), dk, dv, q, k, p.v + bh * dv, alpha, p.beta[bh], p.scale, p.out + bh * dv, u,
                       bh + 1 < end ? state(bh + 1) : nullptr);
    }
  });
}

namespace {

// One chunk of C tokens of one head; S [dk][dv] in place. q, k: [C][dk] (normalized),
// g: token t's log decay at g + t*g_stride, v: [C] rows at v + t*v_stride,
// out rows at out + t*out_stride.
void Chunk(const SimdOps& ops, int C, int dk, int dv, const float* q, const float* k,
           const float* g, int64_t g_stride, const float* v, int64_t v_stride, const float* beta,
           int64_t beta_stride, float scale, float* S, float* out, int64_t out_stride) {
  // G in double: after a run of resets it is near -88 x the run's length, where fp32
  // spacing (2e-4 at ~-3500) would swamp the small gates that follow, and every
  // exp(G_t - G_s) would carry that error (3e-4 in the output after 40 resets).
  std::vector<double> G(static_cast<size_t>(C) * dk);
  std::vector<float> u(static_cast<size_t>(C) * dv), w(dk), e(dk), L(static_cast<size_t>(C) * C);
  // Cumulative log decay, in token order. A gate below kResetLogDecay is a reset
  // (alpha = exp(g) = 0 in fp32 beyond -103.9; exp_nonpos gives exactly 0 below -87) and
  // is summed as kResetLogDecay: a gate of -inf, or finite gates whose sum overflows,
  // would otherwise make the running sums -inf and every later difference -inf - -inf =
  // NaN. Every difference spanning a reset stays <= kResetLogDecay, whose exp is exactly
  // 0 as the reset's; NaN gates stay NaN (std::max keeps its first argument).
  constexpr float kResetLogDecay = -88.f;
  for (int t = 0; t < C; ++t) {
    for (int i = 0; i < dk; ++i) {
      G[static_cast<size_t>(t) * dk + i] =
          (t ? G[static_cast<size_t>(t - 1) * dk + i] : 0.0) + std::max(g[t * g_stride + i], kResetLogDecay);
    }
  }
  // Pairwise decayed dot products: L (k.k, s < t) and M (q.k, s <= t) share exponents.
  std::vector<float> M(static_cast<size_t>(C) * C, 0.f);
  for (int t = 0; t < C; ++t) {
    const double* Gt = &G[static_cast<size_t>(t) * dk];
    for (int s = 0; s <= t; ++s) {
      const double* Gs = &G[static_cast<size_t>(s) * dk];
      for (int i = 0; i < dk; ++i) e[i] = static_cast<float>(Gt[i] - Gs[i]);
      ops.exp_nonpos(e.data(), dk);
      for (int i = 0; i < dk; ++i) w[i] = e[i] * k[static_cast<size_t>(s) * dk + i];
      M[static_cast<size_t>(t) * C + s] = ops.dot(q + static_cast<size_t>(t) * dk, w.data(), dk);
      L[static_cast<size_t>(t) * C + s] = s < t ? ops.dot(k + static_cast<size_t>(t) * dk, w.data(), dk) : 0.f;
    }
  }
  // u_t by forward substitution; o_t from S0 and the u_s.
  for (int t = 0; t < C; ++t) {
    const double* Gt = &G[static_cast<size_t>(t) * dk];
    float* ut = &u[static_cast<size_t>(t) * dv];
    float* ot = out + t * out_stride;
    for (int i = 0; i < dk; ++i) e[i] = static_cast<float>(Gt[i]);
    ops.exp_nonpos(e.data(), dk);
    std::fill(ut, ut + dv, 0.f);
    std::fill(ot, ot + dv, 0.f);
    for (int i = 0; i < dk; ++i) {
      ops.axpy(e[i] * k[static_cast<size_t>(t) * dk + i], S + int64_t{i} * dv, ut, dv);  // S0^T (e k_t)
      ops.axpy(e[i] * q[static_cast<size_t>(t) * dk + i], S + int64_t{i} * dv, ot, dv);  // S0^T (e q_t)
    }
    const float bt = beta[t * beta_stride];
    const float* vt = v + t * v_stride;
    for (int j = 0; j < dv; ++j) ut[j] = bt * (vt[j] - ut[j]);
    for (int s = 0; s < t; ++s) ops.axpy(-bt * L[static_cast<size_t>(t) * C + s], &u[static_cast<size_t>(s) * dv], ut, dv);
    for (int s = 0; s <= t; ++s) ops.axpy(M[static_cast<size_t>(t) * C + s], &u[static_cast<size_t>(s) * dv], ot, dv);
    ops.scal(scale, ot, dv);
  }
  // S_C = Diag(exp(G_C)) S0 + sum_s (exp(G_C - G_s) * k_s) u_s^T.
  const double* GC = &G[static_cast<size_t>(C - 1) * dk];
  std::vector<float> coef(C);
  for (int i = 0; i < dk; ++i) {
    float* row = S + int64_t{i} * dv;
    for (int s = 0; s < C; ++s) coef[s] = static_cast<float>(GC[i] - G[static_cast<size_t>(s) * dk + i]);
    ops.exp_nonpos(coef.data(), C);
    float decay = static_cast<float>(GC[i]);
    ops.exp_nonpos(&decay, 1);
    ops.scal(decay, row, dv);
    for (int s = 0; s < C; ++s) ops.axpy(coef[s] * k[static_cast<size_t>(s) * dk + i], &u[static_cast<size_t>(s) * dv], row, dv);
  }
}

}  // namespace

void CpuKdaChunkedPrefill(const CpuContext& cx, const KdaPrefillParams& p) {
  const KdaStatePool& pool = p.pool;
  const int H = pool.num_heads, dk = pool.d_k, dv = pool.d_v;
  const int64_t head_elems = int64_t{dk} * dv, state_elems = H * head_elems;
  cx.pool->ParallelFor(int64_t{p.batch} * H, [&](int64_t bh) {
    const int b = static_cast<int>(bh / H), h = static_cast<int>(bh % H);
    float* S = pool.states + int64_t{p.slots[b]} * state_elems + h * head_elems;
    const int64_t start = p.start_pos ? p.start_pos[b] : 0;
    const int begin = p.cu_seqlens[b], end = p.cu_seqlens[b + 1];
    int boundary = p.boundary_states ? p.boundary_indptr[b] : 0;
    std::vector<float> q(static_cast<size_t>(kKdaChunk) * dk), k(static_cast<size_t>(kKdaChunk) * dk);
    for (int t0 = begin; t0 < end;) {
      // Chunks follow the absolute grid: the first may be shorter.
      const int64_t pos = start + (t0 - begin);
      const int C = static_cast<int>(std::min<int64_t>(kKdaChunk - pos % kKdaChunk, end - t0));
      for (int t = 0; t < C; ++t) {
        const int64_t th = (int64_t{t0} + t) * H + h;
        std::memcpy(&q[static_cast<size_t>(t) * dk], p.q + th * dk, dk * sizeof(float));
        std::memcpy(&k[static_cast<size_t>(t) * dk], p.k + th * dk, dk * sizeof(float));
        if (p.l2_normalize_qk) {
          L2NormalizeInPlace(&q[static_cast<size_t>(t) * dk], dk);
          L2NormalizeInPlace(&k[static_cast<size_t>(t) * dk], dk);
        }
      }
      const int64_t th0 = int64_t{t0} * H + h;
      Chunk(*cx.ops, C, dk, dv, q.data(), k.data(), p.g + th0 * dk, int64_t{H} * dk,
            p.v + th0 * dv, int64_t{H} * dv, p.beta + th0, H, p.scale, S, p.out + th0 * dv,
            int64_t{H} * dv);
      t0 += C;
      if (p.boundary_states != nullptr && (pos + C) % kKdaChunk == 0) {
        std::memcpy(p.boundary_states + boundary * state_elems + h * head_elems, S,
                    head_elems * sizeof(float));
        ++boundary;
      }
    }
  });
}

}  // namespace kvpool::kernels::internal
