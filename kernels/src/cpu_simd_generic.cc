// Portable inner loops (and the runtime ISA choice).
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "cpu_simd.h"
#include "kvpool/kernels/dtype.h"

namespace kvpool::kernels::internal {
namespace {

inline float Load(const void* row, Elem e, int i) {
  switch (e) {
    case Elem::kBf16: return Bf16ToFloat(static_cast<const uint16_t*>(row)[i]);
    case Elem::kF16: return Fp16ToFloat(static_cast<const uint16_t*>(row)[i]);
    default: return static_cast<const float*>(row)[i];
  }
}

void Score(const float* q, int R, int dim, const void* const* rows, Elem e, int T, float scale,
           float* s, int ld) {
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int i = 0; i < dim; ++i) acc += q[r * dim + i] * Load(rows[t], e, i);
      s[r * ld + t] = scale * acc;
    }
  }
}

void Accum(const float* p, int R, int ld, const void* const* rows, Elem e, int T, int dv,
           float* acc) {
  for (int t = 0; t < T; ++t) {
    for (int r = 0; r < R; ++r) {
      const float w = p[r * ld + t];
      if (w == 0.f) continue;
      for (int j = 0; j < dv; ++j) acc[r * dv + j] += w * Load(rows[t], e, j);
    }
  }
}

void ExpNonpos(float* x, int n) {
  for (int i = 0; i < n; ++i) x[i] = x[i] < -87.f ? 0.f : std::exp(x[i]);
}

float MaxOf(const float* x, int n) {
  float m = -INFINITY;
  for (int i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

float ExpSubSum(float* x, int n, float m) {
  for (int i = 0; i < n; ++i) x[i] -= m;
  ExpNonpos(x, n);
  float sum = 0.f;
  for (int i = 0; i < n; ++i) sum += x[i];
  return sum;
}

void Axpy(float a, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += a * x[i];
}

void Scal(float a, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] *= a;
}

float Dot(const float* a, const float* b, int n) {
  float s = 0.f;
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void KdaStep(float* S, int dk, int dv, const float* q, const float* k, const float* v,
             const float* alpha, float beta, float scale, float* out, float* u, const float* /*next*/) {
  for (int j = 0; j < dv; ++j) u[j] = 0.f;
  for (int i = 0; i < dk; ++i) Axpy(alpha[i] * k[i], S + i * dv, u, dv);
  for (int j = 0; j < dv; ++j) u[j] = beta * (v[j] - u[j]);
  for (int j = 0; j < dv; ++j) out[j] = 0.f;
  for (int i = 0; i < dk; ++i) {
    float* row = S + i * dv;
    for (int j = 0; j < dv; ++j) {
      row[j] = alpha[i] * row[j] + k[i] * u[j];
      out[j] += q[i] * row[j];
    }
  }
  for (int j = 0; j < dv; ++j) out[j] *= scale;
}

const SimdOps kGeneric = {"generic", Score,   Accum,   ExpNonpos, MaxOf,   ExpSubSum,
                          Axpy,      Scal,    Dot,     KdaStep,   nullptr, nullptr,
                          nullptr,   nullptr, 16};

}  // namespace

const SimdOps& GenericOps() { return kGeneric; }

const SimdOps& BestOps() {
  static const SimdOps* best = [] {
    const char* force = std::getenv("KVPOOL_KERNELS_ISA");
    if (force != nullptr && std::strcmp(force, "generic") == 0) return &kGeneric;
    const bool cap_avx2 = force != nullptr && std::strcmp(force, "avx2") == 0;
    const SimdOps* avx2 = Avx2Ops();
#if defined(__x86_64__) || defined(__i386__)
    if (avx2 != nullptr && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c")) {
      const SimdOps* avx512 = Avx512Ops();
      if (!cap_avx2 && avx512 != nullptr && __builtin_cpu_supports("avx512f") &&
          __builtin_cpu_supports("avx512bw")) {
        return avx512;
      }
      return avx2;
    }
#endif
    (void)avx2;
    (void)cap_avx2;
    return &kGeneric;
  }();
  return *best;
}

const SimdOps& BestBf16ProductOps() {
  static const SimdOps* ops = [] {
    const SimdOps& best = BestOps();
#if defined(__x86_64__) || defined(__i386__)
    const SimdOps* bf16 = Avx512Bf16Ops();
    if (bf16 != nullptr && std::strcmp(best.isa, "avx512") == 0 && __builtin_cpu_supports("avx512bf16")) {
      return bf16;
    }
#endif
    return &best;
  }();
  return *ops;
}

}  // namespace kvpool::kernels::internal
