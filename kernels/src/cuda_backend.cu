// The CUDA backend (sm_90a): the kernels of gqa.h, mla.h and kda.h on device memory.
//
// Decode with 16-bit K/V (GQA head_dim 64/128, MLA absorbed) runs on tensor cores:
// cuda_decode_mma.cuh. KDA decode with d_k = d_v = 64 or 128 keeps the state in
// registers (same file). The rest, described here, is the portable path: fp32 caches,
// prefill and materialized MLA.
// Attention (GQA decode/prefill, MLA absorbed, MLA materialized after an up-projection
// pass) shares one paged kernel: a CTA owns one (query, q head, split); its 4 warps
// take tokens round-robin, lanes split the head dims, every warp keeps an online
// softmax, and the warps merge through shared memory in a fixed order. Decode splits
// the context into kGqaSplitTokens / kMlaSplitTokens chunks merged by a second kernel
// in split order, so results are deterministic on a given device.
// KDA: one CTA per (sequence, head), one thread per state column; the prefill runs the
// recurrence token by token on device (the chunk grid decides where boundary states
// are copied), which matches kda.h exactly but is not the chunk-parallel form.
//
// Launchers check only shapes on the host (the tables live on the device); kernels
// skip out-of-range page ids and slots instead of reading out of bounds.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "backends.h"
#include "cuda_decode_mma.cuh"
#include "kvpool/common/status.h"

namespace kvpool::kernels::internal {
namespace {

// CUDA allows at most 65535 blocks on a grid's y and z dimensions; fields that set them
// are refused up front, naming the field, instead of failing as a launch error.
absl::Status GridLimit(int64_t value, absl::string_view field, absl::string_view why) {
  if (value <= 65535) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, "=", value, " exceeds the CUDA backend's 65535 (",
                                                 why, "); split the call"));
}

absl::Status CudaStatus(cudaError_t e, absl::string_view what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

constexpr int kWarps = 4;
// -infinity; written out because __int_as_float is not constexpr.
#define KVPOOL_NEG_INF (-__int_as_float(0x7f800000))

template <typename T>
__device__ __forceinline__ float ToF(T x);
template <>
__device__ __forceinline__ float ToF<float>(float x) { return x; }
template <>
__device__ __forceinline__ float ToF<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float ToF<__half>(__half x) { return __half2float(x); }

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

struct AttnArgs {
  const float* q;             // row (query qi, head h) at q + (qi * num_q_heads + h) * dk
  const void* k;              // paged: slot s, kv head g at k + s * k_stride + g * k_head
  const void* v;
  int64_t k_stride, v_stride;  // elements per token slot
  int k_head, v_head;          // elements per kv head inside a slot
  int dk, dv;
  int page_size;
  int num_pages;
  const int32_t* block_table;  // [batch][max_blocks]
  int max_blocks;
  const int32_t* seq_lens;     // [batch]
  const int32_t* q_indptr;     // [batch + 1] for prefill (causal); nullptr for decode
  int batch;
  int num_q_heads;
  int group;                   // q heads per kv head
  float scale;
  int split_tokens;            // decode: tokens per split; prefill: 0 (one split)
  float* out;                  // [query][num_q_heads][dv] when unsplit
  float* part_acc;             // [query][num_q_heads][max_splits][dv] when split
  float* part_ml;              // [query][num_q_heads][max_splits][2]
  int max_splits;
};

// grid: (queries, num_q_heads, max_splits or 1); block: 32 * kWarps. Queries go on x,
// the only dimension allowed more than 65535 blocks.
template <typename T, int VPL>
__global__ void __launch_bounds__(32 * kWarps) PagedAttnKernel(AttnArgs a) {
  const int qi = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int b = qi, n = 0;  // sequence and number of visible tokens
  if (a.q_indptr == nullptr) {
    n = a.seq_lens[b];
  } else {
    int lo = 0, hi = a.batch - 1;  // last b with q_indptr[b] <= qi
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (a.q_indptr[mid] <= qi) lo = mid; else hi = mid - 1;
    }
    b = lo;
    const int q_len = a.q_indptr[b + 1] - a.q_indptr[b];
    n = a.seq_lens[b] - q_len + (qi - a.q_indptr[b]) + 1;
  }
  // Launchers do not read device-resident seq_lens; a length past the row's pages would
  // read the next row of the table (or past it), so it is cut to the row.
  n = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(n), static_cast<int64_t>(a.max_blocks) * a.page_size)));
  int t_begin = 0, t_end = n;
  if (a.split_tokens > 0) {
    t_begin = min(n, split * a.split_tokens);
    t_end = min(n, t_begin + a.split_tokens);
  }
  const float* q = a.q + (static_cast<int64_t>(qi) * a.num_q_heads + h) * a.dk;
  const int kvh = h / a.group;
  const T* K = static_cast<const T*>(a.k);
  const T* V = static_cast<const T*>(a.v);
  const int32_t* row = a.block_table + static_cast<int64_t>(b) * a.max_blocks;

  float m = KVPOOL_NEG_INF, l = 0.f, acc[VPL];
