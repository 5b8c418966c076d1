// Test-only wall-clock steps: included by one source file of a test binary, it puts its
// clock_gettime in front of libc's for the whole binary and its libraries, and adds
// g_realtime_offset_ns to every CLOCK_REALTIME reading while that is nonzero (a step, as
// NTP or `date -s` makes one). Monotonic readings are left alone.
#pragma once

#include <dlfcn.h>
#include <time.h>

#include <atomic>
#include <cstdint>

inline std::atomic<int64_t> g_realtime_offset_ns{0};

extern "C" int clock_gettime(clockid_t clock, struct timespec* ts) {
  using Fn = int (*)(clockid_t, struct timespec*);
  static const Fn real = reinterpret_cast<Fn>(dlsym(RTLD_NEXT, "clock_gettime"));
  const int r = real(clock, ts);
  const int64_t off = g_realtime_offset_ns.load(std::memory_order_relaxed);
  if (r == 0 && off != 0 && clock == CLOCK_REALTIME) {
    const int64_t ns = int64_t{ts->tv_sec} * 1'000'000'000 + ts->tv_nsec + off;
    ts->tv_sec = ns / 1'000'000'000;
    ts->tv_nsec = ns % 1'000'000'000;
  }
  return r;
}
