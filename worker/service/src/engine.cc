#include "engine.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvpool/common/clock.h"
#include "kvpool/common/cost_model.h"
#include "kvpool/common/status.h"
#include "kvpool/common/units.h"
#include "pool_tier.h"
#include "spdlog/spdlog.h"

namespace kvpool::worker {
namespace {

int KindIndex(StateKind k) { return k == StateKind::kLinearState ? 1 : 0; }
v1::StateKind ToProto(StateKind k) {
  return k == StateKind::kLinearState ? v1::STATE_KIND_LINEAR_STATE : v1::STATE_KIND_ATTN_KV;
}
double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }
// Exponentially weighted moving average; the first sample replaces the prior.
void Ewma(double& avg, double sample, bool* seeded = nullptr) {
  if (seeded != nullptr && !*seeded) {
    avg = sample;
    *seeded = true;
    return;
  }
  avg = avg == 0 ? sample : 0.8 * avg + 0.2 * sample;
}

}  // namespace

absl::StatusOr<OffloadMode> ParseOffloadMode(absl::string_view s) {
  if (s == "off") return OffloadMode::kOff;
  if (s == "write-through") return OffloadMode::kWriteThrough;
  if (s == "write-back") return OffloadMode::kWriteBack;
  return absl::InvalidArgumentError(
      absl::StrCat("--offload=", s, " is not a mode; use write-through, write-back or off"));
}
absl::StatusOr<FetchMode> ParseFetchMode(absl::string_view s) {
  if (s == "auto") return FetchMode::kAuto;
  if (s == "always") return FetchMode::kAlways;
  if (s == "never") return FetchMode::kNever;
  return absl::InvalidArgumentError(absl::StrCat("--fetch=", s, " is not a mode; use auto, always or never"));
}
absl::string_view OffloadModeName(OffloadMode m) {
  switch (m) {
    case OffloadMode::kOff: return "off";
    case OffloadMode::kWriteThrough: return "write-through";
    case OffloadMode::kWriteBack: return "write-back";
  }
  return "?";
}
absl::string_view FetchModeName(FetchMode m) {
  switch (m) {
    case FetchMode::kAuto: return "auto";
    case FetchMode::kAlways: return "always";
    case FetchMode::kNever: return "never";
  }
  return "?";
}

Engine::Engine(EngineConfig config, MetricsRegistry* metrics) : cfg_(std::move(config)), metrics_(metrics) {
  MetricsRegistry& m = *metrics_;
  m_queries_ = &m.GetCounter("kvpool_worker_prefix_cache_queries_total", "Prompt tokens looked up in the prefix caches");
  m_hits_gpu_ = &m.GetCounter("kvpool_worker_prefix_cache_hits_total", "Prompt tokens reused, by tier", {{"tier", "gpu"}});
  m_hits_pool_ = &m.GetCounter("kvpool_worker_prefix_cache_hits_total", "Prompt tokens reused, by tier", {{"tier", "pool"}});
  m_fetched_ = &m.GetCounter("kvpool_worker_prompt_tokens_total", "Prompt tokens by how their KV was obtained", {{"source", "fetched"}});
  m_recomputed_ = &m.GetCounter("kvpool_worker_prompt_tokens_total", "Prompt tokens by how their KV was obtained", {{"source", "recomputed"}});
  m_bytes_in_dram_ = &m.GetCounter("kvpool_worker_bytes_moved_total", "KV bytes moved to or from pool nodes", {{"direction", "fetch"}, {"tier", "dram"}});
  m_bytes_in_nvme_ = &m.GetCounter("kvpool_worker_bytes_moved_total", "KV bytes moved to or from pool nodes", {{"direction", "fetch"}, {"tier", "nvme"}});
  m_bytes_out_ = &m.GetCounter("kvpool_worker_bytes_moved_total", "KV bytes moved to or from pool nodes", {{"direction", "offload"}, {"tier", "pool"}});
  m_ok_ = &m.GetCounter("kvpool_worker_requests_total", "Finished requests", {{"status", "ok"}});
  m_failed_ = &m.GetCounter("kvpool_worker_requests_total", "Finished requests", {{"status", "error"}});
  // A client that cancelled or ran out of time is not a worker error.
  m_cancelled_ = &m.GetCounter("kvpool_worker_requests_total", "Finished requests", {{"status", "cancelled"}});
  m_usage_ = &m.GetGauge("kvpool_worker_kv_cache_usage_perc", "Fraction of KV blocks in use, [0, 1]");
  m_running_ = &m.GetGauge("kvpool_worker_num_requests_running", "Requests prefilling or decoding");
  m_waiting_ = &m.GetGauge("kvpool_worker_num_requests_waiting", "Requests queued");
  m_ttft_ = &m.GetHistogram("kvpool_worker_time_to_first_token_seconds", "TTFT", Histogram::ExponentialBounds(0.001, 2, 16));
}

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(EngineConfig config, MetricsRegistry* metrics) {
  RETURN_IF_ERROR(config.spec.Validate());
  if (config.runner.num_blocks < 2) {
    return absl::InvalidArgumentError(absl::StrCat("--num-blocks=", config.runner.num_blocks,
                                                   " leaves no usable block; give at least 2"));
  }
  config.runner.event_sink = nullptr;  // set below, once `this` exists
  config.runner.source_id = config.instance_id;
  std::unique_ptr<Engine> e(new Engine(std::move(config), metrics));
  model::RunnerOptions ro = e->cfg_.runner;
  ro.event_sink = e.get();
  if (e->cfg_.spec.computable) {
    ASSIGN_OR_RETURN(e->runner_, model::ModelRunner::Create(e->cfg_.spec, ro));
    e->block_pool_ = &e->runner_->cache().block_pool();
    if (!e->cfg_.pool_nodes.empty()) {
      const model::KvArena& arena = e->runner_->arena();
      ASSIGN_OR_RETURN(e->pool_, PoolTier::Create(
                                     PoolTierOptions{e->cfg_.pool_nodes, e->cfg_.instance_id,
                                                     e->cfg_.pool_rpc_timeout_ms, absl::Seconds(2),
                                                     absl::Milliseconds(e->cfg_.pool_transfer_timeout_ms)},
                                     std::span<std::byte>(arena.base(), static_cast<size_t>(arena.size_bytes())),
                                     static_cast<uint64_t>(arena.page_bytes())));
    }
  } else {
    // Accounting mode: the cache manager alone (no payload), times from the cost model.
    if (!e->cfg_.pool_nodes.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model '", e->cfg_.spec.name, "' runs in accounting mode (no KV bytes exist), so --pool-nodes "
          "cannot be used; drop --pool-nodes or use a tiny-* model"));
    }
    ASSIGN_OR_RETURN(cache::CacheLayout layout, cache::CacheLayout::FromModelSpec(e->cfg_.spec));
    cache::CacheConfig cc;
    cc.num_blocks = ro.num_blocks;
    cc.layout = layout;
    cc.enable_prefix_caching = ro.enable_prefix_caching;
    cc.hybrid_mode = ro.hybrid_mode;
    cc.hash_options = HashOptions{.cluster_secret = ro.cluster_secret,
                                  .model_id = e->cfg_.spec.name,
                                  .block_tokens = static_cast<uint32_t>(e->cfg_.spec.block_tokens)};
    cc.source_id = e->cfg_.instance_id;
    cc.event_sink = e.get();
    ASSIGN_OR_RETURN(e->accounting_, cache::KvCacheManager::Create(cc));
    e->block_pool_ = &e->accounting_->block_pool();
  }
  {
    absl::MutexLock l(&e->mu_);
    e->stats_.set_instance_id(e->cfg_.instance_id);
    e->stats_.set_model(e->cfg_.spec.name);
    e->stats_.set_block_tokens(static_cast<uint32_t>(e->cfg_.spec.block_tokens));
    // Usable blocks, as registered with the router and in kv_usage's denominator (block
    // 0 is the null block).
    e->stats_.set_num_gpu_blocks(static_cast<uint64_t>(e->cfg_.runner.num_blocks - 1));
    for (const char* k : {"fetched_dram", "fetched_nvme", "offloaded"}) (*e->stats_.mutable_bytes_moved_by_tier())[k] = 0;
  }
  return e;
}

