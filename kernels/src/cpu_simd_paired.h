// The bf16 decode fast path ("paired" layout, see cpu_simd.h), written once over an ISA
// traits type and instantiated by cpu_simd_avx2.cc (8 fp32 lanes, blocks of 16) and
// cpu_simd_avx512.cc (16 lanes, blocks of 32). Each traits type lives in its file's
// anonymous namespace, so every instantiation here is local to the file compiled with
// its ISA's flags (see the note in cpu_simd.h). No includes: the including file brings
// the intrinsics its traits use.
//
// A traits type I provides:
//   V, kLanes                   vector type and its fp32 lanes; a block is 2 * kLanes
//   Zero(), Load(p), Store(p, v), Set1(x), Fma(a, b, c) = a * b + c, Mul(a, b), Add(a, b)
//   LoadPair(row, i, &e, &o)    2 * kLanes bf16 at row + i: even elements -> e, odd -> o
//   HSum8(const V* a) -> __m256 the 8 lane sums of a[0..7], each in a fixed order (or,
//                               instead, SumLanes<8 or 16>(a, out): see StoreScores)
//   InRegister(v)               pins v to a register (see cpu_simd_avx2.cc)
//   kAccumCols[r]               column blocks per AccumP call for r = 1..4 rows
//   kMaxScoreAccum              score accumulators (rows x tokens) ScoreP may hold: 8, 16
#pragma once

