// AVX-512 (F + BW) variant of the bf16 decode fast path; every other inner loop is the
// AVX2 one. This file alone is compiled with -mavx512f -mavx512bw (and AVX2's flags) and
// is only called after BestOps() checked the CPU; it includes nothing but intrinsics,
// cpu_simd.h and cpu_simd_paired.h (see the note in cpu_simd.h).
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
  // The 8 lane sums of a[0..7], one per lane, each in the same order whatever its
  // position: 16 lanes folded to 8 (lane l + lane l + 8), then pairwise as on AVX2.
  [[gnu::always_inline]] static __m256 HSum8(const V* a) {
    __m256 f[8];
    for (int k = 0; k < 8; ++k) {
      f[k] = _mm256_add_ps(_mm512_castps512_ps256(a[k]),
                           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[k]), 1)));
    }
    const __m256 h0 = _mm256_hadd_ps(f[0], f[1]), h1 = _mm256_hadd_ps(f[2], f[3]);
    const __m256 h2 = _mm256_hadd_ps(f[4], f[5]), h3 = _mm256_hadd_ps(f[6], f[7]);
    const __m256 g0 = _mm256_hadd_ps(h0, h1), g1 = _mm256_hadd_ps(h2, h3);
    return _mm256_add_ps(_mm256_permute2f128_ps(g0, g1, 0x20), _mm256_permute2f128_ps(g0, g1, 0x31));
  }
};

}  // namespace

const SimdOps* Avx512Ops() {
  const SimdOps* avx2 = Avx2Ops();
  if (avx2 == nullptr) return nullptr;
  static const SimdOps ops = [avx2] {
    SimdOps o = *avx2;
    o.isa = "avx512";
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
