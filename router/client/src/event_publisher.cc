#include "kvpool/router/event_publisher.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <chrono>

#include "kvpool/router/events.h"
#include "spdlog/spdlog.h"

namespace kvpool::router {
namespace {
constexpr size_t kMaxEventsPerBatch = 65536;

// Where a batch ends: kMaxEventsPerBatch events, or max_bytes of encoded batch (the
// first event is always taken, so a batch is never empty).
class BatchBound {
 public:
  // The batch's own fields (source_id of at most 128 bytes, registration, flags) count
  // from the start.
  explicit BatchBound(size_t max_bytes) : max_bytes_(max_bytes), bytes_(kBatchFieldsBytes) {}
  // Whether `e` still fits; if so, it is counted. `e` is counted as sent: with the
  // sequence number it gets then (at most 11 bytes) and its entry's tag and length
  // prefix (at most 6).
  bool Take(const v1::KvEvent& e) {
    if (events_ == kMaxEventsPerBatch) return false;
    const size_t size = e.ByteSizeLong() + 11 + 6;
    if (events_ > 0 && bytes_ + size > max_bytes_) return false;
    ++events_;
    bytes_ += size;
    return true;
  }

 private:
  static constexpr size_t kBatchFieldsBytes = 256;
  const size_t max_bytes_;
  size_t events_ = 0;
  size_t bytes_;
};
// Completed decisions one heartbeat carries, at most (the router refuses more); the rest
// wait for the next ones.
constexpr size_t kMaxCompletedPerHeartbeat = 65536;
// Completed decisions kept for later heartbeats, at most (a worker's queue is at most
// 1,000,000 requests; beyond, they time out in the router).
constexpr size_t kMaxCompleted = size_t{1} << 20;
}  // namespace

EventPublisher::EventPublisher(EventPublisherOptions options) : opts_(std::move(options)) {}

EventPublisher::~EventPublisher() { Stop(); }

void EventPublisher::RequestStop() {
  absl::MutexLock l(&mu_);
  stop_ = true;
  streaming_ = false;  // Publish drops events from here
  queue_.clear();
  // A Write blocked on flow control (the router stopped reading) returns false now;
  // without this the join in Stop could wait for TCP to give up, or forever.
  if (live_ctx_ != nullptr) live_ctx_->TryCancel();
}

void EventPublisher::Stop() {
  RequestStop();
  if (thread_.joinable()) thread_.join();
}

void EventPublisher::Unregister() {
  if (!opts_.unregister_on_stop || registration_id_ == 0) return;
  v1::UnregisterRequest req;
  req.set_source_id(opts_.registration.source_id());
  req.set_registration(registration_id_);
  v1::UnregisterResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::ToInt64Milliseconds(opts_.unregister_timeout)));
  const grpc::Status s = stub_->Unregister(&ctx, req, &resp);
  if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) {
    spdlog::warn("unregistering {} from the router at {}: {} (it drops the source once its heartbeats stop)",
                 opts_.registration.source_id(), opts_.router_address, s.error_message());
  }
  registration_id_ = 0;
}

void EventPublisher::Start() {
  {
    absl::MutexLock l(&mu_);
    if (stop_ || thread_.joinable()) return;  // stopped already (or started): nothing to start
  }
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(absl::ToInt64Milliseconds(opts_.keepalive_time)));
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, static_cast<int>(absl::ToInt64Milliseconds(opts_.keepalive_timeout)));
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Keep pinging while a Write is stuck: no data goes out then, and the default limit
  // (2 pings without data) would stop the very pings that detect the dead peer.
  args.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  stub_ = v1::Router::NewStub(
      grpc::CreateCustomChannel(opts_.router_address, grpc::InsecureChannelCredentials(), args));
  thread_ = std::thread([this] { Loop(); });
}

void EventPublisher::Publish(v1::KvEvent event) {
  // The router takes at most kMaxEventHashes hashes per event: a longer run (a prompt of
  // more blocks) goes as consecutive events, each stored part chained to the previous
  // part's last hash, so the router sees the same chain.
  google::protobuf::RepeatedPtrField<std::string>* hashes =
      event.has_stored() ? event.mutable_stored()->mutable_block_hashes()
      : event.has_removed() ? event.mutable_removed()->mutable_block_hashes()
                            : nullptr;
  std::vector<v1::KvEvent> parts;
  if (hashes != nullptr && static_cast<size_t>(hashes->size()) > router::kMaxEventHashes) {
    const google::protobuf::RepeatedPtrField<std::string> all = std::move(*hashes);
    hashes->Clear();  // `event` is the parts' template from here
    const int step = static_cast<int>(router::kMaxEventHashes);
    for (int at = 0; at < all.size(); at += step) {
      v1::KvEvent& part = parts.emplace_back(event);
      google::protobuf::RepeatedPtrField<std::string>* dst =
          part.has_stored() ? part.mutable_stored()->mutable_block_hashes() : part.mutable_removed()->mutable_block_hashes();
      dst->Reserve(std::min(step, all.size() - at));
      for (int i = at; i < std::min(all.size(), at + step); ++i) *dst->Add() = all[i];
      if (part.has_stored() && at > 0) part.mutable_stored()->set_parent_hash(all[at - 1]);
    }
  }
  absl::MutexLock l(&mu_);
  if (!streaming_) return;
  if (parts.empty()) {
    queue_.push_back(std::move(event));
  } else {
    for (v1::KvEvent& p : parts) queue_.push_back(std::move(p));
  }
}

