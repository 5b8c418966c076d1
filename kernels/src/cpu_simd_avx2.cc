// AVX2 + FMA + F16C inner loops. This file alone is compiled with -mavx2 -mfma -mf16c
// and is only called after BestOps() checked the CPU; it includes nothing but
// intrinsics, cpu_simd.h and cpu_simd_paired.h (see the note in cpu_simd.h).
#include <immintrin.h>

#include "cpu_simd.h"
#include "cpu_simd_paired.h"

namespace kvpool::kernels::internal {
namespace {

// The traits of cpu_simd_paired.h's kernels (and ExpPoly there), 8 fp32 lanes.
struct Isa {
  using V = __m256;
  static constexpr int kLanes = 8;
  // Column blocks per AccumP call for 1..4 rows (16 ymm registers).
  static constexpr int kAccumCols[5] = {0, 4, 2, 1, 1};
  static constexpr int kMaxScoreAccum = 8;  // 16 ymm registers
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V Set1(float x) { return _mm256_set1_ps(x); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V Mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V Add(V a, V b) { return _mm256_add_ps(a, b); }
  // Pins v to a register: the compiler may no longer fold the load that produced it into
  // each instruction that uses it. gcc otherwise turns one load feeding two (or NT) uses
  // into a memory operand per use, and the decode score loops then issue more loads than
  // FMAs, which the core's two 256-bit load ports cannot feed (perf: the MLA score loop
  // loaded each q chunk twice and each K chunk twice per 16 FMAs).
  template <typename T>
  [[gnu::always_inline]] static void InRegister(T& v) {
    asm("" : "+x"(v));
  }
  // 16 bf16 at row + i (elements) as fp32: even elements -> *e, odd -> *o.
  [[gnu::always_inline]] static void LoadPair(const void* row, int i, V* e, V* o) {
    __m256i raw =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(row) + i));
    InRegister(raw);  // one load for both halves
    *e = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    *o = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  }
  // The 8 lane sums of a[0..7], one per lane, each reduced as ((l0+l1)+(l2+l3)) +
  // ((l4+l5)+(l6+l7)) whatever its position (so a score does not depend on grouping).
  [[gnu::always_inline]] static __m256 HSum8(const V* a) {
    const __m256 h0 = _mm256_hadd_ps(a[0], a[1]), h1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h2 = _mm256_hadd_ps(a[4], a[5]), h3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
  }
};

template <Elem E>
inline __m256 Load8(const void* row, int i) {
  if constexpr (E == Elem::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(row) + i);
  } else if constexpr (E == Elem::kBf16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(row) + i));
    return _mm256_cvtph_ps(h);
  }
}

template <Elem E>
inline float Load1(const void* row, int i) {
  if constexpr (E == Elem::kF32) {
    return static_cast<const float*>(row)[i];
  } else if constexpr (E == Elem::kBf16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(row)[i]) << 16;
    return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(bits))));
  } else {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<const uint16_t*>(row)[i])));
  }
}

inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Scores of up to 4 query rows against one K row.
template <Elem E, int NR>
inline void ScoreRows(const float* q, int dim, const void* row, float scale, float* s, int ld) {
  __m256 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= dim; i += 8) {
    const __m256 x = Load8<E>(row, i);
    for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * dim + i), x, acc[r]);
  }
  for (int r = 0; r < NR; ++r) {
    float tail = 0.f;
    for (int j = i; j < dim; ++j) tail += q[r * dim + j] * Load1<E>(row, j);
    s[r * ld] = scale * (HSum(acc[r]) + tail);
  }
}

