// Helpers shared by the CPU KDA implementations.
#pragma once

#include <cmath>

namespace kvpool::kernels::internal {

// x /= sqrt(sum x^2 + 1e-6), flash-linear-attention's l2norm.
inline void L2NormalizeInPlace(float* x, int n) {
  float ss = 0.f;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss + 1e-6f);
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

}  // namespace kvpool::kernels::internal
