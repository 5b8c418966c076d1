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

}  // namespace kvpool
