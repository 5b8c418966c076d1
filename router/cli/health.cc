// kvctl health: probes the standard gRPC health service (grpc.health.v1) that every
// kvpool server runs — what deploy/local waits on, and what a person runs by hand.
#include <chrono>
#include <cmath>
#include <thread>

#include <CLI/CLI.hpp>
#include <grpcpp/grpcpp.h>

#include "grpc/health/v1/health.grpc.pb.h"
#include "format.h"
#include "kvctl.h"

namespace kvpool::kvctl {
namespace {

struct HealthArgs {
  std::string addr;
  std::string service;
  double wait_s = 0;
};

// The longest --wait accepted: a day. Beyond it the deadline arithmetic would overflow.
constexpr double kMaxWaitS = 86400;

void RunHealth(const HealthArgs& a, Io& io) {
  if (!std::isfinite(a.wait_s) || a.wait_s < 0 || a.wait_s > kMaxWaitS) {
    *io.err << "kvctl health: --wait=" << a.wait_s << " must be a number of seconds in [0, " << kMaxWaitS << "]\n";
    io.exit_code = 2;
    return;
  }
  auto channel = grpc::CreateChannel(a.addr, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(a.wait_s * 1000));  // <= 8.64e7
  std::string last_error;
  do {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckRequest req;
    req.set_service(a.service);
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = stub->Check(&ctx, req, &resp);
    if (s.ok() && resp.status() == grpc::health::v1::HealthCheckResponse::SERVING) {
      *io.out << a.addr << ": SERVING\n";
      io.exit_code = 0;
      return;
    }
    last_error = s.ok() ? grpc::health::v1::HealthCheckResponse::ServingStatus_Name(resp.status())
                        : s.error_message();
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  } while (true);
  *io.err << a.addr << ": not serving (" << last_error << ")\n";
  io.exit_code = 1;
}

}  // namespace

void AddHealthCommands(CLI::App& app, Io& io) {
  auto args = std::make_shared<HealthArgs>();
  CLI::App* h = app.add_subcommand("health", "Check a kvpool server's gRPC health service");
  h->add_option("--addr", args->addr, "Server address host:port")->required();
  h->add_option("--service", args->service, "Service name (default: the whole server)");
  h->add_option("--wait", args->wait_s, "Keep trying for this many seconds until SERVING (at most 86400)")
      ->check(FiniteNumber())->check(CLI::NonNegativeNumber);
  h->callback([args, &io] { RunHealth(*args, io); });
}

}  // namespace kvpool::kvctl
