// Decode on tensor cores (sm_80+ mma.sync, built for sm_90a): GQA decode (one KV head
// read once for all the q heads it serves) and MLA absorbed decode (one 576-element
// latent per token shared by every head) are the same problem, multi-query attention of
// up to 16 query rows over one paged K/V stream, so one kernel serves both.
//
// A CTA owns (sequence, kv head, 16-row head tile, split of the context) and NW warps;
// with packed heads (Args::pack_dh), all the kv heads of a sequence at once.
// Tiles of TT tokens are staged in shared memory by Hopper bulk copies (one per token
// row, completing on an mbarrier per stage; STAGES deep, so the next tile loads while
// this one computes). Per tile:
//   QK:  S = Q K^T with m16n8k16 MMAs; Q's A fragments stay in registers, K rows come
//        via ldmatrix. GQA: warp w scores its own TT/NW tokens over all of DK. MLA
//        (DK = 576, split-K): warp w takes a quarter of DK for its token group and the
//        four partial sums meet in shared memory.
//   softmax: one running max m and sum l per row (base-2 exponent of scale * log2 e),
//        the same in every warp (GQA: the warps' tile maxima meet in shared memory;
//        MLA: each row's scores sit in one warp's lanes, and the rescale is shared).
//   PV:  warp w owns output columns [w DV/NW, (w+1) DV/NW) over all TT tokens:
//        O += P V (A = P from shared memory, B = V via ldmatrix.trans).
// Precision: the MMAs take 16-bit inputs, the cache's own dtype for K and V (exact), but
// q and p are fp32. Each is split into hi + lo 16-bit parts (x = hi + lo + O(2^-16 x);
// with fp16 caches q must stay below fp16's 65504 in magnitude, p is <= 1)
// and both parts are multiplied, so scores and weights carry ~16 mantissa bits instead
// of 8: the results stay within the fp32 oracle tolerance of tests/kernels. The extra
// MMAs are free here: decode is bound by memory, not by the tensor cores.
// Tokens past the sequence end or on an out-of-range page are zero-filled instead of
// copied (a NaN in an unused page never reaches a product) and masked to -inf.
//
// KDA decode (KdaDecodeTiledKernel): the head's state is read once into registers
// (thread = one column j and DK / (256 / DV) rows), updated and written once.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace kvpool::kernels::internal {
namespace mma {

constexpr int kRows = 16;        // query rows per CTA (the MMA's M)
constexpr int kMaxSplitTokens = 1024;  // a split's block-table entries are staged in shared memory
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

struct Args {
  const float* q;              // [batch][num_q_heads][DK] fp32
  const void* k;               // slot s, kv head g: k + s * k_stride + g * k_head
  const void* v;               // unused when V is the first DV columns of K (MLA)
  int64_t k_stride, v_stride;  // elements per token slot
  int64_t k_head, v_head;      // elements per kv head inside a slot
  int page_size, num_pages;
  const int32_t* block_table;  // [batch][max_blocks]
  int max_blocks;
  const int32_t* seq_lens;     // [batch]
  int num_q_heads;             // q heads per sequence (all kv heads)
  int group;                   // q heads per kv head
  int head_tiles;              // ceil(group / 16)
  float scale;
  int split_tokens;            // multiple of kTileTokens
  int max_splits;              // 1: write out; > 1: write partials for MergeSplitsKernel
  float* out;                  // [batch][num_q_heads][DV]
  float* part_acc;             // [batch][num_q_heads][max_splits][DV]
  float* part_ml;              // [batch][num_q_heads][max_splits][2] (max in natural log units, sum)
  // Packed heads (0 = off): all kv heads of a sequence in one CTA, read as one wide head
  // of DK = kv heads x pack_dh (adjacent in a slot). Row r (q head r) keeps its pack_dh
  // query values at its kv head's columns (r / pack_group) and zeros elsewhere, so its
  // scores are those of its own head; of the DV output columns it keeps its head's.
  // q, out and the partials then have pack_dh columns per head.
  int pack_dh, pack_group;
};

template <typename T>
__device__ __forceinline__ T FromF(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half FromF<__half>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float ToFloat(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float ToFloat(__half x) { return __half2float(x); }
__device__ __forceinline__ uint16_t Bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }
__device__ __forceinline__ uint16_t Bits(__half x) { return __half_as_ushort(x); }

// Two values as one 32-bit MMA operand register: the lower column in the low half.
template <typename T>
__device__ __forceinline__ uint32_t Pack(T lo_col, T hi_col) {
  return static_cast<uint32_t>(Bits(lo_col)) | (static_cast<uint32_t>(Bits(hi_col)) << 16);
}

// x = hi + lo, both representable in T.
template <typename T>
__device__ __forceinline__ void Split(float x, T* hi, T* lo) {
  *hi = FromF<T>(x);
  *lo = FromF<T>(x - ToFloat(*hi));
}

template <typename T>
__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void Mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void Mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Four 8x8 16-bit matrices; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void Ldsm4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void Ldsm4T(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(SmemAddr(p)));
}
__device__ __forceinline__ float NegInf() { return -__int_as_float(0x7f800000); }

// Hopper's bulk copy engine (TMA without a tensor map): one instruction moves a
// contiguous run of bytes global -> shared and reports on an mbarrier, so a tile's
// loads cost one warp a few instructions instead of every thread an address per 16 B.
__device__ __forceinline__ void MbarInit(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void FenceMbarInit() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void FenceProxyAsync() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void MbarArriveExpectTx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(SmemAddr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void MbarWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(SmemAddr(bar)), "r"(parity)
        : "memory");
  } while (done == 0);
}
__device__ __forceinline__ void BulkCopy(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   SmemAddr(smem)),
               "l"(gmem), "r"(bytes), "r"(SmemAddr(bar))
               : "memory");
}

