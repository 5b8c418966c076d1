// kernels_bench: bytes of K/V/state each kernel moves per second, as a fraction of a
// memory-bandwidth probe measured in the same run on the same backend.
//
//   kernels_bench [--json] [--backend=cpu_optimized|cpu_reference|cuda] [--threads=N]
//                 [--quick] [--best] [--only=gqa|mla|kda|SHAPE] [--min-bytes=B] [--huge-pages]
//                 [--bf16-products]
//
// Bytes counted (the "accounting" field of --json says the same):
//   gqa_decode  K and V of every cached token read once: ctx * kv_heads * d * 2 * esz
//   mla_decode  every 576-element entry read once: ctx * 576 * esz
//   kda_decode  every state read and written once: 2 * heads * d_k * d_v * 4
// Probes, re-measured right before each kernel family (load drifts on a shared machine),
// with the backend's thread count, over 256 MiB buffers (8x a 32 MiB L3):
//   copy  CopyWithin, counted as bytes read + bytes written (2 x size, like STREAM Copy);
//   read  the same buffer summed by the same number of threads, counted as bytes read
//         (CPU only; on cuda the copy probe stands in).
// GQA/MLA decode only read, so they are compared with the read probe (bytes read/s vs
// bytes read/s); KDA decode reads and writes, so with the copy probe. fraction_of_copy
// (the figure earlier versions reported for every kernel) and a CPU-time-normalized
// fraction (bytes per CPU-second, kernel vs probe; steadier when the machine is loaded
// and the run gets a varying share of its cores) are printed too.
// Each point runs until >= 0.25 s (0.08 s with --quick) and reports the median.
// Targets count working sets >= max(64 MiB, 2x the last-level cache read from sysfs) only
// (the smaller sweep points may run from cache; each result says whether it fits the LLC).
// --best reports the fastest repetition instead of the median (A/B of kernel versions on
// a loaded machine); --only=SHAPE (e.g. llama, deepseek) runs one shape.
// A third probe (CPU, AVX2+FMA) counts fp32 FMA lanes per second (independent
// FMA chains on every thread, of the backend's width: zmm for its AVX-512 path). With each kernel's FMAs per byte (from the
// math; see FmaPerByte*) it gives a compute roof; every result reports
// fraction_of_roof against min(probe, compute roof). That figure explains a shift from
// memory- to FMA-bound shapes (llama-70b-tp8, deepseek-v3-tp8); it is not the target.
// Each target also names the shapes whose compute roof is below target x probe
// ("fma_bound_below_target"): those cannot meet it with fp32 FMAs on this machine.
// CPU GQA/MLA points also time a plain read of the same pages in the kernel's order
// (PagedRead: no math, next page prefetched; "paged_read_bytes_per_s",
// "fraction_of_paged_read"): explanatory, it says how much of the gap to the probe the
// scattered pages alone explain on this machine.
// --min-bytes lowers the smallest working set swept (to see cache-resident speed);
// --huge-pages madvises host buffers for transparent huge pages.
// --bf16-products: cpu_optimized with BackendOptions::bf16_products (q and softmax weights
// rounded to bf16, vdpbf16ps where the CPU has avx512_bf16; "describe" names the ISA that
// ran). One vdpbf16ps lane does two products, so GQA/MLA fma_per_byte (the roof) is
// halved there: the roof counts fp32 FMA-lane equivalents.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <atomic>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <functional>
#include <thread>
#include <sys/mman.h>
#include <string>
#include <vector>

#include "kvpool/common/service_main.h"
#include "kvpool/kernels/backend.h"

namespace kvpool::kernels {
namespace {

struct Options {
  bool json = false, quick = false;
  Backend backend = Backend::kCpuOptimized;
  int threads = 0;
  std::string only;  // run only kernels whose name contains this ("gqa", "mla", "kda")
  bool bf16_products = false;  // --bf16-products
  double min_bytes = 8e6;  // smallest working set swept (--min-bytes; cache-resident runs)
};

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "kernels_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

bool g_huge_pages = false;  // --huge-pages: madvise(MADV_HUGEPAGE) on host buffers
double g_product_fma = 1.0;  // FMA lanes per product: 0.5 on vdpbf16ps (--bf16-products)

// Asks for transparent huge pages over the 2 MiB-aligned part of [p, p + bytes).
void AdviseHuge(void* p, size_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (e > b) madvise(reinterpret_cast<void*>(b), e - b, MADV_HUGEPAGE);
}

// A buffer in backend memory filled with small pseudo-random values of `dtype`.
struct Buf {
  KernelBackend* be;
  void* p = nullptr;
  Buf(KernelBackend* b, size_t bytes, DType dtype, uint32_t seed) : be(b) {
    auto r = be->Allocate(bytes);
    Check(r.status(), "allocate");
    p = *r;
    if (g_huge_pages && be->memory_space() == MemorySpace::kHost) AdviseHuge(p, bytes);
    // One 16 MiB pattern, copied in repeatedly (filling GiBs element by element on the
    // host would dominate a GPU run).
    constexpr size_t kPattern = size_t{16} << 20;
    const size_t esz = ElementBytes(dtype);
    std::vector<uint8_t> host(std::min(bytes, kPattern));
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < host.size() / esz; ++i) {
      x = x * 1664525u + 1013904223u;
      StoreFromFloat(host.data(), dtype, i, (static_cast<float>(x >> 8) / 16777216.f - 0.5f) * 0.5f);
    }
    for (size_t off = 0; off < bytes; off += host.size()) {
      Check(be->CopyIn(static_cast<char*>(p) + off, host.data(), std::min(host.size(), bytes - off)), "copy in");
    }
  }
  template <typename T>
  Buf(KernelBackend* b, const std::vector<T>& v) : be(b) {
    auto r = be->Allocate(v.size() * sizeof(T));
    Check(r.status(), "allocate");
    p = *r;
    Check(be->CopyIn(p, v.data(), v.size() * sizeof(T)), "copy in");
  }
  ~Buf() { be->Free(p); }
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// Size of the last-level cache of cpu0 (sysfs), or 32 MiB when it cannot be read.
size_t LlcBytes() {
  size_t best = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    FILE* f = std::fopen((dir + "size").c_str(), "r");
    if (f == nullptr) continue;
    char buf[64] = {0};
    const bool ok = std::fgets(buf, sizeof buf, f) != nullptr;
    std::fclose(f);
    if (!ok) continue;
    char* end = nullptr;
    size_t v = std::strtoull(buf, &end, 10);
    if (end != nullptr && (*end == 'K' || *end == 'k')) v <<= 10;
    if (end != nullptr && (*end == 'M' || *end == 'm')) v <<= 20;
    best = std::max(best, v);
  }
  return best > 0 ? best : size_t{32} << 20;
}

double CpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// CPU time / wall time of the last Time() call: how many cores the run really got
// (below the thread count on a shared machine, which deflates compute-bound points
// more than the copy probe).
double g_last_cores = 0;

// --best: report each point's fastest repetition instead of the median (probes too).
// On a loaded machine the fastest short repetition is the one that ran uninterrupted;
// use it to compare kernel versions, not as the headline figure.
bool g_best = false;

// Median (or with --best the fastest) seconds of fn() over enough repetitions.
double Time(KernelBackend* be, const std::function<void()>& fn, double min_total) {
  auto timed = [&](int calls) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < calls; ++i) fn();
    Check(be->Synchronize(), "synchronize");
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  timed(1);
  // On a GPU one call plus a synchronize times the host round trip (~10-20 us), not a
  // kernel of a few us: a repetition there is back-to-back calls and one synchronize,
  // divided by the calls (how nvbench and FlashInfer time). The calls double until a
  // repetition takes >= 2 ms, so the synchronize is a small part of it.
  int calls = 1;
  if (be->memory_space() == MemorySpace::kDevice) {
    while (calls < (1 << 16) && timed(calls) < 2e-3) calls *= 2;
  }
  std::vector<double> runs;
  double total = 0;
  const double cpu0 = CpuSeconds();
  while (total < min_total || runs.size() < 3) {
    const double s = timed(calls);
    runs.push_back(s / calls);
    total += s;
    if (runs.size() >= 200) break;
  }
  g_last_cores = (CpuSeconds() - cpu0) / total;
  std::sort(runs.begin(), runs.end());
  return g_best ? runs.front() : runs[runs.size() / 2];
}