#pragma unroll
  for (int i = 0; i < VPL; ++i) acc[i] = 0.f;
  for (int t = t_begin + warp; t < t_end; t += kWarps) {
    const int page = row[t / a.page_size];
    if (page < 0 || page >= a.num_pages) continue;  // a bad table entry: skip, never fault
    const int64_t slot = static_cast<int64_t>(page) * a.page_size + t % a.page_size;
    const T* kr = K + slot * a.k_stride + static_cast<int64_t>(kvh) * a.k_head;
    const T* vr = V + slot * a.v_stride + static_cast<int64_t>(kvh) * a.v_head;
    float dot = 0.f;
    for (int i = lane; i < a.dk; i += 32) dot += q[i] * ToF(kr[i]);
    const float s = WarpSum(dot) * a.scale;
    const float m_new = fmaxf(m, s);
    const float c = (m == KVPOOL_NEG_INF) ? 0.f : expf(m - m_new);
    const float p = (m_new == KVPOOL_NEG_INF) ? 0.f : expf(s - m_new);  // every score so far -inf: no weight
    l = l * c + p;
#pragma unroll
    for (int i = 0; i < VPL; ++i) {
      const int j = lane + 32 * i;
      acc[i] = acc[i] * c + (j < a.dv ? p * ToF(vr[j]) : 0.f);
    }
    m = m_new;
  }
  // Merge the warps in order 0..kWarps-1.
  __shared__ float sm_m[kWarps], sm_l[kWarps];
  __shared__ float sm_acc[kWarps][VPL * 32];
  if (lane == 0) {
    sm_m[warp] = m;
    sm_l[warp] = l;
  }
#pragma unroll
  for (int i = 0; i < VPL; ++i) sm_acc[warp][lane + 32 * i] = acc[i];
  __syncthreads();
  float M = KVPOOL_NEG_INF;
  for (int w = 0; w < kWarps; ++w) M = fmaxf(M, sm_m[w]);
  float L = 0.f;
  float wts[kWarps];
  for (int w = 0; w < kWarps; ++w) {
    wts[w] = sm_m[w] == KVPOOL_NEG_INF ? 0.f : expf(sm_m[w] - M);
    L += sm_l[w] * wts[w];
  }
  const int64_t qh = static_cast<int64_t>(qi) * a.num_q_heads + h;
  for (int j = threadIdx.x; j < a.dv; j += blockDim.x) {
    float o = 0.f;
    for (int w = 0; w < kWarps; ++w) o += wts[w] * sm_acc[w][j];
    if (a.split_tokens > 0) {
      a.part_acc[(qh * a.max_splits + split) * a.dv + j] = o;
    } else {
      a.out[qh * a.dv + j] = L > 0.f ? o / L : 0.f;
    }
  }
  if (a.split_tokens > 0 && threadIdx.x == 0) {
    a.part_ml[(qh * a.max_splits + split) * 2 + 0] = M;
    a.part_ml[(qh * a.max_splits + split) * 2 + 1] = L;
  }
}

// grid: (queries, num_q_heads); merges splits in order. Splits past the sequence end
// hold m = -inf and drop out.
__global__ void MergeSplitsKernel(const float* part_acc, const float* part_ml, int max_splits, int num_q_heads,
                                  int dv, float* out) {
  const int64_t qh = static_cast<int64_t>(blockIdx.x) * num_q_heads + blockIdx.y;
  float M = KVPOOL_NEG_INF;
  for (int s = 0; s < max_splits; ++s) M = fmaxf(M, part_ml[(qh * max_splits + s) * 2]);
  for (int j = threadIdx.x; j < dv; j += blockDim.x) {
    float L = 0.f, o = 0.f;
    if (M != KVPOOL_NEG_INF) {
      for (int s = 0; s < max_splits; ++s) {
        const float ms = part_ml[(qh * max_splits + s) * 2];
        if (ms == KVPOOL_NEG_INF) continue;
        const float w = expf(ms - M);
        L += part_ml[(qh * max_splits + s) * 2 + 1] * w;
        o += w * part_acc[(qh * max_splits + s) * dv + j];
      }
    }
    out[qh * dv + j] = L > 0.f ? o / L : 0.f;
  }
}

template <typename T>
void LaunchAttnT(const AttnArgs& a, int queries, cudaStream_t st) {
  const dim3 grid(queries, a.num_q_heads, a.split_tokens > 0 ? a.max_splits : 1);
  const int threads = 32 * kWarps;
  if (a.dv <= 64) {
    PagedAttnKernel<T, 2><<<grid, threads, 0, st>>>(a);
  } else if (a.dv <= 128) {
    PagedAttnKernel<T, 4><<<grid, threads, 0, st>>>(a);
  } else if (a.dv <= 256) {
    PagedAttnKernel<T, 8><<<grid, threads, 0, st>>>(a);
  } else {
    PagedAttnKernel<T, 16><<<grid, threads, 0, st>>>(a);
  }
}

void LaunchAttn(DType dtype, const AttnArgs& a, int queries, cudaStream_t st) {
  switch (dtype) {
    case DType::kBf16: return LaunchAttnT<__nv_bfloat16>(a, queries, st);
    case DType::kFp16: return LaunchAttnT<__half>(a, queries, st);
    default: return LaunchAttnT<float>(a, queries, st);
  }
}