// Shared memory of one CTA, in 16-bit elements unless noted. Row strides are padded by
// 8 elements (16 bytes) so the 8 rows an ldmatrix reads fall in distinct banks.
template <int DK, int DV, int STAGES, bool SHARED_V, int NW, int TT>
struct Layout {
  static constexpr int kTileTokens = TT;  // tokens per pipeline stage
  static constexpr int kQs = DK + 8, kKs = DK + 8, kVs = SHARED_V ? kKs : DV + 8, kPs = kTileTokens + 8;
  // Q (hi, lo) is read into registers once, before the first copy: it shares the
  // stage ring's memory.
  static constexpr int kK = 0;
  static constexpr int kQHi = kK, kQLo = kQHi + kRows * kQs;
  static_assert(2 * kRows * kQs <= STAGES * kTileTokens * kKs, "Q fits the stage ring");
  static constexpr int kV = kK + STAGES * kTileTokens * kKs;
  static constexpr int kPHi = kV + (SHARED_V ? 0 : STAGES * kTileTokens * kVs);
  static constexpr int kPLo = kPHi + kRows * kPs;
  static constexpr int kEnd = kPLo + kRows * kPs;
  // Then, in bytes from kEnd * 2 (16-byte aligned): uint64 bars[STAGES];
  // float red_max[NW][16], red_sum[NW][16]; with split-K QK (DK > 128)
  // float part_s[4][16][kSs]; uint8 ok[STAGES][TT]; int32 pages[kMaxPages] (the split's
  // block-table entries, -1 where out of range).
  static constexpr bool kSplitK = DK > 128;
  static constexpr int kSs = kTileTokens + 4;
  static constexpr size_t kBars = size_t{kEnd} * 2;
  static constexpr size_t kRed = kBars + size_t{8} * STAGES;
  static constexpr size_t kPart = kRed + size_t{2} * NW * kRows * 4;
  static constexpr size_t kOk = kPart + (kSplitK ? size_t{4} * kRows * kSs * 4 : 0);
  static constexpr size_t kPages = (kOk + size_t{STAGES} * kTileTokens + 15) / 16 * 16;
  static constexpr int kMaxPages = kMaxSplitTokens + 4;  // pages a split touches, page size 1
  static constexpr size_t kBytes = kPages + size_t{kMaxPages} * 4;
};