struct Result {
  std::string kernel, shape;
  int batch, context;
  double bytes, seconds;
  double cores = g_last_cores;  // filled after Time() ran
  // fp32 FMA-unit operations (FMAs, and the multiplies of KDA) the kernel needs per
  // counted byte; see FmaPerByte*. Sets the compute roof with the FMA probe.
  double fma_per_byte = 0;
  // CPU, GQA/MLA: seconds of PagedRead over the same pages (0: not measured).
  double paged_read_s = 0;
};

// FMA-unit operations per counted byte, from the math alone (one lane = one fp32 FMA):
//   gqa: each K and V element of a kv head meets its G = nq / nkv q heads once
//        (QK^T and PV): 2 G d lanes per 2 d elements, i.e. G / esz per byte;
//   mla: each 576-element entry meets every head for QK^T (576) and its 512-element
//        latent again for PV: H (576 + 512) lanes per 576 esz bytes;
//   kda: per fp32 state element 1 FMA (u = S^T k) + 1 multiply + 2 FMAs (update and
//        output) = 4 lanes per 8 bytes (read + written).
// Softmax exps, conversions and loads are not counted: the roof is optimistic.
double FmaPerByteGqa(int nq, int nkv, size_t esz) { return g_product_fma * (nq / nkv) / esz; }
double FmaPerByteMla(int heads, size_t esz) { return g_product_fma * heads * (576.0 + 512.0) / (576.0 * esz); }
constexpr double kFmaPerByteKda = 4.0 / 8.0;

// The bandwidth probes, measured right before each kernel family's points (the load on
// a shared machine drifts during a run), with the backend's thread count.
//   copy: CopyWithin between two buffers, counted read + write (2 x size, STREAM Copy).
//   read: the same source buffer only read (summed), counted as bytes read. CPU only;
//         on cuda the copy probe stands in for it.
// GQA and MLA decode only read the cache, so their fraction is against `read` (bytes
// read per second against bytes read per second); KDA decode reads and writes each
// state, so its fraction is against `copy` (read + write against read + write).
struct Probe {
  double copy_bw = 0, copy_s = 0, copy_cores = 0;
  double read_bw = 0, read_s = 0, read_cores = 0;
  bool has_read = false;
  // fp32 FMA lanes per second on the backend's thread count (CPU with AVX2+FMA only;
  // 0 where there is no such probe, and then no compute roof is reported).
  double fma_lanes_per_s = 0, fma_s = 0, fma_cores = 0;
  bool fma_zmm = false;  // _mm512_fmadd_ps chains (the backend runs AVX-512), else ymm
  const char* FmaKind() const {
    return fma_zmm ? "independent _mm512_fmadd_ps chains" : "independent _mm256_fmadd_ps chains";
  }
};

uint64_t g_sink = 0;  // keeps the read probe's sums alive

// Sums [p, p + bytes) as 64-bit words on `threads` threads, 4 MiB slices claimed in
// order (as CopyWithin does); several accumulators so the adds never limit it.
// work() on `threads` threads (this one and threads - 1 new ones), joined.
void RunOnThreads(int threads, const std::function<void()>& work) {
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
}

void ReadAll(const void* p, size_t bytes, int threads) {
  constexpr size_t kSlice = size_t{4} << 20;
  std::atomic<size_t> next{0};
  std::atomic<uint64_t> sink{0};
  auto work = [&] {
    uint64_t total = 0;
    for (size_t i = next.fetch_add(1); i * kSlice < bytes; i = next.fetch_add(1)) {
      const char* w = static_cast<const char*>(p) + i * kSlice;
      const size_t n = std::min(kSlice, bytes - i * kSlice);
#if defined(__x86_64__) || defined(__i386__)
      // 4 register accumulators, one 16-byte load + add each per 64-byte line (gcc kept
      // a plain array of accumulators in memory, which made the probe compute bound).
      __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t j = 0; j + 64 <= n; j += 64) {
        a0 = _mm_add_epi64(a0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j)));
        a1 = _mm_add_epi64(a1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j + 16)));
        a2 = _mm_add_epi64(a2, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j + 32)));
        a3 = _mm_add_epi64(a3, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j + 48)));
      }
      const __m128i s = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
      total += static_cast<uint64_t>(_mm_cvtsi128_si64(s)) + static_cast<uint64_t>(_mm_cvtsi128_si64(_mm_unpackhi_epi64(s, s)));