Engine::~Engine() { Stop(); }

void Engine::Start() {
  absl::MutexLock l(&mu_);
  if (started_) return;
  started_ = true;
  thread_ = std::thread([this] { Loop(); });
}

void Engine::Stop() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void Engine::RefuseNew() {
  absl::MutexLock l(&mu_);
  draining_ = true;
}

void Engine::Drain(absl::Duration timeout) {
  absl::MutexLock l(&mu_);
  draining_ = true;
  if (!started_) return;
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_engine_requests_ == 0; };
  if (!mu_.AwaitWithTimeout(absl::Condition(&drained), timeout)) {
    spdlog::warn("shutdown: {} requests still in the worker after the {} drain; answering them UNAVAILABLE",
                 in_engine_requests_, absl::FormatDuration(timeout));
  }
}

absl::Status Engine::Submit(EngineRequest request, EngineDone done) {
  auto p = std::make_unique<Pending>();
  p->req = std::move(request);
  p->done = std::move(done);
  p->arrived = MonotonicNow();
  p->counted_tokens = static_cast<int64_t>(p->req.tokens.size());
  absl::MutexLock l(&mu_);
  if (stop_ || draining_ || !started_) {
    return absl::UnavailableError("the worker is shutting down; send the request elsewhere");
  }
  if (!out_of_service_.ok()) return OutOfService(out_of_service_);
  if (p->counted_tokens > cfg_.max_queued_prompt_tokens) {
    return absl::InvalidArgumentError(absl::StrCat("tokens: a prompt of ", p->counted_tokens,
                                                   " tokens is more than this worker queues at all (",
                                                   cfg_.max_queued_prompt_tokens, ", --max-queued-tokens)"));
  }
  if (in_engine_requests_ >= cfg_.max_queued_requests ||
      in_engine_tokens_ + p->counted_tokens > cfg_.max_queued_prompt_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "worker ", cfg_.instance_id, " holds ", in_engine_requests_, " requests of ", in_engine_tokens_,
        " prompt tokens (at most ", cfg_.max_queued_requests, " / ", cfg_.max_queued_prompt_tokens,
        ", --max-queued-requests / --max-queued-tokens); retry later or elsewhere"));
  }
  ++in_engine_requests_;
  in_engine_tokens_ += p->counted_tokens;
  queue_.push_back(std::move(p));
  return absl::OkStatus();
}

void Engine::SetOutOfServiceHandler(std::function<void(const absl::Status&)> on_out_of_service) {
  absl::Status already;
  {
    absl::MutexLock l(&mu_);
    if (out_of_service_.ok()) {
      on_out_of_service_ = std::move(on_out_of_service);
      return;
    }
    already = out_of_service_;
  }
  if (on_out_of_service) on_out_of_service(already);
}

absl::Status Engine::out_of_service() const {
  absl::MutexLock l(&mu_);
  return out_of_service_;
}

void Engine::Loop() {
  for (;;) {
    std::deque<std::unique_ptr<Pending>> incoming;
    {
      absl::MutexLock l(&mu_);
      const bool busy = !running_.empty() || !backlog_.empty();
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      if (!busy) mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(100));
      if (stop_) break;
      incoming.swap(queue_);
    }
    const bool arrived = !incoming.empty();
    const size_t backlog_before = backlog_.size(), running_before = running_.size();
    TakeIncoming(std::move(incoming));
    DropCancelled();
    AdmitBacklog();
    // Before a step that may run long: the heartbeat sees what came in. When nothing came,
    // left or moved, the load the last iteration set after its step still holds.
    if (arrived || backlog_.size() != backlog_before || running_.size() != running_before) UpdateLoad();
    if (runner_ != nullptr && runner_->NumUnfinished() > 0) StepOnce();
    if (cfg_.offload == OffloadMode::kWriteThrough) OffloadWriteThrough();
    if (cfg_.offload == OffloadMode::kWriteBack) ResolvePages();
    UpdateLoad();
  }
  const absl::Status down = absl::UnavailableError("the worker is shutting down");
  FailAll(down, down);
}

