// PoolNodeService: the thin gRPC layer of kvpool-node. It validates wire fields (naming
// them), converts kvpool.v1 messages to PoolCore calls and back, and converts statuses
// once, here. No state of its own beyond what Connect hands out.
//
// Thread safety: gRPC calls the handlers concurrently; PoolCore is thread-safe and the
// rest is immutable after construction (metrics are lock-free).
#pragma once

#include <string>

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
};

class PoolNodeService final : public kvpool::v1::PoolNode::Service {
 public:
  PoolNodeService(PoolCore* core, ConnectInfo info, MetricsRegistry* metrics);

  grpc::Status Connect(grpc::ServerContext*, const v1::ConnectRequest*, v1::ConnectResponse*) override;
  grpc::Status Lookup(grpc::ServerContext*, const v1::LookupRequest*, v1::LookupResponse*) override;
  grpc::Status Reserve(grpc::ServerContext*, const v1::ReserveRequest*, v1::ReserveResponse*) override;
  grpc::Status Commit(grpc::ServerContext*, const v1::CommitRequest*, v1::CommitResponse*) override;
  grpc::Status Release(grpc::ServerContext*, const v1::ReleaseRequest*, v1::ReleaseResponse*) override;
  grpc::Status GetStats(grpc::ServerContext*, const v1::GetPoolStatsRequest*, v1::PoolStats*) override;

 private:
  grpc::Status Done(absl::string_view method, const absl::Status& s);

  PoolCore* core_;
  const ConnectInfo info_;
  MetricsRegistry* metrics_;
  Histogram* lookup_seconds_;
};

// Conversions shared with the client library and the router publisher.
v1::StateKind ToProto(StateKind k);
v1::Tier ToProto(Tier t);
absl::StatusOr<StateKind> FromProto(v1::StateKind k, absl::string_view field);
void FillStats(const PoolStatsSnapshot& s, v1::PoolStats* out);

}  // namespace kvpool::pool_node
