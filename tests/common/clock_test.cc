// MonotonicNow: wall-clock steps move neither timeouts nor expiries.
#include "kvpool/common/clock.h"

#include <thread>

#include "../clock_step.h"
#include "gtest/gtest.h"

namespace kvpool {
namespace {

TEST(MonotonicNowTest, WallClockStepsMoveItNot) {
  const absl::Time before = MonotonicNow();
  for (const int64_t step_s : {-7200, 3600}) {
    g_realtime_offset_ns.store(step_s * 1'000'000'000);
    ASSERT_GT(std::abs(absl::ToInt64Seconds(absl::Now() - before)), 3000) << "the step did not reach absl::Now";
    const absl::Duration moved = MonotonicNow() - before;
    g_realtime_offset_ns.store(0);
    EXPECT_GE(moved, absl::ZeroDuration()) << step_s;
    EXPECT_LT(moved, absl::Seconds(600)) << step_s;  // steps are hours
  }
  // It goes on with the monotonic clock: at least the time slept.
  const absl::Time t0 = MonotonicNow();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_GE(MonotonicNow() - t0, absl::Milliseconds(20));
}

}  // namespace
}  // namespace kvpool
