#include "net.h"

#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

namespace kvpool::kvctl {

bool AllowedHost(absl::string_view hostport) {
  absl::string_view host = hostport;
  if (!host.empty() && host[0] == '[') {
    host = host.substr(1, host.find(']') - 1);
  } else if (auto c = host.rfind(':'); c != absl::string_view::npos) {
    host = host.substr(0, c);
  }
  if (host == "localhost" || host == "::1") return true;
  std::vector<absl::string_view> parts = absl::StrSplit(host, '.');
  if (parts.size() != 4) return false;
  int o[4];
  for (int i = 0; i < 4; ++i) {
    if (!absl::SimpleAtoi(parts[static_cast<size_t>(i)], &o[i]) || o[i] < 0 || o[i] > 255) return false;
  }
  return o[0] == 127 || o[0] == 10 || (o[0] == 172 && o[1] >= 16 && o[1] <= 31) || (o[0] == 192 && o[1] == 168) ||
         (o[0] == 169 && o[1] == 254);
}

}  // namespace kvpool::kvctl
