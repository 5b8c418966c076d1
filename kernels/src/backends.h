// Factories of the backends, private to kernels/. backend.cc's registry is the only
// caller; CMake compiles either cuda_backend.cu or cuda_unavailable.cc, so no caller
// needs an #ifdef.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "kvpool/kernels/backend.h"

namespace kvpool::kernels::internal {

absl::StatusOr<std::unique_ptr<KernelBackend>> CreateCpuReferenceBackend();
absl::StatusOr<std::unique_ptr<KernelBackend>> CreateCpuOptimizedBackend(const BackendOptions& o);
absl::StatusOr<std::unique_ptr<KernelBackend>> CreateCudaBackend(const BackendOptions& o);
bool CudaCompiled();

}  // namespace kvpool::kernels::internal
