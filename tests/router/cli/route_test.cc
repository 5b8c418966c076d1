// kvctl route against a real kvpool-router on loopback: exit codes follow kvctl.h
// (2 = bad arguments, including a request the router refuses as INVALID_ARGUMENT).
#include <sstream>

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "kvctl.h"
#include "../sim_router_test.h"

namespace kvpool {
namespace {

class RouteTest : public testing::SimRouterTest {
 protected:
  void SetUp() override { StartRouter({"sim-w0"}); }
};

TEST_F(RouteTest, RoutesAValidRequest) {
  std::ostringstream out, err;
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "route", "--router", addr_, "--tokens", "0-63", "--json"}, out, err), 0)
      << err.str();
  EXPECT_TRUE(absl::StrContains(out.str(), "sim-w0")) << out.str();
}

TEST_F(RouteTest, InvalidArgumentFromTheRouterExitsTwo) {
  // tiny-gqa's block size is not 7: the router answers INVALID_ARGUMENT.
  std::ostringstream out, err;
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "route", "--router", addr_, "--tokens", "0-63", "--block-tokens", "7"}, out,
                            err),
            2);
  EXPECT_TRUE(absl::StrContains(err.str(), "INVALID_ARGUMENT")) << err.str();
  EXPECT_TRUE(absl::StrContains(err.str(), "block_tokens=7")) << err.str();
}

TEST(RouteArgsTest, UnreachableRouterIsNotABadArgument) {
  std::ostringstream out, err;
  EXPECT_EQ(kvctl::RunKvctl({"kvctl", "route", "--router", "127.0.0.1:1", "--tokens", "1,2,3"}, out, err), 1);
}

TEST(RouteArgsTest, BadRouterAndTokenArgumentsExitTwo) {
  for (const char* router : {"", "999.999.999.999:1", "host:0"}) {
    std::ostringstream out, err;
    EXPECT_EQ(kvctl::RunKvctl({"kvctl", "route", "--router", router, "--tokens", "1"}, out, err), 2) << err.str();
    EXPECT_TRUE(absl::StrContains(err.str(), "--router=")) << err.str();
  }
  {
    // Each range fits, their sum does not: refused before 2^26 tokens are built.
    std::ostringstream out, err;
    EXPECT_EQ(kvctl::RunKvctl({"kvctl", "route", "--router", "127.0.0.1:1", "--tokens", "0-16000000",
                               "--tokens", "0-16000000"},
                              out, err),
              2);
    EXPECT_TRUE(absl::StrContains(err.str(), "more than 2^24")) << err.str();
  }
  {
    std::ostringstream out, err;
    EXPECT_EQ(kvctl::RunKvctl({"kvctl", "route", "--router", "127.0.0.1:1", "--tokens", "9-3"}, out, err), 2);
    EXPECT_TRUE(absl::StrContains(err.str(), "(A <= B)")) << err.str();
  }
}

}  // namespace
}  // namespace kvpool
