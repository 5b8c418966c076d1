#include "utilization_sim.h"

#include <algorithm>
#include <deque>
#include <fstream>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kvpool/common/status.h"
#include "kvpool/worker/cache/cache_manager.h"
#include "nlohmann/json.hpp"

namespace kvpool::cache::bench {

absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(
        "cannot open trace '", path, "'; pass --trace=<path to synthetic_trace.jsonl>"));
  }
  std::vector<TraceRequest> out;
  std::string line;
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("input_length") ||
        !j.contains("output_length") || !j["input_length"].is_number_integer() ||
        !j["output_length"].is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(
          path, ":", n, ": expected a JSON object with integer input_length and "
          "output_length (Mooncake trace format)"));
    }
    const int64_t input = j["input_length"].get<int64_t>(), output = j["output_length"].get<int64_t>();
    // Bounded so that prompt + output and the block counts derived from them stay far
    // from overflowing (the longest trace request is ~191K tokens).
    constexpr int64_t kMaxLength = int64_t{1} << 30;
    if (input < 1 || input > kMaxLength || output < 0 || output > kMaxLength) {
      const bool bad_input = input < 1 || input > kMaxLength;
      return absl::InvalidArgumentError(absl::StrCat(path, ":", n, ": ", bad_input ? "input_length=" : "output_length=",
                                                     bad_input ? input : output, " must be in [", bad_input ? 1 : 0,
                                                     ", 2^30]", bad_input ? " (a request has a prompt)" : ""));
    }
    out.push_back({input, output});
  }
  if (out.empty()) return absl::InvalidArgumentError(absl::StrCat(path, " has no requests"));
  return out;
}

absl::StatusOr<SimResult> SimulateUtilization(const std::vector<TraceRequest>& trace,
                                              const SimOptions& o) {
  CacheConfig config;
  config.num_blocks = o.num_blocks;
  config.layout = CacheLayout::Paged(o.block_tokens);
  config.enable_prefix_caching = false;  // utilization of private KV only
  config.max_model_len = o.max_model_len;
  ASSIGN_OR_RETURN(std::unique_ptr<CacheManager> m, CreateCacheManager(o.policy, config));
  auto prompt_of = [&](size_t i) {
    return o.prompt_tokens > 0 ? o.prompt_tokens : trace[i].input_length;
  };
  // A request runs only with its prompt below max_model_len (one token of output); with
  // none such, admission would skip the trace's requests forever.
  if (o.max_model_len > 0) {
    bool any_fits = false;
    for (size_t i = 0; i < trace.size() && !any_fits; ++i) any_fits = prompt_of(i) < o.max_model_len;
    if (!any_fits) {
      return absl::InvalidArgumentError(absl::StrCat(
          "max_model_len=", o.max_model_len, " leaves no room for any request of the trace (",
          o.prompt_tokens > 0 ? "prompt_tokens" : "every input_length", " is >= it); raise max_model_len"));
    }
  }
  const bool paged = o.policy == "paged";
  // vLLM's admission watermark: keep 1% of the blocks for running requests to grow into.
  const int64_t watermark = paged ? (o.num_blocks + 99) / 100 : 0;

  struct Running {
    RequestId id;
    size_t trace_index;
    int64_t output;
    int64_t generated;
  };
  std::deque<size_t> pending;  // trace indices; preempted requests go back to the front
  size_t next_trace = 0;
  std::vector<Running> running;
  RequestId next_id = 1;
  SimResult res;
  double sum_live = 0, sum_reserved = 0, sum_batch = 0;
  int64_t measured = 0;

  auto preempt_youngest = [&]() {
    const Running victim = running.back();
    running.pop_back();
    (void)m->Free(victim.id);
    pending.push_front(victim.trace_index);  // recomputed from scratch later
    ++res.preemptions;
  };

  for (int64_t step = 0; step < o.steps; ++step) {
    // Admit FIFO while the prompt fits.
    for (;;) {
      if (pending.empty()) pending.push_back(next_trace++ % trace.size());
      const size_t idx = pending.front();
      const int64_t prompt = prompt_of(idx);
      int64_t output = std::max<int64_t>(1, trace[idx].output_length);
      if (o.max_model_len > 0) {
        if (prompt >= o.max_model_len) {  // cannot run under this max_model_len at all
          pending.pop_front();
          continue;
        }
        output = std::min(output, o.max_model_len - prompt);
      }
      if (paged) {
        const int64_t blocks = (prompt + o.block_tokens - 1) / o.block_tokens;
        if (m->Usage().free_blocks < blocks + watermark) break;
      }
      const RequestId id = next_id++;
      RequestSpec spec;
      spec.id = id;
      spec.num_prompt_tokens = prompt;
      RETURN_IF_ERROR(m->AddRequest(std::move(spec)));
      auto a = m->AllocateSlots(id, prompt);
      if (!a.ok()) {
        RETURN_IF_ERROR(m->Free(id));
        if (a.status().code() != absl::StatusCode::kResourceExhausted) return a.status();
        break;
      }
      running.push_back({id, idx, output, 0});
      pending.pop_front();
    }
    // Decode one token for every running request.
    for (size_t i = 0; i < running.size();) {
      auto a = m->AllocateSlots(running[i].id, 1);
      if (a.ok()) {
        ++running[i].generated;
        ++i;
        continue;
      }
      if (a.status().code() != absl::StatusCode::kResourceExhausted) return a.status();
      const bool self = i + 1 == running.size();
      preempt_youngest();
      if (self) break;
    }
    if (step >= o.steps / 2) {
      const CacheUsage u = m->Usage();
      sum_live += static_cast<double>(u.live_tokens);
      sum_reserved += static_cast<double>(u.reserved_tokens);
      sum_batch += static_cast<double>(running.size());
      res.max_batch = std::max<int64_t>(res.max_batch, static_cast<int64_t>(running.size()));
      ++measured;
    }
    // Retire requests that produced their output.
    for (size_t i = 0; i < running.size();) {
      if (running[i].generated >= running[i].output) {
        RETURN_IF_ERROR(m->Free(running[i].id));
        running.erase(running.begin() + static_cast<ptrdiff_t>(i));
        ++res.finished;
      } else {
        ++i;
      }
    }
  }
  res.utilization = sum_reserved > 0 ? sum_live / sum_reserved : 0;
  res.mean_batch = measured > 0 ? sum_batch / static_cast<double>(measured) : 0;
  return res;
}

}  // namespace kvpool::cache::bench