namespace kvpool::kernels::internal::paired {

// The Cephes expf polynomial: exp(x) for x reduced to [-ln2/2, ln2/2] (the softmax
// exps of both tables, cpu_simd_avx2.cc's Exp8 and cpu_simd_avx512.cc's Exp16, scale it
// by 2^n).
template <typename I>
[[gnu::always_inline]] inline typename I::V ExpPoly(typename I::V x) {
  typename I::V y = I::Set1(1.9875691500e-4f);
  y = I::Fma(y, x, I::Set1(1.3981999507e-3f));
  y = I::Fma(y, x, I::Set1(8.3334519073e-3f));
  y = I::Fma(y, x, I::Set1(4.1665795894e-2f));
  y = I::Fma(y, x, I::Set1(1.6666665459e-1f));
  y = I::Fma(y, x, I::Set1(5.0000001201e-1f));
  return I::Fma(y, I::Mul(x, x), I::Add(x, I::Set1(1.f)));
}

template <typename I>
void Pair(const float* x, float* y, int n) {
  constexpr int kB = 2 * I::kLanes;
  for (int b = 0; b < n; b += kB) {
    for (int k = 0; k < I::kLanes; ++k) {
      y[b + k] = x[b + 2 * k];
      y[b + I::kLanes + k] = x[b + 2 * k + 1];
    }
  }
}

template <typename I>
void Unpair(const float* x, float* y, int n) {
  constexpr int kB = 2 * I::kLanes;
  for (int b = 0; b < n; b += kB) {
    for (int k = 0; k < I::kLanes; ++k) {
      y[b + 2 * k] = x[b + k];
      y[b + 2 * k + 1] = x[b + I::kLanes + k];
    }
  }
}

// s[r * ld + t] = scale * (lane sum of acc[r * NT + t]). Lane sums 8 accumulators at a
// time with HSum8, or where the traits have SumLanes<N> (AVX-512) up to 8 with
// SumLanes<8> and more 16 at a time (zero-padded); each sums every accumulator in the
// same order whatever its position, so any grouping of rows and tokens gives the same
// bits.
template <typename I, int NR, int NT>
[[gnu::always_inline]] inline void StoreScores(const typename I::V* acc, float scale, float* s, int ld) {
  using V = typename I::V;
  constexpr int kN = NR * NT;
  constexpr bool kSumLanes = requires(const V* a, float* o) { I::template SumLanes<16>(a, o); };
  constexpr int kW = kSumLanes && kN > 8 ? 16 : 8;
  constexpr int kGroups = (kN + kW - 1) / kW;
  alignas(64) float out[kW * kGroups];
  for (int g = 0; g < kGroups; ++g) {
    V all[kW];
    for (int k = 0; k < kW; ++k) all[k] = kW * g + k < kN ? acc[kW * g + k] : I::Zero();
    if constexpr (kSumLanes) {
      I::template SumLanes<kW>(all, out + kW * g);
    } else {
      _mm256_store_ps(out + 8 * g, I::HSum8(all));
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) s[r * ld + t] = scale * out[r * NT + t];
  }
}

// Scores of NR paired q rows against NT bf16 K rows; accumulator k = r * NT + t.
template <typename I, int NR, int NT>
[[gnu::always_inline]] inline void ScoreP(const float* qp, int dim, const void* const* rows, float scale,
                                          float* s, int ld) {
  using V = typename I::V;
  constexpr int kB = 2 * I::kLanes;
  static_assert(NR * NT <= I::kMaxScoreAccum && NR * NT <= 16);
  V acc[NR * NT];
  for (int k = 0; k < NR * NT; ++k) acc[k] = I::Zero();
  for (int i = 0; i < dim; i += kB) {
    if constexpr (NR <= 3) {
      // Few rows, several tokens: hold the q chunk, widen one K row at a time (16 ymm
      // registers on AVX2: NR * NT accumulators + 2 NR q + 2 K).
      V qe[NR], qo[NR];
      for (int r = 0; r < NR; ++r) {
        qe[r] = I::Load(qp + r * dim + i);
        qo[r] = I::Load(qp + r * dim + i + I::kLanes);
      }
      for (int t = 0; t < NT; ++t) {
        V ke, ko;
        I::LoadPair(rows[t], i, &ke, &ko);
        for (int r = 0; r < NR; ++r) {
          acc[r * NT + t] = I::Fma(qe[r], ke, acc[r * NT + t]);
          acc[r * NT + t] = I::Fma(qo[r], ko, acc[r * NT + t]);
        }
      }
    } else {
      // Many rows: widen the NT K rows once, stream q (NR * NT accumulators + 2 NT K).
      V ke[NT], ko[NT];
      for (int t = 0; t < NT; ++t) I::LoadPair(rows[t], i, &ke[t], &ko[t]);
      for (int r = 0; r < NR; ++r) {
        V qe = I::Load(qp + r * dim + i), qo = I::Load(qp + r * dim + i + I::kLanes);
        if constexpr (NT > 1) {  // loaded once for the NT tokens
          I::InRegister(qe);
          I::InRegister(qo);
        }
        for (int t = 0; t < NT; ++t) {
          acc[r * NT + t] = I::Fma(qe, ke[t], acc[r * NT + t]);
          acc[r * NT + t] = I::Fma(qo, ko[t], acc[r * NT + t]);
        }
      }
    }
  }
  StoreScores<I, NR, NT>(acc, scale, s, ld);
}

template <typename I, int NR, int NT>
inline void ScorePRows(const float* qp, int dim, const void* const* rows, int T, float scale, float* s,
                       int ld) {
  int t = 0;
  for (; t + NT <= T; t += NT) ScoreP<I, NR, NT>(qp, dim, rows + t, scale, s + t, ld);
  if constexpr (NT > 2) {  // e.g. the 2-token sub-blocks of MLA with 3-7 heads
    if (t + 2 <= T) {
      ScoreP<I, NR, 2>(qp, dim, rows + t, scale, s + t, ld);
      t += 2;
    }
  }
  for (; t < T; ++t) ScoreP<I, NR, 1>(qp, dim, rows + t, scale, s + t, ld);
}

template <typename I>
void ScoreBf16P(const float* qp, int R, int dim, const void* const* rows, int T, float scale, float* s,
                int ld) {
  int r = 0;
  if constexpr (I::kMaxScoreAccum >= 16) {
    // 32 registers (AVX-512): 4 rows x 4 tokens (16 accumulators, 8 widened K halves,
    // 2 q halves), each q load serving four tokens. Against 8 rows x 2 tokens,
    // cache-resident (`--min-bytes=2e6 --quick`, 2026-12-01 03:08-03:10 UTC): DeepSeek TP8
    // 7.7-9.8 against 7.4-9.2 GB/s, llama-70b TP8 20.6-24.5 against 18.9-22.8, better in
    // all 30 alternated pairs. The same bits: every score sums in the same order.
    for (; r + 4 <= R; r += 4) ScorePRows<I, 4, 4>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld);
  } else {
    // Up to 8 rows per K row load (AVX2: ~4% faster than 4 rows x 2 tokens for 8 rows).
    for (; r + 8 <= R; r += 8) ScorePRows<I, 8, 1>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld);
    for (; r + 4 <= R; r += 4) ScorePRows<I, 4, 2>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld);
  }
  switch (R - r) {
    case 3: ScorePRows<I, 3, 2>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld); break;
    case 2: ScorePRows<I, 2, 4>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld); break;
    case 1: ScorePRows<I, 1, 8>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld); break;
    default: break;
  }
}

