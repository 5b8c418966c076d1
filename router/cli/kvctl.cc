#include "kvctl.h"

#include <CLI/CLI.hpp>

namespace kvpool::kvctl {

int RunKvctl(const std::vector<std::string>& args, std::ostream& out, std::ostream& err) {
  CLI::App app{"kvctl: the kvpool router CLI (calculators, routing, load tests, simulation)",
               "kvctl"};
  app.require_subcommand(1);
  Io io{&out, &err};
  AddCalcCommands(app, io);
  AddHealthCommands(app, io);
  AddRouteCommands(app, io);
  AddSimulateCommands(app, io);
  AddReplayCommands(app, io);
  AddLoadCommands(app, io);

  std::vector<std::string> rev(args.rbegin(), args.rend() - (args.empty() ? 0 : 1));
  try {
    app.parse(rev);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e, out, err);
    return code == 0 ? 0 : 2;
  }
  return io.exit_code;
}

}  // namespace kvpool::kvctl
