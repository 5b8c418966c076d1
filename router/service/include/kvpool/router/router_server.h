// RouterServer: the kvpool-router process minus main(): the gRPC kvpool.v1.Router service
// (callback API) with the gRPC health service and server reflection, plus the Prometheus
// endpoint, around one RouterHost.
//
// Example:
//   RouterServerOptions o;
//   o.listen = "127.0.0.1:0";  // port 0 picks a free port
//   ASSIGN_OR_RETURN(auto server, RouterServer::Start(o));
//   std::cout << server->port();
//   server->Wait();            // until Shutdown() from another thread
//
// Thread safety: all methods are thread-safe; Shutdown is idempotent.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvpool/router/router_host.h"

namespace kvpool::router {

struct RouterServerOptions {
  RouterHostOptions host;
  std::string listen = "0.0.0.0:50051";
  std::string metrics_host = "0.0.0.0";
  int metrics_port = 9101;  // 0 picks a free port, -1 disables /metrics
  int max_message_bytes = 128 << 20;
};

class RouterServer {
 public:
  // UNAVAILABLE when it cannot listen; INVALID_ARGUMENT for bad options (names the flag).
  static absl::StatusOr<std::unique_ptr<RouterServer>> Start(RouterServerOptions options);
  ~RouterServer();

  int port() const;
  int metrics_port() const;  // -1 when disabled
  RouterHost& host();
  void Wait();
  void Shutdown();

 private:
  struct Impl;
  explicit RouterServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// The whole kvpool-router program: flags (CLI11), config printout, serve until
// SIGINT/SIGTERM. Returns the exit code.
int RunRouterMain(int argc, char** argv);

}  // namespace kvpool::router
