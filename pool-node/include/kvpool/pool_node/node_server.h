// NodeServer: kvpool-node's configuration and lifecycle.
//
//   flags -> NodeConfig -> NodeServer::Start: UCX context + worker, DRAM arena allocated
//   and registered once (transport), PoolCore over that arena (+ NVMe tier), gRPC server
//   (kvpool.v1.PoolNode + grpc.health.v1), Prometheus /metrics, router publisher.
//
// Example (what main does):
//   ASSIGN_OR_RETURN(NodeConfig cfg, ParseNodeFlags(argc, argv));
//   ASSIGN_OR_RETURN(auto server, NodeServer::Start(cfg));
//   std::cout << server->DescribeConfig();
//   server->Wait();
//
// Thread safety: Start/Shutdown/Wait from one thread; core() is thread-safe.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvpool/pool_node/pool_core.h"

namespace kvpool::pool_node {

struct NodeConfig {
  std::string listen = "0.0.0.0:50061";  // --listen host:port (port 0: pick one)
  std::string advertise;                 // --advertise: address told to the router (default: listen)
  std::string router;                    // --router host:port; empty = no router
  int metrics_port = 0;                  // --metrics-port; 0 picks a free port, -1 disables
  PoolOptions pool;                      // --node-id --dram --page-bytes --nvme-dir --nvme ...
};

// Parses the kvpool-node command line. Errors name the flag.
absl::StatusOr<NodeConfig> ParseNodeFlags(int argc, char** argv);

class NodeServer {
 public:
  static absl::StatusOr<std::unique_ptr<NodeServer>> Start(NodeConfig config);
  ~NodeServer();

  int port() const;           // the gRPC port actually bound
  int metrics_port() const;   // -1 when disabled
  PoolCore& core();
  std::string DescribeConfig() const;
  void Wait();      // until Shutdown (e.g. from a signal)
  void Shutdown();

 private:
  struct State;
  NodeServer();
  std::unique_ptr<State> s_;
};

// The whole of kvpool-node's main(): parse, start, print the configuration, serve until
// SIGINT/SIGTERM. Returns the process exit code.
int NodeMain(int argc, char** argv);

}  // namespace kvpool::pool_node
