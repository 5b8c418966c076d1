// kvpool-worker: serves kvpool.v1.Worker over the model runner (tiny-* presets computed
// for real) or the cache manager alone (real-shape presets, accounting mode), with a
// pool tier on kvpool-node instances and events + heartbeats to kvpool-router.
//
//   WorkerServer::Start(config)   engine thread, gRPC server (+ health), publisher, /metrics
//   DescribeConfig()              what a vLLM user looks for at start: block size, blocks,
//                                 bytes per token, cache bytes per tier, checkpoint interval
//
// Thread safety: Start/Shutdown from one thread; the server's handlers are thread-safe.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvpool::worker {

struct WorkerConfig {
  std::string listen = "127.0.0.1:50071";
  std::string advertise;             // announced to the router; default: listen
  std::string instance_id;           // default: worker-<port>
  std::string model = "tiny-gqa";    // preset name or JSON spec path
  int32_t num_blocks = 512;          // KV pages including the null page
  int32_t max_running = 32;
  int64_t max_model_len = 4096;
  bool prefix_caching = true;
  std::string hybrid_mode = "replay";
  std::string router;                // optional
  std::vector<std::string> pool_nodes;
  std::string offload = "write-through";
  std::string fetch = "auto";
  int pool_rpc_timeout_ms = 2000;
  int pool_transfer_timeout_ms = 10'000;  // a hung pool transfer stalls the engine this long at most
  int metrics_port = -1;             // 0: any free port, -1: off
  int threads = 1;                   // kernel threads
  // Requests in the worker (queued or running) and their prompt tokens, at most; more
  // are refused RESOURCE_EXHAUSTED.
  int64_t max_queued_requests = 4096;
  int64_t max_queued_tokens = int64_t{1} << 26;
  // Shutdown lets the requests already in the worker finish for up to this long (new ones
  // get UNAVAILABLE meanwhile); those still there then get UNAVAILABLE.
  int drain_timeout_ms = 10'000;
  // Fault injection (tests): model::RunnerOptions::forward_fault.
  std::function<absl::Status()> forward_fault;
  // Fault injection (tests): EngineConfig::before_write_back.
  std::function<void()> before_write_back;
};

// Parses kvpool-worker's flags. CANCELLED after --help (printed); INVALID_ARGUMENT names
// the flag.
absl::StatusOr<WorkerConfig> ParseWorkerFlags(int argc, char** argv);

class WorkerServer {
 public:
  static absl::StatusOr<std::unique_ptr<WorkerServer>> Start(WorkerConfig config);
  ~WorkerServer();

  int port() const;
  int metrics_port() const;
  std::string DescribeConfig() const;
  // New requests get UNAVAILABLE, health turns NOT_SERVING and the publisher starts to
  // unregister from the router (on its thread, up to its unregister_timeout: requests the
  // router sends meanwhile get UNAVAILABLE too); then the requests in the worker finish
  // (up to drain_timeout_ms; the rest are answered UNAVAILABLE) before the gRPC server
  // stops. Idempotent; the destructor calls it. A second signal does not cut it short.
  void Shutdown();

 private:
  struct State;
  WorkerServer();
  std::unique_ptr<State> s_;
};

// main() of kvpool-worker.
int WorkerMain(int argc, char** argv);

}  // namespace kvpool::worker
