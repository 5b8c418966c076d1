// MonotonicNow(): the time for timeouts and expiries, as an absl::Time: the wall clock
// when first called plus the monotonic time since. A wall-clock step (NTP, `date -s`)
// moves neither a timeout nor an expiry: absl::Now() stepped forward would end every
// one at once, stepped back would stretch each by the step. Close to the wall clock
// (for logs and displays) as long as nobody steps it.
//
// Example:
//   const absl::Time retry_at = MonotonicNow() + absl::Seconds(2);
//   if (MonotonicNow() < retry_at) return;  // still waiting
//
// Thread safety: thread-safe.
#pragma once

#include <chrono>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvpool {

inline absl::Time MonotonicNow() {
  static const absl::Time wall0 = absl::Now();
  static const std::chrono::steady_clock::time_point steady0 = std::chrono::steady_clock::now();
  return wall0 + absl::FromChrono(std::chrono::steady_clock::now() - steady0);
}

}  // namespace kvpool
