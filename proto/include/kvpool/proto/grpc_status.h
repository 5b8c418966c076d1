// The one pair of converters between absl::Status and grpc::Status.
//
// Both use the same canonical codes, so the conversion keeps the code and the message.
// Services convert once, at the RPC boundary; everything below speaks absl::Status.
//
// Example:
//   grpc::Status Route(...) { return kvpool::ToGrpcStatus(core_->Route(req, resp)); }
#pragma once

#include <grpcpp/support/status.h>

#include "absl/status/status.h"

namespace kvpool {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvpool
