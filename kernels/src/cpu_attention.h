// Building blocks of the CPU optimized attention kernels: a tile-wise online softmax
// over rows of queries that share K/V rows (the q heads of one GQA group, or all MLA
// heads), and the split-K merge.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu_simd.h"
#include "kvpool/kernels/dtype.h"

namespace kvpool::kernels::internal {

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline Elem ElemOf(DType d) {
  return d == DType::kBf16 ? Elem::kBf16 : (d == DType::kFp16 ? Elem::kF16 : Elem::kF32);
}

// Running softmax of R rows: max m[r], sum l[r], unnormalized output acc[r][dv].
struct SoftmaxRows {
  int R = 0;
  int dv = 0;
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;
  void Reset() const {
    std::fill(m, m + R, kNegInf);
    std::fill(l, l + R, 0.f);
    std::fill(acc, acc + int64_t{R} * dv, 0.f);
  }
};

// The softmax half of FoldTile: updates max/sum of every row with a tile of T scores
// (s: [R][kTile], masked ones -inf), rescales the accumulators, and overwrites s with
// the tile's unnormalized probabilities. The caller then accumulates V with them.
inline void SoftmaxTile(const SimdOps& ops, const SoftmaxRows& st, int T, float* s) {
  for (int r = 0; r < st.R; ++r) {
    float* sr = s + r * kTile;
    const float mx = ops.max_of(sr, T);
    if (mx == kNegInf) {  // every token masked for this row: contributes nothing
      std::fill(sr, sr + T, 0.f);
      continue;
    }
    const float m_new = std::max(st.m[r], mx);
    // exp(-inf - m_new) would be exp(-inf) = 0 as wanted, but -inf - -inf is NaN:
    // the first tile of a row has nothing to rescale.
    const float c = st.m[r] == kNegInf ? 0.f : std::exp(st.m[r] - m_new);
    const float sum = ops.exp_sub_sum(sr, T, m_new);
    st.l[r] = st.l[r] * c + sum;
    if (c != 1.f) ops.scal(c, st.acc + int64_t{r} * st.dv, st.dv);
    st.m[r] = m_new;
  }
}

// Folds a tile of T tokens into `st`. s: [R][kTile] scaled scores, masked ones -inf;
// overwritten with the tile's probabilities. vrows: [T] V row pointers.
inline void FoldTile(const SimdOps& ops, const SoftmaxRows& st, int T, float* s,
                     const void* const* vrows, Elem elem) {
  SoftmaxTile(ops, st, T, s);
  ops.accum(s, st.R, kTile, vrows, elem, T, st.dv, st.acc);
}

// out[j] = merged softmax output of n partial states (m_i, l_i, acc_i[dv]) given in a
// fixed order; zeros when every l_i is 0 (a zero-length sequence).
inline void MergePartials(int n, const float* m, const float* l, const float* const* acc, int dv,
                          float* out) {
  float M = kNegInf;
  for (int i = 0; i < n; ++i) M = std::max(M, m[i]);
  std::fill(out, out + dv, 0.f);
  if (M == kNegInf) return;
  float L = 0.f;
  for (int i = 0; i < n; ++i) {
    if (m[i] == kNegInf) continue;  // an empty split: max() above already dropped it
    const float w = std::exp(m[i] - M);
    L += l[i] * w;
    for (int j = 0; j < dv; ++j) out[j] += w * acc[i][j];
  }
  const float inv = 1.f / L;
  for (int j = 0; j < dv; ++j) out[j] *= inv;
}

}  // namespace kvpool::kernels::internal
