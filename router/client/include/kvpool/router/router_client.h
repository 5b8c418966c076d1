// RouterClient: a small synchronous client of kvpool.v1.Router for workers, pool nodes,
// kvctl and tests. Services link this library, never the router's internals.
//
// Example:
//   ASSIGN_OR_RETURN(auto router, RouterClient::Connect("127.0.0.1:50051"));
//   v1::RouteRequest req;
//   req.mutable_model()->set_name("tiny-gqa");
//   for (uint32_t t : tokens) req.add_tokens(t);
//   ASSIGN_OR_RETURN(v1::RouteResponse r, router->Route(req));
//
// Errors come back as absl::Status with the server's code and message.
//
// Thread safety: all methods are thread-safe (one channel, shared).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvpool/v1/router.grpc.pb.h"

namespace kvpool::router {

class RouterClient {
 public:
  // Opens a channel to `address` (host:port) and waits until it is ready or `timeout`
  // passes (UNAVAILABLE naming the address).
  static absl::StatusOr<std::unique_ptr<RouterClient>> Connect(const std::string& address,
                                                               absl::Duration timeout = absl::Seconds(5));

  absl::StatusOr<v1::RouteResponse> Route(const v1::RouteRequest& req, absl::Duration deadline = absl::Seconds(10));
  absl::StatusOr<v1::RegisterResponse> Register(const v1::RegisterRequest& req);
  absl::StatusOr<v1::HeartbeatResponse> Heartbeat(const v1::HeartbeatRequest& req,
                                                  absl::Duration deadline = absl::Seconds(10));
  // Drops `source_id` (only its registration `registration` when that is not 0; NOT_FOUND
  // once the source registered again, or is unknown).
  absl::Status Unregister(const std::string& source_id, uint64_t registration,
                          absl::Duration deadline = absl::Seconds(2));
  absl::StatusOr<v1::RouterStats> GetStats();
  // Sends `batches` on one PublishEvents stream and returns the router's summary.
  absl::StatusOr<v1::PublishEventsResponse> PublishEvents(const std::vector<v1::EventBatch>& batches,
                                                          absl::Duration deadline = absl::Seconds(30));

  const std::string& address() const { return address_; }
  v1::Router::Stub& stub() { return *stub_; }  // for async callers (benchmarks)

 private:
  RouterClient(std::string address, std::shared_ptr<grpc::Channel> channel);
  std::string address_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Router::Stub> stub_;
};

}  // namespace kvpool::router
