#include "kvpool/common/host_port.h"

#include <arpa/inet.h>

#include <algorithm>
#include <cctype>
#include <cstdint>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvpool {

namespace {

// "" when `host` (no port, no brackets) is an IPv4 address or a DNS name, else why not.
std::string HostProblem(absl::string_view host) {
  if (std::all_of(host.begin(), host.end(), [](char c) { return absl::ascii_isdigit(c) || c == '.'; })) {
    // All digits and dots: an IPv4 address or nothing (inet_pton refuses 999.1.1.1 and
    // 0127.0.0.1, which a resolver may read as octal 87.0.0.1).
    in_addr v4;
    return inet_pton(AF_INET, std::string(host).c_str(), &v4) == 1
               ? ""
               : "has a host that is not an IPv4 address (four numbers 0..255, no leading zeros)";
  }
  if (!std::all_of(host.begin(), host.end(),
                   [](char c) { return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_'; })) {
    return "has a host with characters no host name or address has";
  }
  absl::string_view name = host;
  if (absl::EndsWith(name, ".")) name.remove_suffix(1);  // a fully qualified name
  if (name.empty() || name.size() > 253) return "has a host name that is empty or longer than 253 characters";
  for (absl::string_view label : absl::StrSplit(name, '.')) {
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return "has a host name with an empty label, one over 63 characters, or one that starts or ends with '-'";
    }
  }
  return "";
}


}  // namespace

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
    absl::string_view inner = host.size() >= 2 && host.back() == ']' ? host.substr(1, host.size() - 2) : "";
    // A zone id (after %) is an interface name: br-1a2b, cali_x.
    const size_t pct = inner.find('%');
    const absl::string_view zone = pct == absl::string_view::npos ? "" : inner.substr(pct + 1);
    if (pct != absl::string_view::npos) inner = inner.substr(0, pct);
    in6_addr v6;
    const bool ok = !inner.empty() && inet_pton(AF_INET6, std::string(inner).c_str(), &v6) == 1 &&
                    (pct == absl::string_view::npos ||
                     (!zone.empty() && std::all_of(zone.begin(), zone.end(), [](char c) {
                       return absl::ascii_isalnum(c) || c == '.' || c == '-' || c == '_';
                     })));
    if (!ok) return "has a bracketed host that is not an IPv6 address";
  } else if (host.find(':') != absl::string_view::npos) {
    return "has an IPv6 host without brackets (write [::1]:port)";
  } else if (std::string why = HostProblem(host); !why.empty()) {
    return why;
  }
  if (use == HostPortUse::kDial && IsUnspecifiedHost(host)) {
    return "has an unspecified (wildcard) host, which names no one machine: give an address peers can reach";
  }
  uint32_t p = 0;
  const uint32_t lowest = use == HostPortUse::kListen ? 0 : 1;
  if (port.empty() || port.size() > 5 || !std::all_of(port.begin(), port.end(), absl::ascii_isdigit) ||
      !absl::SimpleAtoi(port, &p) || p < lowest || p > 65535) {
    return use == HostPortUse::kListen ? "has no port in 0..65535 (0 picks one)" : "has no port in 1..65535";
  }
  return "";
}

bool IsUnspecifiedHost(absl::string_view host) {
  if (!host.empty() && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (const size_t pct = host.find('%'); pct != absl::string_view::npos) host = host.substr(0, pct);
  const std::string h(host);
  in_addr v4;
  in6_addr v6;
  if (inet_pton(AF_INET, h.c_str(), &v4) == 1) return v4.s_addr == 0;
  return inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_UNSPECIFIED(&v6);
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
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(absl::StrCat(flag, "='", value.substr(0, 128), "' ", why,
                                                   "; give host:port (e.g. 10.0.0.5:50051) or a gRPC target "
                                                   "(unix:PATH, dns:HOST[:PORT], ipv4:A.B.C.D:PORT[,...], ipv6:[ADDR]:PORT[,...])"));
  };
  for (absl::string_view scheme : {"unix:", "unix-abstract:"}) {
    if (!absl::StartsWith(value, scheme)) continue;
    return value.size() > scheme.size() ? absl::OkStatus() : bad("names no socket after the scheme");
  }
  // The port is optional after these schemes (gRPC then uses 443).
  auto host_maybe_port = [](absl::string_view item) {
    if (HostPortProblem(item, HostPortUse::kDial).empty()) return true;
    if (!item.empty() && item.front() == '[') return HostPortProblem(absl::StrCat(item, ":1"), HostPortUse::kDial).empty();
    return item.find(':') == absl::string_view::npos && HostProblem(item).empty();
  };
  if (absl::StartsWith(value, "dns:")) {
    absl::string_view rest = value.substr(4);
    if (absl::StartsWith(rest, "//")) {  // dns://AUTHORITY/HOST[:PORT]
      const size_t slash = rest.find('/', 2);
      rest = slash == absl::string_view::npos ? "" : rest.substr(slash + 1);
    }
    return host_maybe_port(rest) ? absl::OkStatus() : bad("names no host[:port] after dns:");
  }
  for (absl::string_view scheme : {"ipv4:", "ipv6:"}) {
    if (!absl::StartsWith(value, scheme)) continue;
    const bool v4 = scheme == "ipv4:";
    for (absl::string_view item : absl::StrSplit(value.substr(scheme.size()), ',')) {
      in6_addr any;
      const bool bare = !item.empty() && item.front() != '[' &&
                        inet_pton(v4 ? AF_INET : AF_INET6, std::string(item).c_str(), &any) == 1;
      const bool with_port = (v4 ? item.find('[') == absl::string_view::npos : !item.empty() && item.front() == '[') &&
                             host_maybe_port(item) && (!v4 || std::isdigit(static_cast<unsigned char>(item.front())));
      if (!bare && !with_port) {
        return bad(absl::StrCat("has '", item.substr(0, 64), "', not an ", v4 ? "IPv4" : "IPv6", " address[:port]"));
      }
    }
    return absl::OkStatus();
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
