// Non-x86 builds: no AVX2 or AVX-512 variant; BestOps() uses the portable loops.
#include "cpu_simd.h"

namespace kvpool::kernels::internal {
const SimdOps* Avx2Ops() { return nullptr; }
const SimdOps* Avx512Ops() { return nullptr; }
const SimdOps* Avx512Bf16Ops() { return nullptr; }
}  // namespace kvpool::kernels::internal
