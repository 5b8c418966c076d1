// HostPortProblem / CheckListenAddress: what --listen flags and registered addresses accept.
#include "kvpool/common/host_port.h"

#include <gtest/gtest.h>

namespace kvpool {
namespace {

TEST(HostPort, DialAddresses) {
  for (const char* ok : {"127.0.0.1:50051", "pool-0.kvpool.svc:50062", "[::1]:9", "[fe80::1%eth0]:80", "[fe80::1%br-1a2b]:80",
                         "h_1:65535", "Node-7.Example.COM.:80"}) {
    EXPECT_EQ(HostPortProblem(ok, HostPortUse::kDial), "") << ok;
  }
  const std::pair<const char*, const char*> bad[] = {
      {"", "is empty"},
      {"127.0.0.1", "has no :port"},
      {":5", "has no host"},
      {"::1:5", "without brackets"},
      {"[]:5", "not an IPv6 address"},
      {"[1.2.3.4]:5", "not an IPv6 address"},
      {"a b/\n:5", "characters no host name"},
      {"h:0", "1..65535"},
      {"h:65536", "1..65535"},
      {"h:99999", "1..65535"},
      {"h:+80", "1..65535"},
      {"unix:/tmp/s", "1..65535"},  // a client dials host:port
  };
  for (const auto& [addr, why] : bad) {
    EXPECT_NE(HostPortProblem(addr, HostPortUse::kDial).find(why), std::string::npos)
        << addr << ": " << HostPortProblem(addr, HostPortUse::kDial);
  }
}

TEST(HostPort, ListenAddresses) {
  for (const char* ok : {"0.0.0.0:0", "127.0.0.1:50051", "[::]:50051", "unix:/tmp/kvpool.sock", "unix-abstract:kvpool"}) {
    EXPECT_TRUE(CheckListenAddress("--listen", ok).ok()) << ok;
  }
  const absl::Status st = CheckListenAddress("--listen", "127.0.0.1:99999");
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--listen='127.0.0.1:99999' has no port in 0..65535"), absl::string_view::npos) << st;
  EXPECT_FALSE(CheckListenAddress("--listen", "unix:").ok());
}

}  // namespace
}  // namespace kvpool