void EventPublisher::CompleteDecision(uint64_t decision_id) {
  if (decision_id == 0) return;
  absl::MutexLock l(&mu_);
  if (!stop_ && completed_.size() < kMaxCompleted) completed_.push_back(decision_id);
}

uint64_t EventPublisher::events_sent() const {
  absl::MutexLock l(&mu_);
  return events_sent_;
}
uint64_t EventPublisher::dumps_sent() const {
  absl::MutexLock l(&mu_);
  return dumps_sent_;
}
uint64_t EventPublisher::registrations() const {
  absl::MutexLock l(&mu_);
  return registrations_;
}
bool EventPublisher::connected() const {
  absl::MutexLock l(&mu_);
  return streaming_;
}

bool EventPublisher::OpenStream() {
  auto ctx = std::make_unique<grpc::ClientContext>();
  {
    absl::MutexLock l(&mu_);
    if (stop_) return false;  // checked under mu_: the destructor cannot miss this context
    live_ctx_ = ctx.get();
  }
  stream_ctx_ = std::move(ctx);
  stream_resp_.Clear();
  stream_ = stub_->PublishEvents(stream_ctx_.get(), &stream_resp_);
  return true;
}

grpc::Status EventPublisher::CloseStream(bool cancel) {
  if (!stream_) return grpc::Status::OK;
  if (cancel) stream_ctx_->TryCancel();
  grpc::Status why = stream_->Finish();
  stream_.reset();
  {
    absl::MutexLock l(&mu_);
    live_ctx_ = nullptr;
  }
  stream_ctx_.reset();
  return why;
}

// Registers, opens a fresh stream and sends a full dump. False when the router is not
// reachable (the caller retries later).
bool EventPublisher::RegisterAndDump() {
  {
    absl::MutexLock l(&mu_);
    streaming_ = false;
    queue_.clear();
  }
  CloseStream();
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
    v1::RegisterResponse resp;
    // A publisher publishes: the router refuses events of a source registered without it.
    v1::RegisterRequest reg = opts_.registration;
    reg.set_publishes_events(true);
    grpc::Status s = stub_->Register(&ctx, reg, &resp);
    if (!s.ok()) {
      spdlog::warn("router {}: Register of {} failed: {} (retrying)", opts_.router_address,
                   opts_.registration.source_id(), s.error_message());
      return false;
    }
    next_sequence_ = resp.next_sequence() ? resp.next_sequence() : 1;
    registration_id_ = resp.registration();
    if (resp.heartbeat_interval_ms() > 0) heartbeat_ms_ = resp.heartbeat_interval_ms();
    absl::MutexLock l(&mu_);
    ++registrations_;
  }
  if (!OpenStream()) return false;
  if (!SendDump()) return false;
  spdlog::info("router {}: {} registered", opts_.router_address, opts_.registration.source_id());
  return true;
}

// Sends a full dump on the open stream: the first batch has full_dump set (the router
// replaces what it knows of the source), the rest continue the sequence.
bool EventPublisher::SendDump() {
  // From here on changes queue; the dump below covers everything before it (a change
  // caught by both is harmless: stored twice, or removed after the dump, in order).
  {
    absl::MutexLock l(&mu_);
    if (stop_) return false;  // stopping: no stream, no queue
    queue_.clear();
    streaming_ = true;
  }
  std::vector<v1::KvEvent> dump = opts_.dump ? opts_.dump() : std::vector<v1::KvEvent>{};
  size_t i = 0;
  bool first = true;
  do {
    v1::EventBatch batch;
    batch.set_source_id(opts_.registration.source_id());
    batch.set_registration(registration_id_);
    if (first) {
      batch.set_full_dump(true);
      // An empty dump on a stream that has sent events must say where the sequence
      // stands, or the router would see the next event as a gap.
      if (dump.empty()) batch.set_dump_sequence(next_sequence_ - 1);
    }
    first = false;
    BatchBound bound(opts_.max_batch_bytes);
    for (; i < dump.size() && bound.Take(dump[i]); ++i) {
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
  spdlog::info("router {}: {} sent a full dump of {} objects", opts_.router_address,
               opts_.registration.source_id(), dump.size());
  absl::MutexLock l(&mu_);
  ++dumps_sent_;
  events_sent_ += dump.size();
  return true;
}

EventPublisher::HeartbeatOutcome EventPublisher::SendHeartbeat() {
  v1::HeartbeatRequest req;
  req.set_source_id(opts_.registration.source_id());
  // Completed decisions first, then the load: a source that completes a decision once
  // its load counts the request (the worker) never has one released by a heartbeat whose
  // load is older than the request.
  std::vector<uint64_t> completed;
  {
    absl::MutexLock l(&mu_);
    const size_t n = std::min(completed_.size(), kMaxCompletedPerHeartbeat);
    completed.assign(completed_.begin(), completed_.begin() + static_cast<ptrdiff_t>(n));
    completed_.erase(completed_.begin(), completed_.begin() + static_cast<ptrdiff_t>(n));
  }
  if (opts_.load) *req.mutable_load() = opts_.load();
  for (uint64_t d : completed) req.add_completed_decisions(d);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + opts_.rpc_timeout));
  v1::HeartbeatResponse resp;
  grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
  if (!s.ok()) {
    spdlog::warn("router {}: Heartbeat failed: {}", opts_.router_address, s.error_message());
    // Put the decisions back (up to the cap) so the next heartbeat reports them.
    absl::MutexLock l(&mu_);
    for (auto it = completed.rbegin(); it != completed.rend() && completed_.size() < kMaxCompleted; ++it) {
      completed_.push_front(*it);
    }
    return HeartbeatOutcome::kFailed;
  }
  if (resp.unknown_source()) return HeartbeatOutcome::kUnknownSource;
  if (resp.full_dump_requested()) return HeartbeatOutcome::kDumpRequested;
  return HeartbeatOutcome::kOk;
}