// Sums of 4 vectors, one per lane of the result: {sum(a0), sum(a1), sum(a2), sum(a3)}.
inline __m128 HSum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 s01 = _mm256_hadd_ps(a0, a1);  // a0 pairs, a1 pairs (per 128-bit half)
  const __m256 s23 = _mm256_hadd_ps(a2, a3);
  const __m256 s = _mm256_hadd_ps(s01, s23);  // per half: a0 a1 a2 a3 partials
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of NR query rows against 4 K rows at once: the q chunk is loaded once for 4
// tokens and the 4 sums of a row reduce together (dim % 8 == 0).
template <Elem E, int NR>
inline void ScoreRows4(const float* q, int dim, const void* const* rows, float scale, float* s,
                       int ld) {
  __m256 acc[NR][4];
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < 4; ++t) acc[r][t] = _mm256_setzero_ps();
  }
  for (int i = 0; i < dim; i += 8) {
    const __m256 x0 = Load8<E>(rows[0], i), x1 = Load8<E>(rows[1], i);
    const __m256 x2 = Load8<E>(rows[2], i), x3 = Load8<E>(rows[3], i);
    for (int r = 0; r < NR; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * dim + i);
      acc[r][0] = _mm256_fmadd_ps(qv, x0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(qv, x1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(qv, x2, acc[r][2]);
      acc[r][3] = _mm256_fmadd_ps(qv, x3, acc[r][3]);
    }
  }
  const __m128 vs = _mm_set1_ps(scale);
  for (int r = 0; r < NR; ++r) {
    _mm_storeu_ps(s + r * ld, _mm_mul_ps(vs, HSum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3])));
  }
}

// Scores of 4 query rows against 2 K rows (dim % 8 == 0).
template <Elem E>
inline void ScoreRows4x2(const float* q, int dim, const void* const* rows, float scale, float* s,
                         int ld) {
  __m256 a[4][2];
  for (int r = 0; r < 4; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int i = 0; i < dim; i += 8) {
    const __m256 x0 = Load8<E>(rows[0], i), x1 = Load8<E>(rows[1], i);
    for (int r = 0; r < 4; ++r) {
      const __m256 qv = _mm256_loadu_ps(q + r * dim + i);
      a[r][0] = _mm256_fmadd_ps(qv, x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qv, x1, a[r][1]);
    }
  }
  alignas(16) float out[2][4];
  const __m128 vs = _mm_set1_ps(scale);
  for (int t = 0; t < 2; ++t) {
    _mm_store_ps(out[t], _mm_mul_ps(vs, HSum4(a[0][t], a[1][t], a[2][t], a[3][t])));
  }
  for (int r = 0; r < 4; ++r) {
    s[r * ld] = out[0][r];
    s[r * ld + 1] = out[1][r];
  }
}

template <Elem E>
void ScoreT(const float* q, int R, int dim, const void* const* rows, int T, float scale, float* s,
            int ld) {
  int r = 0;
  if (dim % 8 == 0) {
    // Blocks of 4 rows over token pairs; then 1-3 rows over token quads.
    for (; r + 4 <= R; r += 4) {
      int t = 0;
      for (; t + 2 <= T; t += 2) ScoreRows4x2<E>(q + r * dim, dim, rows + t, scale, s + r * ld + t, ld);
      if (t < T) ScoreRows<E, 4>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld);
    }
    const int nr = R - r;
    if (nr > 0) {
      int t = 0;
      for (; t + 4 <= T; t += 4) {
        switch (nr) {
          case 3: ScoreRows4<E, 3>(q + r * dim, dim, rows + t, scale, s + r * ld + t, ld); break;
          case 2: ScoreRows4<E, 2>(q + r * dim, dim, rows + t, scale, s + r * ld + t, ld); break;
          default: ScoreRows4<E, 1>(q + r * dim, dim, rows + t, scale, s + r * ld + t, ld); break;
        }
      }
      for (; t < T; ++t) {
        switch (nr) {
          case 3: ScoreRows<E, 3>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld); break;
          case 2: ScoreRows<E, 2>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld); break;
          default: ScoreRows<E, 1>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld); break;
        }
      }
    }
    return;
  }
  for (int t = 0; t < T; ++t) {
    for (r = 0; r + 4 <= R; r += 4) ScoreRows<E, 4>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld);
    switch (R - r) {
      case 3: ScoreRows<E, 3>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld); break;
      case 2: ScoreRows<E, 2>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld); break;
      case 1: ScoreRows<E, 1>(q + r * dim, dim, rows[t], scale, s + r * ld + t, ld); break;
      default: break;
    }
  }
}

void Score(const float* q, int R, int dim, const void* const* rows, Elem e, int T, float scale,
           float* s, int ld) {
  switch (e) {
    case Elem::kBf16: return ScoreT<Elem::kBf16>(q, R, dim, rows, T, scale, s, ld);
    case Elem::kF16: return ScoreT<Elem::kF16>(q, R, dim, rows, T, scale, s, ld);
    default: return ScoreT<Elem::kF32>(q, R, dim, rows, T, scale, s, ld);
  }
}