absl::Status Engine::OutOfService(const absl::Status& step_error) const {
  return absl::UnavailableError(absl::StrCat("worker ", cfg_.instance_id, " is out of service after a failed engine step (",
                                             step_error.message(), "); send the request elsewhere and restart it"));
}

void Engine::FailAll(const absl::Status& running_why, const absl::Status& waiting_why) {
  std::deque<std::unique_ptr<Pending>> q;
  {
    absl::MutexLock l(&mu_);
    q.swap(queue_);
  }
  for (auto& p : q) Answer(*p, waiting_why);
  for (auto& p : backlog_) Answer(*p, waiting_why);
  backlog_.clear();
  for (auto& [id, p] : running_) {
    if (runner_ != nullptr) runner_->Abort(id).IgnoreError();
    Answer(*p, running_why);
  }
  running_.clear();
}

void Engine::DropCancelled() {
  for (auto it = backlog_.begin(); it != backlog_.end();) {
    if (!(*it)->Cancelled()) {
      ++it;
      continue;
    }
    std::unique_ptr<Pending> p = std::move(*it);
    it = backlog_.erase(it);
    Answer(*p, absl::CancelledError("the client cancelled the request or its deadline passed"));
  }
  for (auto it = running_.begin(); it != running_.end();) {
    if (!it->second->Cancelled()) {
      ++it;
      continue;
    }
    if (runner_ != nullptr) runner_->Abort(it->first).IgnoreError();
    std::unique_ptr<Pending> p = std::move(it->second);
    running_.erase(it++);
    Answer(*p, absl::CancelledError("the client cancelled the request or its deadline passed"));
  }
}

void Engine::ReleaseDecision(Pending& p) {
  if (p.decision_released) return;
  p.decision_released = true;
  if (router::EventPublisher* pub = publisher_.load()) pub->CompleteDecision(p.req.decision_id);
}

void Engine::Answer(Pending& p, absl::StatusOr<v1::GenerateResponse> r) {
  {
    absl::MutexLock l(&mu_);
    --in_engine_requests_;
    in_engine_tokens_ -= p.counted_tokens;
  }
  ReleaseDecision(p);
  if (!r.ok()) (r.status().code() == absl::StatusCode::kCancelled ? m_cancelled_ : m_failed_)->Increment();
  p.done(std::move(r));
}

Engine::LocalHit Engine::FindLocalHit(const std::vector<BlockHash>& chain, int64_t usable) const {
  LocalHit hit;
  while (hit.blocks < usable && block_pool_->GetCachedBlock(chain[static_cast<size_t>(hit.blocks)]) != cache::kNoBlock) {
    ++hit.blocks;
  }
  if (cfg_.spec.IsHybrid()) {
    const int64_t every = cfg_.spec.checkpoint_tokens / cfg_.spec.block_tokens;
    for (int64_t blk = hit.blocks / every * every; blk >= every; blk -= every) {
      if (block_pool_->GetCachedCheckpoint(chain[static_cast<size_t>(blk - 1)]) != cache::kNoBlock) {
        hit.checkpoint = blk;
        break;
      }
    }
  }
  return hit;
}

int64_t Engine::TokensToCompute(const std::vector<BlockHash>& chain, int64_t n) const {
  const int64_t b = cfg_.spec.block_tokens;
  const LocalHit hit = FindLocalHit(chain, (n - 1) / b);
  const bool strict = cfg_.spec.IsHybrid() && cfg_.runner.hybrid_mode == cache::HybridHitMode::kStrict;
  return n - (strict ? hit.checkpoint : hit.blocks) * b;
}

void Engine::TakeIncoming(std::deque<std::unique_ptr<Pending>> incoming) {
  for (auto& p : incoming) {
    const int64_t n = static_cast<int64_t>(p->req.tokens.size());
    p->prefill_tokens = n;
    if (runner_ != nullptr) {
      const absl::Status bad = runner_->CheckSequence(p->req.tokens, p->req.max_new_tokens);
      if (!bad.ok()) {
        Answer(*p, bad);
        continue;
      }
      // While it waits, its load counts the prompt less the prefix cached here now (the
      // router counts a decision's tokens net of its hit; the full prompt, reported, made
      // the worker holding a prefix look the busiest). The chain is kept for Admit.
      if (cfg_.runner.enable_prefix_caching && n > cfg_.spec.block_tokens) {
        p->chain = runner_->HashPrompt(p->req.tokens, p->req.tenant_salt);
        p->prefill_tokens = TokensToCompute(p->chain, n);
      }
    }
    backlog_.push_back(std::move(p));
  }
}

void Engine::AdmitBacklog() {
  while (!backlog_.empty()) {
    const Pending& head = *backlog_.front();
    if (runner_ != nullptr &&
        !runner_->HasRoomFor(static_cast<int64_t>(head.req.tokens.size()), head.req.max_new_tokens)) {
      return;  // FIFO: later ones wait behind it
    }
    std::unique_ptr<Pending> p = std::move(backlog_.front());
    backlog_.pop_front();
    Admit(std::move(p));
  }
}

