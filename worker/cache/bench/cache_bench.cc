// cache_bench: KvCacheManager speed in block operations per second on one core, and
// contiguous-vs-paged utilization and batch cap on the output lengths of a trace.
//
//   cache_bench [--trace=PATH] [--pool_blocks=N] [--sim_steps=N] [--utilization_only]
//               [--benchmark_format=json] [any Google Benchmark flag]
//
// A block operation is one block allocated (popped from the free queue), freed
// (ref_cnt reaching 0) or touched (a prefix-cache hit), counted by the pool itself.
// The trace defaults to $KVPOOL_SOURCE_DIR/../shared/data/traces/synthetic_trace.jsonl,
// then to the same path relative to the source tree this binary was built from.
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "benchmark/benchmark.h"
#include "kvpool/worker/cache/kv_cache_manager.h"
#include "utilization_sim.h"

namespace kvpool::cache::bench {
namespace {

class CountingSink : public KvEventSink {
 public:
  void Publish(absl::string_view, const KvEvent& e) override {
    ++events;
    hashes += e.hashes.size();
  }
  uint64_t events = 0;
  uint64_t hashes = 0;
};

uint64_t BlockOps(const BlockPool& pool) {
  const BlockPoolStats& s = pool.stats();
  return s.blocks_allocated + s.blocks_freed + s.blocks_touched;
}

// One iteration = a batch of requests through their whole life:
//   AddRequest -> GetComputedBlocks -> AllocateSlots(prompt - hit)
//   -> `decode` x AllocateSlots(1) -> Free
// Args: prompt tokens, shared-prefix tokens (a system prompt every request hits),
//       decode tokens, batch size, events (0 | 1).
// Every prompt's private part has fresh hashes, so once the pool has filled, each new
// block evicts a cached one: the steady state of a busy worker.
void BM_RequestLifecycle(benchmark::State& state) {
  const int64_t prompt = state.range(0);
  const int64_t shared = state.range(1);
  const int64_t decode = state.range(2);
  const int64_t batch = state.range(3);
  const bool events = state.range(4) != 0;
  constexpr int32_t kB = 16;
  CountingSink sink;
  CacheConfig config;
  config.num_blocks = 32768;
  config.layout = CacheLayout::Paged(kB);
  config.event_sink = events ? &sink : nullptr;
  auto m = KvCacheManager::Create(config);
  if (!m.ok()) {
    state.SkipWithError(std::string(m.status().message()).c_str());
    return;
  }
  KvCacheManager& cache = **m;
  uint64_t serial = 1;
  RequestId next_id = 1;
  std::vector<RequestId> ids(static_cast<size_t>(batch));
  const uint64_t ops_before = BlockOps(cache.block_pool());
  uint64_t calls = 0;
  for (auto _ : state) {
    for (int64_t r = 0; r < batch; ++r) {
      const RequestId id = ids[static_cast<size_t>(r)] = next_id++;
      RequestSpec spec;
      spec.id = id;
      spec.num_prompt_tokens = prompt;
      spec.block_hashes.resize(static_cast<size_t>(prompt / kB));
      for (size_t i = 0; i < spec.block_hashes.size(); ++i) {
        spec.block_hashes[i] = static_cast<int64_t>(i) < shared / kB
                                   ? BlockHash{i + 1, 0x5157454d}  // the shared system prompt
                                   : BlockHash{i + 1, ++serial};
      }
      (void)cache.AddRequest(std::move(spec));
      auto hit = cache.GetComputedBlocks(id);
      if (!hit.ok()) {
        state.SkipWithError(std::string(hit.status().message()).c_str());
        return;
      }
      auto a = cache.AllocateSlots(id, prompt - hit->num_tokens, &*hit);
      if (!a.ok()) {
        state.SkipWithError(std::string(a.status().message()).c_str());
        return;
      }
      calls += 3;
    }
    for (int64_t t = 0; t < decode; ++t) {
      for (RequestId id : ids) benchmark::DoNotOptimize(cache.AllocateSlots(id, 1));
    }
    calls += static_cast<uint64_t>(decode * batch);
    for (RequestId id : ids) (void)cache.Free(id);
    calls += static_cast<uint64_t>(batch);
  }
  const double ops = static_cast<double>(BlockOps(cache.block_pool()) - ops_before);
  state.counters["block_ops/s"] = benchmark::Counter(ops, benchmark::Counter::kIsRate);
  state.counters["calls/s"] =
      benchmark::Counter(static_cast<double>(calls), benchmark::Counter::kIsRate);
  state.counters["evicted/iter"] = benchmark::Counter(
      static_cast<double>(cache.Usage().evicted_blocks), benchmark::Counter::kAvgIterations);
}

// Shapes: chat prefill (2K prompt, 1.5K shared system prompt: hit + allocate + free),
// chat with 256 decode steps per request, unique RAG-style
// prompts (8K, no sharing), decode-heavy (512 prompt, 1K decode), long context (32K).
BENCHMARK(BM_RequestLifecycle)
    ->ArgNames({"prompt", "shared", "decode", "batch", "events"})
    ->Args({2048, 1536, 0, 32, 0})
    ->Args({2048, 1536, 256, 32, 0})
    ->Args({2048, 1536, 256, 32, 1})
    ->Args({8192, 0, 128, 16, 0})
    ->Args({8192, 0, 128, 16, 1})
    ->Args({512, 0, 1024, 64, 0})
    ->Args({32768, 0, 0, 4, 0})
    ->Args({32768, 0, 0, 4, 1});

// Reference point measured in the same run: the same lifecycle on the contiguous
// policy (one reservation per request, no hashing, no prefix cache) — the floor a
// metadata-only cache manager costs per call.
void BM_ContiguousLifecycle(benchmark::State& state) {
  const int64_t prompt = state.range(0);
  const int64_t decode = state.range(1);
  const int64_t batch = state.range(2);
  CacheConfig config;
  config.num_blocks = 32768;
  config.layout = CacheLayout::Paged(16);
  config.max_model_len = prompt + decode;
  auto m = CreateCacheManager("contiguous", config);
  if (!m.ok()) {
    state.SkipWithError(std::string(m.status().message()).c_str());
    return;
  }
  CacheManager& cache = **m;
  RequestId next_id = 1;
  std::vector<RequestId> ids(static_cast<size_t>(batch));
  uint64_t calls = 0;
  for (auto _ : state) {
    for (RequestId& id : ids) {
      id = next_id++;
      RequestSpec spec;
      spec.id = id;
      spec.num_prompt_tokens = prompt;
      (void)cache.AddRequest(std::move(spec));
      benchmark::DoNotOptimize(cache.AllocateSlots(id, prompt));
    }
    for (int64_t t = 0; t < decode; ++t) {
      for (RequestId id : ids) benchmark::DoNotOptimize(cache.AllocateSlots(id, 1));
    }
    for (RequestId id : ids) (void)cache.Free(id);
    calls += static_cast<uint64_t>(batch * (3 + decode));
  }
  state.counters["calls/s"] =
      benchmark::Counter(static_cast<double>(calls), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_ContiguousLifecycle)
    ->ArgNames({"prompt", "decode", "batch"})
    ->Args({2048, 256, 32});

struct Flags {
  std::string trace;
  int32_t pool_blocks = 16384;
  int64_t sim_steps = 4000;
  bool utilization_only = false;
};

// Removes kvpool's flags from argv (the rest goes to Google Benchmark).
bool ParseFlags(int* argc, char** argv, Flags* f) {
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    absl::string_view a = argv[i];
    if (absl::ConsumePrefix(&a, "--trace=")) {
      f->trace = std::string(a);
    } else if (absl::ConsumePrefix(&a, "--pool_blocks=")) {
      if (!absl::SimpleAtoi(a, &f->pool_blocks) || f->pool_blocks < 2) {
        std::fprintf(stderr, "--pool_blocks=%s: expected an integer >= 2\n", argv[i] + 14);
        return false;
      }
    } else if (absl::ConsumePrefix(&a, "--sim_steps=")) {
      if (!absl::SimpleAtoi(a, &f->sim_steps) || f->sim_steps < 2) {
        std::fprintf(stderr, "--sim_steps=%s: expected an integer >= 2\n", argv[i] + 12);
        return false;
      }
    } else if (a == "--utilization_only") {
      f->utilization_only = true;
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  return true;
}

std::string DefaultTracePath() {
  const std::string rel = "/../shared/data/traces/synthetic_trace.jsonl";
  if (const char* dir = std::getenv("KVPOOL_SOURCE_DIR"); dir != nullptr && *dir != '\0') {
    return std::string(dir) + rel;
  }
  return std::string(KVPOOL_DEFAULT_SOURCE_DIR) + rel;
}

// Runs the utilization scenarios; prints a table to `out` and records each figure in
// the benchmark context (so it lands in --benchmark_format=json output too).
int RunUtilization(const Flags& flags, FILE* out) {
  const std::string path = flags.trace.empty() ? DefaultTracePath() : flags.trace;
  auto trace = LoadTrace(path);
  if (!trace.ok()) {
    std::fprintf(stderr, "utilization: %s\n", std::string(trace.status().message()).c_str());
    return 1;
  }
  int64_t max_output = 0, max_total = 0;
  for (const TraceRequest& r : *trace) {
    // The simulator produces at least one token per request (as a server does).
    max_output = std::max(max_output, std::max<int64_t>(1, r.output_length));
    max_total = std::max(max_total, r.input_length + std::max<int64_t>(1, r.output_length));
  }
  std::fprintf(out, "\nContiguous vs paged KV on %zu requests of %s\n", trace->size(),
               path.c_str());
  std::fprintf(out, "(output lengths from the trace; contiguous reserves max_model_len = "
                    "prompt + longest output; 16-token blocks; continuous batching)\n");
  std::fprintf(out, "%-22s %-11s %12s %11s %12s %10s %10s %12s\n", "prompt", "policy",
               "max_model_len", "pool_blocks", "utilization", "mean_batch", "max_batch",
               "preemptions");
  struct Scenario {
    std::string name;
    int64_t prompt;  // <= 0: the trace's
    int32_t pool_blocks;
  };
  std::vector<Scenario> scenarios = {{"1 token", 1, flags.pool_blocks},
                                     {"128 tokens", 128, flags.pool_blocks},
                                     {"512 tokens", 512, flags.pool_blocks}};
  // With the trace's own prompts (up to ~191K tokens), contiguous must reserve the
  // longest request; the pool must hold at least a few such reservations.
  const int32_t trace_pool = std::max<int32_t>(
      flags.pool_blocks, static_cast<int32_t>(4 * ((max_total + 15) / 16) + 1));
  scenarios.push_back({"trace input_length", 0, trace_pool});
  for (const Scenario& s : scenarios) {
    for (const char* policy : {"contiguous", "paged"}) {
      SimOptions o;
      o.policy = policy;
      o.num_blocks = s.pool_blocks;
      o.prompt_tokens = s.prompt;
      o.max_model_len = s.prompt > 0 ? s.prompt + max_output : max_total;
      o.steps = flags.sim_steps;
      auto r = SimulateUtilization(*trace, o);
      if (!r.ok()) {
        std::fprintf(stderr, "utilization (%s, %s): %s\n", s.name.c_str(), policy,
                     std::string(r.status().message()).c_str());
        return 1;
      }
      std::fprintf(out, "%-22s %-11s %12lld %11d %12.3f %10.1f %10lld %12lld\n",
                   s.name.c_str(), policy, static_cast<long long>(o.max_model_len),
                   o.num_blocks, r->utilization, r->mean_batch,
                   static_cast<long long>(r->max_batch), static_cast<long long>(r->preemptions));
      const std::string key = absl::StrCat("utilization/", s.name, "/", policy);
      benchmark::AddCustomContext(
          key, absl::StrFormat("utilization=%.4f mean_batch=%.1f max_batch=%d "
                               "max_model_len=%d pool_blocks=%d preemptions=%d",
                               r->utilization, r->mean_batch, r->max_batch, o.max_model_len,
                               o.num_blocks, r->preemptions));
    }
  }
  std::fprintf(out, "\n");
  std::fflush(out);
  return 0;
}

}  // namespace
}  // namespace kvpool::cache::bench

int main(int argc, char** argv) {
  using namespace kvpool::cache::bench;
  Flags flags;
  if (!ParseFlags(&argc, argv, &flags)) return 2;
  bool json = false;
  for (int i = 1; i < argc; ++i) {
    if (absl::string_view(argv[i]) == "--benchmark_format=json") json = true;
  }
  // The table goes to stderr in JSON mode so stdout stays one JSON document.
  const int rc = RunUtilization(flags, json ? stderr : stdout);
  if (flags.utilization_only) return rc;
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 2;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return rc;
}