#else
      uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
      const uint64_t* u = reinterpret_cast<const uint64_t*>(w);
      for (size_t j = 0; j + 4 <= n / 8; j += 4) {
        a0 += u[j];
        a1 += u[j + 1];
        a2 += u[j + 2];
        a3 += u[j + 3];
      }
      total += a0 ^ a1 ^ a2 ^ a3;
#endif
    }
    sink.fetch_add(total);
  };
  RunOnThreads(threads, work);
  g_sink += sink.load();
}

float g_fma_sink = 0;  // keeps the FMA probe's results alive

#if defined(__x86_64__) || defined(__i386__)
// kFmaChains independent chains of fp32 FMAs, `iters` rounds: lanes * kFmaChains * iters
// FMA lanes. 12 chains cover the FMA latency (4-5 cycles) x pipes (2) of current x86
// cores with registers to spare. Two widths, since the roof must be that of the ISA the
// backend runs: _mm256_fmadd_ps, and _mm512_fmadd_ps where the backend uses AVX-512 (on
// this project's AVX-512 VM a zmm FMA did 1.6x the lanes per second of a ymm one, so a
// ymm roof understated the AVX-512 kernels' compute roof).
constexpr int kFmaChains = 12;
// Named registers, not an array: gcc at -O2 kept an array of accumulators in memory
// (stores in the loop), and the probe measured those instead of the FMAs.
#define KVPOOL_FMA_CHAINS(NAME, TARGET, V, SET1, ADD, FMA, LOW)                                  \
  __attribute__((target(TARGET))) float NAME(int64_t iters, float seed) {                        \
    const V m = SET1(0.9999999f), c = SET1(1e-7f); /* stays near 1 */                            \
    V a0 = SET1(seed), a1 = ADD(a0, c), a2 = ADD(a1, c), a3 = ADD(a2, c), a4 = ADD(a3, c);        \
    V a5 = ADD(a4, c), a6 = ADD(a5, c), a7 = ADD(a6, c), a8 = ADD(a7, c), a9 = ADD(a8, c);        \
    V a10 = ADD(a9, c), a11 = ADD(a10, c);                                                       \
    for (int64_t i = 0; i < iters; ++i) {                                                        \
      a0 = FMA(a0, m, c); a1 = FMA(a1, m, c); a2 = FMA(a2, m, c); a3 = FMA(a3, m, c);            \
      a4 = FMA(a4, m, c); a5 = FMA(a5, m, c); a6 = FMA(a6, m, c); a7 = FMA(a7, m, c);            \
      a8 = FMA(a8, m, c); a9 = FMA(a9, m, c); a10 = FMA(a10, m, c); a11 = FMA(a11, m, c);        \
    }                                                                                            \
    const V s = ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))),           \
                    ADD(ADD(a8, a9), ADD(a10, a11)));                                            \
    return LOW(s);                                                                               \
  }
__attribute__((target("avx2,fma"))) float Low256(__m256 v) { return _mm_cvtss_f32(_mm256_castps256_ps128(v)); }
__attribute__((target("avx512f"))) float Low512(__m512 v) { return _mm512_cvtss_f32(v); }
KVPOOL_FMA_CHAINS(FmaChains256, "avx2,fma", __m256, _mm256_set1_ps, _mm256_add_ps, _mm256_fmadd_ps, Low256)
KVPOOL_FMA_CHAINS(FmaChains512, "avx512f", __m512, _mm512_set1_ps, _mm512_add_ps, _mm512_fmadd_ps, Low512)
#undef KVPOOL_FMA_CHAINS

bool HaveFma() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

// Runs the FMA chains of the backend's width (zmm when it describes itself as avx512)
// on `threads` threads at once; returns FMA lanes done.
double FmaAll(int64_t iters, int threads, bool zmm) {
  auto chains = zmm ? &FmaChains512 : &FmaChains256;
  std::vector<float> sums(threads);
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { sums[t] = chains(iters, 1.f + t); });
  sums[0] = chains(iters, 1.f);
  for (auto& t : pool) t.join();
  for (float x : sums) g_fma_sink += x;
  return (zmm ? 16.0 : 8.0) * kFmaChains * static_cast<double>(iters) * threads;
}
#else
bool HaveFma() { return false; }
double FmaAll(int64_t, int, bool) { return 0; }
#endif

Probe MeasureProbe(KernelBackend* be, void* a, void* b, size_t bytes, bool gpu, double min_t) {
  Probe pr;
  pr.copy_s = Time(be, [&] { Check(be->CopyWithin(b, a, bytes), "probe copy"); }, min_t);
  pr.copy_bw = 2.0 * bytes / pr.copy_s;
  pr.copy_cores = g_last_cores;
  if (!gpu) {
    pr.read_s = Time(be, [&] { ReadAll(a, bytes, be->num_threads()); }, min_t);
    pr.read_bw = bytes / pr.read_s;
    pr.read_cores = g_last_cores;
    pr.has_read = true;
  } else {
    pr.read_bw = pr.copy_bw;
    pr.read_s = pr.copy_s;
    pr.read_cores = pr.copy_cores;
  }
  if (!gpu && HaveFma()) {
    // ~10-20 ms per repetition at ~50 G lanes/s per core.
    constexpr int64_t kIters = 5'000'000;
    double lanes = 0;
    pr.fma_zmm = be->Describe().rfind("avx512", 0) == 0 && __builtin_cpu_supports("avx512f");
    pr.fma_s = Time(be, [&] { lanes = FmaAll(kIters, be->num_threads(), pr.fma_zmm); }, min_t);
    pr.fma_lanes_per_s = lanes / pr.fma_s;
    pr.fma_cores = g_last_cores;
  }
  return pr;
}

// Bytes of memory a point touches: K/V or entries read once; KDA states, counted read +
// written, are one buffer.
double WorkingSet(const Result& r) { return r.kernel == "kda_decode" ? r.bytes / 2 : r.bytes; }

// The probe bandwidth a kernel's bytes are compared with (see Probe).
bool ReadOnly(const std::string& kernel) { return kernel != "kda_decode"; }

std::vector<int32_t> Table(int batch, int blocks) {
  // Sequence b owns pages [b * blocks, (b + 1) * blocks), in reverse order: no
  // sequential-page shortcut can help.
  std::vector<int32_t> t(static_cast<size_t>(batch) * blocks);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < blocks; ++i) t[static_cast<size_t>(b) * blocks + i] = b * blocks + (blocks - 1 - i);
  }
  return t;
}