// NW warps, TT-token tiles. QK: without split-K (DK <= 128) warp w scores its own
// TT/NW tokens over all of DK; with split-K (MLA) warp w takes k-group w % 4 (a quarter
// of DK) for the tokens of group w / 4, and the 4 partial sums meet in shared memory.
// Softmax: without split-K warp w owns tokens [w TT/NW, (w+1) TT/NW) as MMA fragments;
// with split-K each thread takes kPer scores of one row. PV: warp w owns DV/NW columns.
template <typename T, int DK, int DV, int STAGES, bool SHARED_V, int NW, int TT, int MINB = 1>
__global__ void __launch_bounds__(32 * NW, MINB) DecodeKernel(Args a) {
  using L = Layout<DK, DV, STAGES, SHARED_V, NW, TT>;
  constexpr int kTileTokens = TT;
  constexpr int kDvw = DV / NW;               // output columns per warp
  constexpr int kTpw = kTileTokens / NW;      // softmax tokens per warp
  constexpr int kNt = kTpw / 8;               // their n-tiles
  constexpr int kKSteps = DK / 16;
  constexpr int kKGroups = L::kSplitK ? 4 : 1;
  constexpr int kMySteps = kKSteps / kKGroups;
  constexpr int kTokGroups = NW / kKGroups;   // split-K: token groups
  constexpr int kGroupNp = kTileTokens / kTokGroups / 16;  // split-K: token pairs of n-tiles per warp
  static_assert(DK % 16 == 0 && kDvw % 16 == 0 && kKSteps % kKGroups == 0 && TT % 16 == 0, "tile shapes");
  static_assert(L::kSplitK || kTpw % 8 == 0, "fragment softmax: whole n-tiles per warp");
  static_assert(L::kSplitK ? NW % 4 == 0 : (kNt == 1 || kNt == 2), "warp layout");
  // Split-K softmax: kPer scores per thread, kRowThreads lanes per row.
  constexpr int kPer = kRows * TT / (32 * NW);
  constexpr int kRowThreads = TT / kPer;
  static_assert(!L::kSplitK || (kPer % 2 == 0 && kRowThreads <= 32 && 32 % kRowThreads == 0), "split-K softmax");
  extern __shared__ __align__(16) unsigned char smem[];
  T* const sh = reinterpret_cast<T*>(smem);
  T* const q_hi = sh + L::kQHi;
  T* const q_lo = sh + L::kQLo;
  T* const p_hi = sh + L::kPHi;
  T* const p_lo = sh + L::kPLo;
  uint64_t* const bars = reinterpret_cast<uint64_t*>(smem + L::kBars);
  float* const red_max = reinterpret_cast<float*>(smem + L::kRed);
  float* const red_sum = red_max + NW * kRows;
  float* const part_s = reinterpret_cast<float*>(smem + L::kPart);
  uint8_t* const tok_ok = reinterpret_cast<uint8_t*>(smem + L::kOk);
  int32_t* const pages = reinterpret_cast<int32_t*>(smem + L::kPages);

  const int b = blockIdx.x;
  const int kvh = blockIdx.y / a.head_tiles, ht = blockIdx.y % a.head_tiles;
  const int split = blockIdx.z;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;

  // Visible tokens, cut to the table row (a longer seq_lens would read the next row).
  const int64_t cap = static_cast<int64_t>(a.max_blocks) * a.page_size;
  const int n = static_cast<int>(max(int64_t{0}, min(static_cast<int64_t>(a.seq_lens[b]), cap)));
  const int t_begin = min(n, split * a.split_tokens);
  const int t_end = min(n, t_begin + a.split_tokens);
  const int ntiles = (t_end - t_begin + kTileTokens - 1) / kTileTokens;
  const int rows = min(kRows, a.group - ht * kRows);  // real query rows of this CTA
  const int h0 = kvh * a.group + ht * kRows;          // its first q head

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) MbarInit(&bars[s], NW);  // each warp arrives once per tile
    FenceMbarInit();
  }
  // The split's block-table entries, checked once: loads then look pages up in shared
  // memory instead of waiting on a global load per tile.
  const int page0 = t_begin / a.page_size;
  const int npages = t_end > t_begin ? (t_end - 1) / a.page_size - page0 + 1 : 0;
  const int32_t* const table_row = a.block_table + static_cast<int64_t>(b) * a.max_blocks;
  for (int i = tid; i < npages; i += 32 * NW) {
    const int32_t page = table_row[page0 + i];
    pages[i] = page >= 0 && page < a.num_pages ? page : -1;
  }
  for (int i = tid; i < kRows * DK; i += 32 * NW) {
    const int r = i / DK, d = i % DK;
    float x = 0.f;
    if (r < rows && a.pack_dh == 0) {
      x = a.q[(static_cast<int64_t>(b) * a.num_q_heads + h0 + r) * DK + d];
    } else if (r < rows && d / a.pack_dh == r / a.pack_group) {
      x = a.q[(static_cast<int64_t>(b) * a.num_q_heads + r) * a.pack_dh + d % a.pack_dh];
    }
    Split(x, &q_hi[r * L::kQs + d], &q_lo[r * L::kQs + d]);
  }
  __syncthreads();
  // Q as MMA A fragments, in registers for the whole context: every k-step, or (split-K)
  // this warp's k-group only, which keeps Q out of the per-tile shared-memory traffic.
  const int kk0 = L::kSplitK ? (warp % kKGroups) * kMySteps : 0;
  uint32_t qf_hi[kMySteps][4], qf_lo[kMySteps][4];
