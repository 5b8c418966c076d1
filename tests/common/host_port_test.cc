// HostPortProblem / CheckListenAddress: what --listen flags and registered addresses accept.
#include "kvpool/common/host_port.h"
#include "kvpool/common/service_main.h"

#include <gtest/gtest.h>

#include <string>

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
      {"[:]:1", "not an IPv6 address"},
      {"[fe80::1%]:80", "not an IPv6 address"},
      {"999.999.999.999:1", "not an IPv4 address"},
      {"0127.0.0.1:50051", "not an IPv4 address"},  // octal 87.0.0.1 to some resolvers
      {"1.2.3:80", "not an IPv4 address"},
      {"-:1", "starts or ends with '-'"},
      {"...:1", "not an IPv4 address"},
      {"a..b:1", "empty label"},
      {"host-.example:1", "starts or ends with '-'"},
      {"0.0.0.0:50062", "unspecified"},  // a listening wildcard: dialing it reaches the dialer itself
      {"[::]:50062", "unspecified"},
      {"[::0]:50062", "unspecified"},
  };
  for (const auto& [addr, why] : bad) {
    EXPECT_NE(HostPortProblem(addr, HostPortUse::kDial).find(why), std::string::npos)
        << addr << ": " << HostPortProblem(addr, HostPortUse::kDial);
  }
}

TEST(HostPort, DialTargets) {
  for (const char* ok : {"10.0.0.5:50051", "unix:/tmp/s", "unix-abstract:x", "dns:router.kvpool.svc:50051",
                         "dns:router", "dns:///router:50051", "dns://8.8.8.8/router:1", "ipv4:127.0.0.1:5,10.0.0.1:6",
                         "ipv4:127.0.0.1", "ipv6:[::1]:5", "ipv6:::1", "ipv6:[fe80::1%eth0]:7,[::1]:8"}) {
    EXPECT_TRUE(CheckDialTarget("--router", ok).ok()) << ok << ": " << CheckDialTarget("--router", ok);
  }
  for (const char* bad : {"ipv4:;;;", "ipv4:", "ipv4:1.2.3.4:5,", "ipv4:[::1]:5", "ipv4:host:5", "ipv6:1.2.3.4",
                          "ipv6:[1.2.3.4]:5", "dns:", "dns:-bad", "dns://auth", "dns:a b", "unix:", "h:0"}) {
    const absl::Status st = CheckDialTarget("--router", bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(st.message().find("--router="), absl::string_view::npos) << st;
  }
}

// A wildcard listen address advertises loopback (with the bound port), whatever its
// spelling: [::0] passed through before, and every Register with it was refused.
TEST(HostPort, AdvertisedAddressIsNeverAWildcard) {
  for (const char* listen : {"0.0.0.0:0", "[::]:0", "[::0]:0", "[0:0:0:0:0:0:0:0]:0"}) {
    const std::string a = AdvertiseAddress(listen, "", 50061);
    EXPECT_EQ(a, "127.0.0.1:50061") << listen;
    EXPECT_EQ(HostPortProblem(a, HostPortUse::kDial), "") << listen;
  }
  EXPECT_EQ(AdvertiseAddress("10.0.0.5:0", "", 7), "10.0.0.5:7");
  EXPECT_EQ(AdvertiseAddress("0.0.0.0:0", "pool-0.kvpool.svc:50061", 7), "pool-0.kvpool.svc:50061");
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

TEST(HostPort, SourceIds) {
  EXPECT_TRUE(ValidSourceId("worker-50071"));
  EXPECT_TRUE(ValidSourceId("pool.a_1:x"));
  EXPECT_FALSE(ValidSourceId(""));
  EXPECT_FALSE(ValidSourceId("a b"));
  EXPECT_FALSE(ValidSourceId("worker-/tmp/w.sock"));
  EXPECT_TRUE(ValidSourceId(std::string(128, 'a')));
  EXPECT_FALSE(ValidSourceId(std::string(129, 'a')));
  const absl::Status st = CheckSourceId("--node-id", std::string(300, 'x'));
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("--node-id="), absl::string_view::npos) << st;
  EXPECT_NE(st.message().find("300 bytes"), absl::string_view::npos) << st;
  EXPECT_LT(st.message().size(), 300u) << st;
}

// The flags kvpool-node and kvpool-worker share: each refusal names its flag.
TEST(HostPort, ServiceFlags) {
  auto refused = [](ServiceFlags f, const std::string& flag) {
    const absl::Status st = CheckServiceFlags(f);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_NE(st.message().find(flag), absl::string_view::npos) << st;
  };
  const ServiceFlags ok{.listen = "0.0.0.0:0", .advertise = "", .router = "10.0.0.1:50051", .id_flag = "--node-id", .id = "", .metrics_port = 0};
  EXPECT_TRUE(CheckServiceFlags(ok).ok());
  ServiceFlags f = ok;
  f.advertise = "pool-a";  // no port: the router would refuse every registration
  refused(f, "--advertise");
  f = ok;
  f.router = "router";
  refused(f, "--router");
  for (const char* target : {"unix:/run/kvpool-router.sock", "dns:///router.kvpool:50051", "ipv4:10.0.0.1:50051"}) {
    f.router = target;  // gRPC targets this process dials itself
    EXPECT_TRUE(CheckServiceFlags(f).ok()) << target;
  }
  f.router = "dns:";
  refused(f, "--router");
  f = ok;
  f.id = "a b";
  refused(f, "--node-id");
  f = ok;
  f.metrics_port = -7;
  refused(f, "--metrics-port");
  f.metrics_port = 70000;
  refused(f, "--metrics-port");
  f = ok;
  f.listen = "unix-abstract:kvpool";  // the router cannot hand a Unix socket to clients
  refused(f, "--advertise");
  f.advertise = "10.0.0.2:50061";
  refused(f, "--node-id");  // the default id is made from a port
  f.id = "pool-a";
  EXPECT_TRUE(CheckServiceFlags(f).ok());
  f.router = "";  // no router: nothing to announce
  f.advertise = "";
  f.id = "";
  EXPECT_TRUE(CheckServiceFlags(f).ok());
  EXPECT_TRUE(CheckMetricsPort(-1).ok());
  EXPECT_TRUE(CheckMetricsPort(0).ok());
  EXPECT_TRUE(CheckMetricsPort(65535).ok());
}

}  // namespace
}  // namespace kvpool