// The kernels' memory pattern without their math: every sequence's pages in table order,
// `page_bytes` from each of `streams` (K and V, or the MLA entries), summed with 16-byte
// loads into 4 accumulators as ReadAll does, the next page of each stream prefetched
// while one is read (a plain page walk without it ran at ~0.6-0.75 of this here). Work
// items are (sequence, 1024-token split) on `threads` threads, as the decode kernels cut
// them. An explanatory baseline, not the target's: what a plain read of the same
// scattered pages reaches on this machine.
void PagedRead(const std::vector<const char*>& streams, size_t page_bytes, const std::vector<int32_t>& table,
               int batch, int blocks, int page, int threads) {
  const int split_blocks = std::max(1, 1024 / page);
  const int splits = (blocks + split_blocks - 1) / split_blocks;
  std::atomic<int> next{0};
  std::atomic<uint64_t> sink{0};
  auto work = [&] {
    uint64_t total = 0;
    for (int item = next.fetch_add(1); item < batch * splits; item = next.fetch_add(1)) {
      const int b = item / splits, i0 = (item % splits) * split_blocks, i1 = std::min(blocks, i0 + split_blocks);
      const int32_t* row = table.data() + static_cast<size_t>(b) * blocks;
#if defined(__x86_64__) || defined(__i386__)
      __m128i a0 = _mm_setzero_si128(), a1 = a0, a2 = a0, a3 = a0;
      for (int i = i0; i < i1; ++i) {
        for (const char* base : streams) {
          const char* w = base + static_cast<size_t>(row[i]) * page_bytes;
          const char* nx = i + 1 < i1 ? base + static_cast<size_t>(row[i + 1]) * page_bytes : nullptr;
          for (size_t j = 0; j + 64 <= page_bytes; j += 64) {
            if (nx != nullptr) _mm_prefetch(nx + j, _MM_HINT_T0);
            a0 = _mm_add_epi64(a0, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j)));
            a1 = _mm_add_epi64(a1, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j + 16)));
            a2 = _mm_add_epi64(a2, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j + 32)));
            a3 = _mm_add_epi64(a3, _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + j + 48)));
          }
        }
      }
      const __m128i sum = _mm_add_epi64(_mm_add_epi64(a0, a1), _mm_add_epi64(a2, a3));
      total += static_cast<uint64_t>(_mm_cvtsi128_si64(sum));
#else
      for (int i = i0; i < i1; ++i) {
        for (const char* base : streams) {
          const uint64_t* u = reinterpret_cast<const uint64_t*>(base + static_cast<size_t>(row[i]) * page_bytes);
          for (size_t j = 0; j < page_bytes / 8; ++j) total += u[j];
        }
      }
#endif
    }
    sink.fetch_add(total);
  };
  RunOnThreads(threads, work);
  g_sink += sink.load();
}

Result BenchGqa(KernelBackend* be, const char* shape, int nq, int nkv, int d, int page, int batch,
                int ctx, double min_t) {
  const int blocks = (ctx + page - 1) / page, pages = batch * blocks;
  const size_t kv_bytes = static_cast<size_t>(pages) * page * nkv * d * 2;
  Buf k(be, kv_bytes, DType::kBf16, 1), v(be, kv_bytes, DType::kBf16, 2);
  Buf q(be, std::vector<float>(static_cast<size_t>(batch) * nq * d, 0.01f));
  Buf out(be, std::vector<float>(static_cast<size_t>(batch) * nq * d, 0.f));
  const std::vector<int32_t> table = Table(batch, blocks);
  Buf tab(be, table), lens(be, std::vector<int32_t>(batch, ctx));
  GqaDecodeParams p;
  p.q = q.as<float>();
  p.out = out.as<float>();
  p.kv = {k.p, v.p, DType::kBf16, pages, page, nkv, d};
  p.table = {tab.as<int32_t>(), lens.as<int32_t>(), batch, blocks};
  p.num_q_heads = nq;
  const double s = Time(be, [&] { Check(be->GqaDecode(p), "gqa decode"); }, min_t);
  Result r{"gqa_decode", shape, batch, ctx, 2.0 * batch * ctx * nkv * d * 2, s, g_last_cores,
           FmaPerByteGqa(nq, nkv, ElementBytes(DType::kBf16))};
  if (be->memory_space() == MemorySpace::kHost) {
    r.paged_read_s = Time(be, [&] {
      PagedRead({static_cast<const char*>(k.p), static_cast<const char*>(v.p)},
                static_cast<size_t>(page) * nkv * d * 2, table, batch, blocks, page, be->num_threads());
    }, min_t);
  }
  return r;
}

Result BenchMla(KernelBackend* be, const char* shape, int heads, int batch, int ctx, double min_t) {
  const int page = 64, blocks = (ctx + page - 1) / page, pages = batch * blocks;
  Buf c(be, static_cast<size_t>(pages) * page * 576 * 2, DType::kBf16, 3);
  Buf q(be, std::vector<float>(static_cast<size_t>(batch) * heads * 576, 0.01f));
  Buf out(be, std::vector<float>(static_cast<size_t>(batch) * heads * 512, 0.f));
  const std::vector<int32_t> table = Table(batch, blocks);
  Buf tab(be, table), lens(be, std::vector<int32_t>(batch, ctx));
  MlaDecodeParams p;
  p.q = q.as<float>();
  p.out = out.as<float>();
  p.kv.entries = c.p;
  p.kv.num_pages = pages;
  p.table = {tab.as<int32_t>(), lens.as<int32_t>(), batch, blocks};
  p.num_heads = heads;
  p.scale = 1.f / std::sqrt(192.f);
  const double s = Time(be, [&] { Check(be->MlaDecodeAbsorbed(p), "mla decode"); }, min_t);
  Result r{"mla_decode", shape, batch, ctx, 1.0 * batch * ctx * 576 * 2, s, g_last_cores,
           FmaPerByteMla(heads, ElementBytes(DType::kBf16))};
  if (be->memory_space() == MemorySpace::kHost) {
    r.paged_read_s = Time(be, [&] {
      PagedRead({static_cast<const char*>(c.p)}, static_cast<size_t>(page) * 576 * 2, table, batch, blocks, page,
                be->num_threads());
    }, min_t);
  }
  return r;
}