void EventPublisher::Loop() {
  bool connected = false;
  int failed_heartbeats = 0;  // in a row
  auto last_heartbeat = std::chrono::steady_clock::now();
  // Acts on a heartbeat's answer; false: register + dump again.
  auto heartbeat = [&]() -> bool {
    last_heartbeat = std::chrono::steady_clock::now();
    switch (SendHeartbeat()) {
      case HeartbeatOutcome::kOk:
        failed_heartbeats = 0;
        return true;
      case HeartbeatOutcome::kFailed:
        if (++failed_heartbeats < opts_.max_heartbeat_failures) return true;
        spdlog::warn("router {}: {} heartbeats failed in a row; registering again", opts_.router_address,
                     failed_heartbeats);
        return false;
      case HeartbeatOutcome::kDumpRequested:
        failed_heartbeats = 0;
        return SendDump();
      case HeartbeatOutcome::kUnknownSource:
        return false;
    }
    return false;
  };
  for (;;) {
    if (!connected) {
      {
        absl::MutexLock l(&mu_);
        if (stop_) break;  // a stopped publisher does not register again
      }
      failed_heartbeats = 0;
      connected = RegisterAndDump() && heartbeat();  // load known to the router right away
      if (!connected) {  // unreachable, or registered but refused: do not hammer the router
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
      BatchBound bound(opts_.max_batch_bytes);
      while (!queue_.empty() && bound.Take(queue_.front())) {
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
    }
    if (!batch.empty()) {
      v1::EventBatch b;
      b.set_source_id(opts_.registration.source_id());
      b.set_registration(registration_id_);
      for (v1::KvEvent& e : batch) {
        e.set_sequence(next_sequence_++);
        *b.add_events() = std::move(e);
      }
      if (!stream_->Write(b)) {
        // The router ended the stream: its status says why (not cancelled first).
        const grpc::Status why = CloseStream(/*cancel=*/false);
        spdlog::warn("router {}: PublishEvents stream broke ({}); reconnecting with a full dump",
                     opts_.router_address, why.error_message());
        connected = false;
        const bool aborted = why.error_code() == grpc::StatusCode::ABORTED;
        const bool refused = why.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED;
        if (aborted) {
          spdlog::warn("router {}: {} was registered again elsewhere; is another process using this id?",
                       opts_.router_address, opts_.registration.source_id());
        }
        if (refused) {
          spdlog::warn("router {}: it refused {}'s event stream with RESOURCE_EXHAUSTED (as many streams open as "
                       "its --max-streams, or a batch over its --max-message-bytes); registering again in {}",
                       opts_.router_address, opts_.registration.source_id(),
                       absl::FormatDuration(opts_.retry_interval));
        }
        absl::MutexLock l(&mu_);
        streaming_ = false;  // no stream until the next Register: the dump that opens it covers these
        queue_.clear();
        if (aborted || refused) {
          // Aborted: registered again since this stream began, by this publisher or by
          // another process with the same source id; two such processes would otherwise
          // take the registration from each other at every write. Refused: the router
          // said to retry later; at once, every batch written would cost it another
          // Register and full dump.
          mu_.AwaitWithTimeout(absl::Condition(&stop_), opts_.retry_interval);
          if (stop_) break;
        }
        continue;
      }
      absl::MutexLock l(&mu_);
      events_sent_ += batch.size();
    }
    // Heartbeats at half the interval the router asked for, so one late one is harmless.
    if (std::chrono::steady_clock::now() - last_heartbeat >= std::chrono::milliseconds(heartbeat_ms_ / 2)) {
      connected = heartbeat();
    }
  }
  if (stream_) stream_->WritesDone();  // returns at once if ~EventPublisher cancelled it
  CloseStream();
  Unregister();  // from this thread: RequestStop need not wait for it
}

}  // namespace kvpool::router
