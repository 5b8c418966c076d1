// RouterHost: RouterCore made safe to share between RPC threads, with bounded event
// queues, a maintenance loop and Prometheus metrics. No gRPC types: the gRPC service
// (router_service.cc) only converts protos and delegates here.
//
// Events do not apply on RPC threads. A stream hands its batch to Enqueue and gets a
// callback once it is applied; the stream reads its next batch only then, so each stream
// has at most one batch queued (gRPC flow control pushes back on the sender) and at most
// max_streams streams exist. One applier thread drains the queue in arrival order and
// applies batches, full dumps included, in slices of apply_slice_events events (and at
// most apply_slice_hashes hashes),
// releasing the core lock between slices: a flood of events or a dump of a million
// blocks delays Route by one slice at a time (a dump's first slice also drops the
// source's old entries, one scan of the index). A large batch is
// validated whole first, without the lock, so a bad event late in it applies nothing;
// its slices are not validated again under the lock.
//
//   stream ─Enqueue─► [queue ≤ max_streams batches] ─applier─► core (slices) ─► done(result)
//   Route ───────────────────────────────────────────────────► core (one lock hold)
//
// A stream belongs to one registration of its source: the one its batches name
// (EventBatch.registration, from Register), else the one current when its first batch
// was read (RegistrationOf). A source that registers again is a new incarnation with
// a new stream; what its old stream still delivers, or had queued, or a batch whose
// slices are still applying, describes the old incarnation, so every slice checks the
// registration under the core lock and such work fails with ABORTED instead of landing
// in the new one's view (where its sequence numbers could even look valid).
//
// Thread safety: all public methods are thread-safe and never block for longer than one
// core operation (one Route, or one slice of events).
#pragma once

#include <deque>
#include <functional>
#include <memory>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kvpool/metrics/metrics.h"
#include "kvpool/router/router_core.h"

namespace kvpool::router {

struct RouterHostOptions {
  RouterOptions core;
  size_t max_streams = 1024;          // concurrent PublishEvents streams
  size_t apply_slice_events = 256;    // events applied per core lock hold, at most
  size_t apply_slice_hashes = 16384;  // and their hashes, at most (a slice holds >= 1 event)
  absl::Duration tick_interval = absl::Milliseconds(100);
};

class RouterHost {
 public:
  using Clock = std::function<absl::Time()>;
  using Done = std::function<void(absl::StatusOr<EventsResult>)>;

  // `metrics` may be null; otherwise it must outlive the host. `clock` defaults to MonotonicNow
  // (kvpool/common/clock.h: wall-clock steps move no heartbeat or decision timeout). The
  // host reads it before taking its core lock, never under it: a test clock may be any code.
  static absl::StatusOr<std::unique_ptr<RouterHost>> Create(RouterHostOptions options,
                                                            MetricsRegistry* metrics, Clock clock = nullptr);
  ~RouterHost();  // stops the applier; pending batches complete with UNAVAILABLE

  // Only for RouterCore's thread-safe const part (FindModel, HashTokens), which reads what
  // Create fixed: the one use of core_ without core_mu_, so the analysis is off here.
  const RouterCore& core_for_hashing() const ABSL_NO_THREAD_SAFETY_ANALYSIS { return *core_; }
  const RouterHostOptions& options() const { return options_; }

  absl::StatusOr<RouteDecision> Route(const RouteInput& in);
  // The registration's number (RegisterResponse.registration): a stream that carries it
  // belongs to this registration (see Enqueue).
  absl::StatusOr<uint64_t> Register(const SourceInfo& info);
  // Drops the source now (RouterCore::Deregister); with `registration` != 0 only if that
  // registration is still the current one (else NOT_FOUND, nothing dropped).
  absl::Status Unregister(absl::string_view source_id, uint64_t registration);
  HeartbeatResult Heartbeat(absl::string_view source_id, const InstanceLoad& load,
                            std::span<const uint64_t> completed);
  RouterStatsSnapshot Stats();

  // Stream bookkeeping: RESOURCE_EXHAUSTED beyond max_streams.
  absl::Status OpenStream();
  void CloseStream();
  // The current registration of `source_id` (RouterCore::Registration::id), 0 when it is
  // not registered. A stream takes it with its first batch and passes it to Enqueue with
  // every batch.
  uint64_t RegistrationOf(absl::string_view source_id);
  // A stream of that registration ended without its client's clean half-close (cancelled,
  // cut, or finished with an error): RouterCore::StreamLost, so the source's next
  // heartbeat asks for a full dump.
  void StreamLost(absl::string_view source_id, uint64_t registration);
  // Queues one batch of `source_id`'s registration `registration`; `done` runs on the
  // applier thread once it is applied, or failed: NOT_FOUND when the source is not
  // registered (or was not when the stream began), ABORTED once it has registered again
  // (the stream is stale: send on a stream opened after the latest Register, dump first).
  void Enqueue(std::string source_id, uint64_t registration, EventBatch batch, Done done);

 private:
  struct Work {
    std::string source_id;
    uint64_t registration;  // 0: the source was not registered when its stream began
    EventBatch batch;
    Done done;
    absl::Time enqueued;
  };
  RouterHost(RouterHostOptions options, MetricsRegistry* metrics, Clock clock);
  void ApplierLoop();
  // `*applied` counts the events that landed, also when a later slice fails.
  absl::StatusOr<EventsResult> Apply(Work& w, uint64_t* applied);
  // The source's registration, if it is still the one `w` was queued under.
  absl::StatusOr<RouterCore::Registration> CheckRegistration(const Work& w)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(core_mu_);
  void RefreshGauges();

  const RouterHostOptions options_;
  MetricsRegistry* const metrics_;
  const Clock clock_;
  absl::Mutex core_mu_;  // held for one core call
  // Set in Create, before the applier starts; the core is used under core_mu_ only, but
  // for core_for_hashing().
  std::unique_ptr<RouterCore> core_ ABSL_PT_GUARDED_BY(core_mu_);

  absl::Mutex queue_mu_;
  std::deque<Work> queue_ ABSL_GUARDED_BY(queue_mu_);
  size_t streams_ ABSL_GUARDED_BY(queue_mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(queue_mu_) = false;

  // Metrics (owned by the registry).
  Counter* decisions_[kNumPolicies] = {};
  Counter* hit_gpu_ = nullptr;
  Counter* hit_pool_ = nullptr;
  Counter* requested_blocks_ = nullptr;
  Counter* route_errors_ = nullptr;
  Counter* events_applied_ = nullptr;
  Counter* dropped_sources_ = nullptr;
  Histogram* event_lag_ = nullptr;
  uint64_t scrape_hook_ = 0;  // metrics_'s hook reading this host (removed first when it goes)
  Histogram* route_latency_ = nullptr;
  Gauge* queued_batches_ = nullptr;

  std::thread applier_;  // last: starts after everything above exists
};

}  // namespace kvpool::router
