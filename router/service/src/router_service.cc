// The gRPC layer: kvpool.v1.Router on the callback API. It only converts protos
// (convert.h) and delegates to RouterHost; nothing here blocks a reactor thread for
// longer than one core operation.
#include <atomic>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>

#include "absl/strings/str_cat.h"
#include "convert.h"
#include "kvpool/common/host_port.h"
#include "kvpool/common/status.h"
#include "kvpool/proto/grpc_status.h"
#include "kvpool/router/router_server.h"
#include "kvpool/v1/router.grpc.pb.h"

namespace kvpool::router {
namespace {

constexpr int kMaxCompletedPerHeartbeat = 65536;

// Keepalive: a worker that vanished without a reset (host down, SIGSTOP) would hold one
// of max_streams for ~2 h of TCP keepalive; with these its stream ends within ~40 s.
// Publishers ping every 10 s (EventPublisherOptions::keepalive_time); pings closer than
// kMinClientPingInterval count as strikes and too many close the connection.
constexpr int kKeepaliveTimeMs = 30'000;
constexpr int kKeepaliveTimeoutMs = 10'000;
constexpr int kMinClientPingIntervalMs = 5'000;

// One PublishEvents stream. At any moment either a read or an apply is pending, never
// both, so the reactor needs no lock: read -> convert -> Enqueue -> (applier) OnApplied
// -> read ... -> client half-closes -> Finish with the totals. A stream whose source
// registered again after it began finishes with ABORTED at its next batch. A stream that
// ends any other way (cancelled, cut, or finished here with an error) may have lost
// events its client already wrote, with no later sequence number to show it: its source
// is marked stale at the end (RouterHost::StreamLost), so a heartbeat asks for a full
// dump: its next one, or, where the source was stale already and asked, one within the
// heartbeat timeout (RouterCore::Heartbeat asks once per timeout).
class EventsReactor : public grpc::ServerReadReactor<v1::EventBatch> {
 public:
  EventsReactor(RouterHost* host, v1::PublishEventsResponse* response) : host_(host), response_(response) {
    absl::Status s = host_->OpenStream();
    if (!s.ok()) {
      Finish(ToGrpcStatus(s));
      return;
    }
    opened_ = true;
    StartRead(&batch_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // half-close or cancellation: every batch read so far is applied
      Finish(grpc::Status::OK);
      return;
    }
    std::string source;
    absl::StatusOr<EventBatch> b = BatchFromProto(batch_, &source);
    if (!b.ok()) {
      if (source_.empty() && !source.empty()) {  // the stream's first batch: still its source's
        registration_ = batch_.registration() != 0 ? batch_.registration() : host_->RegistrationOf(source);
        source_ = source;
      }
      Fail(b.status());
      return;
    }
    if (!source_.empty() && source != source_) {
      Fail(absl::InvalidArgumentError(absl::StrCat("source_id=\"", source, "\" but this stream started as \"",
                                                   source_, "\"; use one stream per source")));
      return;
    }
    if (!source_.empty() && batch_.registration() != 0 && batch_.registration() != registration_) {
      Fail(absl::InvalidArgumentError(absl::StrCat("registration=", batch_.registration(),
                                                   " but this stream started with registration=", registration_,
                                                   "; open a new stream after each Register")));
      return;
    }
    if (source_.empty()) {
      // The stream belongs to the registration its first batch names (the source's
      // RegisterResponse.registration), or else to the one its source has now; once the
      // source registers again, its batches are refused (ABORTED). Taken before Enqueue:
      // the next OnReadDone may run on another thread as soon as this batch is applied.
      registration_ = batch_.registration() != 0 ? batch_.registration() : host_->RegistrationOf(source);
      source_ = source;
    }
    host_->Enqueue(std::move(source), registration_, std::move(*b),
                   [this](absl::StatusOr<EventsResult> r) { OnApplied(std::move(r)); });
  }

  // Runs before OnDone (gRPC orders them), possibly on another thread while a batch is
  // applied: hence the atomic.
  void OnCancel() override { lost_.store(true, std::memory_order_relaxed); }

  void OnDone() override {
    // A registration that is no longer current (the ABORTED case) is left alone there.
    if (lost_.load(std::memory_order_relaxed) && !source_.empty()) host_->StreamLost(source_, registration_);
    if (opened_) host_->CloseStream();
    delete this;
  }

