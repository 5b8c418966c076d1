// Inner loops of the CPU optimized backend, behind a table of function pointers
// chosen once at runtime: AVX-512 (bf16 decode) or AVX2+FMA+F16C when the CPU has
// them, portable loops otherwise.
//
// This header is included by translation units compiled with -mavx2 -mfma -mf16c (and
// -mavx512f -mavx512bw), so it must stay free of inline code from other headers (an
// inline function compiled with AVX2 there could be picked by the linker for everyone).
#pragma once

#include <cstdint>

namespace kvpool::kernels::internal {

// Element type of K/V rows (the cache dtypes the kernels accept).
enum class Elem : int { kF32 = 0, kBf16 = 1, kF16 = 2 };

// Tokens per softmax tile: scores of up to kTile tokens are formed, then folded into
// the running max/sum/accumulator at once.
inline constexpr int kTile = 64;

struct SimdOps {
  const char* isa;  // "avx2" or "generic"
  // s[r*ld + t] = scale * sum_i q[r*dim + i] * rows[t][i]   for r < R, t < T.
  void (*score)(const float* q, int R, int dim, const void* const* rows, Elem elem, int T,
                float scale, float* s, int ld);
  // acc[r*dv + j] += sum_t p[r*ld + t] * rows[t][j]          for r < R, j < dv.
  void (*accum)(const float* p, int R, int ld, const void* const* rows, Elem elem, int T,
                int dv, float* acc);
  // x[i] = exp(x[i]) for x <= 0; x < -87 (and -inf) gives exactly 0.
  void (*exp_nonpos)(float* x, int n);
  // max_i x[i] (-inf for n == 0; x holds no NaN).
  float (*max_of)(const float* x, int n);
  // x[i] = exp(x[i] - m) for x[i] <= m (as exp_nonpos of x[i] - m); returns sum_i x[i].
  float (*exp_sub_sum)(float* x, int n, float m);
  // y[i] += a * x[i].
  void (*axpy)(float a, const float* x, float* y, int n);
  // y[i] *= a.
  void (*scal)(float a, float* y, int n);
  // sum_i a[i] * b[i].
  float (*dot)(const float* a, const float* b, int n);
  // One KDA step of one head (kda.h) with alpha = exp(g) given:
  //   u = S^T (alpha*k); S = Diag(alpha) S + k (beta (v - u))^T; out = scale S^T q.
  // S: [dk][dv] in place; u: [dv] scratch. next: the [dk][dv] state the caller steps
  // next (nullptr: none), prefetched row by row while S is read.
  void (*kda_step)(float* S, int dk, int dv, const float* q, const float* k, const float* v,
                   const float* alpha, float beta, float scale, float* out, float* u,
                   const float* next);

  // bf16 decode fast path (nullptr where the ISA has none; callers then use score /
  // accum). It works in the "paired" layout: a vector is cut into blocks of 16
  // elements and each block is stored as its 8 even then its 8 odd elements, which is
  // how one 32-byte load of 16 bf16 widens to two fp32 vectors with a shift and a mask
  // (no shuffles). q rows and accumulators are kept paired; bf16 rows are read as
  // stored. Dimensions must be multiples of 16.
  // y = paired(x) / y = natural(x), n % 16 == 0, x != y. (On bf16 products, pair16
  // rounds q to bf16 and unpair16 reorders accumulators: Avx512Bf16Ops.)
  void (*pair16)(const float* x, float* y, int n);
  void (*unpair16)(const float* x, float* y, int n);
  // As score with bf16 rows and paired q rows (qp[r*dim ...]). Each score's sum runs in
  // the same order however rows and tokens are grouped (bitwise the same for any T).
  void (*score_bf16p)(const float* qp, int R, int dim, const void* const* rows, int T,
                      float scale, float* s, int ld);
  // As accum with bf16 rows and paired accumulators accp[r*dv ...].
  void (*accum_bf16p)(const float* p, int R, int ld, const void* const* rows, int T, int dv,
                      float* accp);
  // Elements per pairing block of pair16 / unpair16 and the paired kernels: 16 as
  // described above (AVX2), 32 for AVX-512 (16 even then 16 odd: one 64-byte load). The
  // paired path needs dimensions that are multiples of it.
  int pair_block;
};

const SimdOps& GenericOps();
// nullptr when this build has no AVX2 variant (non-x86 targets).
const SimdOps* Avx2Ops();
// AVX2's table with the bf16 fast path in AVX-512 (pair_block 32); nullptr where the
// build has none.
const SimdOps* Avx512Ops();
// AVX-512's table with the bf16 path on bf16 products (pair_block 32): pair16 rounds q
// to bf16, score_bf16p / accum_bf16p multiply bf16 by bf16 (vdpbf16ps, fp32 sums),
// unpair16 reorders its accumulators (see cpu_simd_avx512.cc). nullptr where the build
// has none. Selected by BackendOptions::bf16_products only.
const SimdOps* Avx512Bf16Ops();
// AVX-512 when compiled in and the CPU supports avx512f and avx512bw (and AVX2's
// features), else AVX2 when the CPU supports avx2, fma and f16c, else generic.
// KVPOOL_KERNELS_ISA=generic or =avx2 in the environment caps the choice there.
const SimdOps& BestOps();
// Avx512Bf16Ops() where BestOps() is AVX-512 and the CPU supports avx512_bf16, else
// BestOps().
const SimdOps& BestBf16ProductOps();

}  // namespace kvpool::kernels::internal
