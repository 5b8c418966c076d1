// PoolNodeService: the thin gRPC layer of kvpool-node. It validates wire fields (naming
// them), converts kvpool.v1 messages to PoolCore calls and back, and converts statuses
// once, here. No state of its own beyond what Connect hands out.
//
// Threading: Connect, Lookup, Release and GetStats use gRPC's callback API and run on
// the thread that read the request (no hand-off to a handler thread: the sync server's
// hand-offs gave Lookup p99s of 1-4 ms under load). A Lookup that would wait for NVMe
// reads is answered from `blocking_` instead (a reactor must never block). Reserve and
// Commit stay on the sync server's threads: Commit hashes megabytes per call.
//
// Thread safety: gRPC calls the handlers concurrently; PoolCore is thread-safe and the
// rest is immutable after construction (metrics are lock-free). REQUIRES: Drain() after
// the gRPC server has shut down and before the core goes.
#pragma once

#include <array>
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kvpool/metrics/metrics.h"
#include "kvpool/pool_node/pool_core.h"
#include "kvpool/v1/pool.grpc.pb.h"

namespace kvpool::pool_node {

// What Connect answers: the node's UCX worker and its registered DRAM arena.
struct ConnectInfo {
  std::string node_id;
  std::string ucx_worker_address;
  std::string arena_rkey;        // packed rkey
  std::string arena_descriptor;  // transport::RemoteArena::Serialize()
  uint64_t arena_base = 0;
  // False while the id is still to be set (pool-<port>, once the port is bound): Connect
  // answers UNAVAILABLE until SetNodeId, rather than hand out the provisional "pool-node".
  bool node_id_final = true;
};

// A few threads for work that blocks (Lookups that read NVMe), off the reactors.
class BlockingPool {
 public:
  explicit BlockingPool(int threads);
  ~BlockingPool();  // runs what is queued, then joins
  // Queues fn unless max_queued functions are waiting already: false then, fn dropped.
  bool TryRun(std::function<void()> fn, size_t max_queued);

 private:
  bool HasWorkOrStop() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); }

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

using PoolNodeServiceBase = v1::PoolNode::WithCallbackMethod_Connect<
    v1::PoolNode::WithCallbackMethod_Lookup<v1::PoolNode::WithCallbackMethod_Release<
        v1::PoolNode::WithCallbackMethod_GetStats<v1::PoolNode::Service>>>>;

class PoolNodeService final : public PoolNodeServiceBase {
 public:
  PoolNodeService(PoolCore* core, ConnectInfo info, MetricsRegistry* metrics);

  grpc::ServerUnaryReactor* Connect(grpc::CallbackServerContext*, const v1::ConnectRequest*,
                                    v1::ConnectResponse*) override;
  grpc::ServerUnaryReactor* Lookup(grpc::CallbackServerContext*, const v1::LookupRequest*,
                                   v1::LookupResponse*) override;
  grpc::Status Reserve(grpc::ServerContext*, const v1::ReserveRequest*, v1::ReserveResponse*) override;
  grpc::Status Commit(grpc::ServerContext*, const v1::CommitRequest*, v1::CommitResponse*) override;
  grpc::ServerUnaryReactor* Release(grpc::CallbackServerContext*, const v1::ReleaseRequest*,
                                    v1::ReleaseResponse*) override;
  grpc::ServerUnaryReactor* GetStats(grpc::CallbackServerContext*, const v1::GetPoolStatsRequest*,
                                     v1::PoolStats*) override;
  // Answers the Lookups still waiting for NVMe reads and stops their threads.
  void Drain() { blocking_.reset(); }
  // What Connect answers as node_id from now on (NodeServer: pool-<port> once bound).
  void SetNodeId(std::string node_id) {
    absl::MutexLock l(&node_id_mu_);
    node_id_ = std::move(node_id);
    node_id_final_ = true;
  }

 private:
  grpc::Status DoConnect(const v1::ConnectRequest* req, v1::ConnectResponse* resp);
  grpc::Status FinishLookup(absl::StatusOr<LookupAnswer> ans, v1::LookupResponse* resp,
                            std::chrono::steady_clock::time_point start);

  enum Method { kConnect, kLookup, kReserve, kCommit, kRelease, kGetStats, kNumMethods };
  // Counts the call under (method, code) and converts the status.
  grpc::Status Done(Method method, const absl::Status& s);

  PoolCore* core_;
  const ConnectInfo info_;  // node_id unused: see node_id_
  mutable absl::Mutex node_id_mu_;
  std::string node_id_ ABSL_GUARDED_BY(node_id_mu_);
  bool node_id_final_ ABSL_GUARDED_BY(node_id_mu_) = true;
  MetricsRegistry* metrics_;
  Histogram* lookup_seconds_;
  // kvpool_pool_rpcs_total{code="OK"} per method, looked up once: the registry's lookup
  // (label vector, strings, its mutex) would otherwise run on every call.
  std::array<Counter*, kNumMethods> ok_calls_;
  std::unique_ptr<BlockingPool> blocking_;
};

// Conversions shared with the client library and the router publisher.
v1::StateKind ToProto(StateKind k);
v1::Tier ToProto(Tier t);
absl::StatusOr<StateKind> FromProto(v1::StateKind k, absl::string_view field);
void FillStats(const PoolStatsSnapshot& s, v1::PoolStats* out);

}  // namespace kvpool::pool_node
