#include "router_publisher.h"

#include "pool_service.h"

namespace kvpool::pool_node {
namespace {

v1::KvEvent StoredEvent(const ObjectKey& key, const std::optional<BlockHash>& parent, Tier tier) {
  v1::KvEvent e;
  v1::BlockStored* s = e.mutable_stored();
  if (parent) s->set_parent_hash(parent->ToBytes());
  s->add_block_hashes(key.hash.ToBytes());
  s->set_kind(ToProto(key.kind));
  s->set_tier(ToProto(tier));
  return e;
}

}  // namespace

RouterPublisher::RouterPublisher(std::string router_address, std::string source_id,
                                 std::string advertise_address, uint64_t capacity_pages) {
  opts_.router_address = std::move(router_address);
  opts_.registration.set_source_id(std::move(source_id));
  opts_.registration.set_kind(v1::SOURCE_KIND_POOL_NODE);
  opts_.registration.set_address(std::move(advertise_address));
  opts_.registration.set_capacity_blocks(capacity_pages);
  opts_.registration.set_publishes_events(true);
}

RouterPublisher::~RouterPublisher() = default;

void RouterPublisher::Start(const PoolCore* core, const std::string& advertise,
                            const std::string& source_id) {
  core_ = core;
  router::EventPublisherOptions o = opts_;
  o.registration.set_address(advertise);
  o.registration.set_source_id(source_id);
  o.dump = [this] {
    // Copied under the core's lock (the snapshot the later events follow); the events,
    // with their heap strings, are built after it, not while every call waits.
    struct Visible {
      ObjectKey key;
      std::optional<BlockHash> parent;
      Tier tier;
    };
    std::vector<Visible> visible;
    core_->ForEachVisible([&](const ObjectKey& k, const std::optional<BlockHash>& parent, Tier t) {
      visible.push_back({k, parent, t});
    });
    std::vector<v1::KvEvent> dump;
    dump.reserve(visible.size());
    for (const Visible& v : visible) dump.push_back(StoredEvent(v.key, v.parent, v.tier));
    return dump;
  };
  owned_ = std::make_unique<router::EventPublisher>(std::move(o));
  // Before Start: a change made between the publisher's first dump and this store would
  // otherwise be in neither (Publish drops events until the stream is up).
  pub_.store(owned_.get(), std::memory_order_release);
  owned_->Start();
}

void RouterPublisher::OnStored(const ObjectKey& key, const std::optional<BlockHash>& parent, Tier tier) {
  if (router::EventPublisher* p = pub_.load(std::memory_order_acquire)) p->Publish(StoredEvent(key, parent, tier));
}

void RouterPublisher::OnRemoved(const ObjectKey& key, Tier tier) {
  router::EventPublisher* p = pub_.load(std::memory_order_acquire);
  if (p == nullptr) return;
  v1::KvEvent e;
  v1::BlockRemoved* r = e.mutable_removed();
  r->add_block_hashes(key.hash.ToBytes());
  r->set_kind(ToProto(key.kind));
  r->set_tier(ToProto(tier));
  p->Publish(std::move(e));
}

uint64_t RouterPublisher::events_sent() const {
  const router::EventPublisher* p = pub_.load(std::memory_order_acquire);
  return p ? p->events_sent() : 0;
}
uint64_t RouterPublisher::dumps_sent() const {
  const router::EventPublisher* p = pub_.load(std::memory_order_acquire);
  return p ? p->dumps_sent() : 0;
}

}  // namespace kvpool::pool_node
