// Engine: the worker's serving loop. One engine thread owns the model runner (or, for
// real-shape presets, a metadata-only cache manager: accounting mode), the pool tier
// and all cache state; gRPC handlers only Submit requests and wait for their callback.
//
//   Submit ─► queue ─► engine thread:
//     admit     local prefix (cache manager) ─► pool Lookup of the rest ─► fetch or
//               recompute (cost model, measured rates) ─► BeginImport / Get into the
//               arena pages / FinishImport ─► runner.AddSequence
//     step      runner.Step(): admissions + one decode token for every running sequence
//     offload   write-through: blocks and KDA checkpoints cached by the step go to their
//               pool node (before the step's finished requests are answered, so a
//               finished request's blocks are in the pool); write-back: evicted blocks
//               go there from the eviction event, before their page is reused
//     respond   finished sequences: tokens, digest, TTFT breakdown
//   cache events ─► router publisher (stored / removed, tier GPU) + the dump mirror
//
// Thread safety: Submit, Stats, Load, DumpEvents are thread-safe; everything else runs
// on the engine thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/metrics/metrics.h"
#include "kvpool/router/event_publisher.h"
#include "kvpool/v1/worker.pb.h"
#include "kvpool/worker/cache/kv_cache_manager.h"
#include "kvpool/worker/model/model_runner.h"

namespace kvpool::worker {

class PoolTier;

enum class OffloadMode : uint8_t { kOff, kWriteThrough, kWriteBack };
enum class FetchMode : uint8_t { kAuto, kAlways, kNever };
absl::StatusOr<OffloadMode> ParseOffloadMode(absl::string_view s);
absl::StatusOr<FetchMode> ParseFetchMode(absl::string_view s);
absl::string_view OffloadModeName(OffloadMode m);
absl::string_view FetchModeName(FetchMode m);

struct EngineConfig {
  ModelSpec spec;
  model::RunnerOptions runner;  // num_blocks, max_model_len, max_running, caching, threads
  std::string instance_id = "worker";
  std::vector<std::string> pool_nodes;  // empty: no pool tier
  OffloadMode offload = OffloadMode::kWriteThrough;
  FetchMode fetch = FetchMode::kAuto;
  int pool_rpc_timeout_ms = 2000;
  int pool_transfer_timeout_ms = 10'000;
  // Requests in the engine (queued or running) and their prompt tokens, at most: Submit
  // refuses more with RESOURCE_EXHAUSTED (a client retries later or elsewhere) instead
  // of queueing without bound.
  int64_t max_queued_requests = 4096;
  int64_t max_queued_prompt_tokens = int64_t{1} << 26;
  // Fault injection (tests): runs right before each write-back Put, on the engine thread
  // (e.g. sleeps, as a slow pool node would).
  std::function<void()> before_write_back;
};

struct EngineRequest {
  std::string request_id;
  std::vector<TokenId> tokens;
  int32_t max_new_tokens = 16;  // 0..4096 (0: prefill only)
  std::string tenant_salt;
  uint64_t decision_id = 0;
  // Set by the caller (any thread) when nobody waits for the answer any more: the engine
  // drops the request at its next iteration, queued or running, freeing its pages and
  // its running slot, and answers CANCELLED. Null: never cancelled.
  std::shared_ptr<std::atomic<bool>> cancelled;
};

using EngineDone = std::function<void(absl::StatusOr<v1::GenerateResponse>)>;

// How a request's prefix hit of `hit_tokens` (the runner's, at its prefill step) splits
// into local (GPU) and pool tokens. At admission the local cache held `local_tokens` of
// the prompt's prefix and `fetched_tokens` more were imported from the pool right after
// them. The hit is a prefix: blocks evicted before the step (imported or local) shorten
// it from the end, blocks other requests cached meanwhile lengthen it, and those are local.
struct HitSplit {
  int64_t gpu_tokens = 0;
  int64_t pool_tokens = 0;
};
HitSplit SplitPrefixHit(int64_t hit_tokens, int64_t local_tokens, int64_t fetched_tokens);

class Engine : public cache::KvEventSink {
 public:
  static absl::StatusOr<std::unique_ptr<Engine>> Create(EngineConfig config, MetricsRegistry* metrics);
  ~Engine() override;

  void Start();
  // Fails every queued and running request with UNAVAILABLE and joins the thread.
  void Stop();
  // From now on Submit answers UNAVAILABLE (shutting down).
  void RefuseNew();
  // RefuseNew, then waits until the requests already in the engine are answered, at most
  // `timeout`.
  void Drain(absl::Duration timeout);
  // Queues a request; `done` runs on the engine thread when it finishes or fails.
  // INVALID_ARGUMENT (naming the field), UNAVAILABLE (stopped, out of service) or
  // RESOURCE_EXHAUSTED (max_queued_requests / max_queued_prompt_tokens) come back directly.
  absl::Status Submit(EngineRequest request, EngineDone done);

