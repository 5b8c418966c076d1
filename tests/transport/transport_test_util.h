// gtest-side helpers for the transport tests.
#pragma once

#include <chrono>
#include <future>

#include "absl/status/status.h"
#include "kvpool/transport/transport.h"

namespace kvpool::transport::testing {

// Waits for a batch. The 60 s bound is a hang guard, not a speed assertion: a batch
// must finish (OK or error) or the test fails instead of hanging CI.
inline absl::Status Await(std::future<absl::Status> f) {
  if (f.wait_for(std::chrono::seconds(60)) != std::future_status::ready) {
    return absl::DeadlineExceededError("hang guard: batch did not complete in 60 s");
  }
  return f.get();
}

// The spans of a run, by value (empty when the run is invalid; the caller's checks then
// fail on the missing bytes).
inline std::vector<std::span<std::byte>> SpansOf(const Arena& a, const PageRun& run) {
  auto s = a.Spans(run);
  if (!s.ok()) return {};
  return *std::move(s);
}

}  // namespace kvpool::transport::testing
