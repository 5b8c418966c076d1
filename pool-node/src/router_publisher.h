// RouterPublisher: the pool node's adapter onto router::EventPublisher
// (router/client/include/kvpool/router/event_publisher.h), which registers the node
// (SOURCE_KIND_POOL_NODE), streams its stored/removed events with per-source sequence
// numbers, sends heartbeats, and re-registers + re-dumps after a router restart.
//
//   PoolCore --OnStored/OnRemoved--> EventPublisher::Publish --thread--> Router
//   full dump <- PoolCore::ForEachVisible (every visible copy)
//
// Thread safety: OnStored/OnRemoved are called by PoolCore with its mutex held; they only
// take the publisher's queue mutex. The dump calls PoolCore from the publisher thread
// with no publisher lock held.
#pragma once

#include <atomic>
#include <memory>
#include <string>

#include "kvpool/pool_node/pool_core.h"
#include "kvpool/router/event_publisher.h"

namespace kvpool::pool_node {

class RouterPublisher : public EventSink {
 public:
  RouterPublisher(std::string router_address, std::string source_id, std::string advertise_address,
                  uint64_t capacity_pages);
  ~RouterPublisher() override;

  // `advertise`: the node's gRPC address as the router should dial it; `source_id`: the
  // node id registered with the router (replaces the constructor's).
  void Start(const PoolCore* core, const std::string& advertise, const std::string& source_id);
  void OnStored(const ObjectKey& key, const std::optional<BlockHash>& parent, Tier tier) override;
  void OnRemoved(const ObjectKey& key, Tier tier) override;

  uint64_t events_sent() const;
  uint64_t dumps_sent() const;

 private:
  router::EventPublisherOptions opts_;
  const PoolCore* core_ = nullptr;
  std::unique_ptr<router::EventPublisher> owned_;  // set by Start
  // owned_ once started: Start runs after the core and the gRPC server already call
  // OnStored/OnRemoved from their threads (events before it are covered by the dump).
  std::atomic<router::EventPublisher*> pub_{nullptr};
};

}  // namespace kvpool::pool_node