void Engine::Admit(std::unique_ptr<Pending> p) {
  p->admitted = MonotonicNow();
  if (p->Cancelled()) {
    Answer(*p, absl::CancelledError("the client cancelled the request or its deadline passed"));
    return;
  }
  if (runner_ == nullptr) {
    AdmitAccounting(*p);
    return;
  }
  const int64_t b = cfg_.spec.block_tokens;
  const int64_t n = static_cast<int64_t>(p->req.tokens.size());
  // The last prompt token is always computed (its logits give the first output token),
  // so at most (n - 1) / b blocks can be hits.
  const int64_t usable = (n - 1) / b;
  if (cfg_.runner.enable_prefix_caching && pool_ != nullptr && usable > 0 && cfg_.fetch != FetchMode::kNever) {
    const absl::Time t0 = MonotonicNow();
    const std::vector<BlockHash> chain =
        p->chain.empty() ? runner_->HashPrompt(p->req.tokens, p->req.tenant_salt) : std::move(p->chain);
    // Hybrids: the local hit reaches only as far as the last checkpoint cached here
    // (strict) or replays the KDA layers from it (replay); a pool checkpoint past it,
    // even one at or before the local hit, saves that.
    const LocalHit hit = FindLocalHit(chain, usable);
    const int64_t local = hit.blocks, local_ckpt = hit.checkpoint;
    const bool ckpt_gap = cfg_.spec.IsHybrid() && local_ckpt + cfg_.spec.checkpoint_tokens / b <= local;
    const absl::Time t1 = MonotonicNow();
    p->local_hit_s = Seconds(t1 - t0);
    p->local_tokens = local * b;
    if (local < usable || ckpt_gap) {
      p->pool_tokens = FetchFromPool(chain, local, local_ckpt, usable);
      p->pool_fetch_s = Seconds(MonotonicNow() - t1);
      // What it fetched is cached here now (blocks, or a checkpoint alone, alike).
      p->prefill_tokens = TokensToCompute(chain, n);
    } else {
      const bool strict = cfg_.spec.IsHybrid() && cfg_.runner.hybrid_mode == cache::HybridHitMode::kStrict;
      // What is cached here now (more than on arrival if the prefix came meanwhile).
      p->prefill_tokens = n - (strict ? local_ckpt : local) * b;
    }
  } else if (!p->chain.empty()) {
    p->prefill_tokens = TokensToCompute(p->chain, n);  // no pool: what is cached here now
  }
  std::vector<BlockHash>().swap(p->chain);  // not needed past admission
  model::GenerateRequest g;
  g.prompt_tokens = p->req.tokens;
  g.max_new_tokens = p->req.max_new_tokens;
  g.tenant_salt = p->req.tenant_salt;
  absl::StatusOr<model::SequenceId> id = runner_->AddSequence(std::move(g));
  if (!id.ok()) {
    Answer(*p, id.status());
    return;
  }
  running_[*id] = std::move(p);
}

int64_t Engine::FetchFromPool(const std::vector<BlockHash>& chain, int64_t local, int64_t local_ckpt,
                              int64_t usable) {
  const int64_t b = cfg_.spec.block_tokens;
  const std::span<const BlockHash> rest(chain.data() + local, static_cast<size_t>(usable - local));
  const absl::Time t0 = MonotonicNow();
  PoolLookup blocks;
  int64_t run = 0;
  if (!rest.empty()) {
    blocks = pool_->Lookup(rest, StateKind::kAttnKv, static_cast<uint64_t>(runner_->arena().page_bytes()));
    while (run < static_cast<int64_t>(rest.size()) && blocks.found[static_cast<size_t>(run)]) ++run;
  }
  // Hybrids: the KDA state at the end of the hit (local blocks and the fetched run) comes
  // from the nearest checkpoint at or before it, pool or local; replay covers the gap,
  // strict mode stops the hit at the checkpoint, so only blocks up to it are worth
  // fetching. Pool checkpoints past the local one count, at or before the local hit too.
  PoolLookup ckpts;
  std::vector<BlockHash> ckpt_hashes;
  int64_t ckpt_index = -1;  // index into ckpts.found of the checkpoint to fetch
  int64_t ckpt_blk = 0;     // its boundary, in blocks
  if (cfg_.spec.IsHybrid()) {
    const int64_t every = cfg_.spec.checkpoint_tokens / b;  // blocks per checkpoint
    const int64_t first = local_ckpt + every;               // ckpt_hashes[i] is at first + i * every
    for (int64_t blk = first; blk <= local + run; blk += every) ckpt_hashes.push_back(chain[static_cast<size_t>(blk - 1)]);
    if (!ckpt_hashes.empty()) {
      ckpts = pool_->Lookup(ckpt_hashes, StateKind::kLinearState, static_cast<uint64_t>(runner_->arena().state_bytes()));
      for (int64_t i = static_cast<int64_t>(ckpt_hashes.size()) - 1; i >= 0; --i) {
        if (ckpts.found[static_cast<size_t>(i)]) {
          ckpt_index = i;
          ckpt_blk = first + i * every;
          break;
        }
      }
    }
    if (cfg_.runner.hybrid_mode == cache::HybridHitMode::kStrict) {
      const int64_t end = ckpt_index >= 0 ? ckpt_blk : local;
      run = std::max<int64_t>(0, std::min(run, end - local));
    }
  }
  const double lookup_s = Seconds(MonotonicNow() - t0);
  int64_t fetched_tokens = 0;
  if (run > 0 || ckpt_index >= 0) {
    // The fetch moves the run's blocks and the checkpoint's state. A checkpoint alone (at
    // or before the local hit) saves the tokens from the local checkpoint to it: computed
    // again in strict mode, replayed through the KDA layers otherwise (counted as
    // computed: an upper bound on what it saves).
    const double bytes = static_cast<double>(run) * static_cast<double>(cfg_.spec.BlockBytes()) +
                         (ckpt_index >= 0 ? static_cast<double>(runner_->arena().state_bytes()) : 0.0);
    const int64_t saved_tokens = run > 0 ? run * b : (ckpt_blk - local_ckpt) * b;
    bool fetch = cfg_.fetch == FetchMode::kAlways;
    if (cfg_.fetch == FetchMode::kAuto) {
      // Measured rates; before the first measurement, fetch (it is how they get measured).
      const double fetch_s = fetch_bytes_per_s_ > 0 ? fetch_overhead_s_ + bytes / fetch_bytes_per_s_ : 0;
      const double recompute_s =
          recompute_tokens_per_s_ > 0 ? static_cast<double>(saved_tokens) / recompute_tokens_per_s_ : 1e9;
      fetch = fetch_s < recompute_s;
    }
    if (fetch) {
      // Blocks [0, local) are cached here; [local, local + run) come from the pool. A
      // checkpoint alone is imported with the blocks up to it (all cached here).
      const size_t k = static_cast<size_t>(run > 0 ? local + run : ckpt_blk);
      std::unique_ptr<bool[]> have(new bool[k]());
      for (size_t i = static_cast<size_t>(local); i < k; ++i) have[i] = true;
      std::vector<BlockHash> want_ckpt;
      if (ckpt_index >= 0) want_ckpt.push_back(ckpt_hashes[static_cast<size_t>(ckpt_index)]);
      importing_ = true;
      absl::StatusOr<model::ImportPlan> plan = runner_->BeginImport(
          std::span<const BlockHash>(chain.data(), k), std::span<const bool>(have.get(), k), want_ckpt);
      importing_ = false;
      if (plan.ok()) {
        const absl::Time g0 = MonotonicNow();
        std::vector<size_t> which;
        std::vector<std::vector<uint64_t>> dst;
        for (const model::ImportPlan::BlockSlot& s : plan->blocks) {
          which.push_back(static_cast<size_t>(s.chain_index - local));
          dst.push_back({static_cast<uint64_t>(s.page)});
        }
        absl::Status got = which.empty() ? absl::OkStatus() : pool_->Get(blocks, which, dst);
        if (got.ok() && !plan->checkpoints.empty()) {
          std::vector<size_t> cw{static_cast<size_t>(ckpt_index)};
          std::vector<std::vector<uint64_t>> cd(1);
          for (int32_t page : plan->checkpoints.front().pages) cd[0].push_back(static_cast<uint64_t>(page));
          got = pool_->Get(ckpts, cw, cd);
        }
        importing_ = true;
        absl::Status fin = runner_->FinishImport(*plan, got.ok());
        importing_ = false;
        if (!fin.ok()) spdlog::error("FinishImport: {}", std::string(fin.message()));
        if (got.ok()) {
          const double get_s = std::max(1e-6, Seconds(MonotonicNow() - g0));
          uint64_t dram = 0, nvme = 0;
          for (size_t k : which) {
            (blocks.found[k]->object.found_in == pool_node::Tier::kNvme ? nvme : dram) += blocks.found[k]->object.length;
          }
          if (!plan->checkpoints.empty()) {
            const auto& o = ckpts.found[static_cast<size_t>(ckpt_index)]->object;
            (o.found_in == pool_node::Tier::kNvme ? nvme : dram) += o.length;
          }
          // An import that moved nothing (its pages trimmed away) measures no rate: a
          // zero sample cut the average by a fifth each time, until auto mode stopped
          // fetching for good.
          if (dram + nvme > 0) {
            Ewma(fetch_bytes_per_s_, static_cast<double>(dram + nvme) / get_s);
            Ewma(fetch_overhead_s_, lookup_s);
          }
          fetched_tokens = static_cast<int64_t>(plan->blocks.size()) * b;
          m_bytes_in_dram_->Increment(static_cast<double>(dram));
          m_bytes_in_nvme_->Increment(static_cast<double>(nvme));
          absl::MutexLock l(&mu_);
          (*stats_.mutable_bytes_moved_by_tier())["fetched_dram"] += dram;
          (*stats_.mutable_bytes_moved_by_tier())["fetched_nvme"] += nvme;
        } else {
          spdlog::warn("pool fetch of {} blocks failed ({}); recomputing them", which.size(), std::string(got.message()));
        }
      } else if (!absl::IsResourceExhausted(plan.status())) {
        spdlog::warn("import of {} pool blocks refused: {}", run, std::string(plan.status().message()));
      }
    }
  }
  pool_->Release(blocks);
  pool_->Release(ckpts);
  return fetched_tokens;
}

