#include "uring_engine.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"

namespace kvpool::pool_node {

namespace {
constexpr uint64_t kWakeTag = 1;  // user_data of the eventfd poll; ops carry pointers
constexpr uint64_t kMaxFixedChunk = 1ull << 30;
}  // namespace

absl::StatusOr<std::unique_ptr<UringEngine>> UringEngine::Create(int fd, unsigned queue_depth,
                                                                 std::span<std::byte> fixed) {
  std::unique_ptr<UringEngine> e(new UringEngine());
  e->fd_ = fd;
  e->queue_depth_ = queue_depth;
  // Room for queue_depth ops plus the wake-up poll.
  int rc = io_uring_queue_init(queue_depth + 1, &e->ring_, 0);
  if (rc < 0) {
    return absl::UnavailableError(absl::StrCat("io_uring_queue_init(", queue_depth,
                                               ") failed: ", std::strerror(-rc),
                                               "; the NVMe tier needs io_uring"));
  }
  e->ring_ready_ = true;  // from here the destructor tears the ring down (once)
  e->event_fd_ = eventfd(0, EFD_CLOEXEC);
  if (e->event_fd_ < 0) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  std::vector<iovec> iovs;
  for (uint64_t off = 0; off < fixed.size(); off += kMaxFixedChunk) {
    const uint64_t len = std::min<uint64_t>(kMaxFixedChunk, fixed.size() - off);
    iovs.push_back({fixed.data() + off, len});
    e->fixed_.emplace_back(fixed.data() + off, len);
  }
  if (!iovs.empty()) {
    rc = io_uring_register_buffers(&e->ring_, iovs.data(), iovs.size());
    // Without registration (e.g. RLIMIT_MEMLOCK too low) plain READ/WRITE still work.
    e->registered_ = rc == 0;
    if (!e->registered_) e->fixed_.clear();
  }
  e->thread_ = std::thread([p = e.get()] { p->Loop(); });
  return e;
}

UringEngine::~UringEngine() {
  // Create may have failed part-way: no thread, no eventfd, or no ring (whose fd field
  // would then be 0: closing it closed the process's stdin).
  {
    absl::MutexLock l(&mu_);
    stop_ = true;
  }
  if (event_fd_ >= 0) {
    uint64_t one = 1;
    (void)!write(event_fd_, &one, sizeof(one));
  }
  if (thread_.joinable()) thread_.join();
  if (ring_ready_) io_uring_queue_exit(&ring_);
  if (event_fd_ >= 0) close(event_fd_);
}

int UringEngine::FixedIndex(const std::byte* p, uint32_t bytes) const {
  for (size_t i = 0; i < fixed_.size(); ++i) {
    if (p >= fixed_[i].first && p + bytes <= fixed_[i].first + fixed_[i].second) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

absl::Status UringEngine::Run(std::span<const IoOp> ops, std::vector<absl::Status>* op_status) {
  Batch batch;
  Submit(batch, ops, op_status);
  return Wait(batch);
}

void UringEngine::Submit(Batch& batch, std::span<const IoOp> ops, std::vector<absl::Status>* op_status) {
  if (op_status != nullptr) op_status->assign(ops.size(), absl::OkStatus());
  if (ops.empty()) {
    batch.done.Notify();
    return;
  }
  {
    absl::MutexLock bl(&batch.mu);
    batch.remaining = ops.size();
    batch.op_status = op_status;
  }
  {
    absl::MutexLock l(&mu_);
    for (size_t i = 0; i < ops.size(); ++i) queue_.push_back(Pending{&batch, ops[i], i, 0});
  }
  uint64_t one = 1;
  (void)!write(event_fd_, &one, sizeof(one));
}

absl::Status UringEngine::Wait(Batch& batch) {
  batch.done.WaitForNotification();
  absl::MutexLock bl(&batch.mu);
  return batch.status;
}

void UringEngine::Loop() {
  using SteadyClock = std::chrono::steady_clock;
  std::deque<Pending> local;
  std::multimap<SteadyClock::time_point, Pending> deferred;  // -EAGAIN retries, by due time
  unsigned inflight = 0;
  bool poll_armed = false;
  uint64_t wake_buf = 0;
  for (;;) {
    {
      absl::MutexLock l(&mu_);
      while (!queue_.empty()) {
        local.push_back(queue_.front());
        queue_.pop_front();
      }
      if (stop_ && local.empty() && inflight == 0 && deferred.empty()) return;
    }
    const SteadyClock::time_point now = SteadyClock::now();
    while (!deferred.empty() && deferred.begin()->first <= now) {
      local.push_front(deferred.begin()->second);
      deferred.erase(deferred.begin());
    }
    while (inflight < queue_depth_ && !local.empty()) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe == nullptr) break;
      auto* p = new Pending(local.front());
      local.pop_front();
      std::byte* buf = p->op.buffer + p->done;
      const uint32_t len = p->op.bytes - p->done;
      const uint64_t off = p->op.file_offset + p->done;
      const int idx = registered_ ? FixedIndex(buf, len) : -1;
      if (p->op.write) {
        if (idx >= 0) io_uring_prep_write_fixed(sqe, fd_, buf, len, off, idx);
        else io_uring_prep_write(sqe, fd_, buf, len, off);
      } else {
        if (idx >= 0) io_uring_prep_read_fixed(sqe, fd_, buf, len, off, idx);
        else io_uring_prep_read(sqe, fd_, buf, len, off);
      }
      io_uring_sqe_set_data64(sqe, reinterpret_cast<uint64_t>(p));
      ++inflight;
    }
    if (!poll_armed) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe != nullptr) {
        io_uring_prep_read(sqe, event_fd_, &wake_buf, sizeof(wake_buf), 0);
        io_uring_sqe_set_data64(sqe, kWakeTag);
        poll_armed = true;
      }
    }
    if (deferred.empty()) {
      io_uring_submit_and_wait(&ring_, 1);
    } else {
      // Sleep no longer than until the first deferred retry is due.
      const int64_t wait_ns = std::max<int64_t>(
          0, std::chrono::duration_cast<std::chrono::nanoseconds>(deferred.begin()->first - SteadyClock::now()).count());
      __kernel_timespec ts{.tv_sec = wait_ns / 1'000'000'000, .tv_nsec = wait_ns % 1'000'000'000};
      io_uring_cqe* first = nullptr;
      io_uring_submit_and_wait_timeout(&ring_, &first, 1, &ts, nullptr);  // -ETIME: a retry is due
    }
    io_uring_cqe* cqe;
    unsigned head, seen = 0;
    io_uring_for_each_cqe(&ring_, head, cqe) {
      ++seen;
      const uint64_t tag = io_uring_cqe_get_data64(cqe);
      if (tag == kWakeTag) {
        poll_armed = false;
        continue;
      }
      // The timeout liburing queues for io_uring_submit_and_wait_timeout on kernels
      // without IORING_FEAT_EXT_ARG (< 5.11): not an op of ours.
      if (tag == LIBURING_UDATA_TIMEOUT) continue;
      auto* p = reinterpret_cast<Pending*>(tag);
      --inflight;
      const int res = fault_ ? fault_(p->op, cqe->res) : cqe->res;
      absl::Status err;
      if ((res == -EAGAIN || res == -EINTR) && p->retries < kMaxTransientRetries) {
        // Transient: the kernel did not do the op (or part of it) this time.
        ++p->retries;
        if (res == -EINTR) {
          local.push_front(*p);
        } else {
          deferred.emplace(SteadyClock::now() + std::chrono::microseconds(RetryDelayUs(p->retries)), *p);
        }
        delete p;
        continue;
      }
      if (res < 0) {
        err = absl::DataLossError(absl::StrCat(
            p->op.write ? "write" : "read", " at offset ", p->op.file_offset, ": ",
            std::strerror(-res),
            p->retries > 0 ? absl::StrCat(" (after ", p->retries, " retries)") : ""));
      } else if (res == 0) {
        err = absl::DataLossError(absl::StrCat("short ", p->op.write ? "write" : "read",
                                               " at offset ", p->op.file_offset));
      } else if (p->done + static_cast<uint32_t>(res) < p->op.bytes) {
        p->done += res;
        local.push_front(*p);  // resubmit the rest
        delete p;
        continue;
      }
      Batch* b = p->batch;
      const size_t index = p->index;
      delete p;
      bool finished;
      {
        absl::MutexLock bl(&b->mu);
        if (!err.ok() && b->status.ok()) b->status = err;
        if (!err.ok() && b->op_status != nullptr) (*b->op_status)[index] = err;
        finished = --b->remaining == 0;
      }
      if (finished) b->done.Notify();
    }
    io_uring_cq_advance(&ring_, seen);
  }
}

}  // namespace kvpool::pool_node