// Materialized MLA, pass 1: up-project every visible token of every sequence for
// every head into fp32 slots: K [slot][H][nope + rope], V [slot][H][dv].
// grid: (max_blocks * page_size, batch); block: 128 threads over H * (nope + dv).
template <typename T>
__global__ void UpProjectKernel(const T* entries, const int32_t* block_table, int max_blocks,
                                const int32_t* seq_lens, int num_pages, const float* w_uk,
                                const float* w_uv, int H, int nope, int dv, float* Kout, float* Vout) {
  const int t = blockIdx.x, b = blockIdx.y;
  if (t >= seq_lens[b]) return;
  const int page = block_table[static_cast<int64_t>(b) * max_blocks + t / 64];
  if (page < 0 || page >= num_pages) return;
  const int64_t slot = static_cast<int64_t>(page) * 64 + t % 64;
  __shared__ float c[576];
  for (int i = threadIdx.x; i < 576; i += blockDim.x) c[i] = ToF(entries[slot * 576 + i]);
  __syncthreads();
  const int dk = nope + 64;
  for (int o = threadIdx.x; o < H * (dk + dv); o += blockDim.x) {
    const int h = o / (dk + dv), j = o % (dk + dv);
    if (j < nope) {
      const float* w = w_uk + (static_cast<int64_t>(h) * nope + j) * 512;
      float s = 0.f;
      for (int i = 0; i < 512; ++i) s += w[i] * c[i];
      Kout[(slot * H + h) * dk + j] = s;
    } else if (j < dk) {
      Kout[(slot * H + h) * dk + j] = c[512 + (j - nope)];
    } else {
      const float* w = w_uv + (static_cast<int64_t>(h) * dv + (j - dk)) * 512;
      float s = 0.f;
      for (int i = 0; i < 512; ++i) s += w[i] * c[i];
      Vout[(slot * H + h) * dv + (j - dk)] = s;
    }
  }
}

// Concatenates [q_nope | q_rope] per (query, head). grid: total_q * H rows.
__global__ void ConcatQKernel(const float* q_nope, const float* q_rope, int nope, float* q) {
  const int64_t r = blockIdx.x;
  for (int j = threadIdx.x; j < nope + 64; j += blockDim.x) {
    q[r * (nope + 64) + j] = j < nope ? q_nope[r * nope + j] : q_rope[r * 64 + (j - nope)];
  }
}

// ---- KDA ----

// Normalizes x[0..n) in shared memory when l2 (block-wide, fixed-order reduction).
__device__ void BlockL2Normalize(float* x, int n, float* red) {
  if (threadIdx.x == 0) {
    float ss = 0.f;
    for (int i = 0; i < n; ++i) ss += x[i] * x[i];
    red[0] = rsqrtf(ss + 1e-6f);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) x[i] *= red[0];
  __syncthreads();
}

// One token on one head's state S [dk][dv] (global memory); thread j owns column j.
__device__ void KdaStepDevice(float* S, int dk, int dv, const float* q_in, const float* k_in,
                              const float* v, const float* g, float beta, float scale, bool l2,
                              float* out, float* sh) {
  float* q = sh;            // [dk]
  float* k = sh + 256;      // [dk]
  float* alpha = sh + 512;  // [dk]
  float* red = sh + 768;
  for (int i = threadIdx.x; i < dk; i += blockDim.x) {
    q[i] = q_in[i];
    k[i] = k_in[i];
    alpha[i] = expf(g[i]);
  }
  __syncthreads();
  if (l2) {
    BlockL2Normalize(q, dk, red);
    BlockL2Normalize(k, dk, red);
  }
  for (int j = threadIdx.x; j < dv; j += blockDim.x) {
    float u = 0.f;
    for (int i = 0; i < dk; ++i) u += alpha[i] * k[i] * S[i * dv + j];
    const float w = beta * (v[j] - u);
    float o = 0.f;
    for (int i = 0; i < dk; ++i) {
      const float s = alpha[i] * S[i * dv + j] + k[i] * w;
      S[i * dv + j] = s;
      o += q[i] * s;
    }
    out[j] = scale * o;
  }
  __syncthreads();
}

// grid: (batch, H); block: 256.
__global__ void KdaDecodeKernel(KdaDecodeParams p) {
  const int b = blockIdx.x, h = blockIdx.y, H = p.pool.num_heads, dk = p.pool.d_k, dv = p.pool.d_v;
  const int slot = p.slots[b];
  if (slot < 0 || slot >= p.pool.num_slots) return;
  __shared__ float sh[1024];
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  float* S = p.pool.states + (static_cast<int64_t>(slot) * H + h) * dk * dv;
  KdaStepDevice(S, dk, dv, p.q + bh * dk, p.k + bh * dk, p.v + bh * dv, p.g + bh * dk, p.beta[bh], p.scale,
                p.l2_normalize_qk, p.out + bh * dv, sh);
}