void Engine::StepOnce() {
  write_back_in_step_ = absl::ZeroDuration();
  const absl::Time t0 = MonotonicNow();
  absl::StatusOr<std::vector<model::SequenceId>> finished = runner_->Step();
  const absl::Time t1 = MonotonicNow();
  // The step's compute: its time less the write-back Puts its evictions made (a slow pool
  // node made prefill look slow, to each request's recompute_s and to the measured prefill
  // rate that --fetch=auto weighs against a fetch).
  const absl::Duration compute = std::max(absl::ZeroDuration(), (t1 - t0) - write_back_in_step_);
  if (!finished.ok()) {
    spdlog::error("engine step failed: {}; failing every request, and the worker is out of service "
                  "(health NOT_SERVING, no heartbeats): restart it",
                  std::string(finished.status().message()));
    std::function<void(const absl::Status&)> handler;
    {
      absl::MutexLock l(&mu_);
      out_of_service_ = finished.status().ok() ? absl::InternalError("engine step failed") : finished.status();
      handler = std::move(on_out_of_service_);
      on_out_of_service_ = nullptr;
    }
    // Before the requests are answered: a client told of the failure finds the worker
    // out of service already.
    if (handler) handler(finished.status());
    // The requests in the runner get the step's error; those queued or backlogged never
    // reached it: UNAVAILABLE, as Submit answers from here on, so their clients go
    // elsewhere (the step's error may be RESOURCE_EXHAUSTED, "retry later", from here).
    FailAll(finished.status(), OutOfService(finished.status()));
    // The step cached pages its forward pass never wrote (the runner refuses further
    // work): none of what waits to be offloaded may reach the pool.
    offload_queue_.clear();
    unresolved_.clear();
    write_back_[0].clear();
    write_back_[1].clear();
    return;
  }
  int started = 0;
  for (auto& [id, p] : running_) {
    if (p->started || !runner_->Started(id)) continue;
    ++started;
    p->started = true;
    p->step_start = t0;
    p->first_token = t1;
    p->recompute_s = Seconds(compute);
    ReleaseDecision(*p);  // released already once the load counted it (UpdateLoad)
  }
  // Prefill throughput for the fetch-or-recompute choice: the step's tokens over its
  // time (one request's tokens over a step shared with others read N times too slow).
  if (started > 0 && compute > absl::ZeroDuration()) {
    Ewma(recompute_tokens_per_s_, static_cast<double>(runner_->last_step_tokens()) / Seconds(compute));
  }
  // Write-through before answering: once Generate returns, the request's full blocks
  // (and checkpoints) are in the pool, so a request sent elsewhere next can fetch them.
  if (cfg_.offload == OffloadMode::kWriteThrough) OffloadWriteThrough();
  for (model::SequenceId id : *finished) {
    auto it = running_.find(id);
    if (it == running_.end()) continue;
    std::unique_ptr<Pending> p = std::move(it->second);
    running_.erase(it);
    Respond(*p, runner_->TakeResult(id));
  }
}

