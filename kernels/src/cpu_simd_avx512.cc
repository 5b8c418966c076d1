// AVX-512 (F + BW) variant of the bf16 decode fast path and of the softmax's max and
// exp-sum, and the bf16-products variant (AVX512_BF16, below); every other inner loop is
// the AVX2 one. This file alone is
// compiled with -mavx512f -mavx512bw -mavx512bf16 (and AVX2's flags); its tables are only
// used after BestOps() / BestBf16ProductOps() checked the CPU (only the dot:: functions
// use BF16 instructions); it includes nothing but intrinsics, cpu_simd.h and
// cpu_simd_paired.h (see the note in cpu_simd.h).
//
// Layout (SimdOps::pair_block = 32): a vector is cut into blocks of 32 elements and each
// block is stored as its 16 even then its 16 odd elements, so one 64-byte load of 32
// bf16 widens to two fp32 zmm vectors with a shift and a mask.
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_simd_paired.h"

namespace kvpool::kernels::internal {
namespace {

struct Isa {
  using V = __m512;
  static constexpr int kLanes = 16;
  // Column blocks per AccumP call for 1..4 rows (32 zmm registers: 4 rows x 2 blocks
  // keep 16 accumulators and 4 V halves).
  static constexpr int kAccumCols[5] = {0, 4, 4, 2, 2};
  // 8 q rows x 2 tokens: 16 accumulators, 4 K halves and 2 q halves in 32 registers.
  static constexpr int kMaxScoreAccum = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V Set1(float x) { return _mm512_set1_ps(x); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  // As in cpu_simd_avx2.cc: one load per value, not a memory operand per use.
  template <typename T>
  [[gnu::always_inline]] static void InRegister(T& v) {
    asm("" : "+v"(v));
  }
  // 32 bf16 at row + i (elements) as fp32: even elements -> *e, odd -> *o.
  [[gnu::always_inline]] static void LoadPair(const void* row, int i, V* e, V* o) {
    __m512i raw = _mm512_loadu_si512(static_cast<const uint16_t*>(row) + i);
    InRegister(raw);  // one load for both halves
    *e = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    *o = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // Lane sums of N = 8 or 16 vectors, out[k] = sum of a[k]'s 16 lanes, as a transposing
  // tree: each level adds two halves of every vector's remaining lanes while packing two
  // vectors' halves into one register (lanes l + l+8, then l + l+4, l + l+2, l + l+1),
  // so 16 sums take 45 operations (two 8-sum folds, as AVX2's HSum8, took 50 and 16
  // scalar moves).
  // Every sum is added in that order whatever its k and N (fp addition commutes, and
  // the levels treat both operands alike), so any grouping of rows and tokens, and
  // zero padding, gives the same bits.
  template <int N>
  [[gnu::always_inline]] static void SumLanes(const V* a, float* out) {
    static_assert(N == 8 || N == 16);
    constexpr int kH = N / 2;
    V s1[kH];  // low 256 bits: a[k]'s lanes l + l+8; high: a[k + kH]'s
    for (int k = 0; k < kH; ++k) {
      s1[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[k], a[k + kH], 0x44), _mm512_shuffle_f32x4(a[k], a[k + kH], 0xEE));
    }
    constexpr int kQ = N / 4;
    V s2[kQ];  // 128-bit lane j holds one vector's 4 partial sums (l + l+4 of the above)
    for (int k = 0; k < kQ; ++k) {
      s2[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[k], s1[k + kQ], 0x88), _mm512_shuffle_f32x4(s1[k], s1[k + kQ], 0xDD));
    }
    V r;
    if constexpr (N == 16) {
      V s3[2];  // per 128-bit lane: two partial sums of s2[k]'s vector, two of s2[k + 2]'s
      for (int k = 0; k < 2; ++k) {
        s3[k] = _mm512_add_ps(
            _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s2[k]), _mm512_castps_pd(s2[k + 2]))),
            _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s2[k]), _mm512_castps_pd(s2[k + 2]))));
      }
      r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], 0x88), _mm512_shuffle_ps(s3[0], s3[1], 0xDD));
      // Lane 4j + e holds vector {0, 2, 1, 3}[e] + {0, 8, 4, 12}[j]; back to natural order.
      const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
      _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, r));
    } else {
      const V s3 = _mm512_add_ps(
          _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))),
          _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s2[0]), _mm512_castps_pd(s2[1]))));
      r = _mm512_add_ps(_mm512_shuffle_ps(s3, s3, 0x88), _mm512_shuffle_ps(s3, s3, 0xDD));
      // Lane 4j + e (e < 2) holds vector e + {0, 4, 2, 6}[j].
      const __m512i order = _mm512_setr_epi32(0, 1, 8, 9, 4, 5, 12, 13, 0, 0, 0, 0, 0, 0, 0, 0);
      _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, r)));
    }
  }
};

