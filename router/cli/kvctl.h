// kvctl: the router CLI. Subcommands register themselves on one CLI11 app; each file
// (calc.cc, and later route/replay/simulate) owns one command group.
//
// RunKvctl is the whole program behind main(), taking its streams as arguments so tests
// drive it in-process and read what a user would see.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace kvpool::kvctl {

// Runs kvctl with argv-style `args` (args[0] is the program name). Returns the exit
// code: 0 on success, 2 on bad arguments, 1 on other failures.
int RunKvctl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err);

// Streams a subcommand writes to; set by RunKvctl before callbacks run.
struct Io {
  std::ostream* out;
  std::ostream* err;
  int exit_code = 0;
};

// Registers `kvctl calc kv|util|ttft`.
void AddCalcCommands(CLI::App& app, Io& io);

// Registers `kvctl health` (grpc.health.v1 probe).
void AddHealthCommands(CLI::App& app, Io& io);

// Registers `kvctl route` and `kvctl status` (talk to a running kvpool-router).
void AddRouteCommands(CLI::App& app, Io& io);

// Registers `kvctl simulate` (router/sim: the cluster simulator over a trace).
void AddSimulateCommands(CLI::App& app, Io& io);

// Registers `kvctl replay` (drive a live loopback/test cluster with a trace).
void AddReplayCommands(CLI::App& app, Io& io);

// Registers `kvctl load` (open-loop Route load on a loopback/private router).
void AddLoadCommands(CLI::App& app, Io& io);

}  // namespace kvpool::kvctl