HitSplit SplitPrefixHit(int64_t hit_tokens, int64_t local_tokens, int64_t fetched_tokens) {
  const int64_t pool = std::clamp<int64_t>(std::min(hit_tokens, local_tokens + fetched_tokens) - local_tokens, 0,
                                           fetched_tokens);
  return {hit_tokens - pool, pool};
}

void Engine::Respond(Pending& p, absl::StatusOr<model::GenerateResult> r) {
  if (!r.ok()) {
    Answer(p, r.status());
    return;
  }
  v1::GenerateResponse out;
  out.set_request_id(p.req.request_id);
  for (TokenId t : r->output_tokens) out.add_output_tokens(t);
  out.set_hidden_digest(r->hidden_digest.ToBytes());
  const auto [gpu_tokens, pool_tokens] = SplitPrefixHit(r->hit_tokens, p.local_tokens, p.pool_tokens);
  out.set_prompt_tokens(static_cast<uint32_t>(r->prompt_tokens));
  out.set_gpu_hit_tokens(static_cast<uint32_t>(gpu_tokens));
  out.set_pool_hit_tokens(static_cast<uint32_t>(pool_tokens));
  out.set_recomputed_tokens(static_cast<uint32_t>(r->recomputed_tokens));
  v1::TtftBreakdown* t = out.mutable_ttft();
  const double total = Seconds(p.first_token - p.arrived);
  t->set_local_hit_s(p.local_hit_s);
  t->set_pool_fetch_s(p.pool_fetch_s);
  t->set_recompute_s(p.recompute_s);
  t->set_queue_s(std::max(0.0, total - p.local_hit_s - p.pool_fetch_s - p.recompute_s));
  t->set_total_s(total);
  m_ttft_->Observe(total);
  m_ok_->Increment();
  // Queries count where hits do, once the request is answered (as GetStats does): a
  // failed or cancelled request counted queries and no hits, lowering the hit rate.
  m_queries_->Increment(static_cast<double>(r->prompt_tokens));
  m_hits_gpu_->Increment(static_cast<double>(gpu_tokens));
  m_hits_pool_->Increment(static_cast<double>(pool_tokens));
  m_fetched_->Increment(static_cast<double>(pool_tokens));
  m_recomputed_->Increment(static_cast<double>(r->recomputed_tokens));
  {
    absl::MutexLock l(&mu_);
    stats_.set_prefix_queries_tokens(stats_.prefix_queries_tokens() + static_cast<uint64_t>(r->prompt_tokens));
    stats_.set_prefix_hits_gpu_tokens(stats_.prefix_hits_gpu_tokens() + static_cast<uint64_t>(gpu_tokens));
    stats_.set_prefix_hits_pool_tokens(stats_.prefix_hits_pool_tokens() + static_cast<uint64_t>(pool_tokens));
    stats_.set_tokens_fetched(stats_.tokens_fetched() + static_cast<uint64_t>(pool_tokens));
    stats_.set_tokens_recomputed(stats_.tokens_recomputed() + static_cast<uint64_t>(r->recomputed_tokens));
  }
  Answer(p, std::move(out));
}

int64_t Engine::PagesNeeded(int64_t prompt_tokens, int64_t max_new_tokens) const {
  if (runner_ != nullptr) return runner_->PagesNeeded(prompt_tokens, max_new_tokens);
  // Accounting allocates the prompt's blocks and, for hybrids, the live KDA state and
  // (at worst, none cached yet) a checkpoint at each interval boundary of the prompt.
  const cache::CacheConfig& c = accounting_->config();
  const int64_t b = c.layout.block_tokens;
  int64_t pages = (prompt_tokens + b - 1) / b;
  if (c.layout.hybrid()) {
    const int64_t saves = c.enable_prefix_caching ? prompt_tokens / c.layout.checkpoint_tokens : 0;
    pages += (1 + saves) * c.layout.state_pages;
  }
  return pages;
}

void Engine::AdmitAccounting(Pending& p) {
  const int64_t n = static_cast<int64_t>(p.req.tokens.size());
  const cache::RequestId id = next_accounting_id_++;
  cache::RequestSpec rs;
  rs.id = id;
  rs.prompt_tokens = p.req.tokens;
  rs.tenant_salt = p.req.tenant_salt;
  absl::Status s = accounting_->AddRequest(std::move(rs));
  absl::StatusOr<cache::PrefixHit> hit = s.ok() ? accounting_->GetComputedBlocks(id) : absl::StatusOr<cache::PrefixHit>(s);
  absl::StatusOr<cache::SlotAllocation> alloc =
      hit.ok() ? accounting_->AllocateSlots(id, n - hit->num_tokens, &*hit) : absl::StatusOr<cache::SlotAllocation>(hit.status());
  if (s.ok()) accounting_->Free(id).IgnoreError();
  if (!alloc.ok()) {
    Answer(p, alloc.status());
    return;
  }
  const CostModel cost;
  const int64_t recompute = n - hit->num_tokens;
  v1::GenerateResponse out;
  out.set_request_id(p.req.request_id);
  out.set_prompt_tokens(static_cast<uint32_t>(n));
  out.set_gpu_hit_tokens(static_cast<uint32_t>(hit->num_tokens));
  out.set_recomputed_tokens(static_cast<uint32_t>(recompute));
  v1::TtftBreakdown* t = out.mutable_ttft();
  t->set_recompute_s(cost.PrefillSeconds(cfg_.spec, static_cast<double>(recompute)));
  t->set_queue_s(Seconds(p.admitted - p.arrived));
  t->set_total_s(t->queue_s() + t->recompute_s());
  m_ok_->Increment();
  m_queries_->Increment(static_cast<double>(n));
  m_hits_gpu_->Increment(static_cast<double>(hit->num_tokens));
  m_recomputed_->Increment(static_cast<double>(recompute));
  {
    absl::MutexLock l(&mu_);
    stats_.set_prefix_queries_tokens(stats_.prefix_queries_tokens() + static_cast<uint64_t>(n));
    stats_.set_prefix_hits_gpu_tokens(stats_.prefix_hits_gpu_tokens() + static_cast<uint64_t>(hit->num_tokens));
    stats_.set_tokens_recomputed(stats_.tokens_recomputed() + static_cast<uint64_t>(recompute));
  }
  Answer(p, std::move(out));
}

