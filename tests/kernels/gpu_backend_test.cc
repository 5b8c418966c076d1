// Runs every kernel check on the CUDA backend (CTest label `gpu`). Each test skips,
// saying why, when kvpool was built without CUDA or no CUDA device is present.
#include "kernel_test.h"

namespace kvpool::kernels::testing {

INSTANTIATE_TEST_SUITE_P(Gpu, GqaTest, ::testing::Values(Backend::kCuda), BackendParamName);
INSTANTIATE_TEST_SUITE_P(Gpu, MlaTest, ::testing::Values(Backend::kCuda), BackendParamName);
INSTANTIATE_TEST_SUITE_P(Gpu, KdaTest, ::testing::Values(Backend::kCuda), BackendParamName);
// bf16_products is a cpu_optimized option (cpu_backends_test.cc runs those checks).
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(Bf16ProductsTest);

}  // namespace kvpool::kernels::testing
