#include "kvpool/common/service_main.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <thread>

namespace kvpool {
namespace {
std::atomic<bool> g_signalled{false};
void OnSignal(int) { g_signalled.store(true); }
}  // namespace

void WaitForTerminationSignal() {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_signalled.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

}  // namespace kvpool