void Engine::OffloadWriteThrough() {
  if (pool_ == nullptr || offload_queue_.empty()) return;
  std::vector<PoolPut> items;
  for (const ToOffload& o : offload_queue_) {
    PoolPut put{o.hash, o.parent, o.kind, {}, 0};
    if (o.kind == StateKind::kAttnKv) {
      const cache::BlockId id = block_pool_->GetCachedBlock(o.hash);
      if (id == cache::kNoBlock) continue;  // evicted again already
      put.local_pages = {static_cast<uint64_t>(id)};
      put.length = static_cast<uint64_t>(runner_->arena().page_bytes());
    } else {
      const cache::BlockId head = block_pool_->GetCachedCheckpoint(o.hash);
      if (head == cache::kNoBlock) continue;
      for (cache::BlockId pg : block_pool_->RunPages(head)) put.local_pages.push_back(static_cast<uint64_t>(pg));
      put.length = static_cast<uint64_t>(runner_->arena().state_bytes());
    }
    items.push_back(std::move(put));
  }
  offload_queue_.clear();
  const uint64_t written = pool_->Put(items);
  m_bytes_out_->Increment(static_cast<double>(written));
  absl::MutexLock l(&mu_);
  (*stats_.mutable_bytes_moved_by_tier())["offloaded"] += written;
}

void Engine::ResolvePages() {
  for (const ToOffload& o : unresolved_) {
    // Not cached any more: it was cached and evicted within one step (never put).
    if (o.kind == StateKind::kAttnKv) {
      if (!block_pool_->IsCached(o.hash, StateKind::kAttnKv)) continue;
      write_back_[0][o.hash] = WriteBack{o.parent, {}};
    } else {
      const cache::BlockId head = block_pool_->GetCachedCheckpoint(o.hash);
      if (head == cache::kNoBlock) continue;
      WriteBack& w = write_back_[1][o.hash];
      w = WriteBack{std::nullopt, {}};
      for (cache::BlockId pg : block_pool_->RunPages(head)) w.pages.push_back(static_cast<uint64_t>(pg));
    }
  }
  unresolved_.clear();
}

void Engine::Publish(absl::string_view /*source_id*/, const cache::KvEvent& event) {
  // 1. The router: one v1 event per cache event.
  v1::KvEvent e;
  switch (event.type) {
    case cache::KvEvent::Type::kStored: {
      v1::BlockStored* s = e.mutable_stored();
      if (event.parent) s->set_parent_hash(event.parent->ToBytes());
      for (const BlockHash& h : event.hashes) s->add_block_hashes(h.ToBytes());
      s->set_kind(ToProto(event.kind));
      s->set_tier(v1::TIER_GPU);
      break;
    }
    case cache::KvEvent::Type::kRemoved: {
      v1::BlockRemoved* r = e.mutable_removed();
      for (const BlockHash& h : event.hashes) r->add_block_hashes(h.ToBytes());
      r->set_kind(ToProto(event.kind));
      r->set_tier(v1::TIER_GPU);
      break;
    }
    case cache::KvEvent::Type::kCleared:
      e.mutable_cleared();
      break;
  }
  {
    absl::MutexLock l(&mu_);
    const int k = KindIndex(event.kind);
    if (event.type == cache::KvEvent::Type::kStored) {
      std::optional<BlockHash> parent = event.parent;
      for (const BlockHash& h : event.hashes) {
        mirror_[k][h] = MirrorEntry{parent};
        if (event.kind == StateKind::kAttnKv) parent = h;
      }
    } else if (event.type == cache::KvEvent::Type::kRemoved) {
      for (const BlockHash& h : event.hashes) mirror_[k].erase(h);
    } else {
      mirror_[0].clear();
      mirror_[1].clear();
    }
  }
  if (router::EventPublisher* pub = publisher_.load()) pub->Publish(std::move(e));

  // 2. Offload bookkeeping.
  if (pool_ == nullptr || cfg_.offload == OffloadMode::kOff) return;
  if (event.type == cache::KvEvent::Type::kStored) {
    if (importing_) return;  // came from the pool
    std::optional<BlockHash> parent = event.parent;
    for (const BlockHash& h : event.hashes) {
      ToOffload o{h, event.kind == StateKind::kAttnKv ? parent : std::nullopt, event.kind};
      (cfg_.offload == OffloadMode::kWriteThrough ? offload_queue_ : unresolved_).push_back(o);
      if (event.kind == StateKind::kAttnKv) parent = h;
    }
    return;
  }
  if (cfg_.offload != OffloadMode::kWriteBack) return;
  if (event.type == cache::KvEvent::Type::kCleared) {
    write_back_[0].clear();
    write_back_[1].clear();
    return;
  }
  // Write-back: the last copy of these hashes is being dropped; its page still holds
  // the bytes (a reused page is only written after this call returns), so put now.
  // For attn blocks that page is the one the event names, not the page of the copy
  // first cached: older copies may have been reused (silently) since.
  const int k = KindIndex(event.kind);
  const bool attn = event.kind == StateKind::kAttnKv;
  std::vector<PoolPut> items;
  for (size_t i = 0; i < event.hashes.size(); ++i) {
    const BlockHash& h = event.hashes[i];
    auto it = write_back_[k].find(h);
    if (it == write_back_[k].end()) continue;  // imported, or cached and evicted within one step
    std::vector<uint64_t> pages = std::move(it->second.pages);
    if (attn) {
      if (i >= event.pages.size()) {
        spdlog::error("removed event without the page of block {}; not written back", h.ToHex());
        write_back_[k].erase(it);
        continue;
      }
      pages = {static_cast<uint64_t>(event.pages[i])};
    }
    items.push_back(PoolPut{h, it->second.parent, event.kind, std::move(pages),
                            static_cast<uint64_t>(attn ? runner_->arena().page_bytes() : runner_->arena().state_bytes())});
    write_back_[k].erase(it);
  }
  if (items.empty()) return;
  // Put during a step (the eviction that makes room for its requests): not prefill work,
  // so StepOnce takes it out of the step's time.
  const absl::Time put_start = MonotonicNow();
  if (cfg_.before_write_back) cfg_.before_write_back();
  const uint64_t written = pool_->Put(items);
  write_back_in_step_ += MonotonicNow() - put_start;
  m_bytes_out_->Increment(static_cast<double>(written));
  absl::MutexLock l(&mu_);
  (*stats_.mutable_bytes_moved_by_tier())["offloaded"] += written;
}