 private:
  // Finishes with `s` (not OK): the batch in hand, and any the client wrote after it, are
  // not applied.
  void Fail(const absl::Status& s) {
    lost_.store(true, std::memory_order_relaxed);
    Finish(ToGrpcStatus(s));
  }

  void OnApplied(absl::StatusOr<EventsResult> r) {
    if (!r.ok()) {
      Fail(r.status());
      return;
    }
    response_->set_events_applied(response_->events_applied() + r->apply.applied);
    response_->set_last_sequence(r->apply.last_sequence);
    response_->set_full_dump_requested(r->full_dump_requested);
    StartRead(&batch_);
  }

  RouterHost* const host_;
  v1::PublishEventsResponse* const response_;
  v1::EventBatch batch_;
  std::string source_;
  uint64_t registration_ = 0;  // the first batch's registration, else RegistrationOf(source_) then
  bool opened_ = false;
  std::atomic<bool> lost_{false};  // events the client wrote may not have been applied
};

class RouterService final : public v1::Router::CallbackService {
 public:
  explicit RouterService(RouterHost* host) : host_(host) {}

  grpc::ServerUnaryReactor* Route(grpc::CallbackServerContext* ctx, const v1::RouteRequest* req,
                                  v1::RouteResponse* resp) override {
    return Done(ctx, DoRoute(*req, resp));
  }
  grpc::ServerReadReactor<v1::EventBatch>* PublishEvents(grpc::CallbackServerContext*,
                                                         v1::PublishEventsResponse* resp) override {
    return new EventsReactor(host_, resp);
  }
  grpc::ServerUnaryReactor* Register(grpc::CallbackServerContext* ctx, const v1::RegisterRequest* req,
                                     v1::RegisterResponse* resp) override {
    return Done(ctx, DoRegister(*req, resp));
  }
  grpc::ServerUnaryReactor* Unregister(grpc::CallbackServerContext* ctx, const v1::UnregisterRequest* req,
                                       v1::UnregisterResponse*) override {
    if (absl::Status bad = CheckRegisteredId(req->source_id()); !bad.ok()) return Done(ctx, bad);
    return Done(ctx, host_->Unregister(req->source_id(), req->registration()));
  }
  grpc::ServerUnaryReactor* Heartbeat(grpc::CallbackServerContext* ctx, const v1::HeartbeatRequest* req,
                                      v1::HeartbeatResponse* resp) override {
    return Done(ctx, DoHeartbeat(*req, resp));
  }
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext* ctx, const v1::GetRouterStatsRequest*,
                                     v1::RouterStats* resp) override {
    StatsToProto(host_->Stats(), host_->options().core, resp);
    return Done(ctx, absl::OkStatus());
  }

 private:
  // A source_id as Register takes it (refused there otherwise, so never registered).
  static absl::Status CheckRegisteredId(const std::string& id) {
    if (ValidSourceId(id)) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("source_id=\"", id.substr(0, 64),
                                                   "\" must be 1..128 bytes of [A-Za-z0-9._:-] (the id the "
                                                   "source registered with)"));
  }
  static grpc::ServerUnaryReactor* Done(grpc::CallbackServerContext* ctx, const absl::Status& s) {
    grpc::ServerUnaryReactor* r = ctx->DefaultReactor();
    r->Finish(ToGrpcStatus(s));
    return r;
  }

  absl::Status DoRoute(const v1::RouteRequest& req, v1::RouteResponse* resp) {
    ASSIGN_OR_RETURN(RouteInput in, RouteFromProto(req, host_->core_for_hashing()));
    ASSIGN_OR_RETURN(RouteDecision d, host_->Route(in));
    DecisionToProto(d, resp);
    return absl::OkStatus();
  }

  absl::Status DoRegister(const v1::RegisterRequest& req, v1::RegisterResponse* resp) {
    ASSIGN_OR_RETURN(SourceInfo info, SourceFromProto(req));
    ASSIGN_OR_RETURN(const uint64_t registration, host_->Register(info));
    resp->set_registration(registration);
    resp->set_heartbeat_interval_ms(
        static_cast<uint32_t>(absl::ToInt64Milliseconds(host_->options().core.heartbeat_interval)));
    resp->set_next_sequence(1);
    return absl::OkStatus();
  }

