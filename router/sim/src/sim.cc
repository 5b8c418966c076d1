#include "kvpool/common/percentile.h"
#include "kvpool/router/sim.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <deque>
#include <memory>
#include <numeric>
#include <queue>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/time.h"
#include "kvpool/common/status.h"
#include "kvpool/router/router_core.h"
#include "kvpool/router/sim_pool.h"
#include "kvpool/worker/cache/kv_cache_manager.h"

namespace kvpool::sim {
namespace {

using router::kMaxEventHashes;

absl::Time At(double t) { return absl::UnixEpoch() + absl::Seconds(t); }

router::Tier ToRouterTier(cache::Tier t) {
  switch (t) {
    case cache::Tier::kGpu: return router::Tier::kGpu;
    case cache::Tier::kDram: return router::Tier::kDram;
    case cache::Tier::kNvme: return router::Tier::kNvme;
  }
  return router::Tier::kGpu;
}

// Forwards one instance's cache events into the router core, as the worker's event
// publisher and the router's PublishEvents would (minus the wire). Events longer than the
// router's per-event limit are split into chained pieces, renumbered per source.
class EventBridge : public cache::KvEventSink {
 public:
  EventBridge(router::RouterCore* core, std::string id, const double* now, uint64_t* applied)
      : core_(core), id_(std::move(id)), now_(now), applied_(applied) {}

  void Publish(absl::string_view /*source_id*/, const cache::KvEvent& e) override {
    router::EventBatch batch;
    const router::Tier tier = ToRouterTier(e.tier);
    switch (e.type) {
      case cache::KvEvent::Type::kStored:
        for (size_t at = 0; at < e.hashes.size(); at += kMaxEventHashes) {
          const size_t n = std::min(kMaxEventHashes, e.hashes.size() - at);
          const BlockHash parent = at == 0 ? e.parent.value_or(BlockHash{}) : e.hashes[at - 1];
          batch.events.push_back(router::KvEvent::Stored(
              next_seq_++, parent, std::vector<BlockHash>(e.hashes.begin() + at, e.hashes.begin() + at + n), tier,
              e.kind));
        }
        break;
      case cache::KvEvent::Type::kRemoved:
        for (size_t at = 0; at < e.hashes.size(); at += kMaxEventHashes) {
          const size_t n = std::min(kMaxEventHashes, e.hashes.size() - at);
          batch.events.push_back(router::KvEvent::Removed(
              next_seq_++, std::vector<BlockHash>(e.hashes.begin() + at, e.hashes.begin() + at + n), tier, e.kind));
        }
        break;
      case cache::KvEvent::Type::kCleared:
        batch.events.push_back(router::KvEvent::Cleared(next_seq_++));
        break;
    }
    Apply(batch);
  }

  void Apply(const router::EventBatch& batch) {
    if (batch.events.empty()) return;
    auto r = core_->ApplyEvents(id_, batch, At(*now_));
    if (!r.ok()) {
      if (error_.ok()) error_ = r.status();
      return;
    }
    if (r->full_dump_requested && error_.ok()) {
      error_ = absl::InternalError(absl::StrCat("router saw a sequence gap from ", id_));
    }
    *applied_ += r->apply.applied;
  }

  uint64_t* next_seq() { return &next_seq_; }
  const absl::Status& error() const { return error_; }

 private:
  router::RouterCore* core_;
  std::string id_;
  const double* now_;
  uint64_t* applied_;
  uint64_t next_seq_ = 1;
  absl::Status error_;
};

struct Queued {
  size_t request;
  uint64_t predicted_tokens;  // prefill tokens the router predicted (for queued_prefill_tokens)
};

struct Running {
  size_t request = 0;
  double start_s = 0, end_s = 0;
  uint64_t tokens = 0;
  bool cached = false;  // registered with the cache manager
};

struct Instance {
  std::string id;
  std::unique_ptr<EventBridge> bridge;
  std::unique_ptr<cache::KvCacheManager> cache;
  std::deque<Queued> waiting;
  uint64_t waiting_tokens = 0;
  bool busy = false;
  Running running;
  uint64_t requests = 0;
  double busy_s = 0;
};

struct Event {
  double t;
  uint64_t seq;
  bool arrival;  // else: prefill end on `index` (an instance)
  size_t index;
  bool operator>(const Event& o) const { return t != o.t ? t > o.t : seq > o.seq; }
};

double Percentile(std::vector<double>& v, double q) { return NearestRank(v, q); }

class Simulation {
 public:
  Simulation(const Workload& w, const SimOptions& o) : w_(w), o_(o) {}

