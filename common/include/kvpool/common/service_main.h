// The main() shared by kvpool's service binaries (kvpool-node, kvpool-worker):
//
//   flags ──► Start ──► print DescribeConfig() ──► wait for SIGINT/SIGTERM ──► destroy
//   exit 0 after --help (flag parsing answers CANCELLED), 2 for bad flags, 1 when the
//   server cannot start (the message names the flag and the fix).
//
// Example:
//   int NodeMain(int argc, char** argv) {
//     return RunServiceMain("kvpool-node", ParseNodeFlags(argc, argv), &NodeServer::Start);
//   }
//
// Thread safety: call once, from main.
#pragma once

#include <iostream>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace kvpool {

// Process-wide settings; every kvpool binary calls it first thing in main() (RunServiceMain
// does). In builds with NDEBUG it turns absl::Mutex deadlock detection off: Debian's
// libabsl is compiled without NDEBUG, so otherwise every Mutex::Lock in the process (ours
// and gRPC's) updates a global lock graph under a global spinlock. Tests keep it on.
void InitProcess();

// Blocks until the process receives SIGINT or SIGTERM (installs the handlers).
void WaitForTerminationSignal();

// The address a server announces to others: `advertise` when given, else `listen` with
// the port actually bound (so --listen=host:0 announces the real port) and a wildcard
// host (0.0.0.0, [::], empty) replaced by 127.0.0.1.
std::string AdvertiseAddress(const std::string& listen, const std::string& advertise, int bound_port);

template <typename Config, typename Server>
int RunServiceMain(const char* program, absl::StatusOr<Config> config,
                   absl::StatusOr<std::unique_ptr<Server>> (*start)(Config)) {
  InitProcess();
  if (!config.ok()) {
    if (absl::IsCancelled(config.status())) return 0;  // --help
    std::cerr << program << ": " << config.status().message() << "\n";
    return 2;
  }
  absl::StatusOr<std::unique_ptr<Server>> server = start(*std::move(config));
  if (!server.ok()) {
    std::cerr << program << ": " << server.status().message() << "\n";
    return 1;
  }
  std::cout << (*server)->DescribeConfig() << std::flush;
  WaitForTerminationSignal();
  std::cout << program << ": shutting down\n" << std::flush;
  server->reset();
  return 0;
}

}  // namespace kvpool