#pragma unroll
  for (int i = 0; i < kMySteps; ++i) {
    Ldsm4(qf_hi[i], q_hi + (lane & 15) * L::kQs + (kk0 + i) * 16 + (lane >> 4) * 8);
    Ldsm4(qf_lo[i], q_lo + (lane & 15) * L::kQs + (kk0 + i) * 16 + (lane >> 4) * 8);
  }
  // Q's shared memory is the stage ring's: every thread's generic accesses to it are
  // ordered before the bulk copies (async proxy) that overwrite it.
  FenceProxyAsync();
  __syncthreads();

  const T* const K = static_cast<const T*>(a.k);
  const T* const V = static_cast<const T*>(SHARED_V ? a.k : a.v);

  // Every warp issues its share of tile `it` into stage it % STAGES: lane l < TT / NW
  // copies token row warp * TT / NW + l (K, and V unless V is K's first DV columns) with
  // one bulk copy each and the warp arrives once with its byte count. Rows past the end
  // or on an out-of-range page are zero-filled instead (a NaN there never reaches a
  // product) and flagged so the softmax masks them.
  constexpr int kRowsPerWarp = kTileTokens / NW;
  auto load = [&](int it) {
    const int stage = it % STAGES, tok0 = t_begin + it * kTileTokens;
    const int r = warp * kRowsPerWarp + lane, t = tok0 + r;
    const bool mine = lane < kRowsPerWarp;
    const int page = mine && t < t_end ? pages[t / a.page_size - page0] : -1;
    const int64_t slot = page >= 0 ? static_cast<int64_t>(page) * a.page_size + t % a.page_size : -1;
    constexpr uint32_t kRowBytes = (DK + (SHARED_V ? 0 : DV)) * 2;
    const uint32_t copies = __popc(__ballot_sync(0xffffffffu, slot >= 0));
    FenceProxyAsync();  // earlier generic accesses of this stage before the async writes
    if (lane == 0) MbarArriveExpectTx(&bars[stage], copies * kRowBytes);
    __syncwarp();
    if (!mine) return;
    T* const krow = sh + L::kK + (stage * kTileTokens + r) * L::kKs;
    T* const vrow = sh + L::kV + (stage * kTileTokens + r) * L::kVs;
    if (slot >= 0) {
      BulkCopy(krow, K + slot * a.k_stride + kvh * a.k_head, DK * 2, &bars[stage]);
      if constexpr (!SHARED_V) BulkCopy(vrow, V + slot * a.v_stride + kvh * a.v_head, DV * 2, &bars[stage]);
    } else {
      const uint4 zero = make_uint4(0, 0, 0, 0);
      for (int c = 0; c < DK / 8; ++c) reinterpret_cast<uint4*>(krow)[c] = zero;
      if constexpr (!SHARED_V) {
        for (int c = 0; c < DV / 8; ++c) reinterpret_cast<uint4*>(vrow)[c] = zero;
      }
    }
    tok_ok[stage * kTileTokens + r] = slot >= 0;
  };
  for (int s = 0; s < STAGES - 1 && s < ntiles; ++s) load(s);

  float o[kDvw / 8][4];
