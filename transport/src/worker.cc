// WorkerImpl: the progress thread, arenas, endpoints and the batch state machine.
//
// Batch pipeline (initiator):
//   Submit (caller thread): validate ops -> address segments (coalesced), then, holding
//   ucx_mu_, StartBatch on the caller's thread (no hand-off: on CMA a batch completes
//   inside the call); work left in flight is progressed by the progress thread.
//   StartBatch:
//     RMA:  ucp_put_nbx / ucp_get_nbx per segment (+ ucp_ep_flush_nbx for put, so OK
//           means the bytes are visible remotely)
//     AM:   per message of <= kMaxSegsPerMsg segments, put: kAmPut(header=remote segs,
//           payload=iov of local segs) then wait for kAmPutAck (one per batch of several
//           messages); get: kAmGetReq then
//           receive kAmGetResp's payload in place (rendezvous: ucp_am_recv_data_nbx).
//   Every UCX request and every awaited reply counts in Batch::outstanding; the batch
//   finishes (its status is fixed) at the first error or when outstanding drops to 0,
//   and is released when it is finished and nothing is outstanding (late callbacks still
//   find it). The caller's callback runs only then: after a failure UCX may still be
//   receiving earlier messages into the caller's pages, and a caller told "failed"
//   reuses them at once.
#include <poll.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/syscall.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "internal.h"
#include "kvpool/common/stream_copy.h"