// ---- softmax of a tile, 16 lanes (the AVX2 table's Exp8 algorithm, lane for lane) ----

// Cephes-style expf as cpu_simd_avx2.cc's Exp8: |rel err| < 2e-7 on [-87, 0]; inputs
// below -87 give 0.
inline __m512 Exp16(__m512 x) {
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-87.f));
  __m512 fx = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
  fx = _mm512_roundscale_ps(fx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  const __m512 y = paired::ExpPoly<Isa>(x);
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~zero), y, _mm512_castsi512_ps(e));
}

inline __mmask16 Head(int n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }

float MaxOf16(const float* x, int n) {
  __m512 m = _mm512_set1_ps(-__builtin_inff());
  for (int i = 0; i < n; i += 16) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, Head(n - i), x + i));
  return _mm512_reduce_max_ps(m);
}

// x[i] = exp(x[i] - m), returns the sum; the tail's lanes past n are -inf (exp 0) and
// not stored.
float ExpSubSum16(float* x, int n, float m) {
  const __m512 vm = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-__builtin_inff());
  __m512 sum = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16) {
    const __mmask16 k = Head(n - i);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(ninf, k, x + i), vm));
    _mm512_mask_storeu_ps(x + i, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// ---- bf16 products (AVX512_BF16; Avx512Bf16Ops, BackendOptions::bf16_products) ----
// q rows are rounded to bf16 once per split and stored as 32 bf16 per block of 32
// elements, in order, in the first half of the block's 32 float slots (so row and block
// offsets stay in floats, as on the paired path). vdpbf16ps multiplies 16 pairs of
// adjacent bf16 and adds both products to 16 fp32 lanes: a score is one instruction per
// 32 elements per q row, half the FMAs of the widening path and no widening.
// Accumulation pairs tokens instead: V rows t and t+1 interleaved (unpacklo/hi_epi16)
// against the bf16 pair (p_t, p_t+1) of softmax weights, so the accumulators of a block
// of 32 columns hold, per 128-bit lane L, columns 8L..8L+3 (first vector) and 8L+4..8L+7
// (second); UnpairDot puts them back in order. Tiles start at even positions (kTile
// and the splits are even), so the token pairs, and the bits, do not depend on how a
// sequence is cut.
namespace dot {

inline __m512bh Bf16(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// 32 fp32 -> 32 bf16 (round to nearest even), in order.
inline __m512i ToBf16(__m512 lo, __m512 hi) { return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)); }

void PrepQ(const float* x, float* y, int n) {
  for (int b = 0; b < n; b += 32) {
    _mm512_storeu_si512(y + b, ToBf16(_mm512_loadu_ps(x + b), _mm512_loadu_ps(x + b + 16)));
  }
}

void UnpairDot(const float* x, float* y, int n) {
  for (int b = 0; b < n; b += 32) {
    for (int l = 0; l < 4; ++l) {
      for (int k = 0; k < 4; ++k) {
        y[b + 8 * l + k] = x[b + 4 * l + k];
        y[b + 8 * l + 4 + k] = x[b + 16 + 4 * l + k];
      }
    }
  }
}

// Scores of NR bf16 q rows against NT bf16 K rows; accumulator k = r * NT + t.
template <int NR, int NT>
[[gnu::always_inline]] inline void Score(const float* qp, int dim, const void* const* rows, float scale, float* s,
                                         int ld) {
  static_assert(NR * NT <= 24);
  __m512 acc[NR * NT];
  for (int k = 0; k < NR * NT; ++k) acc[k] = _mm512_setzero_ps();
  for (int i = 0; i < dim; i += 32) {
    __m512i kv[NT];
    for (int t = 0; t < NT; ++t) {
      kv[t] = _mm512_loadu_si512(static_cast<const uint16_t*>(rows[t]) + i);
      Isa::InRegister(kv[t]);
    }
    for (int r = 0; r < NR; ++r) {
      __m512i q = _mm512_loadu_si512(qp + r * dim + i);
      if constexpr (NT > 1) Isa::InRegister(q);
      for (int t = 0; t < NT; ++t) acc[r * NT + t] = _mm512_dpbf16_ps(acc[r * NT + t], Bf16(q), Bf16(kv[t]));
    }
  }
  paired::StoreScores<Isa, NR, NT>(acc, scale, s, ld);
}

template <int NR, int NT>
inline void ScoreRows(const float* qp, int dim, const void* const* rows, int T, float scale, float* s, int ld) {
  int t = 0;
  for (; t + NT <= T; t += NT) Score<NR, NT>(qp, dim, rows + t, scale, s + t, ld);
  if constexpr (NT > 2) {  // e.g. the 2-token sub-blocks of MLA with 3-7 heads
    if (t + 2 <= T) {
      Score<NR, 2>(qp, dim, rows + t, scale, s + t, ld);
      t += 2;
    }
  }
  for (; t < T; ++t) Score<NR, 1>(qp, dim, rows + t, scale, s + t, ld);
}

// Blocks of 4 rows x 4 tokens: 8 loads per 16 vdpbf16ps. 8 rows x 2 tokens (10 loads)
// measured slower: DeepSeek TP8 (16 heads) cache-resident 8.1-14.7 GB/s with 4 x 4
// against 9.1-13.2 with 8 x 2, better in 29 of 30 alternated pairs (2026-12-01, 03:01-03:04
// UTC); llama-70b TP8 (8 rows) within noise or a few % better.
void ScoreBf16D(const float* qp, int R, int dim, const void* const* rows, int T, float scale, float* s, int ld) {
  int r = 0;
  for (; r + 4 <= R; r += 4) ScoreRows<4, 4>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld);
  switch (R - r) {
    case 3: ScoreRows<3, 4>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld); break;
    case 2: ScoreRows<2, 4>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld); break;
    case 1: ScoreRows<1, 8>(qp + r * dim, dim, rows, T, scale, s + r * ld, ld); break;
    default: break;
  }
}