#pragma unroll
  for (int i = 0; i < kDvw / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // Running max (base 2) of rows g and g + 8, the same in every warp; the sums of p
  // over this warp's tokens only (added across warps once, after the loop).
  float m0 = NegInf(), m1 = NegInf(), l0 = 0.f, l1 = 0.f;
  float m_row = NegInf(), l_row = 0.f;  // split-K: the row this thread's scores belong to
  const float sc = a.scale * kLog2e;
  const int tw = warp * kTpw;  // this warp's tokens in the tile (softmax; QK without split-K)
  const int jm = lane >> 3;    // which 8x8 matrix of an ldmatrix.x4 this lane addresses

  for (int it = 0; it < ntiles; ++it) {
    const int stage = it % STAGES;
    MbarWait(&bars[stage], static_cast<uint32_t>((it / STAGES) & 1));
    // The zero rows and flags other warps wrote are visible, and every warp is past
    // tile it - 1: its stage can be refilled.
    __syncthreads();
    if (it + STAGES - 1 < ntiles) load(it + STAGES - 1);
    const T* const ks = sh + L::kK + stage * kTileTokens * L::kKs;
    const T* const vs = SHARED_V ? ks : sh + L::kV + stage * kTileTokens * L::kVs;
    const uint8_t* const ok = tok_ok + stage * kTileTokens;

    // QK: s = scores of the 16 rows x this warp's kTpw tokens.
    float s[kNt > 0 ? kNt : 1][4];  // unused with split-K
#pragma unroll
    for (int j = 0; j < kNt; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    if constexpr (!L::kSplitK && kNt == 2) {
      const T* const kb = ks + (tw + (jm >> 1) * 8 + (lane & 7)) * L::kKs + (jm & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < kKSteps; ++kk) {
        uint32_t bk[4];
        Ldsm4(bk, kb + kk * 16);
        Mma<T>(s[0], qf_hi[kk], bk[0], bk[1]);
        Mma<T>(s[1], qf_hi[kk], bk[2], bk[3]);
        Mma<T>(s[0], qf_lo[kk], bk[0], bk[1]);
        Mma<T>(s[1], qf_lo[kk], bk[2], bk[3]);
      }
    } else if constexpr (!L::kSplitK) {
      // One n-tile of 8 tokens: an x4 ldmatrix covers two k-steps. hi and lo parts
      // accumulate apart (two independent MMA chains), then add.
      static_assert(kKSteps % 2 == 0, "k-steps in pairs");
      float s2[4] = {0.f, 0.f, 0.f, 0.f};
      const T* const kb = ks + (tw + (lane & 7)) * L::kKs + (jm >> 1) * 16 + (jm & 1) * 8;
#pragma unroll
      for (int kk = 0; kk < kKSteps; kk += 2) {
        uint32_t bk[4];
        Ldsm4(bk, kb + kk * 16);
        Mma<T>(s[0], qf_hi[kk], bk[0], bk[1]);
        Mma<T>(s2, qf_lo[kk], bk[0], bk[1]);
        Mma<T>(s[0], qf_hi[kk + 1], bk[2], bk[3]);
        Mma<T>(s2, qf_lo[kk + 1], bk[2], bk[3]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) s[0][e] += s2[e];
    } else {
      const int kg = warp % kKGroups, tg = warp / kKGroups;
      float sp[2 * kGroupNp][4], sq[2 * kGroupNp][4];  // hi and lo parts: independent MMA chains
#pragma unroll
      for (int nt = 0; nt < 2 * kGroupNp; ++nt) {
        sp[nt][0] = sp[nt][1] = sp[nt][2] = sp[nt][3] = 0.f;
        sq[nt][0] = sq[nt][1] = sq[nt][2] = sq[nt][3] = 0.f;
      }
      const T* const kb = ks + (tg * kGroupNp * 16 + (jm >> 1) * 8 + (lane & 7)) * L::kKs + kk0 * 16 + (jm & 1) * 8;
#pragma unroll
      for (int i = 0; i < kMySteps; ++i) {
#pragma unroll
        for (int np = 0; np < kGroupNp; ++np) {
          uint32_t bk[4];
          Ldsm4(bk, kb + np * 16 * L::kKs + i * 16);
          Mma<T>(sp[2 * np], qf_hi[i], bk[0], bk[1]);
          Mma<T>(sp[2 * np + 1], qf_hi[i], bk[2], bk[3]);
          Mma<T>(sq[2 * np], qf_lo[i], bk[0], bk[1]);
          Mma<T>(sq[2 * np + 1], qf_lo[i], bk[2], bk[3]);
        }
      }
#pragma unroll
      for (int nt = 0; nt < 2 * kGroupNp; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) sp[nt][e] += sq[nt][e];
      }
      float* const mine = part_s + kg * kRows * L::kSs;
#pragma unroll
      for (int nt = 0; nt < 2 * kGroupNp; ++nt) {
        const int col = tg * kGroupNp * 16 + nt * 8 + t4 * 2;
        *reinterpret_cast<float2*>(mine + g * L::kSs + col) = make_float2(sp[nt][0], sp[nt][1]);
        *reinterpret_cast<float2*>(mine + (g + 8) * L::kSs + col) = make_float2(sp[nt][2], sp[nt][3]);
      }
      __syncthreads();  // the partial scores of every k-group are written
    }
    float al0, al1;  // rescale of rows g and g + 8 for this tile
    if constexpr (L::kSplitK) {
      // Thread per kPer scores: row r's TT tokens are spread over kRowThreads lanes of
      // one warp, so its max and sum are warp shuffles; the row's running m and l live
      // in those lanes, and the rescale reaches the PV fragments through shared memory.
      const int r = tid / kRowThreads, c0 = (tid % kRowThreads) * kPer;
      float sv[kPer], mx = NegInf();
#pragma unroll
      for (int e = 0; e < kPer; ++e) {
        const int c = c0 + e;
        float v = 0.f;
#pragma unroll
        for (int x = 0; x < kKGroups; ++x) v += part_s[(x * kRows + r) * L::kSs + c];  // k-group order
        sv[e] = ok[c] ? v * sc : NegInf();
        mx = fmaxf(mx, sv[e]);
      }
#pragma unroll
      for (int x = kRowThreads / 2; x >= 1; x >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, x));
      const float mn = fmaxf(m_row, mx);
      float ls = 0.f;
#pragma unroll
      for (int e = 0; e < kPer; e += 2) {
        const float p0 = mn == NegInf() ? 0.f : exp2f(sv[e] - mn);
        const float p1 = mn == NegInf() ? 0.f : exp2f(sv[e + 1] - mn);
        ls += p0 + p1;
        T h0, h1, lo0, lo1;
        Split(p0, &h0, &lo0);
        Split(p1, &h1, &lo1);
        *reinterpret_cast<uint32_t*>(p_hi + r * L::kPs + c0 + e) = Pack(h0, h1);
        *reinterpret_cast<uint32_t*>(p_lo + r * L::kPs + c0 + e) = Pack(lo0, lo1);
      }
#pragma unroll
      for (int x = kRowThreads / 2; x >= 1; x >>= 1) ls += __shfl_xor_sync(0xffffffffu, ls, x);
      const float al = m_row == NegInf() ? 0.f : exp2f(m_row - mn);
      l_row = l_row * al + ls;
      m_row = mn;
      if (tid % kRowThreads == 0) red_max[r] = al;
      __syncthreads();  // P and the rescales are written
      al0 = red_max[g];
      al1 = red_max[g + 8];
    } else {
      // Scale to base 2, mask, and the tile's row maxima.
      float mx0 = NegInf(), mx1 = NegInf();
#pragma unroll
      for (int j = 0; j < kNt; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = tw + j * 8 + t4 * 2 + (e & 1);
          s[j][e] = ok[tok] ? s[j][e] * sc : NegInf();
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
      }
#pragma unroll
      for (int x = 1; x <= 2; x <<= 1) {
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, x));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, x));
      }
      if (t4 == 0) {
        red_max[warp * kRows + g] = mx0;
        red_max[warp * kRows + g + 8] = mx1;
      }
      __syncthreads();
      float mn0 = m0, mn1 = m1;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        mn0 = fmaxf(mn0, red_max[w * kRows + g]);
        mn1 = fmaxf(mn1, red_max[w * kRows + g + 8]);
      }
      // p = 2^(s - m_new), stored as hi + lo; row sums of this warp's tokens.
      float ls0 = 0.f, ls1 = 0.f;
