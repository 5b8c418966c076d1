// RouterPublisher: sends the node's stored/removed events to the router.
//
//   PoolCore --OnStored/OnRemoved--> queue --publisher thread--> Router.PublishEvents
//                                                 (client stream, per-source sequence)
//
// The thread registers the node (SOURCE_KIND_POOL_NODE), opens a PublishEvents stream
// and first sends a full dump (every visible copy, from PoolCore::ForEachVisible), then
// the queued events, each with the next sequence number. A failed write, a heartbeat
// answering unknown_source, or one asking for a full dump makes it register (if needed)
// and dump again. Without a router the node runs on; events queue only while a stream
// is up (a dump replaces them on reconnect).
//
// Thread safety: OnStored/OnRemoved are called by PoolCore with its mutex held; they only
// take the queue mutex. The thread calls PoolCore only with no publisher lock held.
#pragma once

#include <deque>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "kvpool/pool_node/pool_core.h"
#include "kvpool/v1/router.grpc.pb.h"

namespace kvpool::pool_node {

class RouterPublisher : public EventSink {
 public:
  RouterPublisher(std::string router_address, std::string source_id, std::string advertise_address,
                  uint64_t capacity_pages);
  ~RouterPublisher() override;

  void Start(const PoolCore* core);
  void OnStored(const ObjectKey& key, const std::optional<BlockHash>& parent, Tier tier) override;
  void OnRemoved(const ObjectKey& key, Tier tier) override;

  uint64_t events_sent() const;
  uint64_t dumps_sent() const;

 private:
  struct Pending {
    bool stored;
    ObjectKey key;
    std::optional<BlockHash> parent;
    Tier tier;
  };
  void Loop();
  bool RegisterAndDump();
  void FillEvent(const Pending& p, v1::KvEvent* e);

  const std::string router_address_, source_id_, advertise_address_;
  const uint64_t capacity_pages_;
  const PoolCore* core_ = nullptr;
  std::unique_ptr<v1::Router::Stub> stub_;  // used by the thread only
  std::unique_ptr<grpc::ClientContext> stream_ctx_;
  v1::PublishEventsResponse stream_resp_;
  std::unique_ptr<grpc::ClientWriter<v1::EventBatch>> stream_;
  uint64_t next_sequence_ = 1;
  uint32_t heartbeat_ms_ = 1000;

  mutable absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool streaming_ ABSL_GUARDED_BY(mu_) = false;  // queue only while a stream is up
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t events_sent_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t dumps_sent_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace kvpool::pool_node
