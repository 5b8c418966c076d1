// Helpers shared by the transport tests and the peer helper process: byte patterns,
// hex, and a child process with line-oriented pipes (every read has a hang guard).
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/string_view.h"

extern char** environ;

namespace kvpool::transport::testing {

// Byte i of pattern `seed`: distinct per seed and offset, so a page landing in the wrong
// place or a shifted byte is caught.
inline uint8_t PatternByte(uint64_t seed, uint64_t i) {
  uint64_t x = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i + 1) * 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  x *= 0x94D049BB133111EBull;
  x ^= x >> 32;
  return static_cast<uint8_t>(x);
}

// Fills `bytes` with pattern `seed` starting at logical offset `start`.
inline void FillPattern(std::span<std::byte> bytes, uint64_t seed, uint64_t start) {
  for (size_t i = 0; i < bytes.size(); ++i) {
    bytes[i] = static_cast<std::byte>(PatternByte(seed, start + i));
  }
}

// Index of the first byte that differs from pattern `seed` at `start`, or -1.
inline int64_t FirstMismatch(std::span<const std::byte> bytes, uint64_t seed, uint64_t start) {
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (bytes[i] != static_cast<std::byte>(PatternByte(seed, start + i))) {
      return static_cast<int64_t>(i);
    }
  }
  return -1;
}

inline std::string ToHex(absl::string_view s) { return absl::BytesToHexString(s); }
inline std::string FromHex(absl::string_view s) { return absl::HexStringToBytes(s); }

// A child process with its stdin/stdout on pipes.
class Child {
 public:
  Child() = default;
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;
  ~Child() {
    Kill();
    if (in_ >= 0) close(in_);
    if (out_ >= 0) close(out_);
  }

  bool Start(const std::vector<std::string>& argv) {
    int to_child[2], from_child[2];
    if (pipe2(to_child, O_CLOEXEC) != 0 || pipe2(from_child, O_CLOEXEC) != 0) return false;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&fa, from_child[1], 1);
    std::vector<char*> args;
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    const int rc = posix_spawn(&pid_, args[0], &fa, nullptr, args.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
    close(to_child[0]);
    close(from_child[1]);
    in_ = to_child[1];
    out_ = from_child[0];
    if (rc != 0) pid_ = -1;
    return rc == 0;
  }

  pid_t pid() const { return pid_; }

  bool WriteLine(const std::string& line) {
    std::string s = line + "\n";
    return write(in_, s.data(), s.size()) == static_cast<ssize_t>(s.size());
  }

  // One line without the newline; "" on EOF or after `timeout_ms` (a hang guard).
  std::string ReadLine(int timeout_ms = 60000) {
    while (true) {
      const size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        // UCX logs to stdout: skip its lines ("[time] [host:pid] file:line UCX ...").
        if (line.find(" UCX ") != std::string::npos) continue;
        return line;
      }
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, timeout_ms) <= 0) return "";
      char tmp[65536];
      const ssize_t n = read(out_, tmp, sizeof(tmp));
      if (n <= 0) return "";
      buf_.append(tmp, n);
    }
  }

  // SIGKILL and reap; returns the wait status (or -1 when not running).
  int Kill() {
    if (pid_ <= 0) return -1;
    kill(pid_, SIGKILL);
    return Wait();
  }
  int Wait() {
    if (pid_ <= 0) return -1;
    int st = 0;
    waitpid(pid_, &st, 0);
    pid_ = -1;
    return st;
  }

 private:
  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buf_;
};

}  // namespace kvpool::transport::testing
