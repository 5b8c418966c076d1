#include "kvpool/router/event_publisher.h"

#include <grpcpp/grpcpp.h>

#include <chrono>

#include "spdlog/spdlog.h"

namespace kvpool::router {
namespace {
constexpr size_t kMaxEventsPerBatch = 65536;
// Completed decisions kept for the next heartbeat, at most (older ones time out in the
// router anyway).
constexpr size_t kMaxCompleted = 65536;
}  // namespace

EventPublisher::EventPublisher(EventPublisherOptions options) : opts_(std::move(options)) {}

EventPublisher::~EventPublisher() {
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

void EventPublisher::Start() {
  stub_ = v1::Router::NewStub(grpc::CreateChannel(opts_.router_address, grpc::InsecureChannelCredentials()));
  thread_ = std::thread([this] { Loop(); });
}

void EventPublisher::Publish(v1::KvEvent event) {
  absl::MutexLock l(&mu_);
  if (streaming_) queue_.push_back(std::move(event));
}

void EventPublisher::CompleteDecision(uint64_t decision_id) {
  if (decision_id == 0) return;
  absl::MutexLock l(&mu_);
  if (completed_.size() < kMaxCompleted) completed_.push_back(decision_id);
}

uint64_t EventPublisher::events_sent() const {
  absl::MutexLock l(&mu_);
  return events_sent_;
}
uint64_t EventPublisher::dumps_sent() const {
  absl::MutexLock l(&mu_);
  return dumps_sent_;
}
bool EventPublisher::connected() const {
  absl::MutexLock l(&mu_);
  return streaming_;
}

// Registers, opens a fresh stream and sends a full dump. False when the router is not
// reachable (the caller retries later).
bool EventPublisher::RegisterAndDump() {
  {
    absl::MutexLock l(&mu_);
    streaming_ = false;
    queue_.clear();
  }
  if (stream_) {
    stream_ctx_->TryCancel();
    stream_->Finish();
    stream_.reset();
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
    v1::RegisterResponse resp;
    grpc::Status s = stub_->Register(&ctx, opts_.registration, &resp);
    if (!s.ok()) {
      spdlog::warn("router {}: Register of {} failed: {} (retrying)", opts_.router_address,
                   opts_.registration.source_id(), s.error_message());
      return false;
    }
    next_sequence_ = resp.next_sequence() ? resp.next_sequence() : 1;
    if (resp.heartbeat_interval_ms() > 0) heartbeat_ms_ = resp.heartbeat_interval_ms();
  }
  // From here on changes queue; the dump below covers everything before it (a change
  // caught by both is harmless: stored twice, or removed after the dump, in order).
  {
    absl::MutexLock l(&mu_);
    queue_.clear();
    streaming_ = true;
  }
  std::vector<v1::KvEvent> dump = opts_.dump ? opts_.dump() : std::vector<v1::KvEvent>{};
  stream_ctx_ = std::make_unique<grpc::ClientContext>();
  stream_resp_.Clear();
  stream_ = stub_->PublishEvents(stream_ctx_.get(), &stream_resp_);
  size_t i = 0;
  bool first = true;
  do {
    v1::EventBatch batch;
    batch.set_source_id(opts_.registration.source_id());
    batch.set_full_dump(first);
    first = false;
    for (; i < dump.size() && batch.events_size() < static_cast<int>(kMaxEventsPerBatch); ++i) {
      v1::KvEvent* e = batch.add_events();
      *e = std::move(dump[i]);
      e->set_sequence(next_sequence_++);
    }
    if (!stream_->Write(batch)) {
      spdlog::warn("router {}: PublishEvents stream broke during the dump", opts_.router_address);
      absl::MutexLock l(&mu_);
      streaming_ = false;
      return false;
    }
  } while (i < dump.size());
  spdlog::info("router {}: {} registered, full dump of {} objects sent", opts_.router_address,
               opts_.registration.source_id(), dump.size());
  absl::MutexLock l(&mu_);
  ++dumps_sent_;
  events_sent_ += dump.size();
  return true;
}

bool EventPublisher::SendHeartbeat() {
  v1::HeartbeatRequest req;
  req.set_source_id(opts_.registration.source_id());
  if (opts_.load) *req.mutable_load() = opts_.load();
  std::vector<uint64_t> completed;
  {
    absl::MutexLock l(&mu_);
    completed.swap(completed_);
  }
  for (uint64_t d : completed) req.add_completed_decisions(d);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
  v1::HeartbeatResponse resp;
  grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
  if (!s.ok()) {
    spdlog::warn("router {}: Heartbeat failed: {}", opts_.router_address, s.error_message());
    return false;
  }
  return !resp.unknown_source() && !resp.full_dump_requested();
}

void EventPublisher::Loop() {
  bool connected = false;
  auto last_heartbeat = std::chrono::steady_clock::now();
  for (;;) {
    if (!connected) {
      connected = RegisterAndDump();
      if (!connected) {
        absl::MutexLock l(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(&stop_), opts_.retry_interval);
        if (stop_) break;
        continue;
      }
      last_heartbeat = std::chrono::steady_clock::now();
      connected = SendHeartbeat();  // load known to the router right away
      if (!connected) {  // registered but refused: do not hammer the router
        absl::MutexLock l(&mu_);
        mu_.AwaitWithTimeout(absl::Condition(&stop_), opts_.retry_interval);
        if (stop_) break;
        continue;
      }
    }
    std::vector<v1::KvEvent> batch;
    {
      absl::MutexLock l(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.AwaitWithTimeout(absl::Condition(&ready), absl::Milliseconds(heartbeat_ms_ / 2 + 1));
      if (stop_) break;
      while (!queue_.empty() && batch.size() < kMaxEventsPerBatch) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    if (!batch.empty()) {
      v1::EventBatch b;
      b.set_source_id(opts_.registration.source_id());
      for (v1::KvEvent& e : batch) {
        e.set_sequence(next_sequence_++);
        *b.add_events() = std::move(e);
      }
      if (!stream_->Write(b)) {
        spdlog::warn("router {}: PublishEvents stream broke; reconnecting with a full dump", opts_.router_address);
        connected = false;
        continue;
      }
      absl::MutexLock l(&mu_);
      events_sent_ += batch.size();
    }
    // Heartbeats at half the interval the router asked for, so one late one is harmless.
    if (std::chrono::steady_clock::now() - last_heartbeat >= std::chrono::milliseconds(heartbeat_ms_ / 2)) {
      last_heartbeat = std::chrono::steady_clock::now();
      connected = SendHeartbeat();
    }
  }
  if (stream_) {
    stream_->WritesDone();
    stream_ctx_->TryCancel();
    stream_->Finish();
  }
}

}  // namespace kvpool::router