#pragma unroll
      for (int j = 0; j < kNt; ++j) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float mn = e < 2 ? mn0 : mn1;
          p[e] = mn == NegInf() ? 0.f : exp2f(s[j][e] - mn);
        }
        ls0 += p[0] + p[1];
        ls1 += p[2] + p[3];
        T h[4], lo[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) Split(p[e], &h[e], &lo[e]);
        const int col = tw + j * 8 + t4 * 2;
        *reinterpret_cast<uint32_t*>(p_hi + g * L::kPs + col) = Pack(h[0], h[1]);
        *reinterpret_cast<uint32_t*>(p_hi + (g + 8) * L::kPs + col) = Pack(h[2], h[3]);
        *reinterpret_cast<uint32_t*>(p_lo + g * L::kPs + col) = Pack(lo[0], lo[1]);
        *reinterpret_cast<uint32_t*>(p_lo + (g + 8) * L::kPs + col) = Pack(lo[2], lo[3]);
      }
#pragma unroll
      for (int x = 1; x <= 2; x <<= 1) {
        ls0 += __shfl_xor_sync(0xffffffffu, ls0, x);
        ls1 += __shfl_xor_sync(0xffffffffu, ls1, x);
      }
      __syncthreads();  // P of every warp is written
      al0 = m0 == NegInf() ? 0.f : exp2f(m0 - mn0);
      al1 = m1 == NegInf() ? 0.f : exp2f(m1 - mn1);
      l0 = l0 * al0 + ls0;
      l1 = l1 * al1 + ls1;
      m0 = mn0;
      m1 = mn1;
    }