  absl::Status Init();
  absl::Status Run();
  SimResult Finish(double wall_s);

 private:
  void Push(double t, bool arrival, size_t index) { events_.push({t, seq_++, arrival, index}); }
  absl::Status Arrive(size_t r);
  absl::Status Start(size_t inst);
  absl::Status End(size_t inst);
  void Heartbeat(size_t inst, std::span<const uint64_t> completed);

  const Workload& w_;
  const SimOptions& o_;
  std::unique_ptr<router::RouterCore> core_;
  std::vector<Instance> inst_;
  std::vector<int64_t> inst_of_slot_;
  std::unique_ptr<PoolTier> pool_;
  std::unique_ptr<EventBridge> pool_bridge_;
  std::priority_queue<Event, std::vector<Event>, std::greater<>> events_;
  uint64_t seq_ = 0;
  double now_ = 0;
  CostModel cost_;
  int64_t block_tokens_ = 0;
  double bytes_per_token_ = 0;
  double kda_fraction_ = 0;
  std::vector<router::KvEvent> pool_events_;

  // Per request results.
  std::vector<double> ttft_, queue_, transfer_, prefill_;
  std::vector<int64_t> gpu_hit_, pool_hit_, predicted_hit_;
  std::vector<double> start_;
  std::vector<uint64_t> decision_;
  SimResult res_;
};

absl::Status Simulation::Init() {
  if (o_.instances < 1) return absl::InvalidArgumentError("--instances must be >= 1");
  if (o_.gpu_blocks < 1) return absl::InvalidArgumentError("--gpu-blocks must be >= 1");
  if (o_.pool_blocks < 0) return absl::InvalidArgumentError("--pool-blocks must be >= 0 (0 = no pool tier)");
  if (!(o_.time_scale > 0)) return absl::InvalidArgumentError("--time-scale must be > 0");
  if (!(o_.pool_bandwidth > 0)) return absl::InvalidArgumentError("--pool-bandwidth must be > 0");
  if (!(o_.achieved_flops > 0)) return absl::InvalidArgumentError("--flops must be > 0");
  ASSIGN_OR_RETURN(router::PolicyKind policy, router::ParsePolicy(o_.policy));
  cost_.achieved_flops = o_.achieved_flops;
  block_tokens_ = w_.spec.block_tokens;
  bytes_per_token_ = static_cast<double>(w_.spec.KvBytesPerToken());
  if (w_.spec.IsHybrid()) {
    kda_fraction_ = static_cast<double>(w_.spec.NumLayers(AttentionKind::kKda)) / w_.spec.NumLayers();
  }

  router::RouterOptions ro;
  ro.models = {w_.model};
  ro.policy = policy;
  ro.seed = o_.seed;
  ro.cost = cost_;
  ro.pool_dram_bandwidth = o_.pool_bandwidth;
  ro.hybrid_mode = router::HybridMode::kReplay;  // the cache manager's default hit mode
  // Simulated instances only prefill (the request they report running is a prefill,
  // counted in its queued tokens): no decode steps to cost.
  ro.ttft_decode_weight = 0;
  ro.max_index_entries = std::max<size_t>(
      ro.max_index_entries,
      static_cast<size_t>(o_.instances) * static_cast<size_t>(o_.gpu_blocks) * 5 / 4 +
          static_cast<size_t>(o_.pool_blocks) + 1024);
  ASSIGN_OR_RETURN(core_, router::RouterCore::Create(ro));

  ASSIGN_OR_RETURN(cache::CacheLayout layout, cache::CacheLayout::FromModelSpec(w_.spec));
  inst_.resize(static_cast<size_t>(o_.instances));
  for (int i = 0; i < o_.instances; ++i) {
    Instance& in = inst_[static_cast<size_t>(i)];
    in.id = absl::StrFormat("w%04d", i);
    in.bridge = std::make_unique<EventBridge>(core_.get(), in.id, &now_, &res_.kv_events);
    cache::CacheConfig cc;
    cc.num_blocks = o_.gpu_blocks + 1;  // + the null block
    cc.layout = layout;
    cc.hash_options = HashOptions{.model_id = w_.spec.name, .block_tokens = static_cast<uint32_t>(block_tokens_)};
    cc.source_id = in.id;
    cc.tier = cache::Tier::kGpu;
    cc.event_sink = in.bridge.get();
    ASSIGN_OR_RETURN(in.cache, cache::KvCacheManager::Create(std::move(cc)));
    RETURN_IF_ERROR(core_->Register({.id = in.id,
                                     .kind = router::SourceKind::kWorker,
                                     .address = absl::StrCat("sim://", in.id),
                                     .model = w_.model,
                                     .capacity_blocks = static_cast<uint64_t>(o_.gpu_blocks)},
                                    At(0)));
    const int64_t slot = core_->SlotOf(in.id);
    if (slot >= static_cast<int64_t>(inst_of_slot_.size())) inst_of_slot_.resize(static_cast<size_t>(slot) + 1, -1);
    inst_of_slot_[static_cast<size_t>(slot)] = i;
  }
  if (o_.pool_blocks > 0) {
    pool_ = std::make_unique<PoolTier>(o_.pool_blocks);
    pool_bridge_ = std::make_unique<EventBridge>(core_.get(), "pool0", &now_, &res_.kv_events);
    router::SourceInfo info;
    info.id = "pool0";
    info.kind = router::SourceKind::kPoolNode;
    info.address = "sim://pool0";
    info.capacity_blocks = static_cast<uint64_t>(o_.pool_blocks);
    RETURN_IF_ERROR(core_->Register(info, At(0)));
  }
  const size_t n = w_.requests.size();
  ttft_.assign(n, 0);
  queue_.assign(n, 0);
  transfer_.assign(n, 0);
  prefill_.assign(n, 0);
  gpu_hit_.assign(n, 0);
  pool_hit_.assign(n, 0);
  predicted_hit_.assign(n, 0);
  start_.assign(n, 0);
  decision_.assign(n, 0);
  for (size_t r = 0; r < n; ++r) Push(w_.requests[r].arrival_s / o_.time_scale, true, r);
  return absl::OkStatus();
}

void Simulation::Heartbeat(size_t i, std::span<const uint64_t> completed) {
  Instance& in = inst_[i];
  router::InstanceLoad load;
  load.running_requests = in.busy ? 1 : 0;
  load.waiting_requests = static_cast<uint32_t>(in.waiting.size());
  uint64_t remaining = 0;
  if (in.busy && in.running.end_s > in.running.start_s) {
    remaining = static_cast<uint64_t>(static_cast<double>(in.running.tokens) * (in.running.end_s - now_) /
                                      (in.running.end_s - in.running.start_s));
  }
  load.queued_prefill_tokens = in.waiting_tokens + remaining;
  const cache::CacheUsage u = in.cache->Usage();
  load.kv_usage = u.total_blocks > 0 ? static_cast<double>(u.used_blocks) / u.total_blocks : 0;
  core_->Heartbeat(in.id, load, completed, At(now_));
  ++res_.heartbeats;
}

absl::Status Simulation::Arrive(size_t r) {
  const Workload::Request& req = w_.requests[r];
  size_t i;
  uint64_t predicted = static_cast<uint64_t>(req.prompt_tokens);
  if (req.hashes.empty()) {
    // Shorter than one block: nothing to match; the router needs at least one hash.
    i = r % inst_.size();
  } else {
    // What each busy instance has left of its running prefill, as of now (it was last
    // reported when that instance last changed: every other busy instance looked as if it
    // had all of its prefill still to do).
    for (size_t j = 0; j < inst_.size(); ++j) {
      if (inst_[j].busy) Heartbeat(j, {});
    }
    router::RouteInput in;
    in.model = w_.model;
    in.hashes = req.hashes;
    in.prompt_tokens = static_cast<uint64_t>(req.prompt_tokens);
    ASSIGN_OR_RETURN(router::RouteDecision d, core_->Route(in, At(now_)));
    i = static_cast<size_t>(inst_of_slot_[d.slot]);
    const int64_t hit =
        std::min<int64_t>(int64_t{d.gpu_hit_blocks + d.pool_hit_blocks} * block_tokens_, req.prompt_tokens);
    predicted_hit_[r] = hit;
    predicted = static_cast<uint64_t>(req.prompt_tokens - hit);
    decision_[r] = d.decision_id;
  }
  Instance& in = inst_[i];
  in.waiting.push_back({r, predicted});
  in.waiting_tokens += predicted;
  ++in.requests;
  const uint64_t id = decision_[r];
  Heartbeat(i, id != 0 ? std::span<const uint64_t>(&id, 1) : std::span<const uint64_t>());
  if (!in.busy) return Start(i);
  return absl::OkStatus();
}

absl::Status Simulation::Start(size_t i) {
  Instance& in = inst_[i];
  const Queued q = in.waiting.front();
  in.waiting.pop_front();
  in.waiting_tokens -= q.predicted_tokens;
  const Workload::Request& req = w_.requests[q.request];
  const int64_t L = req.prompt_tokens;
  const cache::RequestId id = q.request + 1;
  ++res_.sim_events;

  cache::RequestSpec spec;
  spec.id = id;
  spec.num_prompt_tokens = L;
  spec.block_hashes = req.hashes;
  RETURN_IF_ERROR(in.cache->AddRequest(std::move(spec)));
  ASSIGN_OR_RETURN(cache::PrefixHit hit, in.cache->GetComputedBlocks(id));
  bool cached = true;
  auto alloc = in.cache->AllocateSlots(id, L - hit.num_tokens, &hit);
  if (!alloc.ok()) {
    if (alloc.status().code() != absl::StatusCode::kResourceExhausted) return alloc.status();
    // Larger than the whole GPU cache: computed without caching anything.
    RETURN_IF_ERROR(in.cache->Free(id));
    ++res_.uncacheable_requests;
    cached = false;
    hit = cache::PrefixHit{};
  }
  const int64_t g_tokens = hit.num_tokens;
  int64_t p_tokens = 0;
  double transfer_s = 0;
  if (pool_ != nullptr && cached) {
    const int64_t g_blocks = g_tokens / block_tokens_;
    const int64_t max_blocks = (L - 1) / block_tokens_ - g_blocks;  // the last token is recomputed
    if (max_blocks > 0) {
      const uint32_t p = pool_->RunFrom(req.hashes, static_cast<uint32_t>(g_blocks), static_cast<uint32_t>(max_blocks));
      const double tokens = static_cast<double>(p) * block_tokens_;
      const double t = tokens * bytes_per_token_ / o_.pool_bandwidth;
      if (p > 0 && t < cost_.PrefillSeconds(w_.spec, tokens)) {  // fetch only when it beats recompute
        p_tokens = static_cast<int64_t>(tokens);
        transfer_s = t;
      }
    }
  }
  const double replay_s = cost_.PrefillSeconds(w_.spec, static_cast<double>(hit.replay_tokens)) * kda_fraction_;
  const double prefill_s = cost_.PrefillSeconds(w_.spec, static_cast<double>(L - g_tokens - p_tokens)) + replay_s;
  const size_t r = q.request;
  start_[r] = now_;
  queue_[r] = now_ - w_.requests[r].arrival_s / o_.time_scale;
  transfer_[r] = transfer_s;
  prefill_[r] = prefill_s;
  ttft_[r] = queue_[r] + transfer_s + prefill_s;
  gpu_hit_[r] = g_tokens;
  pool_hit_[r] = p_tokens;
  in.busy = true;
  in.running = Running{r, now_, now_ + transfer_s + prefill_s, static_cast<uint64_t>(L - g_tokens - p_tokens), cached};
  in.busy_s += transfer_s + prefill_s;
  Push(in.running.end_s, false, i);
  Heartbeat(i, {});
  return in.bridge->error();
}

absl::Status Simulation::End(size_t i) {
  Instance& in = inst_[i];
  const size_t r = in.running.request;
  ++res_.sim_events;
  if (in.running.cached) RETURN_IF_ERROR(in.cache->Free(r + 1));
  in.busy = false;
  if (pool_ != nullptr && !w_.requests[r].hashes.empty()) {
    pool_events_.clear();
    pool_->Put(w_.requests[r].hashes, pool_bridge_->next_seq(), &pool_events_);
    router::EventBatch b;
    b.events = std::move(pool_events_);
    pool_bridge_->Apply(b);
    pool_events_ = std::move(b.events);
    RETURN_IF_ERROR(pool_bridge_->error());
  }
  res_.makespan_s = std::max(res_.makespan_s, now_);
  if (!in.waiting.empty()) return Start(i);
  Heartbeat(i, {});
  return in.bridge->error();
}

absl::Status Simulation::Run() {
  while (!events_.empty()) {
    const Event e = events_.top();
    events_.pop();
    now_ = e.t;
    if (e.arrival) {
      ++res_.sim_events;
      RETURN_IF_ERROR(Arrive(e.index));
    } else {
      RETURN_IF_ERROR(End(e.index));
    }
  }
  return absl::OkStatus();
}

SimResult Simulation::Finish(double wall_s) {
  SimResult& s = res_;
  s.policy = o_.policy;
  s.instances = o_.instances;
  s.gpu_blocks = o_.gpu_blocks;
  s.pool_blocks = o_.pool_blocks;
  const size_t n = w_.requests.size();
  s.requests = n;
  int64_t dedup_hit = 0, dedup_tokens = 0, predicted = 0;
  for (size_t r = 0; r < n; ++r) {
    const int64_t L = w_.requests[r].prompt_tokens;
    s.prompt_tokens += L;
    s.gpu_hit_tokens += gpu_hit_[r];
    s.pool_hit_tokens += pool_hit_[r];
    predicted += predicted_hit_[r];
    if (!w_.requests[r].duplicate) {
      dedup_hit += gpu_hit_[r] + pool_hit_[r];
      dedup_tokens += L;
    }
  }
  const double total = static_cast<double>(std::max<int64_t>(1, s.prompt_tokens));
  s.gpu_hit_rate = static_cast<double>(s.gpu_hit_tokens) / total;
  s.pool_hit_rate = static_cast<double>(s.pool_hit_tokens) / total;
  s.hit_rate = s.gpu_hit_rate + s.pool_hit_rate;
  s.predicted_hit_rate = static_cast<double>(predicted) / total;
  s.dedup_hit_rate = dedup_tokens > 0 ? static_cast<double>(dedup_hit) / static_cast<double>(dedup_tokens) : 0;
  s.upper_bound = w_.analysis.upper_bound;
  s.dedup_upper_bound = w_.analysis.dedup_upper_bound;
  auto mean = [n](const std::vector<double>& v) {
    return n == 0 ? 0.0 : std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(n);
  };
  s.ttft_mean_s = mean(ttft_);
  s.queue_mean_s = mean(queue_);
  s.transfer_mean_s = mean(transfer_);
  s.prefill_mean_s = mean(prefill_);
  std::vector<double> t = ttft_;
  s.ttft_p50_s = Percentile(t, 0.50);
  s.ttft_p99_s = Percentile(t, 0.99);
  for (const Instance& in : inst_) {
    s.instance_requests.push_back(in.requests);
    s.instance_busy_s.push_back(in.busy_s);
    s.busy_max_s = std::max(s.busy_max_s, in.busy_s);
    s.busy_mean_s += in.busy_s / static_cast<double>(inst_.size());
    s.requests_max = std::max(s.requests_max, static_cast<double>(in.requests));
    s.requests_mean += static_cast<double>(in.requests) / static_cast<double>(inst_.size());
  }
  s.wall_s = wall_s;
  const double work = static_cast<double>(s.sim_events + s.kv_events + s.heartbeats);
  s.events_per_s = wall_s > 0 ? work / wall_s : 0;
  return s;
}

}  // namespace

absl::StatusOr<Workload> Workload::Build(std::span<const trace::TraceRequest> requests,
                                         int64_t trace_block_tokens, const std::string& model) {
  Workload w;
  ASSIGN_OR_RETURN(w.spec, ResolveModelSpec(model));
  w.model = model;
  w.trace_block_tokens = trace_block_tokens;
  ASSIGN_OR_RETURN(BlockHasher hasher,
                   BlockHasher::Create(HashOptions{.model_id = w.spec.name,
                                                   .block_tokens = static_cast<uint32_t>(w.spec.block_tokens)}));
  ASSIGN_OR_RETURN(trace::BlockMapping mapping, trace::BlockMapping::Create(trace_block_tokens, w.spec.block_tokens));
  w.analysis = trace::AnalyzeTrace(requests, mapping);
  const double t0 = requests.empty() ? 0 : requests.front().timestamp_ms;
  const uint32_t vocab = static_cast<uint32_t>(std::max(1, w.spec.vocab_size));
  w.requests.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    const trace::TraceRequest& t = requests[i];
    Request r;
    r.arrival_s = (t.timestamp_ms - t0) / 1000.0;
    r.prompt_tokens = t.input_length;
    r.output_tokens = t.output_length;
    r.hashes = trace::CacheBlockHashes(t, trace_block_tokens, vocab, hasher);
    r.duplicate = w.analysis.duplicate[i];
    w.requests.push_back(std::move(r));
  }
  return w;
}

absl::StatusOr<SimResult> Simulate(const Workload& workload, const SimOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::clock_t c0 = std::clock();
  Simulation sim(workload, options);
  RETURN_IF_ERROR(sim.Init());
  RETURN_IF_ERROR(sim.Run());
  const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  SimResult r = sim.Finish(wall);
  r.cpu_s = static_cast<double>(std::clock() - c0) / CLOCKS_PER_SEC;
  return r;
}

}  // namespace kvpool::sim
