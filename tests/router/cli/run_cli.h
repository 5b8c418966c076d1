// Runs kvctl in-process, as a shell would run the binary: the shared helper of the kvctl
// tests.
#pragma once

#include <sstream>
#include <string>
#include <vector>

#include "kvctl.h"

namespace kvpool::kvctl::cli_test {

struct Result {
  int code;
  std::string out;
  std::string err;
};

// `args` without the program name.
inline Result RunCli(std::vector<std::string> args) {
  args.insert(args.begin(), "kvctl");
  std::ostringstream out, err;
  const int code = RunKvctl(args, out, err);
  return {code, out.str(), err.str()};
}

}  // namespace kvpool::kvctl::cli_test