// acc rows [r0, r0+NR) += p * V over columns [j, j+8).
template <Elem E, int NR>
inline void AccumBlock(const float* p, int ld, const void* const* rows, int T, int j, int dv,
                       float* acc) {
  __m256 a[NR];
  for (int r = 0; r < NR; ++r) a[r] = _mm256_loadu_ps(acc + r * dv + j);
  for (int t = 0; t < T; ++t) {
    const __m256 x = Load8<E>(rows[t], j);
    for (int r = 0; r < NR; ++r) a[r] = _mm256_fmadd_ps(_mm256_set1_ps(p[r * ld + t]), x, a[r]);
  }
  for (int r = 0; r < NR; ++r) _mm256_storeu_ps(acc + r * dv + j, a[r]);
}

// As AccumBlock over 16 columns [j, j+16): each p broadcast feeds two FMAs.
template <Elem E, int NR>
inline void AccumBlock16(const float* p, int ld, const void* const* rows, int T, int j, int dv,
                         float* acc) {
  __m256 a[NR][2];
  for (int r = 0; r < NR; ++r) {
    a[r][0] = _mm256_loadu_ps(acc + r * dv + j);
    a[r][1] = _mm256_loadu_ps(acc + r * dv + j + 8);
  }
  for (int t = 0; t < T; ++t) {
    const __m256 x0 = Load8<E>(rows[t], j), x1 = Load8<E>(rows[t], j + 8);
    for (int r = 0; r < NR; ++r) {
      const __m256 w = _mm256_set1_ps(p[r * ld + t]);
      a[r][0] = _mm256_fmadd_ps(w, x0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(w, x1, a[r][1]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    _mm256_storeu_ps(acc + r * dv + j, a[r][0]);
    _mm256_storeu_ps(acc + r * dv + j + 8, a[r][1]);
  }
}

template <Elem E>
void AccumT(const float* p, int R, int ld, const void* const* rows, int T, int dv, float* acc) {
  int j = 0;
  for (; j + 16 <= dv; j += 16) {
    int r = 0;
    for (; r + 4 <= R; r += 4) AccumBlock16<E, 4>(p + r * ld, ld, rows, T, j, dv, acc + r * dv);
    switch (R - r) {
      case 3: AccumBlock16<E, 3>(p + r * ld, ld, rows, T, j, dv, acc + r * dv); break;
      case 2: AccumBlock16<E, 2>(p + r * ld, ld, rows, T, j, dv, acc + r * dv); break;
      case 1: AccumBlock16<E, 1>(p + r * ld, ld, rows, T, j, dv, acc + r * dv); break;
      default: break;
    }
  }
  for (; j + 8 <= dv; j += 8) {
    int r = 0;
    for (; r + 4 <= R; r += 4) AccumBlock<E, 4>(p + r * ld, ld, rows, T, j, dv, acc + r * dv);
    switch (R - r) {
      case 3: AccumBlock<E, 3>(p + r * ld, ld, rows, T, j, dv, acc + r * dv); break;
      case 2: AccumBlock<E, 2>(p + r * ld, ld, rows, T, j, dv, acc + r * dv); break;
      case 1: AccumBlock<E, 1>(p + r * ld, ld, rows, T, j, dv, acc + r * dv); break;
      default: break;
    }
  }
  for (; j < dv; ++j) {
    for (int r = 0; r < R; ++r) {
      float a = acc[r * dv + j];
      for (int t = 0; t < T; ++t) a += p[r * ld + t] * Load1<E>(rows[t], j);
      acc[r * dv + j] = a;
    }
  }
}

void Accum(const float* p, int R, int ld, const void* const* rows, Elem e, int T, int dv,
           float* acc) {
  switch (e) {
    case Elem::kBf16: return AccumT<Elem::kBf16>(p, R, ld, rows, T, dv, acc);
    case Elem::kF16: return AccumT<Elem::kF16>(p, R, ld, rows, T, dv, acc);
    default: return AccumT<Elem::kF32>(p, R, ld, rows, T, dv, acc);
  }
}

// Cephes-style expf: |rel err| < 2e-7 on [-87, 0]; inputs below -87 give 0.
inline __m256 Exp8(__m256 x) {
  const __m256 zero_mask = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.f)), _mm256_set1_ps(-87.f));
  __m256 fx = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
  fx = _mm256_floor_ps(fx);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = paired::ExpPoly<Isa>(x);
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(zero_mask, y);
}

