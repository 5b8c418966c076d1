// The CPU optimized backend's kernels (cpu_optimized_*.cc), given validated params.
#pragma once

#include "cpu_simd.h"
#include "kvpool/kernels/backend.h"
#include "thread_pool.h"

namespace kvpool::kernels::internal {

struct CpuContext {
  ThreadPool* pool;
  const SimdOps* ops;
};

void CpuGqaDecode(const CpuContext& cx, const GqaDecodeParams& p);
void CpuGqaPrefill(const CpuContext& cx, const GqaPrefillParams& p);
void CpuMlaDecodeAbsorbed(const CpuContext& cx, const MlaDecodeParams& p);
void CpuMlaMaterialized(const CpuContext& cx, const MlaMaterializedParams& p);
void CpuKdaDecode(const CpuContext& cx, const KdaDecodeParams& p);
void CpuKdaChunkedPrefill(const CpuContext& cx, const KdaPrefillParams& p);

}  // namespace kvpool::kernels::internal
