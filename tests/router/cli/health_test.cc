// kvctl health against a real gRPC server running the standard health service.
#include <sstream>

#include <grpcpp/grpcpp.h>
#include <grpcpp/health_check_service_interface.h>
#include <gtest/gtest.h>

#include "kvctl.h"
#include "kvpool/v1/worker.grpc.pb.h"

namespace kvpool::kvctl {
namespace {

int Health(const std::string& addr, std::string& out, std::string& err) {
  std::ostringstream o, e;
  int code = RunKvctl({"kvctl", "health", "--addr", addr, "--wait", "5"}, o, e);
  out = o.str();
  err = e.str();
  return code;
}

TEST(KvctlHealthTest, ReportsServingForALiveServer) {
  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  // Any callback service will do: the health service rides along with it.
  v1::Worker::CallbackService unimplemented;
  builder.RegisterService(&unimplemented);
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  ASSERT_GT(port, 0);
  std::string out, err;
  EXPECT_EQ(Health("127.0.0.1:" + std::to_string(port), out, err), 0) << err;
  EXPECT_NE(out.find("SERVING"), std::string::npos);

  server->GetHealthCheckService()->SetServingStatus(false);
  std::ostringstream o, e;
  EXPECT_EQ(RunKvctl({"kvctl", "health", "--addr", "127.0.0.1:" + std::to_string(port)}, o, e), 1);
  EXPECT_NE(e.str().find("NOT_SERVING"), std::string::npos) << e.str();
  server->Shutdown();
}

TEST(KvctlHealthTest, FailsForAClosedPort) {
  std::ostringstream o, e;
  // Port 1 on loopback: nothing listens there.
  EXPECT_EQ(RunKvctl({"kvctl", "health", "--addr", "127.0.0.1:1"}, o, e), 1);
  EXPECT_NE(e.str().find("not serving"), std::string::npos);
}

TEST(KvctlHealthTest, AbsurdWaitIsABadArgument) {
  // --wait 1e19 used to overflow the conversion to milliseconds: one try, no wait.
  for (const char* wait : {"1e19", "86401", "inf", "nan"}) {
    std::ostringstream o, e;
    EXPECT_EQ(RunKvctl({"kvctl", "health", "--addr", "127.0.0.1:1", "--wait", wait}, o, e), 2) << wait;
    EXPECT_NE(e.str().find("--wait"), std::string::npos) << wait << ": " << e.str();
  }
}

}  // namespace
}  // namespace kvpool::kvctl
