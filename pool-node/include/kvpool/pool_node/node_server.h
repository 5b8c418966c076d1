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

#include <cstdint>
#include <memory>
#include <optional>
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
  // --node-id was given: pool.node_id is used as is (else PoolOptions' default name, or
  // an empty one, becomes pool-<port> once the port is bound).
  bool node_id_given = false;
};

// Parses the kvpool-node command line. Errors name the flag. Refuses a --dram the host
// cannot back (CheckDramFitsHost on ReadHostMemory()).
absl::StatusOr<NodeConfig> ParseNodeFlags(int argc, char** argv);

// What the host can back a DRAM arena with. UCX allocates the arena as sysv shared
// memory; when shmget refuses (size above the sysv limit) it falls back, silently, to a
// posix file in /dev/shm that it fills with write(): a --dram larger than that file
// system's free space then hangs startup and leaves the file behind.
struct HostMemory {
  uint64_t mem_total = 0;              // MemTotal of /proc/meminfo
  uint64_t sysv_max = 0;               // min(kernel.shmmax, kernel.shmall pages)
  std::optional<uint64_t> shm_free;    // free bytes of /dev/shm (statvfs); unset: unknown
};
HostMemory ReadHostMemory();

// InvalidArgument naming --dram and the limit when dram_bytes exceeds MemTotal, or
// exceeds the sysv limit and the free space of /dev/shm; OK otherwise.
absl::Status CheckDramFitsHost(uint64_t dram_bytes, const HostMemory& host);

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