std::vector<v1::KvEvent> Engine::DumpEvents() const {
  std::vector<v1::KvEvent> out;
  absl::MutexLock l(&mu_);
  for (int k = 0; k < 2; ++k) {
    for (const auto& [h, m] : mirror_[k]) {
      v1::KvEvent e;
      v1::BlockStored* s = e.mutable_stored();
      if (m.parent) s->set_parent_hash(m.parent->ToBytes());
      s->add_block_hashes(h.ToBytes());
      s->set_kind(k == 1 ? v1::STATE_KIND_LINEAR_STATE : v1::STATE_KIND_ATTN_KV);
      s->set_tier(v1::TIER_GPU);
      out.push_back(std::move(e));
    }
  }
  return out;
}

void Engine::UpdateLoad() {
  const cache::CacheUsage u = runner_ ? runner_->cache().Usage() : accounting_->Usage();
  const int waiting_runner = runner_ ? runner_->NumWaiting() : 0;
  uint64_t queued_tokens = 0;
  for (const auto& [id, p] : running_) {
    if (!p->started) queued_tokens += static_cast<uint64_t>(p->prefill_tokens);
  }
  const double usage = u.total_blocks > 0 ? static_cast<double>(u.used_blocks) / u.total_blocks : 0;
  m_usage_->Set(usage);
  for (const auto& p : backlog_) queued_tokens += static_cast<uint64_t>(p->prefill_tokens);
  // Every request in the engine counts in the load set here, which the next heartbeat
  // reports: its routing decision is released by that same heartbeat (the publisher
  // takes the completed decisions before it reads the load). Released only at prefill's
  // end, the router counted such a request twice meanwhile: in the reported load and in
  // flight.
  std::vector<uint64_t> release;
  auto take = [&release](Pending& p) {
    if (p.decision_released) return;
    p.decision_released = true;
    if (p.req.decision_id != 0) release.push_back(p.req.decision_id);
  };
  {
    absl::MutexLock l(&mu_);
    // Not taken in yet (the next loop iteration does): their whole prompts.
    for (const auto& p : queue_) queued_tokens += p->req.tokens.size();
    load_.set_running_requests(static_cast<uint32_t>(running_.size()) - static_cast<uint32_t>(waiting_runner));
    load_.set_waiting_requests(
        static_cast<uint32_t>(waiting_runner + static_cast<int>(backlog_.size()) + static_cast<int>(queue_.size())));
    load_.set_queued_prefill_tokens(queued_tokens);
    load_.set_kv_usage(usage);
    stats_.set_kv_usage(usage);
    m_running_->Set(load_.running_requests());
    m_waiting_->Set(load_.waiting_requests());
    for (auto& p : queue_) take(*p);
  }
  for (auto& p : backlog_) take(*p);
  for (auto& [id, p] : running_) take(*p);
  if (router::EventPublisher* pub = publisher_.load()) {
    for (uint64_t d : release) pub->CompleteDecision(d);
  }
}

v1::WorkerStats Engine::Stats() const {
  absl::MutexLock l(&mu_);
  v1::WorkerStats s = stats_;
  *s.mutable_load() = load_;
  return s;
}

v1::Load Engine::Load() const {
  absl::MutexLock l(&mu_);
  return load_;
}

std::string Engine::Describe() {
  const ModelSpec& s = cfg_.spec;
  std::string out;
  const int64_t usable = cfg_.runner.num_blocks - 1;
  absl::StrAppend(&out, "  model          ", s.name, runner_ ? " (computed on the CPU kernels, seeded weights)"
                                                          : " (accounting mode: cost-model times, no math)", "\n");
  absl::StrAppend(&out, "  layers         ", s.NumLayers(), " (gqa ", s.NumLayers(AttentionKind::kGqa), ", mla ",
                  s.NumLayers(AttentionKind::kMla), ", kda ", s.NumLayers(AttentionKind::kKda), ")\n");
  absl::StrAppend(&out, "  block size     ", s.block_tokens, " tokens\n");
  absl::StrAppend(&out, "  KV blocks      ", usable, " usable (+1 null) x ", FormatBytes(static_cast<double>(s.BlockBytes())),
                  " = ", FormatBytes(static_cast<double>(usable * s.BlockBytes())), " GPU tier (",
                  runner_ ? "host memory on this CPU worker" : "metadata only", "), max ", usable * s.block_tokens,
                  " tokens\n");
  absl::StrAppend(&out, "  bytes/token    ", s.KvBytesPerToken(), " (", FormatBytes(static_cast<double>(s.KvBytesPerToken())), ")\n");
  if (s.IsHybrid()) {
    absl::StrAppend(&out, "  KDA state      ", FormatBytes(static_cast<double>(s.FixedStateBytes())),
                    " per sequence; checkpoint every ", s.checkpoint_tokens, " tokens; hit mode ",
                    cache::HybridHitModeName(cfg_.runner.hybrid_mode), "\n");
  } else {
    absl::StrAppend(&out, "  KDA state      none (no checkpoints)\n");
  }
  absl::StrAppend(&out, "  prefix cache   ", cfg_.runner.enable_prefix_caching ? "on" : "off", "; max running ",
                  cfg_.runner.max_running, ", max model len ", cfg_.runner.max_model_len, "\n");
  if (pool_) {
    absl::StrAppend(&out, "  pool nodes     ", pool_->num_nodes(), " (offload ", OffloadModeName(cfg_.offload), ", fetch ",
                    FetchModeName(cfg_.fetch), ", rendezvous placement)\n", pool_->Describe());
  } else {
    absl::StrAppend(&out, "  pool nodes     none\n");
  }
  return out;
}

}  // namespace kvpool::worker
