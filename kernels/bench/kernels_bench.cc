// kernels_bench: bytes of K/V/state each kernel moves per second, as a fraction of a
// memory-bandwidth probe measured in the same run on the same backend.
//
//   kernels_bench [--json] [--backend=cpu_optimized|cpu_reference|cuda] [--threads=N]
//                 [--quick]
//
// Bytes counted:
//   gqa_decode  K and V of every cached token read once: ctx * kv_heads * d * 2 * esz
//   mla_decode  every 576-element entry read once: ctx * 576 * esz
//   kda_decode  every state read and written once: 2 * heads * d_k * d_v * 4
// Probe: a large copy between two buffers (all threads on CPU, device-to-device on
// cuda), counted as bytes read + bytes written (2 x size), the way STREAM counts Copy.
// Each point runs until >= 0.25 s (0.08 s with --quick) and reports the median.
// Working sets are >= 64 MiB where the target applies (larger than any LLC here), so
// the figures are memory, not cache, bandwidth.
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kvpool/kernels/backend.h"

namespace kvpool::kernels {
namespace {

struct Options {
  bool json = false, quick = false;
  Backend backend = Backend::kCpuOptimized;
  int threads = 0;
};

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "kernels_bench: %s: %s\n", what, std::string(s.message()).c_str());
    std::exit(1);
  }
}

// A buffer in backend memory filled with small pseudo-random values of `dtype`.
struct Buf {
  KernelBackend* be;
  void* p = nullptr;
  Buf(KernelBackend* b, size_t bytes, DType dtype, uint32_t seed) : be(b) {
    auto r = be->Allocate(bytes);
    Check(r.status(), "allocate");
    p = *r;
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

double CpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// CPU time / wall time of the last Time() call: how many cores the run really got
// (below the thread count on a shared machine, which deflates compute-bound points
// more than the copy probe).
double g_last_cores = 0;

// Median seconds of fn() over enough repetitions.
double Time(KernelBackend* be, const std::function<void()>& fn, double min_total) {
  fn();
  Check(be->Synchronize(), "synchronize");
  std::vector<double> runs;
  double total = 0;
  const double cpu0 = CpuSeconds();
  while (total < min_total || runs.size() < 3) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    Check(be->Synchronize(), "synchronize");
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    runs.push_back(s);
    total += s;
    if (runs.size() >= 200) break;
  }
  g_last_cores = (CpuSeconds() - cpu0) / total;
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

struct Result {
  std::string kernel, shape;
  int batch, context;
  double bytes, seconds;
  double cores = g_last_cores;  // filled after Time() ran
};

std::vector<int32_t> Table(int batch, int blocks) {
  // Sequence b owns pages [b * blocks, (b + 1) * blocks), in reverse order: no
  // sequential-page shortcut can help.
  std::vector<int32_t> t(static_cast<size_t>(batch) * blocks);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < blocks; ++i) t[static_cast<size_t>(b) * blocks + i] = b * blocks + (blocks - 1 - i);
  }
  return t;
}

Result BenchGqa(KernelBackend* be, const char* shape, int nq, int nkv, int d, int page, int batch,
                int ctx, double min_t) {
  const int blocks = (ctx + page - 1) / page, pages = batch * blocks;
  const size_t kv_bytes = static_cast<size_t>(pages) * page * nkv * d * 2;
  Buf k(be, kv_bytes, DType::kBf16, 1), v(be, kv_bytes, DType::kBf16, 2);
  Buf q(be, std::vector<float>(static_cast<size_t>(batch) * nq * d, 0.01f));
  Buf out(be, std::vector<float>(static_cast<size_t>(batch) * nq * d, 0.f));
  Buf tab(be, Table(batch, blocks)), lens(be, std::vector<int32_t>(batch, ctx));
  GqaDecodeParams p;
  p.q = q.as<float>();
  p.out = out.as<float>();
  p.kv = {k.p, v.p, DType::kBf16, pages, page, nkv, d};
  p.table = {tab.as<int32_t>(), lens.as<int32_t>(), batch, blocks};
  p.num_q_heads = nq;
  const double s = Time(be, [&] { Check(be->GqaDecode(p), "gqa decode"); }, min_t);
  return {"gqa_decode", shape, batch, ctx, 2.0 * batch * ctx * nkv * d * 2, s, g_last_cores};
}