namespace kvpool::transport {
namespace {

// Pieces shown to a ByteObserver on the one-sided copy path: small enough to be still
// in L1/L2 when the observer reads them right after the copy.
constexpr uint64_t kObservePiece = 16 << 10;
// Unobserved one-sided copies go in pieces of at most this: glibc's memcpy of a
// cache-resident 1 MiB ran at 40-48 GB/s on this machine (AMD EPYC, AVX-512) against
// 52-57 GB/s for the same bytes in 64-256 KiB pieces (its large-size loop instead of
// rep movsb), and equal from DRAM (transport/README.md, "Copies in pieces").
constexpr uint64_t kCopyPiece = 256 << 10;
// Active messages: segments at least this long are sent alone, contiguous (see StartAm).
constexpr uint64_t kAloneBytes = 64 << 10;
// The progress thread polls while work is in flight, until this long passes without an
// event (see WorkerImpl::Loop).
constexpr absl::Duration kInflightPoll = absl::Milliseconds(20);

void SendCb(void* request, ucs_status_t status, void* user_data) {
  auto* b = static_cast<Batch*>(user_data);
  b->worker->OnOpDone(b, status);
  ucp_request_free(request);
}

void EpErrCb(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* ep = static_cast<EndpointImpl*>(arg);
  if (auto w = ep->worker_.lock()) w->OnEpError(ep, status);
}

template <unsigned kId>
ucs_status_t AmCb(void* arg, const void* header, size_t header_len, void* data, size_t len,
                  const ucp_am_recv_param_t* param) {
  return static_cast<WorkerImpl*>(arg)->OnAm(kId, header, header_len, data, len, param);
}

std::string PrintToString(const std::function<void(FILE*)>& fn) {
  char* buf = nullptr;
  size_t len = 0;
  FILE* f = open_memstream(&buf, &len);
  if (f == nullptr) return "";
  fn(f);
  std::fclose(f);
  std::string out(buf, len);
  std::free(buf);
  return out;
}

// Transports that give UCX zero-copy one-sided RMA on host memory.
bool LanesDoRma(absl::string_view ep_info) {
  for (absl::string_view line : absl::StrSplit(ep_info, '\n')) {
    if (!absl::StrContains(line, "rma_bw") && !absl::StrContains(line, "rma")) continue;
    for (absl::string_view tl : {"cma/", "knem/", "xpmem/", "rc_mlx5/", "rc_verbs/",
                                 "dc_mlx5/", "ud_"}) {
      if (absl::StrContains(line, tl)) return true;
    }
  }
  return false;
}

// Makes [p, p+len) resident and mapped writable in this process (page tables filled),
// so that copies into it take no page faults. Best effort. `fresh`: nobody else uses the
// memory yet, so on kernels without MADV_POPULATE_WRITE its pages may be touched.
void Populate(std::byte* p, uint64_t len, bool fresh) {
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  auto* start = reinterpret_cast<std::byte*>(reinterpret_cast<uintptr_t>(p) & ~(page - 1));
  const uint64_t n = (p + len) - start;
  if (madvise(start, n, MADV_POPULATE_WRITE) == 0) return;
  if (errno != EINVAL || !fresh) return;  // e.g. ENOMEM: leave it to faults
  // Older kernels: touch every page (nobody else writes it yet).
  for (uint64_t off = 0; off < n; off += page) {
    auto* b = reinterpret_cast<volatile uint8_t*>(start + off);
    *b = *b;
  }
}

#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25  // Linux 6.1
#endif
constexpr uint64_t kHugePage = 2 << 20;

// Backs the 2 MiB-aligned part of [p, p+len) with 2 MiB pages now, where the kernel
// can (MADV_COLLAPSE: Linux 6.1+, also when transparent huge pages are off for shared
// memory, as on this project's VMs); on pages another process already collapsed it only
// maps them 2 MiB at a time. Best effort: older kernels and a lack of free huge pages
// leave 4 KiB pages. Why it matters: copies between scattered pages of a large arena
// mapped with 4 KiB pages ran at ~1 GB/s on this project's current VM, against 10-14
// GB/s with 2 MiB pages (TLB misses; 64 KiB copies at random places in 1 GiB).
// A failure is said once per process on stderr (the arena still works, slower).
void MakeHugeMapped(std::byte* p, uint64_t len) {
  const uintptr_t b = (reinterpret_cast<uintptr_t>(p) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + len) & ~(kHugePage - 1);
  if (e <= b || madvise(reinterpret_cast<void*>(b), e - b, MADV_COLLAPSE) == 0) return;
  const int err = errno;
  static std::atomic<bool> said{false};
  if (said.exchange(true)) return;
  std::fprintf(stderr,
               "kvpool transport: a %llu MiB arena stays on 4 KiB pages (MADV_COLLAPSE: %s%s); "
               "copies between its scattered pages may run several times slower. %s\n",
               static_cast<unsigned long long>(len >> 20), std::strerror(err),
               err == EINVAL ? ", needs Linux 6.1+" : "",
               err == EINVAL ? "Run a newer kernel for 2 MiB pages."
                             : "Free memory, or compact it (echo 1 > /proc/sys/vm/compact_memory), "
                               "before starting the process.");
}

// Lanes that move bytes through shared memory on this host.
bool LanesUseSharedMemory(absl::string_view ep_info) {
  for (absl::string_view tl : {"sysv/", "posix/", "cma/", "knem/", "xpmem/"}) {
    if (absl::StrContains(ep_info, tl)) return true;
  }
  return false;
}

// This host and PID namespace, so a peer's pid means something here.
std::string HostKey() {
  char host[256] = {};
  gethostname(host, sizeof(host) - 1);
  struct stat st {};
  stat("/proc/self/ns/pid", &st);
  return absl::StrCat(host, "/", st.st_ino);
}

constexpr absl::string_view kAddrMagic = "KVW1";

// This host, PID and IPC namespace: where a SysV segment id means the same segment.
std::string ShmHostKey() {
  struct stat st {};
  stat("/proc/self/ns/ipc", &st);
  return absl::StrCat(HostKey(), "/ipc:", st.st_ino);
}

}  // namespace

std::byte* AttachShared(int shm_id, uint64_t size) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  const uint64_t len = (size + page - 1) / page * page;
  // Reserve room for a 2 MiB boundary, attach the segment over it, give back the rest.
  const uint64_t span = len + kHugePage;
  void* r = mmap(nullptr, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (r == MAP_FAILED) return nullptr;
  auto* lo = static_cast<std::byte*>(r);
  auto* at = reinterpret_cast<std::byte*>((reinterpret_cast<uintptr_t>(lo) + kHugePage - 1) &
                                          ~(kHugePage - 1));
  if (shmat(shm_id, at, SHM_REMAP) == reinterpret_cast<void*>(-1)) {
    munmap(lo, span);
    return nullptr;
  }
  if (at > lo) munmap(lo, at - lo);
  if (lo + span > at + len) munmap(at + len, (lo + span) - (at + len));
  return at;
}

void DetachShared(std::byte* p) { shmdt(p); }

MappedObject MappedObjectAt(const void* p) {
  // /proc/self/maps lines: "start-end perms offset dev inode [path]". The mapping that
  // holds p, and the ones right after it that continue the same object (same device and
  // inode, the file offset going on where the last one ended; a mapping split by
  // madvise or mprotect is several lines). Anonymous mappings (inode 0) are not joined:
  // two of them side by side may be unrelated.
  MappedObject out;
  std::FILE* f = std::fopen("/proc/self/maps", "re");
  if (f == nullptr) return out;
  const auto at = reinterpret_cast<uintptr_t>(p);
  uintptr_t end = 0;
  unsigned long long ino = 0, next_off = 0;
  unsigned dev_major = 0, dev_minor = 0;
  char line[512];
  while (std::fgets(line, sizeof(line), f) != nullptr) {
    unsigned long long lo, hi, off, i;
    unsigned ma, mi;
    char perms[8];
    if (std::sscanf(line, "%llx-%llx %7s %llx %x:%x %llu", &lo, &hi, perms, &off, &ma, &mi, &i) != 7) continue;
    if (end == 0) {
      if (at < lo || at >= hi) continue;
      end = hi;
      out.shared = perms[3] == 's';
      out.inode = i;
      out.offset = off + (at - lo);
    } else if (lo == end && i == ino && ma == dev_major && mi == dev_minor && ino != 0 && off == next_off) {
      end = hi;
    } else {
      break;
    }
    ino = i;
    dev_major = ma;
    dev_minor = mi;
    next_off = off + (hi - lo);
    // Without a line ending the line was longer than the buffer (a long path): skip the rest.
    while (std::strchr(line, '\n') == nullptr && std::fgets(line, sizeof(line), f) != nullptr) {
    }
  }
  std::fclose(f);
  if (end != 0) out.bytes = end - at;
  return out;
}

// Worker address: "KVW1" | u32 pid | u16 len | host key | UCX worker address. The pid
// lets a same-host peer notice that this process is gone where UCX cannot (shared
// memory has no peer-failure support in UCX 1.13).
std::string WrapAddress(absl::string_view ucx) {
  const std::string key = HostKey();
  std::string out(kAddrMagic);
  const uint32_t pid = static_cast<uint32_t>(getpid());
  const uint16_t len = static_cast<uint16_t>(key.size());
  out.append(reinterpret_cast<const char*>(&pid), 4);
  out.append(reinterpret_cast<const char*>(&len), 2);
  out += key;
  out.append(ucx.data(), ucx.size());
  return out;
}

void UnwrapAddress(absl::string_view in, std::string* ucx, pid_t* same_host_pid,
                   bool* same_host) {
  *same_host_pid = 0;
  *same_host = false;
  if (in.size() < 10 || in.substr(0, 4) != kAddrMagic) {
    *ucx = std::string(in);  // a bare UCX address
    return;
  }
  uint32_t pid;
  uint16_t len;
  std::memcpy(&pid, in.data() + 4, 4);
  std::memcpy(&len, in.data() + 8, 2);
  if (in.size() < 10u + len) {
    *ucx = std::string(in);
    return;
  }
  if (in.substr(10, len) == HostKey()) {
    *same_host = true;
    if (static_cast<pid_t>(pid) != getpid()) *same_host_pid = static_cast<pid_t>(pid);
  }
  *ucx = std::string(in.substr(10 + len));
}

bool EndpointImpl::PeerProcessGone() const {
  if (peer_pid_ <= 0 || peer_failure_detection_) return false;
  if (peer_gone_.load(std::memory_order_acquire)) return true;
  // One system call per batch cost 1 MiB shared-memory puts here ~20% (each call ~1 us
  // on this VM, the copy ~20-25 us; 0.84-0.88 of ucx_perftest before, 1.04-1.12 after):
  // look again only once the last look is old enough.
  const int64_t now = MonoNanos();
  int64_t last = peer_checked_ns_.load(std::memory_order_relaxed);
  if (now - last < kPeerCheckIntervalNs ||
      !peer_checked_ns_.compare_exchange_strong(last, now, std::memory_order_relaxed)) {
    return false;  // looked recently (or another thread is looking now)
  }
  bool gone;
  if (peer_pidfd_ >= 0) {
    pollfd p{peer_pidfd_, POLLIN, 0};
    gone = poll(&p, 1, 0) > 0;
  } else {
    gone = kill(peer_pid_, 0) != 0 && errno == ESRCH;
  }
  if (gone) peer_gone_.store(true, std::memory_order_release);
  return gone;
}

EndpointImpl::~EndpointImpl() {
  if (peer_pidfd_ >= 0) close(peer_pidfd_);
}

// ---------------------------------------------------------------------------------------
WorkerImpl::~WorkerImpl() { Shutdown(); }

absl::Status WorkerImpl::Start() {
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;  // every call holds ucx_mu_
  auto ctx = static_cast<ucp_context_h>(context_->raw());
  RETURN_IF_ERROR(FromUcs(ucp_worker_create(ctx, &wp, &worker_), "ucp_worker_create"));
  {
    // Batch ids start at a random value (see WorkerImpl::pending_puts_).
    std::random_device rd;
    next_batch_ = (uint64_t{rd()} << 32) | rd();
  }

  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  RETURN_IF_ERROR(FromUcs(ucp_worker_get_address(worker_, &addr, &addr_len),
                          "ucp_worker_get_address"));
  address_ = WrapAddress(absl::string_view(reinterpret_cast<const char*>(addr), addr_len));
  ucp_worker_release_address(worker_, addr);

  const std::pair<unsigned, ucp_am_recv_callback_t> handlers[] = {
      {kAmPut, &AmCb<kAmPut>},
      {kAmPutAck, &AmCb<kAmPutAck>},
      {kAmGetReq, &AmCb<kAmGetReq>},
      {kAmGetResp, &AmCb<kAmGetResp>}};
  for (const auto& [id, cb] : handlers) {
    ucp_am_handler_param_t hp{};
    hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                    UCP_AM_HANDLER_PARAM_FIELD_ARG | UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    hp.id = id;
    hp.cb = cb;
    hp.arg = this;
    hp.flags = UCP_AM_FLAG_WHOLE_MSG;
    RETURN_IF_ERROR(FromUcs(ucp_worker_set_am_recv_handler(worker_, &hp),
                            "ucp_worker_set_am_recv_handler"));
  }

  RETURN_IF_ERROR(FromUcs(ucp_worker_get_efd(worker_, &efd_), "ucp_worker_get_efd"));
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epfd_ < 0) return absl::InternalError(absl::StrCat("epoll_create1: errno ", errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.fd = efd_;
  if (epoll_ctl(epfd_, EPOLL_CTL_ADD, efd_, &ev) != 0) {
    return absl::InternalError(absl::StrCat("epoll_ctl: errno ", errno));
  }
  thread_ = std::thread([this] { Loop(); });
  return absl::OkStatus();
}

void WorkerImpl::Shutdown() {
  {
    absl::MutexLock l(&mu_);
    stopped_ = true;
    posted_cv_.Signal();
  }
  stop_.store(true, std::memory_order_relaxed);
  if (thread_.joinable()) {
    ucp_worker_signal(worker_);
    thread_.join();
  }
  {
    absl::MutexLock l(&ucx_mu_);
    closed_ = true;
  }
  // No mapped copy starts from now on (Submit checks closed_ under ucx_mu_); those
  // running end on their own, without UCX (a memcpy and the caller's copier; the lock is
  // not held meanwhile).
  while (mapped_copies_.load(std::memory_order_acquire) > 0) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  absl::MutexLock l(&ucx_mu_);
  if (worker_ != nullptr) {
    // Rkeys are the worker's: destroy those still held (by batches UCX never let go of,
    // see the drain in Loop) now, before it. Every endpoint was reaped by the drain, so
    // the rest are in retired_.
    for (auto& k : retired_) k->Destroy();
    for (auto& [id, b] : batches_) {
      for (auto& k : b->remote) k->Destroy();
    }
    retired_.clear();
    ucp_worker_destroy(worker_);
    worker_ = nullptr;
    unclosed_.clear();
  }
  if (epfd_ >= 0) close(epfd_);
  epfd_ = -1;
}

bool WorkerImpl::Post(std::function<void()> fn) {
  {
    absl::MutexLock l(&mu_);
    if (stopped_) return false;
    queue_.push_back(std::move(fn));
    posted_cv_.Signal();
  }
  ucp_worker_signal(worker_);
  return true;
}

bool WorkerImpl::ProgressFromCaller() {
  bool progressed = false;
  std::vector<std::pair<BatchCallback, absl::Status>> ready;
  // Before the lock: the progress thread backs off from its next round on, and for as
  // long as this call lasts (one call can keep receiving for milliseconds while messages
  // keep arriving: measured, 1 MiB gets over tcp, the progress thread then took ~0.2 of
  // a CPU contending for the lock, from the owner's share of the machine).
  struct Inside {  // counts this call in callers_progressing_ until it leaves the scope
    std::atomic<int>& n;
    explicit Inside(std::atomic<int>& c) : n(c) { n.fetch_add(1, std::memory_order_relaxed); }
    ~Inside() { n.fetch_sub(1, std::memory_order_relaxed); }
  };
  {
    const Inside inside(callers_progressing_);
    external_progress_ns_.store(MonoNanos(), std::memory_order_relaxed);
    {
      CallerLock l(this);
      if (closed_) return false;
      while (ucp_worker_progress(worker_) != 0) progressed = true;
      ReapClosedEndpoints();
      if (!batches_.empty()) CheckDeadlines();
      if (!retired_.empty()) SweepRkeys();
      if (!pending_puts_.empty()) SweepPendingPuts();
      ready.swap(ready_);  // taken here rather than under a second lock in RunCallbacks
    }
    external_progress_ns_.store(MonoNanos(), std::memory_order_relaxed);
  }
  for (auto& [done, status] : ready) done(std::move(status));
  return progressed;
}

int64_t WorkerImpl::CallerWindowLeftNs() const {
  if (callers_progressing_.load(std::memory_order_relaxed) > 0) return kCallerProgressNs;
  return external_progress_ns_.load(std::memory_order_relaxed) + kCallerProgressNs -
         MonoNanos();
}

absl::Status WorkerImpl::RunSync(std::function<absl::Status()> fn) {
  absl::Status s;
  {
    CallerLock l(this);
    if (closed_) return absl::UnavailableError("transport worker is shut down");
    s = fn();
  }
  RunCallbacks();
  return s;
}

void WorkerImpl::RunCallbacks() {
  std::vector<std::pair<BatchCallback, absl::Status>> ready;
  {
    absl::MutexLock l(&ucx_mu_);
    ready.swap(ready_);
  }
  for (auto& [done, status] : ready) done(std::move(status));
}

void WorkerImpl::RunQueue() {
  std::deque<std::function<void()>> q;
  {
    absl::MutexLock l(&mu_);
    q.swap(queue_);
  }
  for (auto& fn : q) fn();
}

void WorkerImpl::Loop() {
  absl::Time last_progress = MonotonicNow();
  int contended = 0;          // rounds in a row that found ucx_mu_ held by a caller
  bool was_inflight = false;  // the last round had work in flight
  uint64_t seen_submitted = 0;  // submitted_ as of the last round under ucx_mu_
  // Marks this thread asleep for submitters, unless a batch was left in flight since the
  // last round saw submitted_ (then it must not sleep: nobody will signal it).
  auto may_sleep = [&] {
    progress_asleep_.store(true);
    if (submitted_.load() == seen_submitted) return true;
    progress_asleep_.store(false);
    return false;
  };
  while (!stop_.load(std::memory_order_relaxed)) {
    // A caller's thread waits for ucx_mu_: let it take the lock before this loop re-takes
    // it (bounded: ~100 yields).
    for (int i = 0; i < 100 && ucx_waiters_.load(std::memory_order_relaxed) > 0; ++i) {
      std::this_thread::yield();
    }
    if (CallerDrivesProgress()) {
      // A caller polls (Worker::Progress), and its calls also check deadlines and reap
      // endpoints: stay out of its way. Polling UCX here as well would only contend for
      // ucx_mu_, the socket and the CPU (measured on 2 cores: this thread doing the tcp
      // sends while the caller spun). Sleep until the caller's window would end (it
      // moves with each of its calls), or until work is posted (run at once) or the
      // worker stops; resume within kCallerProgressNs once the caller stops. (Waking
      // every 500 us instead cost this thread ~0.2 s of CPU per 1.5 s on the 2-vCPU VM,
      // taken from the processes moving the bytes: see README, "Progress".)
      bool queued;
      {
        absl::MutexLock l(&mu_);
        if (!stopped_ && queue_.empty()) {
          posted_cv_.WaitWithTimeout(
              &mu_, absl::Nanoseconds(std::clamp<int64_t>(CallerWindowLeftNs(), 50'000, kCallerProgressNs)));
        }
        queued = !queue_.empty();
      }
      if (queued) {
        absl::MutexLock l(&ucx_mu_);
        RunQueue();
      }
      if (queued) RunCallbacks();
      last_progress = MonotonicNow();
      continue;
    }
    // Never queue behind a caller's thread for ucx_mu_ (Submit copies shared-memory
    // batches under it, back to back): as a waiter this thread was woken by each of the
    // caller's unlocks, ~900 times a second, each wake-up preempting the caller and
    // handing its CPU slot to other processes on a small machine (measured: the caller
    // got ~55% of a CPU, ucx_perftest ~90%; 1 MiB shared-memory gets at 0.4-0.6x). With
    // work in flight, look again shortly: 20 us, doubling to 1 ms while the lock stays
    // busy. Idle, sleep as when idle: a submitter that leaves work in flight signals a
    // thread marked asleep (may_sleep).
    if (!ucx_mu_.TryLock()) {
      if (was_inflight) {
        usleep(std::min<useconds_t>(1000, 20u << std::min(contended, 6)));
      } else {
        // Not armed: a signal (or an event since the last arm) keeps the fd readable
        // until a round re-arms it, so after one back off by timer rather than spin here.
        if (may_sleep()) {
          epoll_event ev;
          if (epoll_wait(epfd_, &ev, 1, 50) > 0) was_inflight = true;
          progress_asleep_.store(false);
        } else {
          was_inflight = true;
        }
      }
      ++contended;
      continue;
    }
    contended = 0;
    bool progressed = false, busy = false, inflight = false;
    std::vector<std::pair<BatchCallback, absl::Status>> ready;
    RunQueue();
    seen_submitted = submitted_.load();
    while (ucp_worker_progress(worker_) != 0) progressed = true;
    ReapClosedEndpoints();
    if (!batches_.empty()) CheckDeadlines();
    if (!retired_.empty()) SweepRkeys();
    if (!pending_puts_.empty()) SweepPendingPuts();
    inflight = batches_.size() > delivered_in_table_ || OwnerOpsUnderWay();
    busy = inflight || ClosingUnderWay();
    was_inflight = busy;
    ready.swap(ready_);
    ucx_mu_.Unlock();
    for (auto& [done, status] : ready) done(std::move(status));
    if (progressed) {
      last_progress = MonotonicNow();
      continue;
    }
    // While transfers are in flight (batches of ours, or peers' requests we serve), keep
    // polling rather than sleeping in epoll: over tcp every step of a rendezvous (RTS,
    // RTR, the next fragments once the socket drains) is an event this side must answer,
    // and one epoll sleep per step left both processes idle most of the time (measured,
    // 1 MiB puts over tcp loopback: 0.26 cpu-s used in 0.41 s by both processes, 0.5x
    // ucx_perftest, whose two sides poll). Bounded: after kInflightPoll without any event
    // (a stuck reply to a dead peer, a peer starved of CPU) it sleeps in epoll as before.
    // spin = 0 keeps the sleeping behaviour.
    if (inflight && options_.spin > absl::ZeroDuration() &&
        MonotonicNow() - last_progress < kInflightPoll) {
      continue;
    }
    // Keep polling for a while after the last event, in flight or not: peers' software
    // RMA (UCX emulates put/get over shared memory with AM that this side must answer)
    // and the next request of a burst arrive within microseconds; idle, sleep.
    if (MonotonicNow() - last_progress < options_.spin) continue;
    {
      absl::MutexLock l(&mu_);
      if (!queue_.empty()) continue;
    }
    if (CallerDrivesProgress()) continue;  // backs off at the top of the loop
    if (!ucx_mu_.TryLock()) continue;  // a caller is in: back off at the top
    // Under ucx_mu_, as Submit starts batches: one started since this round's progress
    // (busy is stale then) keeps this thread awake; one started after this is signalled.
    if (!may_sleep()) {
      ucx_mu_.Unlock();
      continue;
    }
    const ucs_status_t st = ucp_worker_arm(worker_);
    ucx_mu_.Unlock();
    if (st == UCS_ERR_BUSY) {
      progress_asleep_.store(false);
      continue;
    }
    epoll_event ev;
    // Short sleeps while work is in flight bound deadline checks and cover transports
    // without wakeup events; idle, the owner still wakes for AM requests by event, and
    // a submitter that leaves work in flight signals this thread (marked asleep above).
    epoll_wait(epfd_, &ev, 1, busy ? 1 : 50);
    progress_asleep_.store(false);
  }
  // Drain: fail what is in flight, close endpoints, give UCX a bounded time to finish.
  {
    absl::MutexLock l(&ucx_mu_);
    closed_ = true;  // no new batches, connects or closes from other threads
    RunQueue();
    std::vector<uint64_t> ids;
    for (auto& [id, b] : batches_) ids.push_back(id);
    for (uint64_t id : ids) {
      auto it = batches_.find(id);
      if (it != batches_.end()) {
        Batch& b = *it->second;
        Finish(b, absl::CancelledError("transport worker shut down"));
        // Endpoints close below: no reply comes any more.
        b.outstanding -= b.replies_awaited;
        b.replies_awaited = 0;
        MaybeFree(id);
      }
    }
    for (auto& ep : endpoints_) {
      ep->SetHealth(absl::UnavailableError("transport worker shut down"));
      to_close_.push_back(ep);
    }
    ReapClosedEndpoints();
    const absl::Time end = MonotonicNow() + absl::Seconds(2);
    while ((!closing_reqs_.empty() || OwnerOpsUnderWay() || !batches_.empty()) &&
           MonotonicNow() < end) {
      ucp_worker_progress(worker_);
      ReapClosedEndpoints();
    }
    // Requests UCX still holds after 2 s (a peer that keeps them, an endpoint that cannot
    // be forced closed): answer their callers rather than never; the worker is destroyed
    // right after this thread ends.
    for (auto& [id, b] : batches_) Deliver(*b);
    // Closes still in progress (a mode-NONE endpoint flushing to a peer that died, which
    // cannot be forced) go back to UCX, which drops them with the worker: a request the
    // user still holds at ucp_worker_destroy aborts the process in UCX 1.13 (ucp_ep.c
    // "Assertion `req->flags & UCP_REQUEST_FLAG_RELEASED' failed", seen in
    // MultiProcessTest.InitiatorKilledOwnerKeepsServing/Shm under load).
    // Their EndpointImpls stay until the worker is gone: UCX may still call the error
    // handler of such an endpoint (its argument) while it tears the worker down.
    for (Closing& c : closing_reqs_) {
      ucp_request_free(c.req);
      unclosed_.push_back(std::move(c.ep));
    }
    closing_reqs_.clear();
  }
  RunCallbacks();
}

// ---------------------------------------------------------------------------------------
// Arenas

absl::StatusOr<std::shared_ptr<Arena>> WorkerImpl::Register(std::byte* base, uint64_t size,
                                                            uint64_t page_bytes, bool owns) {
  if ((base == nullptr && !owns) || page_bytes == 0 || size == 0 || size % page_bytes != 0) {
    if (owns && base != nullptr) munmap(base, size);
    return absl::InvalidArgumentError(absl::StrCat(
        "arena: size=", size, " page_bytes=", page_bytes,
        "; size must be a positive multiple of page_bytes and memory non-null"));
  }
  auto arena = std::shared_ptr<Arena>(new Arena());
  arena->base_ = base;
  arena->size_ = size;
  arena->page_bytes_ = page_bytes;
  arena->context_ = context_;
  arena->owns_memory_ = false;  // UCX-allocated memory goes with ucp_mem_unmap

  auto ctx = static_cast<ucp_context_h>(context_->raw());
  ucp_mem_h memh = nullptr;
  ucp_mem_map_params_t mp{};
  mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_LENGTH;
  mp.length = size;
  int shm_id = -1;
  if (base == nullptr) {
    // A SysV segment of our own, mapped at a 2 MiB boundary and collapsed into 2 MiB
    // pages: peers on this host map it the same way (RkeyFor) and put/get are memcpy by
    // the initiator alone, where registered user memory would need the owner to answer
    // emulated RMA. Marked for removal at once: it goes with its last mapping, also
    // when this process dies (Linux lets peers attach it meanwhile).
    shm_id = shmget(IPC_PRIVATE, size, IPC_CREAT | 0600);
    if (shm_id >= 0) {
      base = AttachShared(shm_id, size);
      shmctl(shm_id, IPC_RMID, nullptr);
      if (base == nullptr) shm_id = -1;
    }
  }
  if (base != nullptr && shm_id >= 0) {
    arena->base_ = base;
    arena->shm_id_ = shm_id;
    // One page per 2 MiB first: collapsing those copies a page per huge page, where a
    // collapse of the whole populated range copies every byte (1 GiB: 0.08-0.1 s
    // against 0.4-4 s here). Then the rest is mapped (2 MiB at a time where collapsed).
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    for (uint64_t off = 0; off < size; off += kHugePage) Populate(base + off, std::min(page, size - off), true);
    MakeHugeMapped(base, size);
    Populate(base, size, /*fresh=*/true);
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
    mp.address = base;
    absl::Status st = FromUcs(ucp_mem_map(ctx, &mp, &memh), "ucp_mem_map (arena registration)");
    if (!st.ok()) return st;  // ~Arena detaches the segment
    arena->descriptor_.shm_id = shm_id;
    arena->descriptor_.owner_pid = static_cast<uint32_t>(getpid());
    arena->descriptor_.shm_host = ShmHostKey();
  } else if (base == nullptr) {
    // Fallback (no SysV shared memory here): UCX allocates (UCX_ALLOC_PRIO: sysv / posix
    // shared memory first) and peers on this host reach it through UCX's mapping
    // (ucp_rkey_ptr), with 4 KiB pages.
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.flags = UCP_MEM_MAP_ALLOCATE;
    RETURN_IF_ERROR(FromUcs(ucp_mem_map(ctx, &mp, &memh), "ucp_mem_map (arena allocation)"));
    ucp_mem_attr_t attr{};
    attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
    absl::Status q = FromUcs(ucp_mem_query(memh, &attr), "ucp_mem_query");
    if (!q.ok() || attr.length < size) {
      ucp_mem_unmap(ctx, memh);
      return q.ok() ? absl::InternalError("UCX allocated a short arena") : q;
    }
    arena->base_ = static_cast<std::byte*>(attr.address);
    base = arena->base_;
    // Resident from the start, like registered memory: first-touch page allocation
    // (zeroing, faults) would otherwise land on the first transfers into each page.
    Populate(base, size, /*fresh=*/true);
  } else {
    mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_ADDRESS;
    mp.address = base;
    RETURN_IF_ERROR(FromUcs(ucp_mem_map(ctx, &mp, &memh), "ucp_mem_map (arena registration)"));
  }
  arena->memh_ = memh;
  void* rkey = nullptr;
  size_t rkey_len = 0;
  RETURN_IF_ERROR(FromUcs(ucp_rkey_pack(ctx, memh, &rkey, &rkey_len), "ucp_rkey_pack"));
  arena->descriptor_.rkey.assign(static_cast<const char*>(rkey), rkey_len);
  ucp_rkey_buffer_release(rkey);

  absl::MutexLock l(&mu_);
  arena->id_ = next_arena_id_++;
  arena->descriptor_.arena_id = arena->id_;
  arena->descriptor_.base = reinterpret_cast<uint64_t>(base);
  arena->descriptor_.size = size;
  arena->descriptor_.page_bytes = page_bytes;
  arenas_[arena->id_] = arena;
  return arena;
}

void WorkerImpl::Forget(uint32_t id) {
  absl::MutexLock l(&mu_);
  arenas_.erase(id);
}

std::shared_ptr<Arena> WorkerImpl::FindArena(uint32_t id) {
  absl::MutexLock l(&mu_);
  auto it = arenas_.find(id);
  if (it == arenas_.end()) return nullptr;
  return it->second.lock();
}

// ---------------------------------------------------------------------------------------
// Endpoints

absl::StatusOr<std::shared_ptr<EndpointImpl>> WorkerImpl::Connect(absl::string_view address,
                                                                  absl::string_view name) {
  if (address.empty()) {
    return absl::InvalidArgumentError("peer address is empty; pass the peer Worker::address()");
  }
  auto ep = std::make_shared<EndpointImpl>(weak_from_this(), std::string(name));
  std::string addr;
  bool same_host = false;
  UnwrapAddress(address, &addr, &ep->peer_pid_, &same_host);
  if (ep->peer_pid_ > 0) {
    // Close-on-exec by default. Fails (-1) on kernels before 5.3 or for a pid already
    // gone: PeerProcessGone then asks kill(pid, 0).
    ep->peer_pidfd_ = static_cast<int>(syscall(SYS_pidfd_open, ep->peer_pid_, 0));
  }
  RETURN_IF_ERROR(RunSync([this, ep, addr, same_host]() -> absl::Status {
    ucp_ep_params_t p{};
    p.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                   UCP_EP_PARAM_FIELD_ERR_HANDLER;
    p.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    // A peer on this host is reached over shared memory when the context has it. UCX
    // 1.13 only picks lanes that support the requested error mode, and its shared-memory
    // transports have no PEER support: asking for PEER would put a same-host peer on
    // tcp loopback (measured: ~0.4 GB/s instead of a memcpy). The peer's death is then
    // noticed through its pid (PeerProcessGone) and the batch deadline instead.
    const bool prefer_shm = same_host && context_->shared_memory_capable();
    p.err_mode = context_->peer_failure_capable() && !prefer_shm ? UCP_ERR_HANDLING_MODE_PEER
                                                                 : UCP_ERR_HANDLING_MODE_NONE;
    ep->peer_failure_detection_ = p.err_mode == UCP_ERR_HANDLING_MODE_PEER;
    p.err_handler.cb = &EpErrCb;
    p.err_handler.arg = ep.get();
    if (!ep->name_.empty()) {
      p.field_mask |= UCP_EP_PARAM_FIELD_NAME;
      p.name = ep->name_.c_str();
    }
    ucs_status_t st = ucp_ep_create(worker_, &p, &ep->ep_);
    if (st == UCS_ERR_UNREACHABLE && p.err_mode == UCP_ERR_HANDLING_MODE_PEER) {
      // UCX 1.13's shared-memory AM transports (posix, sysv) have no peer-failure
      // support, so with UCX_TLS=sm,cma,self no lane qualifies for PEER mode. Connect
      // without it: a dead peer then surfaces as a failed RMA (cma: ESRCH) or, at the
      // latest, as the batch timeout.
      p.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      st = ucp_ep_create(worker_, &p, &ep->ep_);
      ep->peer_failure_detection_ = false;
    }
    RETURN_IF_ERROR(FromUcs(st, "ucp_ep_create (is the peer address from Worker::address()?)"));
    ep->describe_ = PrintToString([&](FILE* f) { ucp_ep_print_info(ep->ep_, f); });
    if (prefer_shm && context_->peer_failure_capable() && !LanesUseSharedMemory(ep->describe_)) {
      // Same host, yet UCX found no shared-memory lane (e.g. another IPC namespace):
      // without shared memory, take the transport that watches the peer.
      CloseUcpEp(ep);  // mode NONE: flushed, not forced (nothing is in flight on it yet)
      p.err_mode = UCP_ERR_HANDLING_MODE_PEER;
      RETURN_IF_ERROR(FromUcs(ucp_ep_create(worker_, &p, &ep->ep_), "ucp_ep_create"));
      ep->peer_failure_detection_ = true;
      ep->describe_ = PrintToString([&](FILE* f) { ucp_ep_print_info(ep->ep_, f); });
    }
    ep->shm_lanes_ = LanesUseSharedMemory(ep->describe_);
    ep->protocol_ = options_.protocol;
    if (ep->protocol_ == Protocol::kAuto) {
      ep->protocol_ = LanesDoRma(ep->describe_) ? Protocol::kRma : Protocol::kActiveMessage;
    }
    endpoints_.push_back(ep);
    return absl::OkStatus();
  }));
  return ep;
}

void WorkerImpl::CloseEndpoint(std::shared_ptr<EndpointImpl> ep) {
  {
    absl::MutexLock l(&ucx_mu_);
    if (closed_) return;
    ep->SetHealth(absl::UnavailableError("endpoint closed"));
    FailEndpointBatches(ep.get(), absl::CancelledError("endpoint closed"));
    to_close_.push_back(ep);
    ReapClosedEndpoints();
    ucp_worker_signal(worker_);  // let the progress thread finish the close
  }
  RunCallbacks();
}

void WorkerImpl::OnEpError(EndpointImpl* ep, ucs_status_t status) {
  const std::string peer = ep->name_.empty() ? std::string("(unnamed endpoint)") : absl::StrCat("'", ep->name_, "'");
  absl::Status s = FromUcs(status, absl::StrCat("peer ", peer, " failed"));
  if (s.ok() || s.code() == absl::StatusCode::kCancelled) {
    s = absl::UnavailableError(absl::StrCat("peer ", peer, " failed"));
  } else if (s.code() != absl::StatusCode::kUnavailable) {
    s = absl::UnavailableError(s.message());
  }
  ep->SetHealth(s);
  FailEndpointBatches(ep, s);
  for (auto& e : endpoints_) {
    if (e.get() == ep) to_close_.push_back(e);
  }
}

void WorkerImpl::FailEndpointBatches(EndpointImpl* ep, const absl::Status& s) {
  std::vector<uint64_t> hit;
  for (auto& [id, b] : batches_) {
    if (b->ep.get() != ep) continue;
    hit.push_back(id);
    if (!b->finished) Finish(*b, s);
    // The endpoint failed or is closing: replies still awaited on it (including those of
    // a batch that failed earlier, e.g. one part refused) will not come. Its UCX requests
    // still count until UCX completes or cancels them.
    b->outstanding -= b->replies_awaited;
    b->replies_awaited = 0;
  }
  for (uint64_t id : hit) MaybeFree(id);
}

void WorkerImpl::ReapClosedEndpoints() {
  while (!to_close_.empty()) {
    std::vector<std::shared_ptr<EndpointImpl>> eps;
    eps.swap(to_close_);
    for (auto& ep : eps) {
      if (ep->ep_ == nullptr) continue;
      {
        // The endpoint's rkeys go before it, but batches may still hold them (requests
        // UCX completes during the close): retire them, and keep the descriptors in
        // fresh imports (never unpacked: ep_ is null from here on).
        absl::MutexLock l(&ep->mu_);
        for (auto& [id, key] : ep->imported_) {
          auto fresh = std::make_shared<RemoteKey>(key->desc);
          retired_.push_back(std::exchange(key, std::move(fresh)));
        }
        for (auto& key : ep->stale_keys_) retired_.push_back(std::move(key));
        ep->stale_keys_.clear();
      }
      CloseUcpEp(ep);
      std::erase(endpoints_, ep);
    }
  }
  for (size_t i = 0; i < closing_reqs_.size();) {
    if (ucp_request_check_status(closing_reqs_[i].req) != UCS_INPROGRESS) {
      ucp_request_free(closing_reqs_[i].req);
      closing_reqs_[i] = closing_reqs_.back();
      closing_reqs_.pop_back();
    } else {
      ++i;
    }
  }
}

void WorkerImpl::CloseUcpEp(const std::shared_ptr<EndpointImpl>& ep) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // Force where the endpoint has PEER error handling: the peer may be gone, a graceful
  // close would wait for it, and forcing completes (cancels) its requests. UCX 1.13
  // refuses to force a mode-NONE endpoint (UCS_ERR_INVALID_PARAM, the ep left open and
  // leaked): those are flushed, and their transfers in flight run to completion (or
  // until the peer dies; see CheckDeadlines).
  p.flags = ep->peer_failure_detection_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  void* req = ucp_ep_close_nbx(ep->ep_, &p);
  if (UCS_PTR_IS_ERR(req) && p.flags != 0) {
    // Refused before anything happened: the ep is still ours; flush it instead.
    p.flags = 0;
    req = ucp_ep_close_nbx(ep->ep_, &p);
  }
  ep->ep_ = nullptr;
  if (UCS_PTR_IS_ERR(req)) {
    // The flush failed at once (the peer is unreachable): UCX has released the ep.
    // Nothing to wait for; say so rather than drop it silently. (Not through health:
    // Connect closes a first attempt this way and reuses the EndpointImpl.)
    std::fprintf(stderr, "kvpool transport: closing endpoint %s: %s\n", ep->name_.c_str(),
                 ucs_status_string(UCS_PTR_STATUS(req)));
  } else if (req != nullptr) {
    closing_reqs_.push_back({req, ep, MonotonicNow()});
  }
}

bool WorkerImpl::ClosingUnderWay() const {
  if (closing_reqs_.empty()) return false;
  const absl::Time now = MonotonicNow();
  for (const Closing& c : closing_reqs_) {
    if (now - c.since <= options_.batch_timeout) return true;
  }
  return false;
}

ucp_rkey_h WorkerImpl::RkeyFor(EndpointImpl& ep, RemoteKey& key) {
  {
    // Imports replaced since: destroyed by SweepRkeys once no batch holds them (a batch
    // of the previous import may still have RMA requests on its rkey).
    absl::MutexLock l(&ep.mu_);
    for (auto& k : ep.stale_keys_) retired_.push_back(std::move(k));
    ep.stale_keys_.clear();
  }
  SweepRkeys();
  if (ep.ep_ == nullptr) return nullptr;
  if (key.rkey == nullptr) {
    if (ucp_ep_rkey_unpack(ep.ep_, key.desc.rkey.data(), &key.rkey) != UCS_OK) {
      key.rkey = nullptr;
      return nullptr;
    }
    // A same-host arena: map its segment here (where the endpoint moves bytes through
    // shared memory, so UCX_TLS=tcp still means tcp) and fill its page tables once,
    // rather than one fault per page inside the first copies. The segment must still be
    // the owner's (ids are reused once a segment is gone).
    if (ep.shm_lanes_ && key.desc.shm_id >= 0 && key.desc.shm_id <= INT32_MAX &&
        key.desc.shm_host == ShmHostKey()) {
      const int id = static_cast<int>(key.desc.shm_id);
      struct shmid_ds ds {};
      if (shmctl(id, IPC_STAT, &ds) == 0 && ds.shm_segsz >= key.desc.size &&
          static_cast<uint32_t>(ds.shm_cpid) == key.desc.owner_pid) {
        key.mapped = AttachShared(id, ds.shm_segsz);
      }
    }
    void* mapped = key.mapped;
    if (mapped != nullptr) {
      MakeHugeMapped(key.mapped, key.desc.size);
    } else if (ucp_rkey_ptr(key.rkey, key.desc.base, &mapped) != UCS_OK) {
      mapped = nullptr;  // (UCX's mapping of a fallback arena, above)
    } else if (const MappedObject m = MappedObjectAt(mapped); !m.shared || m.offset != 0 || m.bytes < key.desc.size) {
      // UCX's mapping of a fallback arena (a shared segment, mapped from its start):
      // ucp_rkey_ptr only adds an offset, so a descriptor whose size is larger than the
      // owner allocated, or whose base is not the segment's, would have copies (and the
      // Populate below) run past the mapping or into other memory. The SysV path checks
      // the segment's size the same way.
      key.refused = absl::StrCat(
          "remote arena ", key.desc.arena_id, ": its descriptor (base 0x", absl::Hex(key.desc.base), ", ",
          key.desc.size, " bytes) does not match what UCX mapped for it here (",
          m.bytes == 0 ? std::string("nothing at that base")
                       : absl::StrCat(m.bytes, " bytes of a ", m.shared ? "shared" : "private", " mapping, from offset ",
                                      m.offset),
          "); it does not describe the owner's arena (import the owner's own descriptor)");
      mapped = nullptr;
    }
    if (mapped != nullptr) Populate(static_cast<std::byte*>(mapped), key.desc.size, /*fresh=*/false);
  }
  return key.refused.empty() ? key.rkey : nullptr;
}

void WorkerImpl::SweepRkeys() {
  // use_count() == 1: only this list holds it, and nothing can take a new reference (a
  // retired import is in no endpoint's imported_); batches drop theirs under ucx_mu_
  // (MaybeFree) or never used the rkey (refused in Submit).
  std::erase_if(retired_, [](const std::shared_ptr<RemoteKey>& k) { return k.use_count() == 1; });
}

// ---------------------------------------------------------------------------------------
// Batches (initiator)

void WorkerImpl::StartBatch(std::unique_ptr<Batch> owned) {
  Batch& b = *owned;
  b.id = next_batch_++;
  b.worker = this;
  batches_[b.id] = std::move(owned);
  {
    absl::MutexLock l(&mu_);
    ++stats_.batches_in_flight;
  }
  absl::Status h = b.ep->health();
  if (!h.ok() || b.ep->ep_ == nullptr) {
    Finish(b, h.ok() ? absl::UnavailableError("endpoint closed") : h);
  } else if (b.ep->protocol_ == Protocol::kRma) {
    StartRma(b);
  } else {
    StartAm(b);
  }
  if (!b.finished && b.outstanding == 0) Finish(b, absl::OkStatus());
  MaybeFree(b.id);
}

void WorkerImpl::Track(Batch& b, ucs_status_ptr_t r, absl::string_view what) {
  if (r == nullptr) return;
  if (UCS_PTR_IS_ERR(r)) {
    Finish(b, FromUcs(UCS_PTR_STATUS(r), what));
    return;
  }
  ++b.outstanding;
}

void WorkerImpl::CopyMapped(const Batch& b, Segment& s, std::byte* rp, bool stream) {
  auto copy = [stream](std::byte* dst, const std::byte* src, uint64_t n) {
    if (stream) {
      StreamCopy(dst, src, n);
    } else {
      std::memcpy(dst, src, n);
    }
  };
  if (!b.observe) {
    std::byte* const dst = b.dir == Direction::kPut ? rp : s.local;
    const std::byte* const src = b.dir == Direction::kPut ? s.local : rp;
    for (uint64_t off = 0; off < s.len; off += kCopyPiece) copy(dst + off, src + off, std::min(kCopyPiece, s.len - off));
    return;
  }
  if (b.copy) {  // copied and observed in one pass by the caller's copier
    if (b.dir == Direction::kPut) {
      b.copy(s.op, rp, s.local, s.len, stream);
    } else {
      b.copy(s.op, s.local, rp, s.len, stream);
    }
    s.observed = true;
    return;
  }
  // Copy in cache-sized pieces and show each to the observer while it is hot: a put's
  // source (just read); a get's bytes as they land, which streaming stores do not leave
  // in cache, so a streamed get goes through a cache-resident bounce piece (observed
  // bytes are exactly the stored ones even if the owner's change meanwhile).
  alignas(64) thread_local std::byte bounce[kObservePiece];
  for (uint64_t off = 0; off < s.len; off += kObservePiece) {
    const uint64_t n = std::min(kObservePiece, s.len - off);
    if (b.dir == Direction::kPut) {
      copy(rp + off, s.local + off, n);
      b.observe(s.op, std::span<const std::byte>(s.local + off, n));
    } else if (stream) {
      std::memcpy(bounce, rp + off, n);
      b.observe(s.op, std::span<const std::byte>(bounce, n));
      StreamCopy(s.local + off, bounce, n);
    } else {
      std::memcpy(s.local + off, rp + off, n);
      b.observe(s.op, std::span<const std::byte>(s.local + off, n));
    }
  }
  s.observed = true;
}

bool WorkerImpl::MapSegments(Batch& b) {
  if (b.ep->protocol_ != Protocol::kRma || b.ep->ep_ == nullptr || !b.ep->health().ok()) return false;
  RemoteKey* key = nullptr;
  ucp_rkey_h rkey = nullptr;
  for (Segment& s : b.segs) {
    if (key == nullptr || key->desc.arena_id != s.remote_arena) {
      key = b.Import(s.remote_arena);
      rkey = key != nullptr ? RkeyFor(*b.ep, *key) : nullptr;
      if (rkey == nullptr) return false;
    }
    void* mapped = nullptr;
    if (key->mapped != nullptr) {
      mapped = key->mapped + s.remote_offset;
    } else if (ucp_rkey_ptr(rkey, key->desc.base + s.remote_offset, &mapped) != UCS_OK) {
      mapped = nullptr;
    }
    if (mapped == nullptr) return false;
    s.remote_mapped = static_cast<std::byte*>(mapped);
  }
  return true;
}

absl::Status WorkerImpl::CheckPeerAlive(Batch& b) {
  if (!b.ep->PeerProcessGone()) return absl::OkStatus();
  // One-sided shared memory outlives its owner: the bytes moved, but to or from an arena
  // nobody serves any more.
  absl::Status s = absl::UnavailableError(
      absl::StrCat("peer process ", b.ep->peer_pid_, " exited; reconnect to a live peer"));
  b.ep->SetHealth(s);
  return s;
}

absl::Status WorkerImpl::RunMapped(Batch& b) {
  const bool stream = b.bytes >= options_.stream_copy_min_bytes;
  for (Segment& s : b.segs) CopyMapped(b, s, s.remote_mapped, stream);
  if (stream) StreamFence();
  absl::Status st = CheckPeerAlive(b);
  CountFinished(b, st);
  return st;
}

void WorkerImpl::CountFinished(const Batch& b, const absl::Status& s) {
  absl::MutexLock l(&mu_);
  if (s.ok()) {
    ++stats_.batches_ok;
    (b.dir == Direction::kPut ? stats_.bytes_put : stats_.bytes_get) += b.bytes;
  } else {
    ++stats_.batches_failed;
  }
}

void WorkerImpl::StartRma(Batch& b) {
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                   UCP_OP_ATTR_FIELD_MEMH;
  p.cb.send = &SendCb;
  p.user_data = &b;
  uint32_t cached_id = 0;
  bool needs_flush = false;
  ucp_rkey_h rkey = nullptr;
  uint64_t rbase = 0;
  std::byte* rmapped = nullptr;  // the remote arena's segment mapped here (RemoteKey::mapped)
  // Shared-memory copies of large batches use streaming stores (StreamCopy): their
  // destination is beyond the caches, and a plain store first reads each line it writes
  // (DRAM to DRAM: ~1.8x the copy rate here, see kvpool/common/stream_copy.h). Small
  // batches keep memcpy, which is faster into cache-resident memory.
  const bool stream = b.bytes >= options_.stream_copy_min_bytes;
  bool streamed = false;
  for (Segment& s : b.segs) {
    if (rkey == nullptr || s.remote_arena != cached_id) {
      // The import the segments were validated against (Submit), not the endpoint's
      // current one: a re-import since must not pair these offsets with another base.
      RemoteKey* key = b.Import(s.remote_arena);
      rkey = key != nullptr ? RkeyFor(*b.ep, *key) : nullptr;
      rbase = key != nullptr ? key->desc.base : 0;
      rmapped = key != nullptr ? key->mapped : nullptr;
      cached_id = s.remote_arena;
      if (rkey == nullptr) {
        Finish(b, absl::FailedPreconditionError(
                      key != nullptr && !key->refused.empty()
                          ? key->refused
                          : absl::StrCat("cannot unpack the rkey of remote arena ", s.remote_arena,
                                         "; the peer and this process must share a transport (UCX_TLS)")));
        return;
      }
    }
    p.memh = static_cast<ucp_mem_h>(s.memh);
    const uint64_t raddr = rbase + s.remote_offset;
    // Shared memory the owner exported (AllocateArena), mapped here (by RkeyFor, or by
    // UCX for a fallback arena): the copy is a plain memcpy, complete and visible when
    // it returns.
    void* mapped = rmapped != nullptr ? rmapped + s.remote_offset : nullptr;
    if (mapped != nullptr ||
        (ucp_rkey_ptr(rkey, raddr, &mapped) == UCS_OK && mapped != nullptr)) {
      streamed |= stream;
      CopyMapped(b, s, static_cast<std::byte*>(mapped), stream);
      continue;
    }
    needs_flush = true;
    ucs_status_ptr_t r = b.dir == Direction::kPut
                             ? ucp_put_nbx(b.ep->ep_, s.local, s.len, raddr, rkey, &p)
                             : ucp_get_nbx(b.ep->ep_, s.local, s.len, raddr, rkey, &p);
    Track(b, r, b.dir == Direction::kPut ? "ucp_put_nbx" : "ucp_get_nbx");
    if (b.finished) return;
  }
  // Streaming stores are weakly ordered: visible to the owner (and to the caller's other
  // threads) before the batch completes.
  if (streamed) StreamFence();
  if (b.dir == Direction::kPut && needs_flush) {
    // Remote completion: OK must mean the bytes are visible to the owner.
    ucp_request_param_t fp{};
    fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    fp.cb.send = &SendCb;
    fp.user_data = &b;
    Track(b, ucp_ep_flush_nbx(b.ep->ep_, &fp), "ucp_ep_flush_nbx");
  }
}

void WorkerImpl::StartAm(Batch& b) {
  // A get reply above kEagerMaxBytes comes by rendezvous, received straight into the
  // caller's pages. On an endpoint UCX cannot force-close (no peer failure detection:
  // same-host shared memory) a stalled but live peer can go on writing them after the
  // batch failed at its deadline: UCX cannot cancel an AM receive. There a get goes in
  // messages of at most kEagerMaxBytes (large segments cut, small ones gathered only up
  // to it): an eager reply lands in UCX's buffer and is copied in only while the batch is
  // still awaited (OnInitiatorReply), so a late one is dropped.
  const bool eager_only = b.dir == Direction::kGet && !b.ep->peer_failure_detection_;
  if (eager_only) {
    std::vector<Segment> pieces;
    pieces.reserve(b.segs.size());
    for (const Segment& s : b.segs) {
      for (uint64_t off = 0; off < s.len; off += kEagerMaxBytes) {
        Segment p = s;
        p.local = s.local + off;
        p.remote_offset = s.remote_offset + off;
        p.len = std::min<uint64_t>(kEagerMaxBytes, s.len - off);
        pieces.push_back(p);
      }
    }
    b.segs = std::move(pieces);
  }
  // Messages: a large segment travels alone, as one contiguous buffer on both sides (the
  // contiguous-datatype rendezvous ucx_perftest's am_bw baseline uses too, rather than
  // UCX's generic iov path); small ones are gathered, up to kMaxSegsPerMsg per message,
  // into an iov.
  std::vector<std::pair<size_t, size_t>> msgs;  // [first, first + n) of b.segs
  for (size_t i = 0; i < b.segs.size();) {
    size_t n = 1;
    if (b.segs[i].len < kAloneBytes) {
      uint64_t bytes = b.segs[i].len;  // eager_only: a gathered reply stays eager too
      while (i + n < b.segs.size() && n < kMaxSegsPerMsg && b.segs[i + n].len < kAloneBytes &&
             (!eager_only || bytes + b.segs[i + n].len <= kEagerMaxBytes)) {
        bytes += b.segs[i + n].len;
        ++n;
      }
    }
    msgs.emplace_back(i, n);
    i += n;
  }
  const size_t nmsg = msgs.size();
  b.iovs.resize(nmsg);
  b.msg_first_seg.resize(nmsg);
  for (size_t m = 0; m < nmsg; ++m) b.msg_first_seg[m] = msgs[m].first;
  for (size_t m = 0; m < nmsg; ++m) {
    const auto [first, n] = msgs[m];
    b.iovs[m].resize(n);
    for (size_t i = 0; i < n; ++i) b.iovs[m][i] = {b.segs[first + i].local, b.segs[first + i].len};
  }
  // A put of several messages is answered once, after its last message landed, and a get
  // asks for consecutive messages in one request of at most kMaxSegsPerMsg segments: over
  // tcp a reply or a request per message is one more small message (a send and a receive
  // system call on each side) for every 64 KiB moved.
  b.one_reply = b.dir == Direction::kPut && nmsg > 1 && nmsg <= kMaxPartsPerBatch;
  b.answered.assign(b.one_reply ? 1 : nmsg, false);
  if (b.one_reply) {
    ++b.outstanding;  // the batch's ack
    ++b.replies_awaited;
  }
  std::vector<std::pair<size_t, size_t>> reqs;  // messages [first, first + n) per send
  for (size_t m = 0, segs = 0; m < nmsg; ++m) {
    const size_t n = msgs[m].second;
    if (b.dir == Direction::kGet && !reqs.empty() && segs + n <= kMaxSegsPerMsg) {
      ++reqs.back().second;
      segs += n;
    } else {
      reqs.emplace_back(m, 1);
      segs = n;
    }
  }
  b.headers.resize(reqs.size());
  for (size_t q = 0; q < reqs.size(); ++q) {
    const auto [m0, k] = reqs[q];
    const size_t first = msgs[m0].first;
    const size_t nsegs = msgs[m0 + k - 1].first + msgs[m0 + k - 1].second - first;
    AmHeader h{};
    h.batch_id = b.id;
    h.part = static_cast<uint32_t>(m0);
    h.num_segs = static_cast<uint32_t>(nsegs);
    if (b.one_reply) h.num_parts = static_cast<uint32_t>(nmsg);
    if (b.dir == Direction::kGet && k > 1) h.num_parts = static_cast<uint32_t>(k);
    std::string& hdr = b.headers[q];
    const size_t counts = h.num_parts > 0 && b.dir == Direction::kGet ? k : 0;
    hdr.resize(sizeof(AmHeader) + nsegs * sizeof(WireSeg) + counts * sizeof(uint32_t));
    std::memcpy(hdr.data(), &h, sizeof(h));
    for (size_t i = 0; i < nsegs; ++i) {
      const Segment& s = b.segs[first + i];
      WireSeg w{};
      w.arena_id = s.remote_arena;
      w.offset = s.remote_offset;
      w.len = s.len;
      std::memcpy(hdr.data() + sizeof(AmHeader) + i * sizeof(WireSeg), &w, sizeof(w));
    }
    for (size_t j = 0; j < counts; ++j) {
      const auto n = static_cast<uint32_t>(msgs[m0 + j].second);
      std::memcpy(hdr.data() + sizeof(AmHeader) + nsegs * sizeof(WireSeg) + j * sizeof(uint32_t), &n,
                  sizeof(n));
    }
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA |
                     UCP_OP_ATTR_FIELD_FLAGS;
    p.cb.send = &SendCb;
    p.user_data = &b;
    p.flags = UCP_AM_SEND_FLAG_REPLY;
    if (!b.one_reply) {
      b.outstanding += static_cast<int>(k);  // the ack (put) or the responses (get)
      b.replies_awaited += static_cast<int>(k);
    }
    const auto& iov = b.iovs[m0];
    if (b.dir == Direction::kPut) p.flags |= EagerFlagFor(iov);
    ucs_status_ptr_t r;
    if (b.dir == Direction::kPut && iov.size() == 1) {
      r = ucp_am_send_nbx(b.ep->ep_, kAmPut, hdr.data(), hdr.size(), iov[0].buffer,
                          iov[0].length, &p);
    } else if (b.dir == Direction::kPut) {
      p.op_attr_mask |= UCP_OP_ATTR_FIELD_DATATYPE;
      p.datatype = ucp_dt_make_iov();
      r = ucp_am_send_nbx(b.ep->ep_, kAmPut, hdr.data(), hdr.size(), iov.data(), iov.size(), &p);
    } else {
      r = ucp_am_send_nbx(b.ep->ep_, kAmGetReq, hdr.data(), hdr.size(), nullptr, 0, &p);
    }
    if (UCS_PTR_IS_ERR(r)) {
      // Nothing went out: no reply will come for these messages (nor, answered once, for
      // the batch: the owner never sees all of it).
      for (size_t j = 0; j < k; ++j) {
        const size_t slot = b.one_reply ? 0 : m0 + j;
        if (b.answered[slot]) continue;
        --b.outstanding;
        --b.replies_awaited;
        b.answered[slot] = true;
      }
    }
    Track(b, r, "ucp_am_send_nbx");
    if (b.finished) return;
  }
}

void WorkerImpl::OnOpDone(Batch* b, ucs_status_t status) {
  --b->outstanding;
  if (status != UCS_OK) {
    Finish(*b, FromUcs(status, b->dir == Direction::kPut ? "put" : "get"));
  } else if (!b->finished && b->outstanding == 0) {
    Finish(*b, absl::OkStatus());
  }
  MaybeFree(b->id);
}

void WorkerImpl::Finish(Batch& b, absl::Status s) {
  if (b.finished) return;
  if (s.ok()) s = CheckPeerAlive(b);
  b.finished = true;
  b.status = s;
  CountFinished(b, s);
  if (s.ok() && b.observe && b.done) {
    // Bytes that UCX moved (not copied here): shown to the observer just before `done`,
    // outside the lock. For a get they have landed; for a put they are the source.
    std::vector<Segment> rest;
    for (const Segment& seg : b.segs) {
      if (!seg.observed) rest.push_back(seg);
    }
    if (!rest.empty()) {
      // The batch (and its hold on the local arenas) is freed before `done` runs: the
      // wrapper keeps the arenas the observer reads (a caller may drop its Arena while
      // the batch is in flight).
      b.done = [observe = std::move(b.observe), rest = std::move(rest), hold = b.hold,
                done = std::move(b.done)](absl::Status st) {
        for (const Segment& seg : rest) {
          observe(seg.op, std::span<const std::byte>(seg.local, seg.len));
        }
        done(std::move(st));
      };
    }
  }
  b.observe = nullptr;
  b.copy = nullptr;
  // `done` waits for the release (MaybeFree): requests of this batch may still be moving
  // bytes into or out of the caller's pages.
}

void WorkerImpl::Deliver(Batch& b) {
  if (b.delivered) return;
  b.delivered = true;
  ++delivered_in_table_;  // every caller holds the batch in batches_ (MaybeFree erases it next)
  // Run by RunCallbacks once ucx_mu_ is released: a callback may submit again.
  if (b.done) ready_.emplace_back(std::move(b.done), b.status);
  b.done = nullptr;
}

void WorkerImpl::MaybeFree(uint64_t id) {
  auto it = batches_.find(id);
  if (it != batches_.end() && it->second->finished && it->second->outstanding <= 0) {
    Deliver(*it->second);
    batches_.erase(it);
    --delivered_in_table_;
    absl::MutexLock l(&mu_);
    --stats_.batches_in_flight;
  }
}

void WorkerImpl::CheckDeadlines() {
  const absl::Time now = MonotonicNow();
  if (now - last_deadline_check_ < absl::Milliseconds(5)) return;
  last_deadline_check_ = now;
  // Late: unfinished, or failed but still held by requests or replies (e.g. one part
  // refused while another's reply never comes). Endpoints, not batch pointers: closing
  // one may release (free) its batches.
  std::vector<std::shared_ptr<EndpointImpl>> late;
  std::vector<uint64_t> abandon;
  for (auto& [id, b] : batches_) {
    if (now <= b->deadline) continue;
    if (b->ep->ep_ != nullptr && std::find(late.begin(), late.end(), b->ep) == late.end()) {
      late.push_back(b->ep);
    }
    // The endpoint is closed but UCX still holds requests of the batch: a mode-NONE
    // (shared-memory) endpoint cannot be force-closed, and a dead peer never completes
    // them. Give up on them once the peer process is gone (it writes nothing any more)
    // or one more timeout later, rather than hang the caller.
    if (b->ep->ep_ == nullptr && !b->delivered &&
        (now > b->deadline + options_.batch_timeout || b->ep->PeerProcessGone())) {
      abandon.push_back(id);
    }
  }
  const absl::Status s = absl::DeadlineExceededError(absl::StrCat(
      "batch did not complete within ", absl::FormatDuration(options_.batch_timeout),
      "; endpoint closed (reconnect to retry)"));
  for (auto& ep : late) {
    ep->SetHealth(absl::UnavailableError(s.message()));
    // Fix the status first: the close below completes pending requests with errors.
    for (auto& [id, b] : batches_) {
      if (b->ep == ep && !b->finished) Finish(*b, s);
    }
    // UCX cannot cancel a started transfer: closing the endpoint (force, where it has
    // PEER error handling) completes what is pending, so that no byte lands in the
    // caller's pages after its callback. Closed before anything is released.
    to_close_.push_back(ep);
    ReapClosedEndpoints();
    FailEndpointBatches(ep.get(), s);
  }
  for (uint64_t id : abandon) {
    auto it = batches_.find(id);
    if (it == batches_.end()) continue;
    Batch& b = *it->second;
    if (!b.finished) Finish(b, s);
    b.status = absl::Status(b.status.code(), absl::StrCat(
        b.status.message(), "; the peer did not let go of the transfer (a shared-memory "
                            "endpoint cannot cancel one in flight)"));
    // The Batch itself stays until UCX completes its requests (they point at it).
    Deliver(b);
  }
}

}  // namespace kvpool::transport
