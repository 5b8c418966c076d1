#include "kvpool/router/router_client.h"

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "kvpool/proto/grpc_status.h"

namespace kvpool::router {

namespace {
std::chrono::system_clock::time_point Deadline(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}
}  // namespace

RouterClient::RouterClient(std::string address, std::shared_ptr<grpc::Channel> channel)
    : address_(std::move(address)), channel_(std::move(channel)), stub_(v1::Router::NewStub(channel_)) {}

absl::StatusOr<std::unique_ptr<RouterClient>> RouterClient::Connect(const std::string& address,
                                                                   absl::Duration timeout) {
  if (address.empty()) return absl::InvalidArgumentError("--router: empty; give host:port");
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(128 << 20);
  args.SetMaxSendMessageSize(128 << 20);
  auto channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (!channel->WaitForConnected(Deadline(timeout))) {
    return absl::UnavailableError(absl::StrCat("router at ", address, " is not reachable within ",
                                               absl::FormatDuration(timeout), "; is kvpool-router running there?"));
  }
  return std::unique_ptr<RouterClient>(new RouterClient(address, std::move(channel)));
}

absl::StatusOr<v1::RouteResponse> RouterClient::Route(const v1::RouteRequest& req, absl::Duration deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(deadline));
  v1::RouteResponse resp;
  grpc::Status s = stub_->Route(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<v1::RegisterResponse> RouterClient::Register(const v1::RegisterRequest& req) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(absl::Seconds(10)));
  v1::RegisterResponse resp;
  grpc::Status s = stub_->Register(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<v1::HeartbeatResponse> RouterClient::Heartbeat(const v1::HeartbeatRequest& req,
                                                               absl::Duration deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(deadline));
  v1::HeartbeatResponse resp;
  grpc::Status s = stub_->Heartbeat(&ctx, req, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::Status RouterClient::Unregister(const std::string& source_id, uint64_t registration, absl::Duration deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(deadline));
  v1::UnregisterRequest req;
  req.set_source_id(source_id);
  req.set_registration(registration);
  v1::UnregisterResponse resp;
  grpc::Status s = stub_->Unregister(&ctx, req, &resp);
  return s.ok() ? absl::OkStatus() : FromGrpcStatus(s);
}

absl::StatusOr<v1::RouterStats> RouterClient::GetStats() {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(absl::Seconds(10)));
  v1::RouterStats resp;
  grpc::Status s = stub_->GetStats(&ctx, v1::GetRouterStatsRequest{}, &resp);
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

absl::StatusOr<v1::PublishEventsResponse> RouterClient::PublishEvents(const std::vector<v1::EventBatch>& batches,
                                                                      absl::Duration deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(deadline));
  v1::PublishEventsResponse resp;
  std::unique_ptr<grpc::ClientWriter<v1::EventBatch>> writer = stub_->PublishEvents(&ctx, &resp);
  for (const v1::EventBatch& b : batches) {
    if (!writer->Write(b)) break;  // the server finished early: Finish() says why
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  if (!s.ok()) return FromGrpcStatus(s);
  return resp;
}

}  // namespace kvpool::router
