// KernelBackend launchers: validate every parameter, resolve default scales, then hand
// the call to the backend. Validation lives here once so every backend refuses the
// same inputs with the same messages.
#include "kvpool/kernels/backend.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "backends.h"
#include "kvpool/common/status.h"

namespace kvpool::kernels {
namespace {

absl::Status Invalid(absl::string_view arg, absl::string_view what) {
  // "kv.page_size" + "=16 but ..." reads as one phrase; other details follow a colon.
  const bool joined = !what.empty() && (what[0] == '=' || what[0] == '[');
  return absl::InvalidArgumentError(absl::StrCat(arg, joined ? "" : ": ", what));
}

absl::Status CheckPtr(const void* p, absl::string_view arg) {
  if (p == nullptr) return Invalid(arg, "is null; pass the buffer");
  return absl::OkStatus();
}

absl::Status CheckScale(float scale, absl::string_view arg) {
  if (!std::isfinite(scale)) return Invalid(arg, absl::StrCat("=", scale, " must be finite"));
  return absl::OkStatus();
}

// A softmax scale: 0 takes the default 1/sqrt(head_dim); a negative one would weight the
// least similar keys most, which no attention layer does.
absl::Status CheckSoftmaxScale(float scale) {
  RETURN_IF_ERROR(CheckScale(scale, "scale"));
  if (scale < 0.f) return Invalid("scale", absl::StrCat("=", scale, " must be >= 0 (0: 1/sqrt(head_dim))"));
  return absl::OkStatus();
}

// Shapes and (on host) contents of a block table over pages of `page_size`.
absl::Status CheckTable(const BlockTable& t, int page_size, int num_pages, bool host) {
  if (t.batch < 0) return Invalid("table.batch", absl::StrCat("=", t.batch, " must be >= 0"));
  if (t.batch == 0) return absl::OkStatus();
  if (t.max_blocks < 1) {
    return Invalid("table.max_blocks", absl::StrCat("=", t.max_blocks, " must be >= 1"));
  }
  RETURN_IF_ERROR(CheckPtr(t.block_table, "table.block_table"));
  RETURN_IF_ERROR(CheckPtr(t.seq_lens, "table.seq_lens"));
  if (!host) return absl::OkStatus();
  const int64_t cap = int64_t{t.max_blocks} * page_size;
  for (int b = 0; b < t.batch; ++b) {
    const int len = t.seq_lens[b];
    if (len < 0 || len > cap) {
      return Invalid(absl::StrCat("table.seq_lens[", b, "]"),
                     absl::StrCat("=", len, " outside [0, max_blocks*page_size=", cap,
                                  "]; grow max_blocks or shorten the sequence"));
    }
    if (len > kMaxSeqLen) {
      return Invalid(absl::StrCat("table.seq_lens[", b, "]"),
                     absl::StrCat("=", len, " exceeds kMaxSeqLen=", kMaxSeqLen,
                                  " tokens per sequence; split the sequence"));
    }
    const int64_t used = (int64_t{len} + page_size - 1) / page_size;  // len near INT_MAX
    for (int64_t i = 0; i < used; ++i) {
      const int page = t.block_table[int64_t{b} * t.max_blocks + i];
      if (page < 0 || page >= num_pages) {
        return Invalid(absl::StrCat("table.block_table[", b, "][", i, "]"),
                       absl::StrCat("=", page, " is not a page in [0, num_pages=", num_pages,
                                    ")"));
      }
    }
  }
  return absl::OkStatus();
}

// q_indptr: [batch+1], starts at 0, nondecreasing, q_len <= seq_len.
absl::Status CheckIndptr(const int32_t* indptr, const BlockTable& t, bool host,
                         absl::string_view arg) {
  if (t.batch == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPtr(indptr, arg));
  if (!host) return absl::OkStatus();
  if (indptr[0] != 0) return Invalid(arg, absl::StrCat("[0]=", indptr[0], " must be 0"));
  for (int b = 0; b < t.batch; ++b) {
    const int64_t q_len = int64_t{indptr[b + 1]} - indptr[b];  // no int overflow on bad input
    if (q_len < 0) {
      return Invalid(arg, absl::StrCat("decreases at ", b, "; it must be a prefix sum"));
    }
    if (q_len > t.seq_lens[b]) {
      return Invalid(arg, absl::StrCat("sequence ", b, " has ", q_len,
                                       " new tokens but table.seq_lens[", b, "]=",
                                       t.seq_lens[b], "; append the new K/V first"));
    }
  }
  return absl::OkStatus();
}

// A prefill call with no query rows (an empty batch, or every sequence with no new
// tokens) reads and writes nothing, so its q / out buffers may be null, as an empty
// tensor's data pointer is. (On a device backend indptr is not readable here: only an
// empty batch counts.) REQUIRES: CheckIndptr passed.
bool NoQueryRows(const int32_t* indptr, const BlockTable& t, bool host) {
  return t.batch == 0 || (host && indptr[t.batch] == 0);
}

absl::Status CheckGqaKv(const GqaPagedKv& kv, int num_q_heads) {
  RETURN_IF_ERROR(CheckCacheDType(kv.dtype, "kv.dtype"));
  if (kv.head_dim != 64 && kv.head_dim != 128) {
    return Invalid("kv.head_dim", absl::StrCat("=", kv.head_dim, " but GQA kernels support 64 or 128"));
  }
  if (kv.page_size != 1 && kv.page_size != 16 && kv.page_size != 64) {
    return Invalid("kv.page_size",
                   absl::StrCat("=", kv.page_size, " but GQA kernels support pages of 1, 16 or 64 tokens"));
  }
  if (kv.num_kv_heads < 1) {
    return Invalid("kv.num_kv_heads", absl::StrCat("=", kv.num_kv_heads, " must be >= 1"));
  }
  if (num_q_heads < 1 || num_q_heads % kv.num_kv_heads != 0) {
    return Invalid("num_q_heads", absl::StrCat("=", num_q_heads,
                                               " must be a positive multiple of kv.num_kv_heads=",
                                               kv.num_kv_heads));
  }
  if (kv.num_pages < 1) return Invalid("kv.num_pages", absl::StrCat("=", kv.num_pages, " must be >= 1"));
  RETURN_IF_ERROR(CheckPtr(kv.k, "kv.k"));
  RETURN_IF_ERROR(CheckPtr(kv.v, "kv.v"));
  return absl::OkStatus();
}

absl::Status CheckMlaKv(const MlaPagedKv& kv) {
  RETURN_IF_ERROR(CheckCacheDType(kv.dtype, "kv.dtype"));
  if (kv.page_size != kMlaPageSize) {
    return Invalid("kv.page_size",
                   absl::StrCat("=", kv.page_size,
                                " but MLA kernels need 64 (FlashMLA's page size); allocate MLA "
                                "blocks of 64 tokens"));
  }
  if (kv.kv_lora_rank != 512) {
    return Invalid("kv.kv_lora_rank", absl::StrCat("=", kv.kv_lora_rank, " but MLA kernels need 512"));
  }
  if (kv.rope_dim != 64) {
    return Invalid("kv.rope_dim", absl::StrCat("=", kv.rope_dim, " but MLA kernels need 64"));
  }
  if (kv.num_pages < 1) return Invalid("kv.num_pages", absl::StrCat("=", kv.num_pages, " must be >= 1"));
  return CheckPtr(kv.entries, "kv.entries");
}

absl::Status CheckPool(const KdaStatePool& pool) {
  if (pool.num_slots < 1) return Invalid("pool.num_slots", absl::StrCat("=", pool.num_slots, " must be >= 1"));
  if (pool.num_heads < 1) return Invalid("pool.num_heads", absl::StrCat("=", pool.num_heads, " must be >= 1"));
  if (pool.d_k < 1 || pool.d_k > 256) return Invalid("pool.d_k", absl::StrCat("=", pool.d_k, " must be in [1, 256]"));
  if (pool.d_v < 1 || pool.d_v > 256) return Invalid("pool.d_v", absl::StrCat("=", pool.d_v, " must be in [1, 256]"));
  return CheckPtr(pool.states, "pool.states");
}

absl::Status CheckSlots(const int32_t* slots, int batch, const KdaStatePool& pool, bool host) {
  RETURN_IF_ERROR(CheckPtr(slots, "slots"));
  if (!host) return absl::OkStatus();
  std::vector<bool> seen(pool.num_slots, false);
  for (int b = 0; b < batch; ++b) {
    const int s = slots[b];
    if (s < 0 || s >= pool.num_slots) {
      return Invalid(absl::StrCat("slots[", b, "]"),
                     absl::StrCat("=", s, " is not a slot in [0, pool.num_slots=", pool.num_slots, ")"));
    }
    if (seen[s]) {
      return Invalid(absl::StrCat("slots[", b, "]"),
                     absl::StrCat("=", s, " appears twice; each sequence needs its own state slot"));
    }
    seen[s] = true;
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckCacheDType(DType dtype, absl::string_view arg) {
  if (dtype == DType::kBf16 || dtype == DType::kFp16 || dtype == DType::kFp32) {
    return absl::OkStatus();
  }
  return Invalid(arg, absl::StrCat("=", DTypeName(dtype),
                                   " is not supported by the kernels; use bf16, fp16 or fp32"));
}

absl::string_view BackendName(Backend b) {
  switch (b) {
    case Backend::kCpuReference: return "cpu_reference";
    case Backend::kCpuOptimized: return "cpu_optimized";
    case Backend::kCuda: return "cuda";
  }
  return "unknown";
}

absl::StatusOr<Backend> ParseBackend(absl::string_view name) {
  for (Backend b : {Backend::kCpuReference, Backend::kCpuOptimized, Backend::kCuda}) {
    if (name == BackendName(b)) return b;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown kernel backend '", name, "'; use cpu_reference, cpu_optimized or cuda"));
}

absl::StatusOr<std::unique_ptr<KernelBackend>> CreateBackend(Backend kind,
                                                             const BackendOptions& options) {
  switch (kind) {
    case Backend::kCpuReference: return internal::CreateCpuReferenceBackend();
    case Backend::kCpuOptimized: return internal::CreateCpuOptimizedBackend(options);
    case Backend::kCuda: return internal::CreateCudaBackend(options);
  }
  return absl::InvalidArgumentError("unknown backend");
}

std::vector<Backend> CompiledBackends() {
  std::vector<Backend> out = {Backend::kCpuReference, Backend::kCpuOptimized};
  if (internal::CudaCompiled()) out.push_back(Backend::kCuda);
  return out;
}

absl::StatusOr<void*> KernelBackend::Allocate(size_t bytes) {
  if (bytes > SIZE_MAX - 63) {  // rounding up to 64 would wrap to a tiny buffer
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  void* p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
  if (p == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes"));
  }
  return p;
}

void KernelBackend::Free(void* p) { std::free(p); }

absl::Status KernelBackend::CopyIn(void* dst, const void* host_src, size_t bytes) {
  if (bytes != 0) std::memcpy(dst, host_src, bytes);
  return absl::OkStatus();
}

absl::Status KernelBackend::CopyOut(void* host_dst, const void* src, size_t bytes) {
  if (bytes != 0) std::memcpy(host_dst, src, bytes);
  return absl::OkStatus();
}

absl::Status KernelBackend::CopyWithin(void* dst, const void* src, size_t bytes) {
  if (bytes != 0) std::memcpy(dst, src, bytes);
  return absl::OkStatus();
}

namespace {
// A kernel's scratch buffers (per work item, on any pool thread; ThreadPool::ParallelFor
// hands the first item's exception to the caller) may not fit: RESOURCE_EXHAUSTED, not
// an exception through the launcher's Status interface.
// `note`: what the failed call may have left behind (KDA kernels update their states in
// place, item by item).
template <typename F>
absl::Status Run(const char* kernel, F&& f, const char* note = "") {
  try {
    return f();
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(kernel, ": out of host memory for the kernel's scratch buffers", note, "; run smaller batches"));
  } catch (const std::length_error&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(kernel, ": scratch buffers too large for this batch", note, "; run smaller batches"));
  }
}
constexpr char kKdaStatesNote[] =
    " (some of the batch's KDA states, and boundary states, may already be updated: restore them before a retry)";
}  // namespace

absl::Status KernelBackend::GqaDecode(const GqaDecodeParams& p) {
  const bool host = memory_space() == MemorySpace::kHost;
  RETURN_IF_ERROR(CheckGqaKv(p.kv, p.num_q_heads));
  RETURN_IF_ERROR(CheckSoftmaxScale(p.scale));
  RETURN_IF_ERROR(CheckTable(p.table, p.kv.page_size, p.kv.num_pages, host));
  if (p.table.batch == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPtr(p.q, "q"));
  RETURN_IF_ERROR(CheckPtr(p.out, "out"));
  GqaDecodeParams r = p;
  if (r.scale == 0.f) r.scale = 1.f / std::sqrt(static_cast<float>(p.kv.head_dim));
  return Run("GqaDecode", [&] { return DoGqaDecode(r); });
}

absl::Status KernelBackend::GqaPrefill(const GqaPrefillParams& p) {
  const bool host = memory_space() == MemorySpace::kHost;
  RETURN_IF_ERROR(CheckGqaKv(p.kv, p.num_q_heads));
  RETURN_IF_ERROR(CheckSoftmaxScale(p.scale));
  RETURN_IF_ERROR(CheckTable(p.table, p.kv.page_size, p.kv.num_pages, host));
  RETURN_IF_ERROR(CheckIndptr(p.q_indptr, p.table, host, "q_indptr"));
  if (NoQueryRows(p.q_indptr, p.table, host)) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPtr(p.q, "q"));
  RETURN_IF_ERROR(CheckPtr(p.out, "out"));
  GqaPrefillParams r = p;
  if (r.scale == 0.f) r.scale = 1.f / std::sqrt(static_cast<float>(p.kv.head_dim));
  return Run("GqaPrefill", [&] { return DoGqaPrefill(r); });
}

absl::Status KernelBackend::MlaDecodeAbsorbed(const MlaDecodeParams& p) {
  const bool host = memory_space() == MemorySpace::kHost;
  RETURN_IF_ERROR(CheckMlaKv(p.kv));
  if (p.num_heads < 1) return Invalid("num_heads", absl::StrCat("=", p.num_heads, " must be >= 1"));
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) {
    return Invalid("scale", absl::StrCat("=", p.scale, " must be > 0 (1/sqrt(qk_nope_dim + rope_dim))"));
  }
  RETURN_IF_ERROR(CheckTable(p.table, p.kv.page_size, p.kv.num_pages, host));
  if (p.table.batch == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPtr(p.q, "q"));
  RETURN_IF_ERROR(CheckPtr(p.out, "out"));
  return Run("MlaDecodeAbsorbed", [&] { return DoMlaDecodeAbsorbed(p); });
}

absl::Status KernelBackend::MlaMaterialized(const MlaMaterializedParams& p) {
  const bool host = memory_space() == MemorySpace::kHost;
  RETURN_IF_ERROR(CheckMlaKv(p.kv));
  if (p.num_heads < 1) return Invalid("num_heads", absl::StrCat("=", p.num_heads, " must be >= 1"));
  if (p.qk_nope_dim < 1 || p.qk_nope_dim > 256) {
    return Invalid("qk_nope_dim", absl::StrCat("=", p.qk_nope_dim, " must be in [1, 256]"));
  }
  if (p.v_head_dim < 1 || p.v_head_dim > 256) {
    return Invalid("v_head_dim", absl::StrCat("=", p.v_head_dim, " must be in [1, 256]"));
  }
  if (!(p.scale > 0.f) || !std::isfinite(p.scale)) {
    return Invalid("scale", absl::StrCat("=", p.scale, " must be > 0 (1/sqrt(qk_nope_dim + rope_dim))"));
  }
  RETURN_IF_ERROR(CheckTable(p.table, p.kv.page_size, p.kv.num_pages, host));
  RETURN_IF_ERROR(CheckIndptr(p.q_indptr, p.table, host, "q_indptr"));
  if (NoQueryRows(p.q_indptr, p.table, host)) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPtr(p.q_nope, "q_nope"));
  RETURN_IF_ERROR(CheckPtr(p.q_rope, "q_rope"));
  RETURN_IF_ERROR(CheckPtr(p.w_uk, "w_uk"));
  RETURN_IF_ERROR(CheckPtr(p.w_uv, "w_uv"));
  RETURN_IF_ERROR(CheckPtr(p.out, "out"));
  return Run("MlaMaterialized", [&] { return DoMlaMaterialized(p); });
}

absl::Status KernelBackend::KdaDecode(const KdaDecodeParams& p) {
  const bool host = memory_space() == MemorySpace::kHost;
  RETURN_IF_ERROR(CheckPool(p.pool));
  RETURN_IF_ERROR(CheckScale(p.scale, "scale"));
  if (p.batch < 0) return Invalid("batch", absl::StrCat("=", p.batch, " must be >= 0"));
  if (p.batch == 0) return absl::OkStatus();
  for (auto [ptr, name] : {std::pair<const void*, const char*>{p.q, "q"}, {p.k, "k"}, {p.v, "v"},
                           {p.g, "g"}, {p.beta, "beta"}, {p.out, "out"}}) {
    RETURN_IF_ERROR(CheckPtr(ptr, name));
  }
  RETURN_IF_ERROR(CheckSlots(p.slots, p.batch, p.pool, host));
  KdaDecodeParams r = p;
  if (r.scale == 0.f) r.scale = 1.f / std::sqrt(static_cast<float>(p.pool.d_k));
  return Run("KdaDecode", [&] { return DoKdaDecode(r); }, kKdaStatesNote);
}

absl::Status KernelBackend::KdaChunkedPrefill(const KdaPrefillParams& p) {
  const bool host = memory_space() == MemorySpace::kHost;
  RETURN_IF_ERROR(CheckPool(p.pool));
  RETURN_IF_ERROR(CheckScale(p.scale, "scale"));
  if (p.batch < 0) return Invalid("batch", absl::StrCat("=", p.batch, " must be >= 0"));
  if (p.batch == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckPtr(p.cu_seqlens, "cu_seqlens"));
  // No tokens at all (checked below to be a valid prefix sum): nothing is read or
  // written, so the token buffers may be null, as an empty tensor's data pointer is.
  const bool no_tokens = host && p.cu_seqlens[p.batch] == 0;
  if (!no_tokens) {
    for (auto [ptr, name] : {std::pair<const void*, const char*>{p.q, "q"}, {p.k, "k"}, {p.v, "v"},
                             {p.g, "g"}, {p.beta, "beta"}, {p.out, "out"}}) {
      RETURN_IF_ERROR(CheckPtr(ptr, name));
    }
  }
  RETURN_IF_ERROR(CheckSlots(p.slots, p.batch, p.pool, host));
  if (p.boundary_states != nullptr) RETURN_IF_ERROR(CheckPtr(p.boundary_indptr, "boundary_indptr"));
  if (host) {
    if (p.cu_seqlens[0] != 0) return Invalid("cu_seqlens", absl::StrCat("[0]=", p.cu_seqlens[0], " must be 0"));
    if (p.cu_seqlens[p.batch] > kMaxSeqLen) {
      return Invalid(absl::StrCat("cu_seqlens[", p.batch, "]"),
                     absl::StrCat("=", p.cu_seqlens[p.batch], " exceeds kMaxSeqLen=", kMaxSeqLen,
                                  " tokens per call; split the batch"));
    }
    int64_t expected = 0;
    for (int b = 0; b < p.batch; ++b) {
      const int64_t len = int64_t{p.cu_seqlens[b + 1]} - p.cu_seqlens[b];  // no int overflow
      if (len < 0) return Invalid("cu_seqlens", absl::StrCat("decreases at ", b, "; it must be a prefix sum"));
      const int start = p.start_pos ? p.start_pos[b] : 0;
      if (start < 0) return Invalid(absl::StrCat("start_pos[", b, "]"), absl::StrCat("=", start, " must be >= 0"));
      if (p.boundary_states != nullptr) {
        if (p.boundary_indptr[b] != expected) {
          return Invalid(absl::StrCat("boundary_indptr[", b, "]"),
                         absl::StrCat("=", p.boundary_indptr[b], " but the runs before it have ",
                                      expected, " chunk boundaries; use KdaCountBoundaries"));
        }
        expected += KdaCountBoundaries(start, len);
      }
    }
    if (p.boundary_states != nullptr && p.boundary_indptr[p.batch] != expected) {
      return Invalid(absl::StrCat("boundary_indptr[", p.batch, "]"),
                     absl::StrCat("=", p.boundary_indptr[p.batch], " but the runs have ", expected,
                                  " chunk boundaries; use KdaCountBoundaries"));
    }
  }
  if (no_tokens) return absl::OkStatus();
  KdaPrefillParams r = p;
  if (r.scale == 0.f) r.scale = 1.f / std::sqrt(static_cast<float>(p.pool.d_k));
  return Run("KdaChunkedPrefill", [&] { return DoKdaChunkedPrefill(r); }, kKdaStatesNote);
}

}  // namespace kvpool::kernels
