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
// restarted) or one asking for a full dump makes it register again and re-dump. Without
// a router the source runs on: events are only queued while a stream is up, since the
// next dump replaces them.
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
  v1::RegisterRequest registration;    // source_id, kind, address, model, capacity
  // Every object the source holds now, as `stored` events (sequence left 0). Required.
  std::function<std::vector<v1::KvEvent>()> dump;
  // The load sent with each heartbeat; optional (no load field when unset).
  std::function<v1::Load()> load;
  absl::Duration rpc_timeout = absl::Seconds(2);
  absl::Duration retry_interval = absl::Seconds(1);  // between failed Register attempts
};

class EventPublisher {
 public:
  explicit EventPublisher(EventPublisherOptions options);
  ~EventPublisher();  // stops the thread, closes the stream
  EventPublisher(const EventPublisher&) = delete;
  EventPublisher& operator=(const EventPublisher&) = delete;

  void Start();
  // Queues an event; its sequence number is assigned when it is sent.
  void Publish(v1::KvEvent event);
  // A routed request (RouteResponse.decision_id) finished prefill: reported in the next
  // heartbeat so the router releases its optimistic load. 0 is ignored.
  void CompleteDecision(uint64_t decision_id);

  uint64_t events_sent() const;
  uint64_t dumps_sent() const;
  bool connected() const;  // registered and streaming

 private:
  void Loop();
  bool RegisterAndDump();
  bool SendHeartbeat();  // false: register + dump again

  const EventPublisherOptions opts_;
  std::unique_ptr<v1::Router::Stub> stub_;  // used by the thread only
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  v1::PublishEventsResponse stream_resp_;
  std::unique_ptr<grpc::ClientWriter<v1::EventBatch>> stream_;
  uint64_t next_sequence_ = 1;          // thread only
  uint32_t heartbeat_ms_ = 1000;        // thread only

  mutable absl::Mutex mu_;
  std::deque<v1::KvEvent> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<uint64_t> completed_ ABSL_GUARDED_BY(mu_);
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;  // queue only while a stream is up
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t events_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dumps_sent_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace kvpool::router