#pragma unroll
    for (int i = 0; i < kDvw / 8; ++i) {
      o[i][0] *= al0;
      o[i][1] *= al0;
      o[i][2] *= al1;
      o[i][3] *= al1;
    }
    // PV: O[16 rows][this warp's columns] += P[16][TT] V[TT][columns].
    {
      const T* const vb = vs + ((jm & 1) * 8 + (lane & 7)) * L::kVs + warp * kDvw + (jm >> 1) * 8;
#pragma unroll
      for (int kk = 0; kk < kTileTokens / 16; ++kk) {
        uint32_t ph[4], pl[4];
        Ldsm4(ph, p_hi + (lane & 15) * L::kPs + kk * 16 + (lane >> 4) * 8);
        Ldsm4(pl, p_lo + (lane & 15) * L::kPs + kk * 16 + (lane >> 4) * 8);
#pragma unroll
        for (int np = 0; np < kDvw / 16; ++np) {
          uint32_t bv[4];
          Ldsm4T(bv, vb + kk * 16 * L::kVs + np * 16);
          Mma<T>(o[2 * np], ph, bv[0], bv[1]);
          Mma<T>(o[2 * np + 1], ph, bv[2], bv[3]);
          Mma<T>(o[2 * np], pl, bv[0], bv[1]);
          Mma<T>(o[2 * np + 1], pl, bv[2], bv[3]);
        }
      }
    }
    // No barrier here: the next tile's first barrier orders the reuse of this stage,
    // and P, red_max and part_s are rewritten only after barriers every warp passes
    // once done reading them.
  }
  if constexpr (L::kSplitK) {
    // The rows' m and l, from the lanes that own them.
    __syncthreads();  // everyone is past the last tile's reads of red_max
    if (tid % kRowThreads == 0) {
      red_max[tid / kRowThreads] = m_row;
      red_sum[tid / kRowThreads] = l_row;
    }
    __syncthreads();
    m0 = red_max[g];
    m1 = red_max[g + 8];
    l0 = red_sum[g];
    l1 = red_sum[g + 8];
  } else {
    // The row sums, added across warps in warp order.
    if (t4 == 0) {
      red_sum[warp * kRows + g] = l0;
      red_sum[warp * kRows + g + 8] = l1;
    }
    __syncthreads();
    l0 = l1 = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      l0 += red_sum[w * kRows + g];
      l1 += red_sum[w * kRows + g + 8];
    }
  }

  const int dv_out = a.pack_dh ? a.pack_dh : DV;  // output columns per q head
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = g + half * 8;
    if (r >= rows) continue;
    const float mm = half ? m1 : m0, ll = half ? l1 : l0;
    const int64_t qh = static_cast<int64_t>(b) * a.num_q_heads + h0 + r;
#pragma unroll
    for (int i = 0; i < kDvw / 8; ++i) {
      int d = warp * kDvw + i * 8 + t4 * 2;  // d, d + 1: one head's columns (pack_dh is even)
      if (a.pack_dh) {
        if (d / a.pack_dh != r / a.pack_group) continue;  // another kv head's columns
        d %= a.pack_dh;
      }
      const float v0 = o[i][half * 2], v1 = o[i][half * 2 + 1];
      if (a.max_splits == 1) {
        a.out[qh * dv_out + d] = ll > 0.f ? v0 / ll : 0.f;
        a.out[qh * dv_out + d + 1] = ll > 0.f ? v1 / ll : 0.f;
      } else {
        float* const dst = a.part_acc + (qh * a.max_splits + split) * dv_out + d;
        dst[0] = v0;
        dst[1] = v1;
      }
    }
    if (a.max_splits > 1 && warp == 0 && t4 == 0) {
      a.part_ml[(qh * a.max_splits + split) * 2 + 0] = mm == NegInf() ? NegInf() : mm * kLn2;
      a.part_ml[(qh * a.max_splits + split) * 2 + 1] = ll;
    }
  }
}

