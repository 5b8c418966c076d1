#include "kvpool/common/service_main.h"

#include <atomic>
#include <chrono>
#include <csignal>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "kvpool/common/host_port.h"

namespace kvpool {
namespace {
std::atomic<bool> g_signalled{false};
void OnSignal(int) { g_signalled.store(true); }
}  // namespace

void InitProcess() {
#ifdef NDEBUG
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
#endif
}

void WaitForTerminationSignal() {
  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  while (!g_signalled.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
}

std::string AdvertiseAddress(const std::string& listen, const std::string& advertise, int bound_port) {
  if (!advertise.empty()) return advertise;
  std::string host = listen.substr(0, listen.rfind(':'));
  if (host.empty() || IsUnspecifiedHost(host)) host = "127.0.0.1";  // what dialing would refuse
  return host + ":" + std::to_string(bound_port);
}

}  // namespace kvpool
