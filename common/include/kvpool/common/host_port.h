// Checks of host:port addresses, for --listen flags and the addresses sources register.
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

// INVALID_ARGUMENT naming the flag (e.g. "--listen") and its value when `value` is not
// a listen address (HostPortUse::kListen); OK otherwise.
absl::Status CheckListenAddress(absl::string_view flag, absl::string_view value);

}  // namespace kvpool