Result BenchMla(KernelBackend* be, const char* shape, int heads, int batch, int ctx, double min_t) {
  const int page = 64, blocks = (ctx + page - 1) / page, pages = batch * blocks;
  Buf c(be, static_cast<size_t>(pages) * page * 576 * 2, DType::kBf16, 3);
  Buf q(be, std::vector<float>(static_cast<size_t>(batch) * heads * 576, 0.01f));
  Buf out(be, std::vector<float>(static_cast<size_t>(batch) * heads * 512, 0.f));
  Buf tab(be, Table(batch, blocks)), lens(be, std::vector<int32_t>(batch, ctx));
  MlaDecodeParams p;
  p.q = q.as<float>();
  p.out = out.as<float>();
  p.kv.entries = c.p;
  p.kv.num_pages = pages;
  p.table = {tab.as<int32_t>(), lens.as<int32_t>(), batch, blocks};
  p.num_heads = heads;
  p.scale = 1.f / std::sqrt(192.f);
  const double s = Time(be, [&] { Check(be->MlaDecodeAbsorbed(p), "mla decode"); }, min_t);
  return {"mla_decode", shape, batch, ctx, 1.0 * batch * ctx * 576 * 2, s, g_last_cores};
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
  return {"kda_decode", shape, batch, 0, 2.0 * batch * state * 4, s, g_last_cores};
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
    } else if (a.rfind("--threads=", 0) == 0) {
      o.threads = std::atoi(a.c_str() + 10);
    } else {
      std::fprintf(stderr, "usage: kernels_bench [--json] [--quick] [--backend=NAME] [--threads=N]\n");
      return 2;
    }
  }
  auto created = CreateBackend(o.backend, {.num_threads = o.threads});
  Check(created.status(), "backend");
  KernelBackend* be = created->get();
  const bool gpu = o.backend == Backend::kCuda;
  const double min_t = o.quick ? 0.08 : 0.25;

  // Probe: 512 MiB on CPU (2 x 256 MiB buffers), 4 GiB on GPU.
  const size_t probe_bytes = gpu ? (size_t{2} << 30) : (size_t{256} << 20);
  double probe_s;
  {
    Buf a(be, probe_bytes, DType::kFp32, 5), b(be, probe_bytes, DType::kFp32, 6);
    probe_s = Time(be, [&] { Check(be->CopyWithin(b.p, a.p, probe_bytes), "probe copy"); }, min_t);
  }
  const double probe_bw = 2.0 * probe_bytes / probe_s;
  const double probe_cores = g_last_cores;

  std::vector<Result> results;
  // Each sweep keeps the working set between ~8 MB and ~1 GB (CPU) or ~4.5 GB (GPU).
  const double max_bytes = gpu ? 4.5e9 : 1.1e9;
  const std::vector<int> batches = gpu ? std::vector<int>{8, 32, 128} : std::vector<int>{1, 8, 32};
  const std::vector<int> contexts = o.quick ? std::vector<int>{1024, 4096} : std::vector<int>{1024, 4096, 16384};
  struct GqaShape { const char* name; int nq, nkv, d, page; };
  const GqaShape gqa_shapes[] = {{"tiny-gqa", 4, 2, 64, 16}, {"llama-70b-tp8", 8, 1, 128, 16}};
  for (const auto& s : gqa_shapes) {
    for (int b : batches) {
      for (int ctx : contexts) {
        const double bytes = 2.0 * b * ctx * s.nkv * s.d * 2;
        if (bytes > max_bytes || bytes < 8e6) continue;
        results.push_back(BenchGqa(be, s.name, s.nq, s.nkv, s.d, s.page, b, ctx, min_t));
      }
    }
  }
  for (auto [name, heads] : {std::pair{"tiny-mla", 4}, std::pair{"deepseek-v3-tp8", 16}}) {
    for (int b : batches) {
      for (int ctx : contexts) {
        const double bytes = 1.0 * b * ctx * 576 * 2;
        if (bytes > max_bytes || bytes < 8e6) continue;
        results.push_back(BenchMla(be, name, heads, b, ctx, min_t));
      }
    }
  }
  const std::vector<int> kda_batches = gpu ? std::vector<int>{1024, 8192, 32768} : std::vector<int>{256, 1024, 4096};
  for (int b : kda_batches) results.push_back(BenchKda(be, "tiny-hybrid", 2, 64, 64, b, min_t));
  for (int b : gpu ? std::vector<int>{64, 512} : std::vector<int>{16, 128}) {
    results.push_back(BenchKda(be, "kimi-k3-tp8", 12, 128, 128, b, min_t));
  }

  // Targets: GQA at >= 4K context, MLA, KDA, over working sets >= 64 MiB.
  struct Target { const char* kernel; int min_ctx; double cpu, gpu; };
  const Target targets[] = {{"gqa_decode", 4096, 0.60, 0.80}, {"mla_decode", 4096, 0.50, 0.75},
                            {"kda_decode", 0, 0.50, 0.50}};
  std::string tjson;
  std::string ttext;
  for (const auto& t : targets) {
    double worst = 1e9, best = 0;
    for (const auto& r : results) {
      if (r.kernel != t.kernel || r.context < t.min_ctx || r.bytes < 64.0 * (1 << 20)) continue;
      const double f = r.bytes / r.seconds / probe_bw;
      worst = std::min(worst, f);
      best = std::max(best, f);
    }
    const double goal = gpu ? t.gpu : t.cpu;
    char line[512];
    std::snprintf(line, sizeof line,
                  "%s{\"kernel\": \"%s\", \"min_context\": %d, \"worst_fraction\": %.3f, "
                  "\"best_fraction\": %.3f, \"target\": %.2f, \"met\": %s}",
                  tjson.empty() ? "" : ", ", t.kernel, t.min_ctx, worst, best, goal,
                  worst >= goal ? "true" : "false");
    tjson += line;
    std::snprintf(line, sizeof line, "  %-11s ctx>=%-5d worst %.3f best %.3f of probe (target %.2f) %s\n",
                  t.kernel, t.min_ctx, worst, best, goal, worst >= goal ? "MET" : "NOT MET");
    ttext += line;
  }

  if (o.json) {
    std::printf("{\n  \"backend\": \"%s\", \"describe\": \"%s\",\n", std::string(BackendName(o.backend)).c_str(),
                be->Describe().c_str());
    std::printf("  \"probe\": {\"kind\": \"%s\", \"buffer_bytes\": %zu, \"seconds\": %.6f, "
                "\"bytes_per_s\": %.4e, \"counts\": \"read+write\", \"cpu_cores_used\": %.2f},\n",
                gpu ? "device-to-device copy" : "parallel memcpy", probe_bytes, probe_s, probe_bw,
                probe_cores);
    std::printf("  \"results\": [\n");
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      std::printf("    {\"kernel\": \"%s\", \"shape\": \"%s\", \"dtype\": \"%s\", \"batch\": %d, "
                  "\"context\": %d, \"bytes\": %.0f, \"seconds\": %.6f, \"bytes_per_s\": %.4e, "
                  "\"fraction_of_probe\": %.3f, \"cpu_cores_used\": %.2f}%s\n",
                  r.kernel.c_str(), r.shape.c_str(), r.kernel == "kda_decode" ? "fp32" : "bf16",
                  r.batch, r.context, r.bytes, r.seconds, r.bytes / r.seconds,
                  r.bytes / r.seconds / probe_bw, r.cores, i + 1 < results.size() ? "," : "");
    }
    std::printf("  ],\n  \"targets\": [%s]\n}\n", tjson.c_str());
  } else {
    std::printf("backend %s (%s); probe %.2f GB/s (copy, read+write; %.2f cores used)\n",
                std::string(BackendName(o.backend)).c_str(), be->Describe().c_str(), probe_bw / 1e9,
                probe_cores);
    std::printf("%-11s %-16s %6s %7s %10s %9s %9s %6s\n", "kernel", "shape", "batch", "context", "MB", "GB/s",
                "fraction", "cores");
    for (const auto& r : results) {
      std::printf("%-11s %-16s %6d %7d %10.1f %9.2f %9.3f %6.2f\n", r.kernel.c_str(), r.shape.c_str(), r.batch,
                  r.context, r.bytes / 1e6, r.bytes / r.seconds / 1e9, r.bytes / r.seconds / probe_bw, r.cores);
    }
    std::printf("targets (working sets >= 64 MiB):\n%s", ttext.c_str());
  }
  return 0;
}

}  // namespace
}  // namespace kvpool::kernels

int main(int argc, char** argv) { return kvpool::kernels::Main(argc, argv); }
