// One interface over the kernel backends: CPU reference, CPU optimized, CUDA.
//
// Callers pick a backend by value (Backend enum or its name) and get a KernelBackend;
// nothing outside kernels/ needs an #ifdef to know which backends were built.
//
//   cpu_reference  readable scalar loops, single-threaded: the oracle the tests trust.
//   cpu_optimized  AVX2/FMA/F16C when the CPU has them (runtime dispatch, portable
//                  loops otherwise), work split over a small thread pool.
//   cuda           sm_90a kernels; takes device pointers. CreateBackend answers
//                  FAILED_PRECONDITION when kvpool was built without CUDA and
//                  UNAVAILABLE when no CUDA device is present.
//
// Every launcher validates its parameters before any work and answers
// INVALID_ARGUMENT with a message that names the argument and the fix, e.g.
//   "kv.page_size=16 but MLA kernels need 64; allocate MLA blocks of 64 tokens".
// Host backends also check the contents of block tables, seq_lens, indptrs and slots.
//
// Determinism: for a fixed backend (and any thread count) results are bitwise
// reproducible run to run: work items are independent and split-K partials merge
// in a fixed order. The CUDA backend is deterministic for a fixed device.
//
// Thread safety: a KernelBackend may be called from one thread at a time (the CPU
// optimized backend owns a thread pool that one call uses at a time); use one backend
// object per calling thread otherwise.
//
// Example:
//   ASSIGN_OR_RETURN(auto backend, CreateBackend(Backend::kCpuOptimized));
//   GqaDecodeParams p{.q = q, .out = out, .kv = kv, .table = table, .num_q_heads = 4};
//   RETURN_IF_ERROR(backend->GqaDecode(p));
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvpool/kernels/gqa.h"
#include "kvpool/kernels/kda.h"
#include "kvpool/kernels/mla.h"

namespace kvpool::kernels {

enum class Backend : uint8_t { kCpuReference, kCpuOptimized, kCuda };
enum class MemorySpace : uint8_t { kHost, kDevice };

absl::string_view BackendName(Backend b);  // "cpu_reference", "cpu_optimized", "cuda"
absl::StatusOr<Backend> ParseBackend(absl::string_view name);

struct BackendOptions {
  int num_threads = 0;  // cpu_optimized: 0 = hardware concurrency (at most 64)
  int device = 0;       // cuda: device ordinal
  bool portable_loops = false;  // cpu_optimized: skip AVX2 even where the CPU has it
  // cpu_optimized, decode over bf16 caches (GQA, absorbed MLA): round q and the softmax
  // weights to bf16 and multiply them by the cached bf16 values with AVX-512 BF16 dot
  // products (vdpbf16ps, fp32 sums), as llama.cpp's and vLLM's CPU attention do and as
  // tensor cores do: half the arithmetic instructions, results within bf16 rounding of
  // q and p (~2^-9 relative per product) instead of fp32's. Where the CPU lacks
  // avx512_bf16 (or the ISA is capped) the exact path runs; Describe() names the ISA.
  bool bf16_products = false;
};

class KernelBackend {
 public:
  virtual ~KernelBackend() = default;

  virtual Backend kind() const = 0;
  virtual MemorySpace memory_space() const = 0;
  // Threads the backend uses (1 for the reference, 0 for CUDA).
  virtual int num_threads() const = 0;

  // The launchers: validate, then run. See gqa.h, mla.h, kda.h for the math.
  absl::Status GqaDecode(const GqaDecodeParams& p);
  absl::Status GqaPrefill(const GqaPrefillParams& p);
  absl::Status MlaDecodeAbsorbed(const MlaDecodeParams& p);
  absl::Status MlaMaterialized(const MlaMaterializedParams& p);
  absl::Status KdaDecode(const KdaDecodeParams& p);
  absl::Status KdaChunkedPrefill(const KdaPrefillParams& p);

  // Memory the backend's kernels read and write: host memory (64-byte aligned) for
  // the CPU backends, device memory for cuda. Lets tests and benchmarks stay
  // backend-agnostic; production callers own their cache memory.
  virtual absl::StatusOr<void*> Allocate(size_t bytes);
  virtual void Free(void* p);
  virtual absl::Status CopyIn(void* dst, const void* host_src, size_t bytes);
  virtual absl::Status CopyOut(void* host_dst, const void* src, size_t bytes);
  // Copies between two of the backend's buffers as fast as the backend can (all
  // threads on CPU, device-to-device on cuda): the benchmark's bandwidth probe.
  virtual absl::Status CopyWithin(void* dst, const void* src, size_t bytes);
  // What runs the kernels, for reports: "avx2 x 2 threads", a GPU name, ...
  virtual std::string Describe() const = 0;

  // Bytes of the cache closest to memory that the kernels share (the GPU's L2); 0 when
  // the backend does not know (CPU backends: the benchmark reads sysfs itself).
  virtual size_t cache_bytes() const { return 0; }

  // Blocks until work queued by previous calls is done (a no-op on CPU backends).
  virtual absl::Status Synchronize() { return absl::OkStatus(); }

 protected:
  // Called with validated parameters (and resolved default scales).
  virtual absl::Status DoGqaDecode(const GqaDecodeParams& p) = 0;
  virtual absl::Status DoGqaPrefill(const GqaPrefillParams& p) = 0;
  virtual absl::Status DoMlaDecodeAbsorbed(const MlaDecodeParams& p) = 0;
  virtual absl::Status DoMlaMaterialized(const MlaMaterializedParams& p) = 0;
  virtual absl::Status DoKdaDecode(const KdaDecodeParams& p) = 0;
  virtual absl::Status DoKdaChunkedPrefill(const KdaPrefillParams& p) = 0;
};

// Creates a backend; see the codes above for cuda.
absl::StatusOr<std::unique_ptr<KernelBackend>> CreateBackend(Backend kind,
                                                             const BackendOptions& options = {});

// Backends compiled into this build (cuda only when built with nvcc; whether a device
// is present is CreateBackend's answer).
std::vector<Backend> CompiledBackends();

}  // namespace kvpool::kernels