  v1::WorkerStats Stats() const;
  v1::Load Load() const;
  // Every object the worker caches, as `stored` events (the router's full dump).
  std::vector<v1::KvEvent> DumpEvents() const;
  // Not owned; may be set while the engine runs. Null: no router.
  void SetPublisher(router::EventPublisher* publisher) { publisher_.store(publisher); }
  // After a failed step the model runner refuses all further work (its cache may name
  // pages the step never wrote): the engine is then out of service, Submit answers
  // UNAVAILABLE, and `on_out_of_service` runs once, on the engine thread with no engine
  // lock held (at once, on this thread, when it already is). The worker server turns its
  // health to NOT_SERVING and stops its heartbeats, so the router routes elsewhere.
  void SetOutOfServiceHandler(std::function<void(const absl::Status&)> on_out_of_service);
  // OK while in service; else the failed step's error.
  absl::Status out_of_service() const;
  // The configuration, as printed at start. Call before Start (it asks the pool nodes).
  std::string Describe();

  const ModelSpec& spec() const { return cfg_.spec; }
  bool accounting() const { return runner_ == nullptr; }
  int64_t num_blocks() const { return cfg_.runner.num_blocks; }
  // KV pages a request of `prompt_tokens` that generates `max_new_tokens` holds at most:
  // the runner's count; in accounting mode the prompt's blocks, and for hybrid presets
  // the KDA state and checkpoint pages. One needing more than num_blocks() - 1 can never
  // run here.
  int64_t PagesNeeded(int64_t prompt_tokens, int64_t max_new_tokens) const;

  // A routed request refused before the engine took it (its RPC failed validation, or
  // Submit refused it): the router's decision for it is over too (reported with the next heartbeat, like the
  // engine's own). 0 (not routed) is ignored. Thread-safe.
  void ReleaseRefusedDecision(uint64_t decision_id) {
    if (router::EventPublisher* pub = publisher_.load()) pub->CompleteDecision(decision_id);
  }

  // cache::KvEventSink: called inside cache manager calls on the engine thread.
  void Publish(absl::string_view source_id, const cache::KvEvent& event) override;

 private:
  struct Pending {
    EngineRequest req;
    EngineDone done;
    absl::Time arrived;
    absl::Time admitted;      // left the engine queue
    absl::Time step_start;    // the step that computed its prompt
    absl::Time first_token;
    double local_hit_s = 0;
    double pool_fetch_s = 0;
    double recompute_s = 0;
    int64_t local_tokens = 0;  // prompt prefix in the local cache at admission (before fetching)
    int64_t pool_tokens = 0;   // prompt tokens fetched from pool nodes (after local_tokens)
    bool started = false;
    bool decision_released = false;  // CompleteDecision sent (counted in the load, or ended)
    int64_t counted_tokens = 0;      // in in_engine_tokens_ until answered
    // Prompt tokens it is expected to compute (the load's queued_prefill_tokens): all but
    // its prefix cached here when it arrived, then (after a fetch) its local and fetched
    // hit once admitted. An estimate.
    int64_t prefill_tokens = 0;
    std::vector<BlockHash> chain;    // its prompt's block hashes from arrival to admission
    bool Cancelled() const { return req.cancelled != nullptr && req.cancelled->load(std::memory_order_relaxed); }
  };
  struct MirrorEntry {
    std::optional<BlockHash> parent;
  };

