// The CPU optimized backend: owns the thread pool and the ISA choice.
#include <algorithm>
#include <cstring>
#include <string>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "backends.h"
#include "cpu_optimized.h"

namespace kvpool::kernels::internal {
namespace {

class CpuOptimizedBackend final : public KernelBackend {
 public:
  CpuOptimizedBackend(int threads, const SimdOps* ops) : pool_(threads), cx_{&pool_, ops} {}

  Backend kind() const override { return Backend::kCpuOptimized; }
  MemorySpace memory_space() const override { return MemorySpace::kHost; }
  int num_threads() const override { return pool_.num_threads(); }
  std::string Describe() const override {
    return absl::StrCat(cx_.ops->isa, " x ", pool_.num_threads(), " threads");
  }

  // 4 MiB slices claimed by all threads, so every thread streams long ranges.
  absl::Status CopyWithin(void* dst, const void* src, size_t bytes) override {
    constexpr size_t slice = size_t{4} << 20;
    pool_.ParallelFor(static_cast<int64_t>((bytes + slice - 1) / slice), [&](int64_t i) {
      const size_t begin = std::min(bytes, slice * i), end = std::min(bytes, begin + slice);
      if (end > begin) std::memcpy(static_cast<char*>(dst) + begin, static_cast<const char*>(src) + begin, end - begin);
    });
    return absl::OkStatus();
  }

 protected:
  absl::Status DoGqaDecode(const GqaDecodeParams& p) override {
    CpuGqaDecode(cx_, p);
    return absl::OkStatus();
  }
  absl::Status DoGqaPrefill(const GqaPrefillParams& p) override {
    CpuGqaPrefill(cx_, p);
    return absl::OkStatus();
  }
  absl::Status DoMlaDecodeAbsorbed(const MlaDecodeParams& p) override {
    CpuMlaDecodeAbsorbed(cx_, p);
    return absl::OkStatus();
  }
  absl::Status DoMlaMaterialized(const MlaMaterializedParams& p) override {
    CpuMlaMaterialized(cx_, p);
    return absl::OkStatus();
  }
  absl::Status DoKdaDecode(const KdaDecodeParams& p) override {
    CpuKdaDecode(cx_, p);
    return absl::OkStatus();
  }
  absl::Status DoKdaChunkedPrefill(const KdaPrefillParams& p) override {
    CpuKdaChunkedPrefill(cx_, p);
    return absl::OkStatus();
  }

 private:
  ThreadPool pool_;
  const CpuContext cx_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KernelBackend>> CreateCpuOptimizedBackend(const BackendOptions& o) {
  constexpr int kMaxThreads = 1024;
  if (o.num_threads < 0 || o.num_threads > kMaxThreads) {
    return absl::InvalidArgumentError(absl::StrCat("num_threads=", o.num_threads, ": must be 0..", kMaxThreads,
                                                   " (0 = hardware concurrency, at most 64)"));
  }
  int threads = o.num_threads;
  if (threads == 0) threads = std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 64);
  const SimdOps* ops = o.portable_loops ? &GenericOps() : o.bf16_products ? &BestBf16ProductOps() : &BestOps();
  try {
    return std::make_unique<CpuOptimizedBackend>(threads, ops);
  } catch (const std::system_error& e) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot start ", threads - 1, " kernel threads (", e.what(), "); lower num_threads"));
  }
}

}  // namespace kvpool::kernels::internal
