#include "kvpool/common/host_port.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvpool {

std::string HostPortProblem(absl::string_view a, HostPortUse use) {
  if (a.empty()) return "is empty";
  if (use == HostPortUse::kListen) {
    for (absl::string_view scheme : {"unix:", "unix-abstract:"}) {
      if (absl::StartsWith(a, scheme)) return a.size() > scheme.size() ? "" : "names no socket after the scheme";
    }
  }
  const size_t colon = a.rfind(':');
  if (colon == absl::string_view::npos) return "has no :port";
  const absl::string_view host = a.substr(0, colon), port = a.substr(colon + 1);
  if (host.empty()) return "has no host";
  if (host.front() == '[') {
    const absl::string_view inner = host.size() >= 2 && host.back() == ']' ? host.substr(1, host.size() - 2) : "";
    const bool ok = !inner.empty() && inner.find(':') != absl::string_view::npos &&
                    std::all_of(inner.begin(), inner.end(), [](char c) {
                      // Zone ids (after %) are interface names: br-1a2b, cali_x.
                      return absl::ascii_isalnum(c) || c == ':' || c == '.' || c == '%' || c == '-' || c == '_';
                    });
    if (!ok) return "has a bracketed host that is not an IPv6 address";
  } else if (host.find(':') != absl::string_view::npos) {
    return "has an IPv6 host without brackets (write [::1]:port)";
  } else if (!std::all_of(host.begin(), host.end(),
                          [](char c) { return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_'; })) {
    return "has a host with characters no host name or address has";
  }
  uint32_t p = 0;
  const uint32_t lowest = use == HostPortUse::kListen ? 0 : 1;
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &p) || p < lowest || p > 65535) {
    return use == HostPortUse::kListen ? "has no port in 0..65535 (0 picks one)" : "has no port in 1..65535";
  }
  return "";
}

absl::Status CheckListenAddress(absl::string_view flag, absl::string_view value) {
  const std::string why = HostPortProblem(value, HostPortUse::kListen);
  if (why.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, "='", value.substr(0, 128), "' ", why,
                                                 "; give host:port, e.g. 127.0.0.1:50051 (port 0 picks one)"));
}

absl::Status CheckDialAddress(absl::string_view flag, absl::string_view value) {
  const std::string why = HostPortProblem(value, HostPortUse::kDial);
  if (why.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, "='", value.substr(0, 128), "' ", why,
                                                 "; give host:port, e.g. 10.0.0.5:50051"));
}

absl::Status CheckDialTarget(absl::string_view flag, absl::string_view value) {
  for (absl::string_view scheme : {"unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:"}) {
    if (absl::StartsWith(value, scheme) && value.size() > scheme.size()) return absl::OkStatus();
  }
  return CheckDialAddress(flag, value);
}

bool IsUnixSocketAddress(absl::string_view address) {
  return absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
}

bool ValidSourceId(absl::string_view id) {
  if (id.empty() || id.size() > 128) return false;
  return std::all_of(id.begin(), id.end(),
                     [](char c) { return absl::ascii_isalnum(c) || c == '.' || c == '_' || c == ':' || c == '-'; });
}

absl::Status CheckSourceId(absl::string_view flag, absl::string_view value) {
  if (ValidSourceId(value)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, "='", value.substr(0, 128), "'",
                                                 value.size() > 128 ? "... (" : "", value.size() > 128 ? absl::StrCat(value.size(), " bytes)") : "",
                                                 " must be 1..128 bytes of letters, digits and . _ : -"));
}

absl::Status CheckMetricsPort(int port) {
  if (port >= -1 && port <= 65535) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--metrics-port=", port, " must be -1 (off), 0 (pick one) or a port up to 65535"));
}

absl::Status CheckServiceFlags(const ServiceFlags& f) {
  if (absl::Status s = CheckListenAddress("--listen", f.listen); !s.ok()) return s;
  if (!f.advertise.empty()) {
    if (absl::Status s = CheckDialAddress("--advertise", f.advertise); !s.ok()) return s;
  }
  if (!f.router.empty()) {
    if (absl::Status s = CheckDialTarget("--router", f.router); !s.ok()) return s;
    if (IsUnixSocketAddress(f.listen) && f.advertise.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--listen='", f.listen.substr(0, 128), "' is a Unix socket, which the router cannot hand to "
          "clients: give --advertise host:port (an address that reaches this process)"));
    }
    if (IsUnixSocketAddress(f.listen) && f.id.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("--listen='", f.listen.substr(0, 128), "' is a Unix socket: give ",
                                                     f.id_flag, " (the default id is made from the port)"));
    }
  }
  if (!f.id.empty()) {
    if (absl::Status s = CheckSourceId(f.id_flag, f.id); !s.ok()) return s;
  }
  return CheckMetricsPort(f.metrics_port);
}

}  // namespace kvpool