  explicit Engine(EngineConfig config, MetricsRegistry* metrics);
  void Loop();
  // Requests taken from queue_ wait in backlog_ (FIFO) until the runner has room to
  // start them at the next step (ModelRunner::HasRoomFor); only then are they admitted:
  // their local hit looked up, their pool blocks fetched, their sequence added. A prefix
  // fetched for a request that then waited behind running ones would sit in the cache
  // as free blocks the running sequences' allocations evict: fetched, then recomputed.
  // Requests the runner would refuse (sizes, token ids) are answered at once.
  void TakeIncoming(std::deque<std::unique_ptr<Pending>> incoming);
  // Blocks of `chain[0, usable)` cached here from the start, and the last KDA checkpoint
  // boundary among them (hybrids; 0 otherwise), in blocks.
  struct LocalHit {
    int64_t blocks = 0;
    int64_t checkpoint = 0;
  };
  LocalHit FindLocalHit(const std::vector<BlockHash>& chain, int64_t usable) const;
  // Prompt tokens of `n` left to compute with what is cached here now: all but the local
  // hit (strict hybrids: up to its last checkpoint; the last token always).
  int64_t TokensToCompute(const std::vector<BlockHash>& chain, int64_t n) const;
  void AdmitBacklog();
  void Admit(std::unique_ptr<Pending> p);
  void AdmitAccounting(Pending& p);
  // Looks the prompt's blocks beyond the local hit up in the pool and lands the ones
  // worth fetching in the arena; for hybrids also the latest KDA checkpoint past the
  // local one (`local_ckpt_blocks`: the last boundary at or before the local hit whose
  // checkpoint is cached here, 0 for none), even at or before the local hit. Returns
  // prompt tokens fetched.
  int64_t FetchFromPool(const std::vector<BlockHash>& chain, int64_t local_blocks, int64_t local_ckpt_blocks,
                        int64_t usable_blocks);
  void StepOnce();
  void Respond(Pending& p, absl::StatusOr<model::GenerateResult> r);
  void OffloadWriteThrough();
  void ResolvePages();  // write-back: page of every newly cached object
  void UpdateLoad();
  // Answers every request: those in the runner with `running_why`, the queued and the
  // backlogged ones (never started) with `waiting_why`.
  void FailAll(const absl::Status& running_why, const absl::Status& waiting_why);
  // What a request gets from a worker whose step failed with `step_error`.
  absl::Status OutOfService(const absl::Status& step_error) const;
  // Backlogged, running or runner-queued requests whose caller gave up: aborted,
  // answered CANCELLED.
  void DropCancelled();
  // Tells the router its decision for `p` is over: the request ended (answered, failed,
  // cancelled). UpdateLoad releases it earlier, once the load it sets counts the request.
  // Once per request; decision_id 0 (not routed) is ignored.
  void ReleaseDecision(Pending& p);
  // Every answer goes through here: releases the decision, counts failures, calls done.
  void Answer(Pending& p, absl::StatusOr<v1::GenerateResponse> r);

  const EngineConfig cfg_;
  MetricsRegistry* metrics_;
  std::unique_ptr<model::ModelRunner> runner_;         // computable specs
  std::unique_ptr<cache::KvCacheManager> accounting_;  // real-shape specs
  std::unique_ptr<PoolTier> pool_;
  std::atomic<router::EventPublisher*> publisher_{nullptr};
  const cache::BlockPool* block_pool_ = nullptr;

  // Engine thread only.
  std::deque<std::unique_ptr<Pending>> backlog_;
  absl::flat_hash_map<model::SequenceId, std::unique_ptr<Pending>> running_;
  struct ToOffload {
    BlockHash hash;
    std::optional<BlockHash> parent;
    StateKind kind;
  };
  std::vector<ToOffload> offload_queue_;  // write-through: cached since the last offload
  std::vector<ToOffload> unresolved_;     // write-back: pages not looked up yet
  // Write-back, by kind: objects computed here (imports are already in the pool) and
  // still cached, with what their Put needs. Attn blocks carry no page: one hash may
  // have several copies whose pages are reused silently until the last goes, so the
  // page comes from the removed event (the last copy's). Checkpoints have one run.
  struct WriteBack {
    std::optional<BlockHash> parent;  // kAttnKv only; a checkpoint's is nullopt
    std::vector<uint64_t> pages;      // kLinearState: the run's pages, head first
  };
  absl::flat_hash_map<BlockHash, WriteBack> write_back_[2];
  bool importing_ = false;  // events of an import are pool copies: not offloaded again
  double recompute_tokens_per_s_ = 0;  // EWMA of measured prefill throughput
  absl::Duration write_back_in_step_;  // engine thread: write-back Puts during the current step
  double fetch_bytes_per_s_ = 0;       // EWMA of measured pool Get throughput
  double fetch_overhead_s_ = 0.002;    // EWMA of Lookup + Get fixed cost
  uint64_t next_accounting_id_ = 1;

  mutable absl::Mutex mu_;
  int64_t in_engine_requests_ ABSL_GUARDED_BY(mu_) = 0;  // submitted, not yet answered
  int64_t in_engine_tokens_ ABSL_GUARDED_BY(mu_) = 0;    // their prompt tokens
  absl::Status out_of_service_ ABSL_GUARDED_BY(mu_);
  std::function<void(const absl::Status&)> on_out_of_service_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<Pending>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;  // Drain: Submit refuses
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  v1::WorkerStats stats_ ABSL_GUARDED_BY(mu_);
  v1::Load load_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<BlockHash, MirrorEntry> mirror_[2] ABSL_GUARDED_BY(mu_);  // by kind
  std::thread thread_;

  // Metrics (lock-free).
  Counter* m_queries_;
  Counter* m_hits_gpu_;
  Counter* m_hits_pool_;
  Counter* m_fetched_;
  Counter* m_recomputed_;
  Counter* m_bytes_in_dram_;
  Counter* m_bytes_in_nvme_;
  Counter* m_bytes_out_;
  Counter* m_ok_;
  Counter* m_failed_;
  Counter* m_cancelled_;
  Gauge* m_usage_;
  Gauge* m_running_;
  Gauge* m_waiting_;
  Histogram* m_ttft_;
};

}  // namespace kvpool::worker
