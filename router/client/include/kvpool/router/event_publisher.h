// EventPublisher: how a source (a worker or a pool node) keeps the router's index of it
// current. One background thread:
//
//   Publish(event) --> queue --thread--> Router.PublishEvents (one client stream,
//                                         per-source sequence numbers 1, 2, 3, ...)
//   every heartbeat interval ----------> Router.Heartbeat (load, completed decisions)
//
// The thread registers the source, opens a PublishEvents stream and first sends a full
// dump (options.dump(): every object the source holds, as `stored` events), then the
// queued events. A broken stream, a heartbeat answering unknown_source (the router
// restarted) or max_heartbeat_failures heartbeat errors in a row make it register again
// and re-dump; one failed heartbeat (a timeout, a blip) is retried at the next interval,
// because registering again makes the router forget the source until the dump lands. A
// heartbeat asking for a full dump gets one on the open stream, without registering.
// Without a router the source runs on: events are only queued while a stream is up,
// since the next dump replaces them.
//
// A router that stops reading (hung, SIGSTOPped, host gone without a reset) cannot hold
// the thread forever: the channel sends keepalive pings, so a dead peer breaks the
// stream after keepalive_time + keepalive_timeout, and ~EventPublisher cancels the
// stream, so a Write blocked on HTTP/2 flow control returns at once.
//
// Example (a worker):
//   EventPublisherOptions o;
//   o.router_address = "127.0.0.1:50051";
//   o.registration.set_source_id("worker-0");
//   o.registration.set_kind(v1::SOURCE_KIND_WORKER);
//   o.dump = [&] { return mirror.DumpEvents(); };   // thread-safe snapshot
//   o.load = [&] { return engine.Load(); };
//   EventPublisher pub(std::move(o));
//   pub.Start();
//   pub.Publish(stored_event);
//
// Thread safety: Publish / CompleteDecision / the counters may be called from any
// thread (they take one mutex, never block on the network). dump and load are called
// from the publisher thread with no publisher lock held.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvpool/v1/router.grpc.pb.h"

namespace kvpool::router {

struct EventPublisherOptions {
  std::string router_address;          // host:port
  v1::RegisterRequest registration;    // source_id, kind, address, model, capacity (publishes_events: set)
  // Every object the source holds now, as `stored` events (sequence left 0). Required.
  std::function<std::vector<v1::KvEvent>()> dump;
  // The load sent with each heartbeat; optional (no load field when unset).
  std::function<v1::Load()> load;
  absl::Duration rpc_timeout = absl::Seconds(2);
  // Between failed Register attempts, and before registering again after the router
  // refused the event stream (RESOURCE_EXHAUSTED: at its --max-streams) or aborted it.
  absl::Duration retry_interval = absl::Seconds(1);
  // Heartbeat RPC errors in a row (DEADLINE_EXCEEDED, UNAVAILABLE, ...) before the
  // publisher gives up on the stream and registers again; fewer are retried.
  int max_heartbeat_failures = 3;
  // HTTP/2 keepalive on the router channel. The router accepts pings at most every 5 s
  // (router_service.cc), so keep keepalive_time >= 5 s.
  absl::Duration keepalive_time = absl::Seconds(10);
  absl::Duration keepalive_timeout = absl::Seconds(5);
  // Stop (and the destructor) unregisters the source (Router.Unregister, at most
  // unregister_timeout), so the router stops routing to it at once rather than after
  // its heartbeat timeout.
  bool unregister_on_stop = true;
  absl::Duration unregister_timeout = absl::Seconds(1);
  // A batch on the stream ends at 65536 events or once its encoded bytes would pass this
  // (at least one event each; one event of 4096 hashes is ~74 KB). It must stay
  // under the router's largest message (kvpool-router --max-message-bytes, 128 MiB by
  // default): a batch beyond it breaks the stream at every attempt.
  size_t max_batch_bytes = size_t{4} << 20;
};

class EventPublisher {
 public:
  explicit EventPublisher(EventPublisherOptions options);
  // Stop(): cancels the stream, then waits for the thread: an RPC it has in flight (at
  // most rpc_timeout) and its Unregister (at most unregister_timeout).
  ~EventPublisher();
  EventPublisher(const EventPublisher&) = delete;
  EventPublisher& operator=(const EventPublisher&) = delete;

  void Start();
  // Stops the thread, cancels the stream and unregisters the source (as the destructor
  // does; see unregister_on_stop); idempotent. Later Publish and CompleteDecision calls
  // are dropped, and Start does nothing. For a process that must take no more traffic
  // but cannot exit yet.
  void Stop();
  // Stop without waiting: the thread unregisters (at most unregister_timeout) and ends on
  // its own; Stop or the destructor joins it. Callable from any thread, e.g. one that
  // must not block.
  void RequestStop();
  // Queues an event; its sequence number is assigned when it is sent. A stored or removed
  // event of more than 4096 hashes (the router's limit per event) is queued as
  // consecutive events of at most 4096, stored parts chained by parent hash.
  void Publish(v1::KvEvent event);
  // A routed request (RouteResponse.decision_id) is counted in the source's load now (or
  // ended): reported in the next heartbeat, whose load (read after the completed
  // decisions are taken) counts it, so the router releases its optimistic load. 0 is
  // ignored.
  void CompleteDecision(uint64_t decision_id);

  uint64_t events_sent() const;
  uint64_t dumps_sent() const;
  uint64_t registrations() const;  // successful Register calls
  bool connected() const;  // registered and streaming

 private:
  enum class HeartbeatOutcome {
    kOk,
    kFailed,         // RPC error: retried at the next interval
    kDumpRequested,  // the router is stale on this source: full dump on the stream
    kUnknownSource,  // the router forgot the source: register again
  };

  void Loop();
  bool RegisterAndDump();
  bool OpenStream();   // false when stopping
  // Finishes the stream, if any (cancelling it first unless `cancel` is false); returns
  // its status.
  grpc::Status CloseStream(bool cancel = true);
  bool SendDump();     // false: the stream broke
  HeartbeatOutcome SendHeartbeat();
  void Unregister();  // the thread, as it ends (unregister_on_stop)

  const EventPublisherOptions opts_;
  std::unique_ptr<v1::Router::Stub> stub_;  // used by the thread only
  // The stream's context. Owned by the thread; live_ctx_ is the same pointer, published
  // under mu_ so ~EventPublisher can TryCancel() it (thread-safe in gRPC) while the
  // thread is blocked in Write.
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  v1::PublishEventsResponse stream_resp_;
  std::unique_ptr<grpc::ClientWriter<v1::EventBatch>> stream_;
  uint64_t next_sequence_ = 1;          // thread only
  uint64_t registration_id_ = 0;        // RegisterResponse.registration; thread only
  uint32_t heartbeat_ms_ = 1000;        // thread only

  mutable absl::Mutex mu_;
  std::deque<v1::KvEvent> queue_ ABSL_GUARDED_BY(mu_);
  std::deque<uint64_t> completed_ ABSL_GUARDED_BY(mu_);
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;  // queue only while a stream is up
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* live_ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t registrations_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t events_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dumps_sent_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace kvpool::router