// grid: (batch, H); block: 256. Token by token; copies boundary states on the grid.
__global__ void KdaPrefillKernel(KdaPrefillParams p) {
  const int b = blockIdx.x, h = blockIdx.y, H = p.pool.num_heads, dk = p.pool.d_k, dv = p.pool.d_v;
  const int slot = p.slots[b];
  if (slot < 0 || slot >= p.pool.num_slots) return;
  __shared__ float sh[1024];
  const int64_t head_elems = static_cast<int64_t>(dk) * dv, state_elems = H * head_elems;
  float* S = p.pool.states + slot * state_elems + h * head_elems;
  const int64_t start = p.start_pos ? p.start_pos[b] : 0;
  // Launchers do not read device-resident metadata (the CPU checks it on host). Here
  // every block checks all of it and the call changes nothing unless cu_seqlens and
  // boundary_indptr are non-decreasing from >= 0 and no start_pos is negative: runs then
  // cannot overlap or leave their buffers. Boundary states go only into the run's own
  // [boundary_indptr[b], boundary_indptr[b + 1]).
  bool bad = false;
  for (int i = threadIdx.x; i < p.batch; i += blockDim.x) {
    bad |= p.cu_seqlens[i] > p.cu_seqlens[i + 1] || (i == 0 && p.cu_seqlens[0] < 0);
    bad |= p.start_pos != nullptr && p.start_pos[i] < 0;
    bad |= p.boundary_states != nullptr &&
           (p.boundary_indptr[i] > p.boundary_indptr[i + 1] || (i == 0 && p.boundary_indptr[0] < 0));
  }
  if (__syncthreads_or(bad)) return;  // the same answer in every thread of the block
  const int begin = p.cu_seqlens[b], end = p.cu_seqlens[b + 1];
  int boundary = p.boundary_states ? p.boundary_indptr[b] : 0;
  const int boundary_end = p.boundary_states ? p.boundary_indptr[b + 1] : 0;
  for (int t = begin; t < end; ++t) {
    const int64_t th = static_cast<int64_t>(t) * H + h;
    KdaStepDevice(S, dk, dv, p.q + th * dk, p.k + th * dk, p.v + th * dv, p.g + th * dk, p.beta[th], p.scale,
                  p.l2_normalize_qk, p.out + th * dv, sh);
    if (p.boundary_states != nullptr && (start + (t - begin) + 1) % kKdaChunk == 0) {
      if (boundary < boundary_end) {
        float* dst = p.boundary_states + boundary * state_elems + h * head_elems;
        for (int64_t i = threadIdx.x; i < head_elems; i += blockDim.x) dst[i] = S[i];
      }
      ++boundary;
      __syncthreads();
    }
  }
}