// accp rows [0, NR) += p * V over paired columns [j, j + 2 kLanes NC).
template <typename I, int NR, int NC>
[[gnu::always_inline]] inline void AccumP(const float* p, int ld, const void* const* rows, int T, int j, int dv,
                                          float* accp) {
  using V = typename I::V;
  constexpr int kB = 2 * I::kLanes;
  V a[NR][NC][2];
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      a[r][c][0] = I::Load(accp + r * dv + j + kB * c);
      a[r][c][1] = I::Load(accp + r * dv + j + kB * c + I::kLanes);
    }
  }
  for (int t = 0; t < T; ++t) {
    V xe[NC], xo[NC];
    for (int c = 0; c < NC; ++c) I::LoadPair(rows[t], j + kB * c, &xe[c], &xo[c]);
    for (int r = 0; r < NR; ++r) {
      const V w = I::Set1(p[r * ld + t]);
      for (int c = 0; c < NC; ++c) {
        a[r][c][0] = I::Fma(w, xe[c], a[r][c][0]);
        a[r][c][1] = I::Fma(w, xo[c], a[r][c][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      I::Store(accp + r * dv + j + kB * c, a[r][c][0]);
      I::Store(accp + r * dv + j + kB * c + I::kLanes, a[r][c][1]);
    }
  }
}

// Rows [0, NR) over every column: blocks of NC column blocks, then single blocks.
template <typename I, int NR>
inline void AccumPRows(const float* p, int ld, const void* const* rows, int T, int dv, float* accp) {
  constexpr int kB = 2 * I::kLanes, NC = I::kAccumCols[NR];
  int j = 0;
  for (; j + kB * NC <= dv; j += kB * NC) AccumP<I, NR, NC>(p, ld, rows, T, j, dv, accp);
  // A remainder of 2+ blocks (d = 64 on AVX-512 with 1-2 rows) as pairs: one block per
  // call kept 2 NR accumulator chains, and each token waited on an FMA latency (tiny-gqa
  // cache-resident, one thread: +5-10% bytes/s, 3 alternated pairs).
  if constexpr (NC > 2) {
    for (; j + 2 * kB <= dv; j += 2 * kB) AccumP<I, NR, 2>(p, ld, rows, T, j, dv, accp);
  }
  for (; j < dv; j += kB) AccumP<I, NR, 1>(p, ld, rows, T, j, dv, accp);
}

template <typename I>
void AccumBf16P(const float* p, int R, int ld, const void* const* rows, int T, int dv, float* accp) {
  int r = 0;
  for (; r + 4 <= R; r += 4) AccumPRows<I, 4>(p + r * ld, ld, rows, T, dv, accp + r * dv);
  switch (R - r) {
    case 3: AccumPRows<I, 3>(p + r * ld, ld, rows, T, dv, accp + r * dv); break;
    case 2: AccumPRows<I, 2>(p + r * ld, ld, rows, T, dv, accp + r * dv); break;
    case 1: AccumPRows<I, 1>(p + r * ld, ld, rows, T, dv, accp + r * dv); break;
    default: break;
  }
}

}  // namespace kvpool::kernels::internal::paired
