#include "router_publisher.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "pool_service.h"
#include "spdlog/spdlog.h"

namespace kvpool::pool_node {
namespace {
constexpr size_t kMaxEventsPerBatch = 65536;
std::chrono::system_clock::time_point Deadline(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}
}  // namespace

RouterPublisher::RouterPublisher(std::string router_address, std::string source_id,
                                 std::string advertise_address, uint64_t capacity_pages)
    : router_address_(std::move(router_address)),
      source_id_(std::move(source_id)),
      advertise_address_(std::move(advertise_address)),
      capacity_pages_(capacity_pages) {}

RouterPublisher::~RouterPublisher() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void RouterPublisher::Start(const PoolCore* core) {
  core_ = core;
  stub_ = v1::Router::NewStub(grpc::CreateChannel(router_address_, grpc::InsecureChannelCredentials()));
  thread_ = std::thread([this] { Loop(); });
}

void RouterPublisher::OnStored(const ObjectKey& key, const std::optional<BlockHash>& parent, Tier tier) {
  absl::MutexLock l(&mu_);
  if (streaming_) queue_.push_back(Pending{true, key, parent, tier});
}

void RouterPublisher::OnRemoved(const ObjectKey& key, Tier tier) {
  absl::MutexLock l(&mu_);
  if (streaming_) queue_.push_back(Pending{false, key, std::nullopt, tier});
}

uint64_t RouterPublisher::events_sent() const {
  absl::MutexLock l(&mu_);
  return events_sent_;
}
uint64_t RouterPublisher::dumps_sent() const {
  absl::MutexLock l(&mu_);
  return dumps_sent_;
}

void RouterPublisher::FillEvent(const Pending& p, v1::KvEvent* e) {
  e->set_sequence(next_sequence_++);
  if (p.stored) {
    v1::BlockStored* s = e->mutable_stored();
    if (p.parent) s->set_parent_hash(p.parent->ToBytes());
    s->add_block_hashes(p.key.hash.ToBytes());
    s->set_kind(ToProto(p.key.kind));
    s->set_tier(ToProto(p.tier));
  } else {
    v1::BlockRemoved* r = e->mutable_removed();
    r->add_block_hashes(p.key.hash.ToBytes());
    r->set_kind(ToProto(p.key.kind));
    r->set_tier(ToProto(p.tier));
  }
}

// Registers, opens a fresh stream and sends a full dump. False when the router is not
// reachable (the caller retries later).
bool RouterPublisher::RegisterAndDump() {
  {
    absl::MutexLock l(&mu_);
    streaming_ = false;
    queue_.clear();
  }
  if (stream_) {
    stream_->WritesDone();
    stream_->Finish();
    stream_.reset();
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(2000));
    v1::RegisterRequest req;
    req.set_source_id(source_id_);
    req.set_kind(v1::SOURCE_KIND_POOL_NODE);
    req.set_address(advertise_address_);
    req.set_capacity_blocks(capacity_pages_);
    req.set_publishes_events(true);
    v1::RegisterResponse resp;
    grpc::Status s = stub_->Register(&ctx, req, &resp);
    if (!s.ok()) {
      spdlog::warn("router {}: Register failed: {} (retrying)", router_address_, s.error_message());
      return false;
    }
    next_sequence_ = resp.next_sequence() ? resp.next_sequence() : 1;
    if (resp.heartbeat_interval_ms() > 0) heartbeat_ms_ = resp.heartbeat_interval_ms();
  }
  // From here on changes queue; the dump below covers everything before it (a change
  // caught by both is harmless: stored twice or removed after the dump, in order).
  {
    absl::MutexLock l(&mu_);
    queue_.clear();
    streaming_ = true;
  }
  std::vector<Pending> dump;
  core_->ForEachVisible([&](const ObjectKey& k, const std::optional<BlockHash>& parent, Tier t) {
    dump.push_back(Pending{true, k, parent, t});
  });
  stream_ctx_ = std::make_unique<grpc::ClientContext>();
  stream_resp_.Clear();
  stream_ = stub_->PublishEvents(stream_ctx_.get(), &stream_resp_);
  size_t i = 0;
  bool first = true;
  do {
    v1::EventBatch batch;
    batch.set_source_id(source_id_);
    batch.set_full_dump(first);
    first = false;
    for (; i < dump.size() && batch.events_size() < static_cast<int>(kMaxEventsPerBatch); ++i) {
      FillEvent(dump[i], batch.add_events());
    }
    if (!stream_->Write(batch)) {
      spdlog::warn("router {}: PublishEvents stream broke during the dump", router_address_);
      absl::MutexLock l(&mu_);
      streaming_ = false;
      return false;
    }
  } while (i < dump.size());
  absl::MutexLock l(&mu_);
  ++dumps_sent_;
  events_sent_ += dump.size();
  return true;
}

void RouterPublisher::Loop() {
  bool connected = false;
  auto last_heartbeat = std::chrono::steady_clock::now();
  for (;;) {
    if (!connected) {
      connected = RegisterAndDump();
      if (!connected) {
        absl::MutexLock l(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(&stop_), absl::Seconds(1));
        if (stop_) break;
        continue;
      }
      last_heartbeat = std::chrono::steady_clock::now();
    }
    std::vector<Pending> batch;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(heartbeat_ms_));
      if (stop_) break;
      while (!queue_.empty() && batch.size() < kMaxEventsPerBatch) {
        batch.push_back(queue_.front());
        queue_.pop_front();
      }
    }
    if (!batch.empty()) {
      v1::EventBatch b;
      b.set_source_id(source_id_);
      for (const Pending& p : batch) FillEvent(p, b.add_events());
      if (!stream_->Write(b)) {
        spdlog::warn("router {}: PublishEvents stream broke; reconnecting with a full dump", router_address_);
        connected = false;
        continue;
      }
      absl::MutexLock l(&mu_);
      events_sent_ += batch.size();
    }
    if (std::chrono::steady_clock::now() - last_heartbeat >= std::chrono::milliseconds(heartbeat_ms_)) {
      last_heartbeat = std::chrono::steady_clock::now();
      grpc::ClientContext ctx;
      ctx.set_deadline(Deadline(2000));
      v1::HeartbeatRequest req;
      req.set_source_id(source_id_);
      v1::HeartbeatResponse resp;
      grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
      if (!s.ok() || resp.unknown_source() || resp.full_dump_requested()) connected = false;
    }
  }
  if (stream_) {
    stream_->WritesDone();
    stream_ctx_->TryCancel();
    stream_->Finish();
  }
}

}  // namespace kvpool::pool_node
