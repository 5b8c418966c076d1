// Runs every kernel check on the two CPU backends.
#include "kernel_test.h"

namespace kvpool::kernels::testing {

#define KVPOOL_CPU_BACKENDS \
  ::testing::Values(Backend::kCpuReference, Backend::kCpuOptimized), BackendParamName
INSTANTIATE_TEST_SUITE_P(Cpu, GqaTest, KVPOOL_CPU_BACKENDS);
INSTANTIATE_TEST_SUITE_P(Cpu, MlaTest, KVPOOL_CPU_BACKENDS);
INSTANTIATE_TEST_SUITE_P(Cpu, KdaTest, KVPOOL_CPU_BACKENDS);
INSTANTIATE_TEST_SUITE_P(Bf16, Bf16ProductsTest, ::testing::Values(Backend::kCpuOptimized), BackendParamName);

}  // namespace kvpool::kernels::testing
