// The CUDA factory of a build without nvcc.
#include "backends.h"

namespace kvpool::kernels::internal {

absl::StatusOr<std::unique_ptr<KernelBackend>> CreateCudaBackend(const BackendOptions&) {
  return absl::FailedPreconditionError(
      "kvpool was built without CUDA (nvcc not found or -DKVPOOL_CUDA=OFF); rebuild with "
      "CUDA to use the cuda kernel backend");
}

bool CudaCompiled() { return false; }

}  // namespace kvpool::kernels::internal
