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

#include <cstdint>
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
  // The largest request the server parses (gRPC's max receive size). An event batch is
  // parsed before its stream's source is checked, so streams hold at most
  // host.max_streams times this; sources send batches of at most 4 MiB
  // (EventPublisherOptions::max_batch_bytes), a Route of 2^24 tokens takes up to 80 MiB.
  int max_message_bytes = 128 << 20;
};

// --max-message-bytes bounds: room for a source's 4 MiB batches, and what gRPC's int takes.
inline constexpr uint64_t kMinRouterMessageBytes = uint64_t{8} << 20;
inline constexpr uint64_t kMaxRouterMessageBytes = uint64_t{2047} << 20;

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
