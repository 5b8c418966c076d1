// Proto <-> router_core conversion, with the validation every RPC needs. Errors are
// INVALID_ARGUMENT naming the field (`block_hashes[3]`, `events[2].stored.tier`).
//
// Thread safety: free functions; `core` is only read through its thread-safe const part.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "kvpool/router/router_core.h"
#include "kvpool/v1/router.pb.h"

namespace kvpool::router {

// Limits from router.proto.
inline constexpr size_t kMaxRouteTokens = size_t{1} << 24;
inline constexpr size_t kMaxRouteHashes = size_t{1} << 20;
inline constexpr size_t kMaxBatchEvents = 65536;

absl::StatusOr<SourceInfo> SourceFromProto(const v1::RegisterRequest& req);
// Converts a batch; `source_id` receives the batch's source.
absl::StatusOr<EventBatch> BatchFromProto(const v1::EventBatch& batch, std::string* source_id);
// Validates, resolves the model and hashes tokens (thread-safe; no core lock needed).
absl::StatusOr<RouteInput> RouteFromProto(const v1::RouteRequest& req, const RouterCore& core);
absl::StatusOr<InstanceLoad> LoadFromProto(const v1::Load& load, absl::string_view field);

void DecisionToProto(const RouteDecision& d, v1::RouteResponse* out);
void StatsToProto(const RouterStatsSnapshot& s, const RouterOptions& options, v1::RouterStats* out);

}  // namespace kvpool::router
