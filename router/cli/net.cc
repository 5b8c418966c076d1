#include "net.h"

#include <arpa/inet.h>

#include <cstdint>
#include <string>

namespace kvpool::kvctl {

bool AllowedHost(absl::string_view hostport) {
  absl::string_view host = hostport;
  if (!host.empty() && host[0] == '[') {
    host = host.substr(1, host.find(']') - 1);
  } else if (auto c = host.rfind(':'); c != absl::string_view::npos) {
    host = host.substr(0, c);
  }
  if (host == "localhost" || host == "::1") return true;
  // inet_pton takes only canonical dotted quads: 0127.0.0.1 or 010.0.0.1 (which a
  // resolver may read as octal, 87.0.0.1 and 8.0.0.1) are refused, not taken for
  // loopback or private.
  in_addr a;
  if (inet_pton(AF_INET, std::string(host).c_str(), &a) != 1) return false;
  const uint32_t v = ntohl(a.s_addr);
  const uint32_t o0 = v >> 24, o1 = (v >> 16) & 0xff;
  return o0 == 127 || o0 == 10 || (o0 == 172 && o1 >= 16 && o1 <= 31) || (o0 == 192 && o1 == 168) ||
         (o0 == 169 && o1 == 254);
}

}  // namespace kvpool::kvctl