  absl::Status DoHeartbeat(const v1::HeartbeatRequest& req, v1::HeartbeatResponse* resp) {
    RETURN_IF_ERROR(CheckRegisteredId(req.source_id()));
    // The core releases each decision under core_mu_; an unbounded list would stall
    // every Route for as long as it takes.
    if (req.completed_decisions_size() > kMaxCompletedPerHeartbeat) {
      return absl::InvalidArgumentError(absl::StrCat("completed_decisions: ", req.completed_decisions_size(),
                                                     " entries; send at most ", kMaxCompletedPerHeartbeat,
                                                     " per heartbeat"));
    }
    ASSIGN_OR_RETURN(InstanceLoad load, LoadFromProto(req.load(), "load"));
    const HeartbeatResult r =
        host_->Heartbeat(req.source_id(), load,
                         std::span<const uint64_t>(req.completed_decisions().data(), req.completed_decisions().size()));
    resp->set_full_dump_requested(r.full_dump_requested);
    resp->set_unknown_source(r.unknown_source);
    return absl::OkStatus();
  }

  RouterHost* const host_;
};

}  // namespace

struct RouterServer::Impl {
  MetricsRegistry metrics;
  std::unique_ptr<MetricsHttpServer> metrics_server;
  std::unique_ptr<RouterHost> host;
  std::unique_ptr<RouterService> service;
  std::unique_ptr<grpc::Server> server;
  int port = 0;
  absl::Mutex mu;
  bool shut_down ABSL_GUARDED_BY(mu) = false;
};

RouterServer::RouterServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

RouterServer::~RouterServer() {
  Shutdown();
  impl_->server.reset();
  impl_->service.reset();
  impl_->host.reset();  // after the server: reactors may still hold it until Shutdown returns
}

absl::StatusOr<std::unique_ptr<RouterServer>> RouterServer::Start(RouterServerOptions options) {
  RETURN_IF_ERROR(CheckListenAddress("--listen", options.listen));
  if (options.max_message_bytes < 0 || static_cast<uint64_t>(options.max_message_bytes) < kMinRouterMessageBytes) {
    return absl::InvalidArgumentError(absl::StrCat("--max-message-bytes=", options.max_message_bytes,
                                                   " is below 8 MiB (", kMinRouterMessageBytes,
                                                   "): a source's event batch takes up to 4 MiB"));
  }
  auto impl = std::make_unique<Impl>();
  ASSIGN_OR_RETURN(impl->host, RouterHost::Create(options.host, &impl->metrics));
  impl->service = std::make_unique<RouterService>(impl->host.get());

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, grpc::InsecureServerCredentials(), &impl->port);
  builder.RegisterService(impl->service.get());
  builder.SetMaxReceiveMessageSize(options.max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, kKeepaliveTimeMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, kKeepaliveTimeoutMs);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, kMinClientPingIntervalMs);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);  // our own keepalive pings
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
  impl->server = builder.BuildAndStart();
  if (impl->server == nullptr || impl->port == 0) {
    return absl::UnavailableError(absl::StrCat("could not listen on --listen=", options.listen,
                                               " (address in use or not local?)"));
  }
  impl->server->GetHealthCheckService()->SetServingStatus("kvpool.v1.Router", true);
  if (options.metrics_port >= 0) {
    auto m = MetricsHttpServer::Start(&impl->metrics, options.metrics_host, options.metrics_port);
    if (!m.ok()) {
      impl->server->Shutdown();
      return absl::UnavailableError(absl::StrCat("--metrics-port=", options.metrics_port, ": ",
                                                 m.status().message()));
    }
    impl->metrics_server = std::move(*m);
  }
  return std::unique_ptr<RouterServer>(new RouterServer(std::move(impl)));
}

int RouterServer::port() const { return impl_->port; }
int RouterServer::metrics_port() const { return impl_->metrics_server ? impl_->metrics_server->port() : -1; }
RouterHost& RouterServer::host() { return *impl_->host; }
void RouterServer::Wait() { impl_->server->Wait(); }

void RouterServer::Shutdown() {
  {
    absl::MutexLock l(&impl_->mu);
    if (impl_->shut_down) return;
    impl_->shut_down = true;
  }
  impl_->server->GetHealthCheckService()->SetServingStatus(false);
  impl_->server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  impl_->metrics_server.reset();
}

}  // namespace kvpool::router