class CudaBackend final : public KernelBackend {
 public:
  CudaBackend(int device, std::string name) : device_(device), name_(std::move(name)) {
    cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking);
    cudaDeviceGetAttribute(&l2_bytes_, cudaDevAttrL2CacheSize, device);
    // The tensor-core decode's split partials come from a pool of the backend's own
    // that keeps its memory: the default pool returns memory to the driver at every
    // synchronize, and re-mapping it cost ~0.3 ms per call. A pool of our own leaves the
    // process-wide default pool (other libraries' cudaMallocAsync) as it was. It holds
    // at most the largest partials of one decode (batch x q heads x splits x (dv + 2)
    // floats). Without it, decode falls back to the default pool.
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    if (cudaMemPoolCreate(&partials_pool_, &props) == cudaSuccess) {
      uint64_t keep = UINT64_MAX;
      cudaMemPoolSetAttribute(partials_pool_, cudaMemPoolAttrReleaseThreshold, &keep);
    } else {
      partials_pool_ = nullptr;
      cudaGetLastError();  // clear the error the failed call left for the next launch check
    }
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
    if (partials_pool_ != nullptr) cudaMemPoolDestroy(partials_pool_);
  }

  Backend kind() const override { return Backend::kCuda; }
  MemorySpace memory_space() const override { return MemorySpace::kDevice; }
  int num_threads() const override { return 0; }
  std::string Describe() const override { return name_; }
  size_t cache_bytes() const override { return static_cast<size_t>(std::max(l2_bytes_, 0)); }

  absl::StatusOr<void*> Allocate(size_t bytes) override {
    void* p = nullptr;
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&p, std::max<size_t>(bytes, 256)), "cudaMalloc"));
    return p;
  }
  void Free(void* p) override {
    cudaStreamSynchronize(stream_);  // kernels may still read it
    cudaFree(p);
  }
  absl::Status CopyIn(void* dst, const void* src, size_t bytes) override {
    // On our stream, then wait: the legacy stream does not order against a
    // non-blocking stream, and pageable copies may return before the DMA lands.
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, stream_), "cudaMemcpy H2D"));
    return CudaStatus(cudaStreamSynchronize(stream_), "cudaMemcpy H2D");
  }
  absl::Status CopyOut(void* dst, const void* src, size_t bytes) override {
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, stream_), "cudaMemcpy D2H"));
    return CudaStatus(cudaStreamSynchronize(stream_), "kernel or cudaMemcpy D2H");
  }
  absl::Status CopyWithin(void* dst, const void* src, size_t bytes) override {
    return CudaStatus(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_), "cudaMemcpy D2D");
  }
  absl::Status Synchronize() override { return CudaStatus(cudaStreamSynchronize(stream_), "kernel"); }

 protected:
  absl::Status DoGqaDecode(const GqaDecodeParams& p) override {
    RETURN_IF_ERROR(GridLimit(p.num_q_heads, "num_q_heads", "one block row per head"));
    AttnArgs a = Common(p.kv.k, p.kv.v, p.kv.num_kv_heads * p.kv.head_dim, p.kv.head_dim, p.kv.head_dim,
                        p.kv.page_size, p.kv.num_pages, p.table, p.num_q_heads, p.kv.num_kv_heads, p.scale);
    a.q = p.q;
    if (MmaDtype(p.kv.dtype) && (p.kv.head_dim == 64 || p.kv.head_dim == 128) &&
        Aligned16(p.kv.k, p.kv.v, a.k_stride, a.k_head, p.kv.dtype)) {
      mma::Args m = MmaArgs(a, p.kv.num_kv_heads);
      m.v = p.kv.v;
      m.v_stride = a.v_stride;
      m.v_head = a.v_head;
      return DecodeMma(m, p.table.batch, p.kv.dtype, p.kv.head_dim, p.kv.head_dim, p.kv.num_kv_heads, p.out);
    }
    return Decode(a, p.kv.dtype, kGqaSplitTokens, p.out);
  }

  absl::Status DoGqaPrefill(const GqaPrefillParams& p) override {
    RETURN_IF_ERROR(GridLimit(p.num_q_heads, "num_q_heads", "one block row per head"));
    AttnArgs a = Common(p.kv.k, p.kv.v, p.kv.num_kv_heads * p.kv.head_dim, p.kv.head_dim, p.kv.head_dim,
                        p.kv.page_size, p.kv.num_pages, p.table, p.num_q_heads, p.kv.num_kv_heads, p.scale);
    a.q = p.q;
    a.q_indptr = p.q_indptr;
    a.out = p.out;
    ASSIGN_OR_RETURN(const int total, TotalQueries(p.q_indptr, p.table.batch));
    if (total > 0) LaunchAttn(p.kv.dtype, a, total, stream_);
    return CudaStatus(cudaGetLastError(), "gqa prefill launch");
  }

  absl::Status DoMlaDecodeAbsorbed(const MlaDecodeParams& p) override {
    RETURN_IF_ERROR(GridLimit(p.num_heads, "num_heads", "one block row per head"));
    AttnArgs a = Common(p.kv.entries, p.kv.entries, p.kv.EntryDim(), 0, 0, p.kv.page_size, p.kv.num_pages,
                        p.table, p.num_heads, 1, p.scale);
    a.k_stride = a.v_stride = p.kv.EntryDim();
    a.dk = p.kv.EntryDim();
    a.dv = p.kv.kv_lora_rank;
    a.q = p.q;
    if (MmaDtype(p.kv.dtype) && p.kv.kv_lora_rank == 512 && p.kv.rope_dim == 64 &&
        Aligned16(p.kv.entries, p.kv.entries, a.k_stride, 0, p.kv.dtype)) {
      mma::Args m = MmaArgs(a, 1);
      m.k_head = 0;
      return DecodeMma(m, p.table.batch, p.kv.dtype, 576, 512, 1, p.out);
    }
    return Decode(a, p.kv.dtype, kMlaSplitTokens, p.out);
  }

  absl::Status DoMlaMaterialized(const MlaMaterializedParams& p) override {
    RETURN_IF_ERROR(GridLimit(p.num_heads, "num_heads", "one block row per head"));
    RETURN_IF_ERROR(GridLimit(p.table.batch, "table.batch", "one block row per sequence when up-projecting"));
    ASSIGN_OR_RETURN(const int total, TotalQueries(p.q_indptr, p.table.batch));
    if (total == 0) return absl::OkStatus();
    const int H = p.num_heads, dk = p.qk_nope_dim + 64, dv = p.v_head_dim;
    const int64_t slots = static_cast<int64_t>(p.kv.num_pages) * 64;
    float *K = nullptr, *V = nullptr, *q = nullptr;
    auto alloc = [&]() -> absl::Status {
      RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&K), slots * H * dk * 4, stream_), "alloc K"));
      RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&V), slots * H * dv * 4, stream_), "alloc V"));
      return CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&q), static_cast<int64_t>(total) * H * dk * 4, stream_), "alloc q");
    };
    if (absl::Status st = alloc(); !st.ok()) {  // free what was allocated
      for (float* ptr : {K, V, q}) {
        if (ptr != nullptr) cudaFreeAsync(ptr, stream_);
      }
      return st;
    }
    const dim3 grid(p.table.max_blocks * 64, p.table.batch);
    switch (p.kv.dtype) {
      case DType::kBf16:
        UpProjectKernel<<<grid, 128, 0, stream_>>>(static_cast<const __nv_bfloat16*>(p.kv.entries), p.table.block_table,
                                                   p.table.max_blocks, p.table.seq_lens, p.kv.num_pages, p.w_uk, p.w_uv,
                                                   H, p.qk_nope_dim, dv, K, V);
        break;
      case DType::kFp16:
        UpProjectKernel<<<grid, 128, 0, stream_>>>(static_cast<const __half*>(p.kv.entries), p.table.block_table,
                                                   p.table.max_blocks, p.table.seq_lens, p.kv.num_pages, p.w_uk, p.w_uv,
                                                   H, p.qk_nope_dim, dv, K, V);
        break;
      default:
        UpProjectKernel<<<grid, 128, 0, stream_>>>(static_cast<const float*>(p.kv.entries), p.table.block_table,
                                                   p.table.max_blocks, p.table.seq_lens, p.kv.num_pages, p.w_uk, p.w_uv,
                                                   H, p.qk_nope_dim, dv, K, V);
        break;
    }
    ConcatQKernel<<<total * H, 128, 0, stream_>>>(p.q_nope, p.q_rope, p.qk_nope_dim, q);
    AttnArgs a = Common(K, V, 0, dk, dv, 64, p.kv.num_pages, p.table, H, H, p.scale);
    a.k_stride = static_cast<int64_t>(H) * dk;  // K [slot][H][dk], V [slot][H][dv]
    a.v_stride = static_cast<int64_t>(H) * dv;
    a.k_head = dk;
    a.v_head = dv;
    a.dk = dk;
    a.dv = dv;
    a.q = q;
    a.q_indptr = p.q_indptr;
    a.out = p.out;
    LaunchAttn(DType::kFp32, a, total, stream_);
    cudaFreeAsync(K, stream_);
    cudaFreeAsync(V, stream_);
    cudaFreeAsync(q, stream_);
    return CudaStatus(cudaGetLastError(), "mla materialized launch");
  }

  absl::Status DoKdaDecode(const KdaDecodeParams& p) override {
    RETURN_IF_ERROR(GridLimit(p.pool.num_heads, "pool.num_heads", "one block row per head"));
    const dim3 grid(p.batch, p.pool.num_heads);
    const int dk = p.pool.d_k, dv = p.pool.d_v;
    if (dk == 128 && dv == 128) {
      mma::KdaDecodeTiledKernel<128, 128><<<grid, 256, 0, stream_>>>(
          p.q, p.k, p.v, p.g, p.beta, p.slots, p.pool.states, p.pool.num_slots, p.pool.num_heads, p.scale,
          p.l2_normalize_qk, p.out);
    } else if (dk == 64 && dv == 64) {
      mma::KdaDecodeTiledKernel<64, 64><<<grid, 256, 0, stream_>>>(
          p.q, p.k, p.v, p.g, p.beta, p.slots, p.pool.states, p.pool.num_slots, p.pool.num_heads, p.scale,
          p.l2_normalize_qk, p.out);
    } else {
      KdaDecodeKernel<<<grid, 256, 0, stream_>>>(p);
    }
    return CudaStatus(cudaGetLastError(), "kda decode launch");
  }

  absl::Status DoKdaChunkedPrefill(const KdaPrefillParams& p) override {
    RETURN_IF_ERROR(GridLimit(p.pool.num_heads, "pool.num_heads", "one block row per head"));
    KdaPrefillKernel<<<dim3(p.batch, p.pool.num_heads), 256, 0, stream_>>>(p);
    return CudaStatus(cudaGetLastError(), "kda prefill launch");
  }

 private:
  // Fields shared by every attention launch; GQA's layout by default.
  static AttnArgs Common(const void* k, const void* v, int64_t stride, int head, int dim, int page_size,
                         int num_pages, const BlockTable& t, int num_q_heads, int num_kv_heads, float scale) {
    AttnArgs a{};
    a.k = k;
    a.v = v;
    a.k_stride = a.v_stride = stride;
    a.k_head = a.v_head = head;
    a.dk = a.dv = dim;
    a.page_size = page_size;
    a.num_pages = num_pages;
    a.block_table = t.block_table;
    a.max_blocks = t.max_blocks;
    a.seq_lens = t.seq_lens;
    a.batch = t.batch;
    a.num_q_heads = num_q_heads;
    a.group = num_q_heads / num_kv_heads;
    a.scale = scale;
    return a;
  }

  static bool MmaDtype(DType d) { return d == DType::kBf16 || d == DType::kFp16; }

  // Bulk copies need 16-byte aligned addresses: base pointers, the slot stride and the
  // head offset must keep every row 16-byte aligned (else the portable kernel runs).
  static bool Aligned16(const void* k, const void* v, int64_t stride, int64_t head, DType d) {
    const int64_t esz = ElementBytes(d);
    return reinterpret_cast<uintptr_t>(k) % 16 == 0 && reinterpret_cast<uintptr_t>(v) % 16 == 0 &&
           (stride * esz) % 16 == 0 && (head * esz) % 16 == 0;
  }

  static mma::Args MmaArgs(const AttnArgs& a, int num_kv_heads) {
    mma::Args m{};
    m.q = a.q;
    m.k = a.k;
    m.v = a.v;
    m.k_stride = a.k_stride;
    m.v_stride = a.v_stride;
    m.k_head = a.k_head;
    m.v_head = a.v_head;
    m.page_size = a.page_size;
    m.num_pages = a.num_pages;
    m.block_table = a.block_table;
    m.max_blocks = a.max_blocks;
    m.seq_lens = a.seq_lens;
    m.num_q_heads = a.num_q_heads;
    m.group = a.num_q_heads / num_kv_heads;
    m.head_tiles = (m.group + mma::kRows - 1) / mma::kRows;
    m.scale = a.scale;
    return m;
  }

  // Tensor-core decode: grid (batch, kv heads x head tiles, splits). Splits of
  // kGqaSplitTokens / kMlaSplitTokens cover max_blocks * page_size (seq_lens stay on
  // the device); more than one split writes partials that MergeSplitsKernel combines
  // in split order.
  //
  // Configurations (template <dtype, DK, DV, stages, V = K's first DV columns, warps,
  // tile tokens, min CTAs per SM>), chosen by measurement on an H200 (kernels/README.md):
  //   GQA d=128 (and packed d=64 pairs): 4 warps, 32-token tiles, 2 stages, at most 128
  //              registers so 4 CTAs share an SM. What counted was CTAs per SM: the
  //              same tiles at 133 registers (3 per SM) ran 0.47-0.68 of the copy
  //              against 0.71-0.82; 3 or 4 stages (fewer CTAs per SM) and 2-warp CTAs
  //              were slower; 8 warps x 64 tokens (the previous choice) is faster on
  //              batches of <= 128 CTAs but 0.65-0.74 on the large ones.
  //   GQA d=64 not packed: 4 warps, 64-token tiles, 2 stages.
  //   MLA:       8 warps, 32-token tiles, 2 stages, at most 128 registers (2 CTAs per
  //              SM): DeepSeek's 16 heads +7-10% over 4 warps (whose 219 registers
  //              also allow 2), tiny-mla within noise. 3-4 stages, 16-token tiles and
  //              512- or 256-token splits were slower on the large shapes.
  absl::Status DecodeMma(mma::Args m, int batch, DType dtype, int dk, int dv, int num_kv_heads, float* out) {
    // Packed heads: kv heads of dk = 64 that are adjacent in a slot (GqaPagedKv's
    // layout) and serve at most 16 q heads in all are read as one head of 128, in one
    // CTA: 256-byte rows per token instead of two 128-byte ones (see mma::Args).
    const int out_dv = dv;
    if (dk != 576 && num_kv_heads > 1 && num_kv_heads * dk == 128 && dk == dv && m.k_head == dk &&
        m.v_head == dv && m.num_q_heads <= mma::kRows && PackHeads()) {
      m.pack_dh = dk;
      m.pack_group = m.group;
      m.group = m.num_q_heads;
      m.head_tiles = 1;
      dk = dv = 128;
      num_kv_heads = 1;
    }
    const int64_t grid_y = static_cast<int64_t>(num_kv_heads) * m.head_tiles;
    RETURN_IF_ERROR(GridLimit(grid_y, "kv heads x ceil(q heads per kv head / 16)", "one block row per head tile"));
    if (batch == 0) return absl::OkStatus();
    constexpr int kT = 64;  // the largest tile the kernels use
    const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(m.max_blocks) * m.page_size);
    // Fixed split boundaries (not sized to fill the GPU): a sequence's result must not
    // depend on the batch it is in (kernels/README.md), and splits sized by the batch
    // changed the merge and its rounding.
    static_assert(kGqaSplitTokens % kT == 0 && kMlaSplitTokens % kT == 0, "whole tiles per split");
    static_assert(kGqaSplitTokens <= mma::kMaxSplitTokens && kMlaSplitTokens <= mma::kMaxSplitTokens,
                  "a split's pages fit the kernel's shared-memory table");
    const int64_t split_tokens = dk == 576 ? kMlaSplitTokens : kGqaSplitTokens;
    const int64_t splits = (cap + split_tokens - 1) / split_tokens;
    RETURN_IF_ERROR(GridLimit(splits, "table.max_blocks * page_size / split tokens", "one block layer per split"));
    m.split_tokens = static_cast<int>(split_tokens);
    m.max_splits = static_cast<int>(splits);
    m.out = out;
    const int64_t rows = static_cast<int64_t>(batch) * m.num_q_heads * splits;
    if (splits > 1) {
      auto alloc = [&](float** p, int64_t bytes) {
        return CudaStatus(partials_pool_ != nullptr
                              ? cudaMallocFromPoolAsync(reinterpret_cast<void**>(p), bytes, partials_pool_, stream_)
                              : cudaMallocAsync(reinterpret_cast<void**>(p), bytes, stream_),
                          "alloc decode partials");
      };
      RETURN_IF_ERROR(alloc(&m.part_acc, rows * out_dv * 4));
      if (absl::Status st = alloc(&m.part_ml, rows * 2 * 4); !st.ok()) {
        cudaFreeAsync(m.part_acc, stream_);
        return st;
      }
    }
    const dim3 grid(batch, static_cast<unsigned>(grid_y), static_cast<unsigned>(splits));
    const bool bf16 = dtype == DType::kBf16;
    cudaError_t e;
    if (dk == 576) {
      e = bf16 ? mma::LaunchDecode<__nv_bfloat16, 576, 512, 2, true, 8, 32, 2>(m, grid, stream_)
               : mma::LaunchDecode<__half, 576, 512, 2, true, 8, 32, 2>(m, grid, stream_);
    } else if (dk == 128) {
      e = bf16 ? mma::LaunchDecode<__nv_bfloat16, 128, 128, 2, false, 4, 32, 4>(m, grid, stream_)
               : mma::LaunchDecode<__half, 128, 128, 2, false, 4, 32, 4>(m, grid, stream_);
    } else {
      e = bf16 ? mma::LaunchDecode<__nv_bfloat16, 64, 64, 2, false, 4, 64>(m, grid, stream_)
               : mma::LaunchDecode<__half, 64, 64, 2, false, 4, 64>(m, grid, stream_);
    }
    if (e == cudaSuccess && splits > 1) {
      MergeSplitsKernel<<<dim3(batch, m.num_q_heads), 128, 0, stream_>>>(m.part_acc, m.part_ml, m.max_splits,
                                                                         m.num_q_heads, out_dv, out);
      e = cudaGetLastError();
    }
    if (splits > 1) {
      cudaFreeAsync(m.part_acc, stream_);
      cudaFreeAsync(m.part_ml, stream_);
    }
    return CudaStatus(e, "tensor-core decode launch");
  }

  // KVPOOL_CUDA_PACK_HEADS=0 turns packed heads off (for A/B runs).
  static bool PackHeads() {
    static const bool on = [] {
      const char* e = std::getenv("KVPOOL_CUDA_PACK_HEADS");
      return e == nullptr || std::string(e) != "0";
    }();
    return on;
  }

  // q_indptr[batch] read back from the device: the grid size of a prefill.
  absl::StatusOr<int> TotalQueries(const int32_t* q_indptr, int batch) {
    int32_t total = 0;
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(&total, q_indptr + batch, sizeof(total), cudaMemcpyDeviceToHost,
                                               stream_), "read q_indptr"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream_), "read q_indptr"));
    if (total < 0) return absl::InvalidArgumentError(absl::StrCat("q_indptr[batch]=", total, " must be >= 0"));
    return total;
  }

  // Split-K decode: splits cover max_blocks * page_size (no host copy of seq_lens);
  // splits past a sequence's end record m = -inf and drop out of the merge.
  absl::Status Decode(AttnArgs a, DType dtype, int split_tokens, float* out) {
    const int64_t cap = static_cast<int64_t>(a.max_blocks) * a.page_size;
    RETURN_IF_ERROR(GridLimit((cap + split_tokens - 1) / split_tokens, "table.max_blocks * page_size / split tokens",
                              "one block layer per split"));
    a.max_splits = static_cast<int>(std::max<int64_t>(1, (cap + split_tokens - 1) / split_tokens));
    a.split_tokens = split_tokens;
    const int64_t rows = static_cast<int64_t>(a.batch) * a.num_q_heads * a.max_splits;
    RETURN_IF_ERROR(CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&a.part_acc), rows * a.dv * 4, stream_), "alloc"));
    if (absl::Status st = CudaStatus(cudaMallocAsync(reinterpret_cast<void**>(&a.part_ml), rows * 2 * 4, stream_), "alloc");
        !st.ok()) {
      cudaFreeAsync(a.part_acc, stream_);
      return st;
    }
    LaunchAttn(dtype, a, a.batch, stream_);
    MergeSplitsKernel<<<dim3(a.batch, a.num_q_heads), 128, 0, stream_>>>(a.part_acc, a.part_ml, a.max_splits,
                                                                        a.num_q_heads, a.dv, out);
    cudaFreeAsync(a.part_acc, stream_);
    cudaFreeAsync(a.part_ml, stream_);
    return CudaStatus(cudaGetLastError(), "decode launch");
  }

  int device_;
  int l2_bytes_ = 0;
  cudaMemPool_t partials_pool_ = nullptr;
  std::string name_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<KernelBackend>> CreateCudaBackend(const BackendOptions& o) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0) {
    return absl::UnavailableError(absl::StrCat("no CUDA device present (",
                                               e == cudaSuccess ? "0 devices" : cudaGetErrorString(e), ")"));
  }
  if (o.device < 0 || o.device >= count) {
    return absl::InvalidArgumentError(absl::StrCat("device=", o.device, " but ", count, " CUDA devices exist"));
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(o.device), "cudaSetDevice"));
  cudaDeviceProp prop{};
  RETURN_IF_ERROR(CudaStatus(cudaGetDeviceProperties(&prop, o.device), "cudaGetDeviceProperties"));
  if (prop.major != 9) {
    return absl::FailedPreconditionError(absl::StrCat("kvpool kernels are built for sm_90a but device ", o.device,
                                                      " (", prop.name, ") is sm_", prop.major, prop.minor));
  }
  return std::make_unique<CudaBackend>(o.device, absl::StrCat(prop.name, " (sm_", prop.major, prop.minor, ")"));
}

bool CudaCompiled() { return true; }

}  // namespace kvpool::kernels::internal