// Sets the kernel's dynamic shared memory limit (a per-device setting, so on every
// launch: it is cheap), then launches.
template <typename T, int DK, int DV, int STAGES, bool SHARED_V, int NW, int TT, int MINB = 1>
cudaError_t LaunchDecode(const Args& a, dim3 grid, cudaStream_t st) {
  constexpr size_t kBytes = Layout<DK, DV, STAGES, SHARED_V, NW, TT>::kBytes;
  const cudaError_t attr = cudaFuncSetAttribute(DecodeKernel<T, DK, DV, STAGES, SHARED_V, NW, TT, MINB>,
                                                cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kBytes));
  if (attr != cudaSuccess) return attr;
  DecodeKernel<T, DK, DV, STAGES, SHARED_V, NW, TT, MINB><<<grid, 32 * NW, kBytes, st>>>(a);
  return cudaGetLastError();
}

// ---- KDA decode with the state in registers ----

// grid: (batch, H); block: 256 = DV columns x (256 / DV) row groups.
template <int DK, int DV>
__global__ void __launch_bounds__(256) KdaDecodeTiledKernel(const float* __restrict__ q, const float* __restrict__ k,
                                                            const float* __restrict__ v, const float* __restrict__ gate,
                                                            const float* __restrict__ beta, const int32_t* __restrict__ slots,
                                                            float* __restrict__ states, int num_slots, int H, float scale,
                                                            bool l2, float* __restrict__ out) {
  constexpr int kGroups = 256 / DV, kRowsPer = DK / kGroups;
  static_assert(256 % DV == 0 && DK % kGroups == 0, "shape");
  const int b = blockIdx.x, h = blockIdx.y;
  const int slot = slots[b];
  if (slot < 0 || slot >= num_slots) return;
  __shared__ float sq[DK], sk[DK], sa[DK], red[kGroups][DV], norm[2];
  const int64_t bh = static_cast<int64_t>(b) * H + h;
  const int tid = threadIdx.x, j = tid % DV, grp = tid / DV, i0 = grp * kRowsPer;
  float* const S = states + (static_cast<int64_t>(slot) * H + h) * DK * DV;
  float st[kRowsPer];
#pragma unroll
  for (int r = 0; r < kRowsPer; ++r) st[r] = S[(i0 + r) * DV + j];  // all loads in flight at once
  for (int i = tid; i < DK; i += 256) {
    sq[i] = q[bh * DK + i];
    sk[i] = k[bh * DK + i];
    sa[i] = expf(gate[bh * DK + i]);
  }
  __syncthreads();
  if (l2) {
    if (tid < 2) {
      const float* x = tid == 0 ? sq : sk;
      float ss = 0.f;
      for (int i = 0; i < DK; ++i) ss += x[i] * x[i];
      norm[tid] = rsqrtf(ss + 1e-6f);
    }
    __syncthreads();
    for (int i = tid; i < DK; i += 256) {
      sq[i] *= norm[0];
      sk[i] *= norm[1];
    }
    __syncthreads();
  }
  float u = 0.f;
#pragma unroll
  for (int r = 0; r < kRowsPer; ++r) u += sa[i0 + r] * sk[i0 + r] * st[r];
  red[grp][j] = u;
  __syncthreads();
  u = 0.f;
#pragma unroll
  for (int x = 0; x < kGroups; ++x) u += red[x][j];
  const float w = beta[bh] * (v[bh * DV + j] - u);
  float o = 0.f;
#pragma unroll
  for (int r = 0; r < kRowsPer; ++r) {
    st[r] = sa[i0 + r] * st[r] + sk[i0 + r] * w;
    S[(i0 + r) * DV + j] = st[r];
    o += sq[i0 + r] * st[r];
  }
  __syncthreads();  // everyone has read red for u
  red[grp][j] = o;
  __syncthreads();
  if (grp == 0) {
    float acc = 0.f;
#pragma unroll
    for (int x = 0; x < kGroups; ++x) acc += red[x][j];
    out[bh * DV + j] = scale * acc;
  }
}

}  // namespace mma
}  // namespace kvpool::kernels::internal