Result BenchKda(KernelBackend* be, const char* shape, int H, int dk, int dv, int batch, double min_t) {
  const size_t state = static_cast<size_t>(H) * dk * dv;
  Buf pool(be, batch * state * 4, DType::kFp32, 4);
  std::vector<int32_t> slots(batch);
  for (int b = 0; b < batch; ++b) slots[b] = (b * 7919) % batch;  // a permutation (batch odd or coprime)
  std::sort(slots.begin(), slots.end());
  slots.erase(std::unique(slots.begin(), slots.end()), slots.end());
  for (int b = static_cast<int>(slots.size()); b < batch; ++b) slots.push_back(b);
  Buf sl(be, slots);
  Buf q(be, std::vector<float>(static_cast<size_t>(batch) * H * dk, 0.1f));
  Buf k(be, std::vector<float>(static_cast<size_t>(batch) * H * dk, 0.1f));
  Buf v(be, std::vector<float>(static_cast<size_t>(batch) * H * dv, 0.1f));
  Buf g(be, std::vector<float>(static_cast<size_t>(batch) * H * dk, -0.01f));
  Buf beta(be, std::vector<float>(static_cast<size_t>(batch) * H, 0.5f));
  Buf out(be, std::vector<float>(static_cast<size_t>(batch) * H * dv, 0.f));
  KdaDecodeParams p;
  p.q = q.as<float>();
  p.k = k.as<float>();
  p.v = v.as<float>();
  p.g = g.as<float>();
  p.beta = beta.as<float>();
  p.slots = sl.as<int32_t>();
  p.out = out.as<float>();
  p.pool = {pool.as<float>(), batch, H, dk, dv};
  p.batch = batch;
  const double s = Time(be, [&] { Check(be->KdaDecode(p), "kda decode"); }, min_t);
  return {"kda_decode", shape, batch, 0, 2.0 * batch * state * 4, s, g_last_cores, kFmaPerByteKda};
}

// "%.4e" of v as a string (JSON fields that may be null).
std::string Sci(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.4e", v);
  return buf;
}