// Softmax weights of a tile as bf16 pairs: w[t / 2] = (p[t], p[t + 1]), zero past T.
inline void WeightPairs(const float* p, int T, uint32_t* w) {
  static_assert(kTile == 64);
  const __mmask16 m0 = T >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << T) - 1);
  const __mmask16 m1 = T >= 32 ? 0xFFFF : T <= 16 ? 0 : static_cast<__mmask16>((1u << (T - 16)) - 1);
  const __mmask16 m2 = T >= 48 ? 0xFFFF : T <= 32 ? 0 : static_cast<__mmask16>((1u << (T - 32)) - 1);
  const __mmask16 m3 = T >= 64 ? 0xFFFF : T <= 48 ? 0 : static_cast<__mmask16>((1u << (T - 48)) - 1);
  _mm512_storeu_si512(w, ToBf16(_mm512_maskz_loadu_ps(m0, p), _mm512_maskz_loadu_ps(m1, p + 16)));
  _mm512_storeu_si512(w + 16, ToBf16(_mm512_maskz_loadu_ps(m2, p + 32), _mm512_maskz_loadu_ps(m3, p + 48)));
}

// accp rows [0, NR) += p * V over columns [j, j + 32 NC), tokens in pairs.
template <int NR, int NC>
[[gnu::always_inline]] inline void Accum(const uint32_t* w, const void* const* rows, int T, int j, int dv,
                                         float* accp) {
  __m512 a[NR][NC][2];
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      a[r][c][0] = _mm512_loadu_ps(accp + r * dv + j + 32 * c);
      a[r][c][1] = _mm512_loadu_ps(accp + r * dv + j + 32 * c + 16);
    }
  }
  for (int t = 0; t < T; t += 2) {
    __m512i lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i x = _mm512_loadu_si512(static_cast<const uint16_t*>(rows[t]) + j + 32 * c);
      const __m512i y = t + 1 < T ? _mm512_loadu_si512(static_cast<const uint16_t*>(rows[t + 1]) + j + 32 * c)
                                  : _mm512_setzero_si512();  // (p_T is 0; row T does not exist)
      lo[c] = _mm512_unpacklo_epi16(x, y);
      hi[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int r = 0; r < NR; ++r) {
      const __m512i pw = _mm512_set1_epi32(static_cast<int>(w[r * (kTile / 2) + t / 2]));
      for (int c = 0; c < NC; ++c) {
        a[r][c][0] = _mm512_dpbf16_ps(a[r][c][0], Bf16(pw), Bf16(lo[c]));
        a[r][c][1] = _mm512_dpbf16_ps(a[r][c][1], Bf16(pw), Bf16(hi[c]));
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int c = 0; c < NC; ++c) {
      _mm512_storeu_ps(accp + r * dv + j + 32 * c, a[r][c][0]);
      _mm512_storeu_ps(accp + r * dv + j + 32 * c + 16, a[r][c][1]);
    }
  }
}