void ExpNonpos(float* x, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, Exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = i; j < n; ++j) buf[j - i] = x[j];
    _mm256_store_ps(buf, Exp8(_mm256_load_ps(buf)));
    for (int j = i; j < n; ++j) x[j] = buf[j - i];
  }
}

float MaxOf(const float* x, int n) {
  __m256 m = _mm256_set1_ps(-__builtin_inff());
  int i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  float r = _mm_cvtss_f32(h);
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

float ExpSubSum(float* x, int n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (i < n) {  // tail: pad with -inf (exp gives exactly 0)
    alignas(32) float buf[8];
    for (int j = 0; j < 8; ++j) buf[j] = i + j < n ? x[i + j] : -__builtin_inff();
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_load_ps(buf), vm));
    _mm256_store_ps(buf, e);
    for (int j = i; j < n; ++j) x[j] = buf[j - i];
    sum = _mm256_add_ps(sum, e);
  }
  return HSum(sum);
}

void Axpy(float a, const float* x, float* y, int n) {
  const __m256 va = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

void Scal(float a, float* y, int n) {
  const __m256 va = _mm256_set1_ps(a);
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] *= a;
}

float Dot(const float* a, const float* b, int n) {
  __m256 acc = _mm256_setzero_ps();
  int i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = HSum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

void KdaStep(float* S, int dk, int dv, const float* q, const float* k, const float* v,
             const float* alpha, float beta, float scale, float* out, float* u, const float* next) {
  // Pass 1 (reads S once, row-major): u = S^T (alpha * k). Row i of the next state is
  // asked for (into L2) as row i of this one is read, so a small state's step is not a
  // wait for memory and then compute.
  for (int j = 0; j < dv; ++j) u[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    if (i + 1 < dk) _mm_prefetch(reinterpret_cast<const char*>(S + (i + 1) * dv), _MM_HINT_T0);
    if (next != nullptr) {
      const char* row = reinterpret_cast<const char*>(next + int64_t{i} * dv);
      for (int64_t b = 0; b < int64_t{dv} * 4; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
    Axpy(alpha[i] * k[i], S + i * dv, u, dv);
  }
  for (int j = 0; j < dv; ++j) u[j] = beta * (v[j] - u[j]);
  for (int j = 0; j < dv; ++j) out[j] = 0.f;
  // Pass 2 (S is in cache now): S = alpha S + k u^T, out += q_i S_i.
  for (int i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    const __m256 va = _mm256_set1_ps(alpha[i]);
    const __m256 vk = _mm256_set1_ps(k[i]);
    const __m256 vq = _mm256_set1_ps(q[i]);
    int j = 0;
    for (; j + 8 <= dv; j += 8) {
      const __m256 s = _mm256_fmadd_ps(vk, _mm256_loadu_ps(u + j),
                                       _mm256_mul_ps(va, _mm256_loadu_ps(row + j)));
      _mm256_storeu_ps(row + j, s);
      _mm256_storeu_ps(out + j, _mm256_fmadd_ps(vq, s, _mm256_loadu_ps(out + j)));
    }
    for (; j < dv; ++j) {
      row[j] = alpha[i] * row[j] + k[i] * u[j];
      out[j] += q[i] * row[j];
    }
  }
  Scal(scale, out, dv);
}

// ---- bf16 decode fast path, paired layout (see cpu_simd.h, cpu_simd_paired.h; the traits
// Isa above) ----

const SimdOps kAvx2 = {"avx2",
                       Score,
                       Accum,
                       ExpNonpos,
                       MaxOf,
                       ExpSubSum,
                       Axpy,
                       Scal,
                       Dot,
                       KdaStep,
                       paired::Pair<Isa>,
                       paired::Unpair<Isa>,
                       paired::ScoreBf16P<Isa>,
                       paired::AccumBf16P<Isa>,
                       2 * Isa::kLanes};

}  // namespace

const SimdOps* Avx2Ops() { return &kAvx2; }

}  // namespace kvpool::kernels::internal