int Main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--json") {
      o.json = true;
    } else if (a == "--quick") {
      o.quick = true;
    } else if (a.rfind("--backend=", 0) == 0) {
      auto b = ParseBackend(a.substr(10));
      Check(b.status(), "--backend");
      o.backend = *b;
    } else if (a.rfind("--min-bytes=", 0) == 0) {
      o.min_bytes = std::atof(a.c_str() + 12);
    } else if (a == "--best") {
      g_best = true;
    } else if (a == "--huge-pages") {
      g_huge_pages = true;
    } else if (a == "--bf16-products") {
      o.bf16_products = true;
    } else if (a.rfind("--only=", 0) == 0) {
      o.only = a.substr(7);
    } else if (a.rfind("--threads=", 0) == 0) {
      o.threads = std::atoi(a.c_str() + 10);
    } else {
      std::fprintf(stderr, "usage: kernels_bench [--json] [--quick] [--best] [--backend=NAME] [--threads=N] "
                           "[--only=gqa|mla|kda|SHAPE] [--min-bytes=B] [--huge-pages] [--bf16-products]\n");
      return 2;
    }
  }
  auto created = CreateBackend(o.backend, {.num_threads = o.threads, .bf16_products = o.bf16_products});
  Check(created.status(), "backend");
  KernelBackend* be = created->get();
  if (be->Describe().find("avx512_bf16") != std::string::npos) g_product_fma = 0.5;
  const bool gpu = o.backend == Backend::kCuda;
  const double min_t = o.quick ? 0.08 : 0.25;

  // Targets count working sets >= 64 MiB and >= 2x the last-level cache (so no target
  // point is served from cache; on cuda the GPU's L2).
  const size_t llc = gpu ? be->cache_bytes() : LlcBytes();
  const double target_min_bytes = std::max(64.0 * (1 << 20), 2.0 * llc);
  // Probe buffers: 2 x 256 MiB on CPU, or 2x the LLC each where that is more (a VM of
  // 2026-12-02 reported 260 MiB of L3), 2 x 2 GiB on GPU; kept for the whole run so the
  // probe can be measured again before each kernel family.
  const size_t probe_bytes =
      gpu ? (size_t{2} << 30)
          : std::max(size_t{256} << 20, (static_cast<size_t>(target_min_bytes) + (size_t{2} << 20) - 1) /
                                            (size_t{2} << 20) * (size_t{2} << 20));
  Buf probe_a(be, probe_bytes, DType::kFp32, 5), probe_b(be, probe_bytes, DType::kFp32, 6);
  std::vector<std::pair<std::string, Probe>> probes;  // (family, probe)
  std::vector<size_t> probe_of;                       // per result: index into probes
  auto probe_now = [&](const char* family) {
    probes.emplace_back(family, MeasureProbe(be, probe_a.p, probe_b.p, probe_bytes, gpu, min_t));
  };
  std::vector<Result> results;
  // Each sweep keeps the working set between ~8 MB and ~1 GB (CPU) or ~4.5 GB (GPU), or
  // up to a point of target_min_bytes where the LLC is larger than that allows.
  const double max_bytes = gpu ? 4.5e9 : std::max(1.1e9, 1.05 * target_min_bytes);
  // The batch, doubled from `from`, whose point of `bytes_per_batch` bytes per unit of
  // batch first reaches target_min_bytes within max_bytes; 0 when `from`'s already does
  // (or none fits). A shape whose default sweep stays under 2x the LLC gets that one
  // point more, so its target is measured at all.
  auto batch_reaching_target = [&](int from, double bytes_per_batch) {
    if (gpu || from * bytes_per_batch >= target_min_bytes) return 0;
    for (int b = from * 2; b * bytes_per_batch <= max_bytes; b *= 2) {
      if (b * bytes_per_batch >= target_min_bytes) return b;
    }
    return 0;
  };
  const std::vector<int> batches = gpu ? std::vector<int>{8, 32, 128} : std::vector<int>{1, 8, 32};
  const std::vector<int> contexts = o.quick ? std::vector<int>{1024, 4096} : std::vector<int>{256, 1024, 4096, 16384};
  struct GqaShape { const char* name; int nq, nkv, d, page; };
  const GqaShape gqa_shapes[] = {{"tiny-gqa", 4, 2, 64, 16}, {"llama-70b-tp8", 8, 1, 128, 16}};
  auto wanted = [&](const char* kernel) { return o.only.empty() || std::string(kernel).find(o.only) != std::string::npos; };
  const bool any_gqa = wanted("gqa_decode") || o.only == "tiny-gqa" || o.only == "llama";
  const bool any_mla = wanted("mla_decode") || o.only == "tiny-mla" || o.only == "deepseek";
  if (any_gqa) probe_now("gqa_decode");
  // --only also selects a shape ("--only=llama", "--only=deepseek").
  auto shape_wanted = [&](const char* kernel, const char* shape) {
    return o.only.empty() || std::string(kernel).find(o.only) != std::string::npos ||
           std::string(shape).find(o.only) != std::string::npos;
  };
  for (const auto& s : gqa_shapes) {
    if (!shape_wanted("gqa_decode", s.name)) continue;
    for (int b : batches) {
      for (int ctx : contexts) {
        const double bytes = 2.0 * b * ctx * s.nkv * s.d * 2;
        if (bytes > max_bytes || bytes < o.min_bytes) continue;
        results.push_back(BenchGqa(be, s.name, s.nq, s.nkv, s.d, s.page, b, ctx, min_t));
      }
    }
    const int ctx = contexts.back();
    if (int b = batch_reaching_target(batches.back(), 2.0 * ctx * s.nkv * s.d * 2); b > 0) {
      results.push_back(BenchGqa(be, s.name, s.nq, s.nkv, s.d, s.page, b, ctx, min_t));
    }
  }
  probe_of.resize(results.size(), probes.size() - 1);
  if (any_mla) probe_now("mla_decode");
  for (auto [name, heads] : {std::pair{"tiny-mla", 4}, std::pair{"deepseek-v3-tp8", 16}}) {
    if (!shape_wanted("mla_decode", name)) continue;
    for (int b : batches) {
      for (int ctx : contexts) {
        const double bytes = 1.0 * b * ctx * 576 * 2;
        if (bytes > max_bytes || bytes < o.min_bytes) continue;
        results.push_back(BenchMla(be, name, heads, b, ctx, min_t));
      }
    }
    const int ctx = contexts.back();
    if (int b = batch_reaching_target(batches.back(), 1.0 * ctx * 576 * 2); b > 0) {
      results.push_back(BenchMla(be, name, heads, b, ctx, min_t));
    }
  }
  const std::vector<int> kda_batches = gpu ? std::vector<int>{1024, 8192, 32768} : std::vector<int>{256, 1024, 4096};
  probe_of.resize(results.size(), probes.size() - 1);
  if (wanted("kda_decode")) {
  probe_now("kda_decode");
  // Bytes per sequence: its state read and written (fp32 d_k x d_v per head).
  std::vector<int> tiny_batches = kda_batches, kimi_batches = gpu ? std::vector<int>{64, 512} : std::vector<int>{16, 128};
  if (int b = batch_reaching_target(tiny_batches.back(), 2.0 * 2 * 64 * 64 * 4); b > 0) tiny_batches.push_back(b);
  if (int b = batch_reaching_target(kimi_batches.back(), 2.0 * 12 * 128 * 128 * 4); b > 0) kimi_batches.push_back(b);
  for (int b : tiny_batches) results.push_back(BenchKda(be, "tiny-hybrid", 2, 64, 64, b, min_t));
  for (int b : kimi_batches) results.push_back(BenchKda(be, "kimi-k3-tp8", 12, 128, 128, b, min_t));
  }

  probe_of.resize(results.size(), probes.size() - 1);
  // Per result: fraction of the matching probe (read for GQA/MLA, copy for KDA), of the
  // copy probe (the figure earlier runs reported), and the CPU-time-normalized
  // fraction (bytes per CPU-second of the kernel against the probe's bytes per
  // CPU-second): on a loaded machine a run gets a varying share of its threads' cores,
  // and this one does not move with that share.
  // Explanatory, not a target: the compute roof (bytes/s the FMA probe allows at the
  // kernel's FMAs per byte), the roof = min(matching probe, compute roof), and the
  // fraction of that roof. A shape whose compute roof is below the probe cannot reach
  // the probe-based target with fp32 FMAs on this machine, however it reads memory.
  struct Fractions {
    double of_probe, of_copy, cpu_normalized, compute_roof, roof, of_roof;
    bool fma_bound;  // the compute roof is the lower one
    double paged_read_bw, of_paged_read;  // 0: not measured
  };
  auto fractions = [&](size_t i) {
    const Result& r = results[i];
    const Probe& pr = probes[probe_of[i]].second;
    const double bw = r.bytes / r.seconds;
    const double ref = ReadOnly(r.kernel) ? pr.read_bw : pr.copy_bw;
    const double ref_cores = ReadOnly(r.kernel) ? pr.read_cores : pr.copy_cores;
    const double norm = (r.cores > 0 && ref_cores > 0) ? (bw / r.cores) / (ref / ref_cores) : 0;
    const double compute = (pr.fma_lanes_per_s > 0 && r.fma_per_byte > 0) ? pr.fma_lanes_per_s / r.fma_per_byte : 0;
    const double roof = compute > 0 ? std::min(ref, compute) : ref;
    const double paged = r.paged_read_s > 0 ? r.bytes / r.paged_read_s : 0;
    return Fractions{bw / ref, bw / pr.copy_bw, norm, compute, roof, bw / roof, compute > 0 && compute < ref,
                     paged, paged > 0 ? bw / paged : 0};
  };

  // Targets: GQA at >= 4K context, MLA, KDA, over working sets >= target_min_bytes.
  struct Target { const char* kernel; int min_ctx; double cpu, gpu; };
  const Target targets[] = {{"gqa_decode", 4096, 0.60, 0.80}, {"mla_decode", 4096, 0.50, 0.75},
                            {"kda_decode", 0, 0.50, 0.50}};
  std::string tjson;
  std::string ttext;
  for (const auto& t : targets) {
    double worst = 1e9, best = 0, worst_norm = 1e9, worst_roof = 1e9, best_roof = 0;
    double worst_paged = 1e9, worst_paged_of_probe = 1e9;  // paged read: of the kernel; of the probe
    int n = 0;
    const double goal = gpu ? t.gpu : t.cpu;
    // Shapes whose compute roof (fma probe / fma_per_byte) is below goal x the probe:
    // with fp32 FMAs they cannot reach the target on this machine, however memory is
    // read. Listed once per shape with the roof as a fraction of the probe.
    std::vector<std::pair<std::string, double>> unreachable;
    for (size_t i = 0; i < results.size(); ++i) {
      const Result& r = results[i];
      if (r.kernel != t.kernel || r.context < t.min_ctx || r.bytes < target_min_bytes) continue;
      const Fractions f = fractions(i);
      const double probe_bw = ReadOnly(r.kernel) ? probes[probe_of[i]].second.read_bw : probes[probe_of[i]].second.copy_bw;
      if (f.compute_roof > 0 && f.compute_roof < goal * probe_bw &&
          std::none_of(unreachable.begin(), unreachable.end(), [&](const auto& u) { return u.first == r.shape; })) {
        unreachable.emplace_back(r.shape, f.compute_roof / probe_bw);
      }
      worst = std::min(worst, f.of_probe);
      best = std::max(best, f.of_probe);
      worst_norm = std::min(worst_norm, f.cpu_normalized);
      worst_roof = std::min(worst_roof, f.of_roof);
      if (f.paged_read_bw > 0) {
        worst_paged = std::min(worst_paged, f.of_paged_read);
        worst_paged_of_probe = std::min(worst_paged_of_probe, f.paged_read_bw / probe_bw);
      }
      best_roof = std::max(best_roof, f.of_roof);
      ++n;
    }
    if (n == 0) continue;  // not run (--only) or no point large enough (--quick)
    std::string roof_json, roof_text;
    for (const auto& [shape, frac] : unreachable) {
      char u[160];
      std::snprintf(u, sizeof u, "%s{\"shape\": \"%s\", \"compute_roof_fraction_of_probe\": %.3f}",
                    roof_json.empty() ? "" : ", ", shape.c_str(), frac);
      roof_json += u;
      std::snprintf(u, sizeof u, "%s%s (compute roof %.2f of the probe)", roof_text.empty() ? "" : ", ",
                    shape.c_str(), frac);
      roof_text += u;
    }
    char line[512];
    std::snprintf(line, sizeof line,
                  "%s{\"kernel\": \"%s\", \"min_context\": %d, \"probe\": \"%s\", "
                  "\"worst_fraction\": %.3f, \"best_fraction\": %.3f, "
                  "\"worst_cpu_normalized_fraction\": %.3f, \"target\": %.2f, \"met\": %s, "
                  "\"worst_fraction_of_roof\": %.3f, \"best_fraction_of_roof\": %.3f, "
                  "\"fma_bound_below_target\": [",
                  tjson.empty() ? "" : ", ", t.kernel, t.min_ctx, ReadOnly(t.kernel) ? "read" : "copy",
                  worst, best, worst_norm, goal, worst >= goal ? "true" : "false", worst_roof, best_roof);
    tjson += line;
    tjson += roof_json + "]";
    if (worst_paged < 1e9) {
      std::snprintf(line, sizeof line,
                    ", \"worst_fraction_of_paged_read\": %.3f, \"worst_paged_read_fraction_of_probe\": %.3f",
                    worst_paged, worst_paged_of_probe);
      tjson += line;
    }
    tjson += "}";
    std::snprintf(line, sizeof line,
                  "  %-11s ctx>=%-5d worst %.3f best %.3f of %s probe (cpu-normalized worst %.3f; "
                  "target %.2f) %s; of roof (explanatory, not the target) worst %.3f best %.3f\n",
                  t.kernel, t.min_ctx, worst, best, ReadOnly(t.kernel) ? "read" : "copy", worst_norm,
                  goal, worst >= goal ? "MET" : "NOT MET", worst_roof, best_roof);
    ttext += line;
    if (worst_paged < 1e9) {
      std::snprintf(line, sizeof line,
                    "              a plain read of the same pages (explanatory): at worst %.3f of the %s probe; "
                    "the kernel at worst %.3f of it\n",
                    worst_paged_of_probe, ReadOnly(t.kernel) ? "read" : "copy", worst_paged);
      ttext += line;
    }
    if (!roof_text.empty()) {
      ttext += "              FMA-bound below the target here (fp32 FMAs cannot reach it on this machine): " +
               roof_text + "\n";
    }
  }

  if (o.json) {
    std::printf("{\n  \"backend\": \"%s\", \"describe\": \"%s\", \"threads\": %d, \"bf16_products\": %s,\n",
                std::string(BackendName(o.backend)).c_str(), be->Describe().c_str(), be->num_threads(),
                o.bf16_products ? "true" : "false");
    std::printf("  \"accounting\": \"gqa_decode bytes = K+V of every cached token read once; mla_decode "
                "bytes = every 576-element entry read once; kda_decode bytes = every state read + "
                "written once. fraction_of_probe: gqa/mla against the read probe (bytes read/s), kda "
                "against the copy probe (read+write bytes/s). Probes use the backend's thread count, "
                "buffers of %zu bytes, and are re-measured before each kernel family. "
                "fits_llc: the working set (kda: the states, half its bytes) is no larger than the "
                "last-level cache (llc_bytes), so "
                "that point may run from cache; targets count only points of >= "
                "target_min_bytes (2x the LLC, at least 64 MiB). "
                "fraction_of_roof is explanatory, not the target: compute_roof_bytes_per_s = the fma "
                "probe (fp32 FMA lanes/s, independent FMA chains of the backend's vector width on every thread: "
                "_mm512_fmadd_ps where it runs AVX-512, else _mm256_fmadd_ps) / "
                "fma_per_byte (the kernel's FMAs per counted byte from the math: gqa G/esz, mla "
                "H*(576+512)/(576*esz), kda 0.5; exps, conversions and loads not counted), "
                "roof_bytes_per_s = min(the probe fraction_of_probe uses, compute roof).\",\n",
                probe_bytes);
    std::printf("  \"llc_bytes\": %zu, \"target_min_bytes\": %.0f, \"statistic\": \"%s%s\",\n", llc,
                target_min_bytes, g_best ? "fastest repetition (--best)" : "median repetition",
                gpu ? "; a repetition is back-to-back calls (>= ~2 ms) and one synchronize, per call" : "");
    std::printf("  \"probes\": [\n");
    for (size_t i = 0; i < probes.size(); ++i) {
      const Probe& pr = probes[i].second;
      std::printf("    {\"before\": \"%s\", \"copy\": {\"kind\": \"%s\", \"buffer_bytes\": %zu, "
                  "\"seconds\": %.6f, \"bytes_per_s\": %.4e, \"counts\": \"read+write\", "
                  "\"cpu_cores_used\": %.2f}, \"read\": {\"kind\": \"%s\", \"seconds\": %.6f, "
                  "\"bytes_per_s\": %.4e, \"counts\": \"read\", \"cpu_cores_used\": %.2f}, ",
                  probes[i].first.c_str(), gpu ? "device-to-device copy" : "parallel memcpy", probe_bytes,
                  pr.copy_s, pr.copy_bw, pr.copy_cores,
                  pr.has_read ? "parallel read (sum)" : "copy stands in (no read probe on this backend)",
                  pr.read_s, pr.read_bw, pr.read_cores);
      if (pr.fma_lanes_per_s > 0) {
        std::printf("\"fma\": {\"kind\": \"%s\", \"seconds\": %.6f, "
                    "\"fma_lanes_per_s\": %.4e, \"cpu_cores_used\": %.2f}}%s\n",
                    pr.FmaKind(), pr.fma_s, pr.fma_lanes_per_s, pr.fma_cores, i + 1 < probes.size() ? "," : "");
      } else {
        std::printf("\"fma\": null}%s\n", i + 1 < probes.size() ? "," : "");
      }
    }
    std::printf("  ],\n  \"results\": [\n");
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      const Fractions f = fractions(i);
      std::printf("    {\"kernel\": \"%s\", \"shape\": \"%s\", \"dtype\": \"%s\", \"batch\": %d, "
                  "\"context\": %d, \"bytes\": %.0f, \"seconds\": %.6f, \"bytes_per_s\": %.4e, "
                  "\"probe\": \"%s\", \"fraction_of_probe\": %.3f, \"fraction_of_copy\": %.3f, "
                  "\"cpu_normalized_fraction\": %.3f, \"cpu_cores_used\": %.2f, \"fma_per_byte\": %.3f, "
                  "\"compute_roof_bytes_per_s\": %s, \"roof_bytes_per_s\": %.4e, \"bound\": \"%s\", "
                  "\"fraction_of_roof\": %.3f, \"paged_read_bytes_per_s\": %s, \"fraction_of_paged_read\": %s, "
                  "\"fits_llc\": %s, "
                  "\"counts_for_target\": %s}%s\n",
                  r.kernel.c_str(), r.shape.c_str(), r.kernel == "kda_decode" ? "fp32" : "bf16",
                  r.batch, r.context, r.bytes, r.seconds, r.bytes / r.seconds,
                  ReadOnly(r.kernel) ? "read" : "copy", f.of_probe, f.of_copy, f.cpu_normalized, r.cores,
                  r.fma_per_byte, f.compute_roof > 0 ? Sci(f.compute_roof).c_str() : "null", f.roof,
                  f.fma_bound ? "fma" : "memory",
                  f.of_roof, f.paged_read_bw > 0 ? Sci(f.paged_read_bw).c_str() : "null",
                  f.paged_read_bw > 0 ? Sci(f.of_paged_read).c_str() : "null",
                  WorkingSet(r) <= static_cast<double>(llc) ? "true" : "false",
                  r.bytes >= target_min_bytes ? "true" : "false",
                  i + 1 < results.size() ? "," : "");
    }
    std::printf("  ],\n  \"targets\": [%s]\n}\n", tjson.c_str());
  } else {
    std::printf("backend %s (%s)\n", std::string(BackendName(o.backend)).c_str(), be->Describe().c_str());
    for (const auto& [family, pr] : probes) {
      char fma[96] = "fma probe n/a";
      if (pr.fma_lanes_per_s > 0) {
        std::snprintf(fma, sizeof fma, "fma %.1f G lanes/s (%.2f cores)", pr.fma_lanes_per_s / 1e9, pr.fma_cores);
      }
      std::printf("probe before %-10s copy %.2f GB/s (read+write, %.2f cores), read %.2f GB/s (%.2f cores), %s\n",
                  family.c_str(), pr.copy_bw / 1e9, pr.copy_cores, pr.read_bw / 1e9, pr.read_cores, fma);
    }
    std::printf("last-level cache %.1f MiB; statistic: %s; 'llc' column: in = working set fits the LLC "
                "(may run from cache), out = exceeds it\n",
                llc / 1048576.0, g_best ? "fastest repetition (--best)" : "median repetition");
    std::printf("'roof' = min(probe, fma probe / fma_per_byte): explanatory, not the target; 'bound' = which "
                "of the two is lower\n");
    std::printf("%-11s %-16s %6s %7s %10s %9s %9s %9s %9s %6s %4s %7s %9s %8s %6s %8s %8s\n", "kernel", "shape",
                "batch", "context", "MB", "GB/s", "fraction", "of_copy", "cpu_norm", "cores", "llc", "fma/B",
                "roofGB/s", "of_roof", "bound", "pagedGB/s", "of_paged");
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      const Fractions f = fractions(i);
      std::printf("%-11s %-16s %6d %7d %10.1f %9.2f %9.3f %9.3f %9.3f %6.2f %4s %7.2f %9.2f %8.3f %6s %8.2f %8.3f\n",
                  r.kernel.c_str(), r.shape.c_str(), r.batch, r.context, r.bytes / 1e6, r.bytes / r.seconds / 1e9,
                  f.of_probe, f.of_copy, f.cpu_normalized, r.cores,
                  gpu ? "-" : (WorkingSet(r) <= static_cast<double>(llc) ? "in" : "out"), r.fma_per_byte,
                  f.roof / 1e9, f.of_roof, f.fma_bound ? "fma" : "mem", f.paged_read_bw / 1e9, f.of_paged_read);
    }
    std::printf("targets (working sets >= %.0f MiB = max(64 MiB, 2x LLC); gqa/mla vs the read probe, kda vs "
                "the copy probe):\n%s",
                target_min_bytes / 1048576.0, ttext.c_str());
  }
  if (g_sink == 42 || g_fma_sink == 42.f) std::printf("\n");  // never true in practice; keeps the read probe's sums
  return 0;
}

}  // namespace
}  // namespace kvpool::kernels

int main(int argc, char** argv) {
  kvpool::InitProcess();
  return kvpool::kernels::Main(argc, argv);
}