template <int NR>
inline void AccumRows(const float* p, int ld, const void* const* rows, int T, int dv, float* accp) {
  constexpr int NC = Isa::kAccumCols[NR];
  alignas(64) uint32_t w[NR * kTile / 2];
  for (int r = 0; r < NR; ++r) WeightPairs(p + r * ld, T, w + r * (kTile / 2));
  int j = 0;
  for (; j + 32 * NC <= dv; j += 32 * NC) Accum<NR, NC>(w, rows, T, j, dv, accp);
  if constexpr (NC > 2) {  // as paired::AccumPRows: two blocks, twice the chains of one
    for (; j + 64 <= dv; j += 64) Accum<NR, 2>(w, rows, T, j, dv, accp);
  }
  for (; j < dv; j += 32) Accum<NR, 1>(w, rows, T, j, dv, accp);
}

void AccumBf16D(const float* p, int R, int ld, const void* const* rows, int T, int dv, float* accp) {
  int r = 0;
  for (; r + 4 <= R; r += 4) AccumRows<4>(p + r * ld, ld, rows, T, dv, accp + r * dv);
  switch (R - r) {
    case 3: AccumRows<3>(p + r * ld, ld, rows, T, dv, accp + r * dv); break;
    case 2: AccumRows<2>(p + r * ld, ld, rows, T, dv, accp + r * dv); break;
    case 1: AccumRows<1>(p + r * ld, ld, rows, T, dv, accp + r * dv); break;
    default: break;
  }
}

}  // namespace dot

}  // namespace

const SimdOps* Avx512Bf16Ops() {
  const SimdOps* avx512 = Avx512Ops();
  if (avx512 == nullptr) return nullptr;
  static const SimdOps ops = [avx512] {
    SimdOps o = *avx512;
    o.isa = "avx512_bf16";
    o.pair16 = dot::PrepQ;
    o.unpair16 = dot::UnpairDot;
    o.score_bf16p = dot::ScoreBf16D;
    o.accum_bf16p = dot::AccumBf16D;
    o.pair_block = 32;
    return o;
  }();
  return &ops;
}

const SimdOps* Avx512Ops() {
  const SimdOps* avx2 = Avx2Ops();
  if (avx2 == nullptr) return nullptr;
  static const SimdOps ops = [avx2] {
    SimdOps o = *avx2;
    o.isa = "avx512";
    o.max_of = MaxOf16;
    o.exp_sub_sum = ExpSubSum16;
    o.pair16 = paired::Pair<Isa>;
    o.unpair16 = paired::Unpair<Isa>;
    o.score_bf16p = paired::ScoreBf16P<Isa>;
    o.accum_bf16p = paired::AccumBf16P<Isa>;
    o.pair_block = 2 * Isa::kLanes;
    return o;
  }();
  return &ops;
}

}  // namespace kvpool::kernels::internal
