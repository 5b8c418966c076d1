// Checks of host:port addresses (for --listen flags and the addresses sources register),
// of the ids sources register, and of the flags the service binaries share.
//
//   if (std::string why = HostPortProblem(flag_value, HostPortUse::kListen); !why.empty())
//     return absl::InvalidArgumentError(absl::StrCat("--listen=", flag_value, ": ", why));
//
// gRPC would take "127.0.0.1:99999" and listen on port 34463 (the port modulo 65536), or
// hand a newline in a registered host to every client it routes there.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvpool {

enum class HostPortUse {
  kDial,    // an address clients connect to: port 1..65535
  kListen,  // a listen address: port 0 picks one; "unix:PATH" and "unix-abstract:NAME" are gRPC Unix sockets
};

// What is wrong with `address` as a host:port ("" when nothing): a host (a name of
// letters, digits, '.', '-' and '_'; an IPv4 address; or a bracketed IPv6 one) and a
// decimal port.
std::string HostPortProblem(absl::string_view address, HostPortUse use);

// Whether `host` (no port; brackets and a zone allowed) is a wildcard, 0.0.0.0 or any
// spelling of [::]: it names no one machine to dial.
bool IsUnspecifiedHost(absl::string_view host);

// INVALID_ARGUMENT naming the flag (e.g. "--listen") and its value when `value` is not
// a listen address (HostPortUse::kListen); OK otherwise.
absl::Status CheckListenAddress(absl::string_view flag, absl::string_view value);
// The same for an address others dial (HostPortUse::kDial: --advertise, what a source
// announces to the router and the router hands to clients).
absl::Status CheckDialAddress(absl::string_view flag, absl::string_view value);
// A gRPC target this process dials itself (--router, --pool-nodes): host:port as above,
// or a gRPC name scheme with something after it (unix:, unix-abstract:, dns:, ipv4:,
// ipv6:).
absl::Status CheckDialTarget(absl::string_view flag, absl::string_view value);
// "unix:PATH" or "unix-abstract:NAME" (a gRPC Unix socket: no host and port to announce).
bool IsUnixSocketAddress(absl::string_view address);

// The ids sources register with the router (worker instance ids, pool node ids):
// 1..128 bytes of [A-Za-z0-9._:-].
bool ValidSourceId(absl::string_view id);
// INVALID_ARGUMENT naming the flag when `value` is not a valid source id.
absl::Status CheckSourceId(absl::string_view flag, absl::string_view value);

// The flags kvpool-node and kvpool-worker share, checked before anything starts (the
// router would otherwise refuse the registration over and over, or metrics go quietly
// off); errors name the flag and the fix. `id` may be empty (defaulted from the port).
struct ServiceFlags {
  absl::string_view listen, advertise, router;
  absl::string_view id_flag, id;  // e.g. "--node-id"
  int metrics_port = 0;
};
absl::Status CheckServiceFlags(const ServiceFlags& f);
// -1 (off), 0 (pick one) or 1..65535, else INVALID_ARGUMENT naming --metrics-port.
absl::Status CheckMetricsPort(int port);

}  // namespace kvpool
