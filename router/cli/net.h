// Address checks shared by kvctl's commands that generate traffic (replay, load): they
// only drive loopback or private (test-namespace) clusters.
#pragma once

#include "absl/strings/string_view.h"

namespace kvpool::kvctl {

// Whether `hostport` ("host:port", "[v6]:port" or a bare host) names loopback
// (127/8, localhost, ::1) or a private address as used by test network namespaces
// (10/8, 172.16/12, 192.168/16, 169.254/16).
bool AllowedHost(absl::string_view hostport);

}  // namespace kvpool::kvctl
