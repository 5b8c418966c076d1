#include "chart.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace kvpool::kvctl {

std::string GnuplotQuote(absl::string_view s) {
  std::string q = "'";
  for (char c : s) {
    if (c == '\'') q += '\'';
    q += c;
  }
  q += '\'';
  return q;
}

absl::Status RunGnuplot(const std::string& script) {
  // A relative path that starts with '-' would read as a gnuplot option.
  const std::string arg = !script.empty() && script[0] == '-' ? "./" + script : script;
  int fds[2];
  if (pipe(fds) != 0) return absl::UnavailableError(absl::StrCat("cannot run gnuplot: pipe: ", strerror(errno)));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addclose(&actions, fds[0]);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, fds[1], STDERR_FILENO);
  posix_spawn_file_actions_addclose(&actions, fds[1]);
  char* argv[] = {const_cast<char*>("gnuplot"), const_cast<char*>(arg.c_str()), nullptr};
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, "gnuplot", &actions, nullptr, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  close(fds[1]);
  if (err != 0) {
    close(fds[0]);
    return absl::UnavailableError(absl::StrCat("cannot run gnuplot (", strerror(err), "); install gnuplot-nox"));
  }
  std::string output;
  char buf[256];
  for (;;) {
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n > 0) {
      output.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  close(fds[0]);
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    return absl::UnavailableError(absl::StrCat("gnuplot failed (exit ", code, "): ", output));
  }
  return absl::OkStatus();
}

}  // namespace kvpool::kvctl
