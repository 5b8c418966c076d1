#include "kvctl.h"

#include <exception>
#include <new>

#include <CLI/CLI.hpp>

#include "kvpool/common/cli_flags.h"

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
  kvpool::RequireDecimalIntegers(app);
  try {
    app.parse(rev);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e, out, err);
    return code == 0 ? 0 : 2;
  } catch (const std::bad_alloc&) {
    err << "kvctl: out of memory; check the sizes in the arguments and input (e.g. a trace's input_length)\n";
    return 1;
  } catch (const std::exception& e) {
    // A command that throws (JSON of a non-UTF-8 path, a library error) fails cleanly
    // instead of terminating the process.
    err << "kvctl: " << e.what() << "\n";
    return 1;
  }
  return io.exit_code;
}

}  // namespace kvpool::kvctl
