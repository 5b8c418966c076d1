// The parameterized fixture every kernel check runs under: one backend per instance.
// kernels_test instantiates the CPU backends, kernels_gpu_test the CUDA one (which
// skips, saying why, where no CUDA device or no CUDA build is present).
#pragma once

#include <memory>

#include "gtest/gtest.h"
#include "kvpool/kernels/backend.h"

namespace kvpool::kernels::testing {

class KernelTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    auto be = CreateBackend(GetParam(), {.num_threads = 2});
    if (!be.ok()) {
      if (GetParam() == Backend::kCuda) {
        GTEST_SKIP() << "CUDA kernel backend not usable here (" << be.status()
                     << "); run scripts/gpu-check.sh on a machine with an NVIDIA GPU";
      }
      FAIL() << be.status();
    }
    be_ = std::move(*be);
  }
  bool host() const { return be_->memory_space() == MemorySpace::kHost; }
  std::unique_ptr<KernelBackend> be_;
};

// One suite per kernel family, instantiated per binary (cpu_backends_test.cc,
// gpu_backend_test.cc).
class GqaTest : public KernelTest {};
class MlaTest : public KernelTest {};
class KdaTest : public KernelTest {};
// BackendOptions::bf16_products checks: a cpu_optimized option, so kernels_test
// instantiates them for cpu_optimized only (prefix Bf16, outside the isa_avx2 rerun).
class Bf16ProductsTest : public KernelTest {};

inline std::string BackendParamName(const ::testing::TestParamInfo<Backend>& info) {
  return std::string(BackendName(info.param));
}

}  // namespace kvpool::kernels::testing
