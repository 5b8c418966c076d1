// UringEngine: batched O_DIRECT file I/O on one io_uring, driven by its own thread.
//
// Callers hand a batch of page reads/writes to Run(), which returns when every op of
// the batch finished. The engine thread keeps up to queue_depth ops in flight across
// all batches (so several callers share the queue depth), and sleeps in
// io_uring_submit_and_wait when idle: an eventfd polled through the ring wakes it when
// a new batch arrives. Memory handed in at Create is registered with the ring
// (io_uring_register_buffers, in chunks of at most 1 GiB) and ops on it use
// READ_FIXED/WRITE_FIXED, so the kernel does not pin pages per op.
//
// Thread safety: Run may be called from any number of threads concurrently. No caller
// holds a lock while it waits for completions; the queue mutex guards only the hand-off.
#pragma once

#include <liburing.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"

namespace kvpool::pool_node {

struct IoOp {
  bool write = false;
  uint64_t file_offset = 0;  // multiple of 4096 (O_DIRECT)
  std::byte* buffer = nullptr;  // 4096-aligned
  uint32_t bytes = 0;           // multiple of 4096
};

class UringEngine {
 public:
  // `fd`: an O_DIRECT file; `fixed`: memory to register (may be empty).
  static absl::StatusOr<std::unique_ptr<UringEngine>> Create(int fd, unsigned queue_depth,
                                                             std::span<std::byte> fixed);
  ~UringEngine();

  // One submitted batch of ops. Must stay where it is (not moved or destroyed) until
  // Wait returned for it.
  class Batch {
   public:
    Batch() = default;
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

   private:
    friend class UringEngine;
    absl::Mutex mu;
    size_t remaining ABSL_GUARDED_BY(mu) = 0;
    absl::Status status ABSL_GUARDED_BY(mu);
    std::vector<absl::Status>* op_status ABSL_GUARDED_BY(mu) = nullptr;  // per op, optional
    absl::Notification done;
  };

  // Runs every op; the first error (as -errno turned into a Status) fails the batch,
  // but the batch still waits for all its ops before returning. `op_status`, when
  // given, gets one status per op (so a caller can tell which ops failed).
  absl::Status Run(std::span<const IoOp> ops, std::vector<absl::Status>* op_status = nullptr);
  // Run in two halves, so that a caller can work (e.g. verify the data of an earlier
  // batch) while a batch is in flight: Submit queues the ops and returns at once; Wait
  // returns when all of them finished, with Run's result. Batches start in the order
  // they were submitted. `op_status` must outlive the Wait.
  void Submit(Batch& batch, std::span<const IoOp> ops, std::vector<absl::Status>* op_status = nullptr);
  absl::Status Wait(Batch& batch);

  // Fault injection for tests: called on each op's completion with the op and the
  // kernel's result (bytes or -errno); returns the result to act on. Set before the
  // first Run/Submit.
  void SetCompletionFaultForTest(std::function<int(const IoOp&, int res)> fault) {
    fault_ = std::move(fault);
  }

  // Ops that complete with -EAGAIN or -EINTR are submitted again, up to this many times
  // each, before the error fails the op. After -EINTR (a signal) at once; after -EAGAIN
  // (a device or queue with no room now) once RetryDelay has passed, doubling from
  // kFirstRetryDelayUs up to kMaxRetryDelayUs: a lasting EAGAIN fails the op after
  // about 0.2 s of tries, not after 16 resubmissions within microseconds. The other ops
  // keep running meanwhile.
  static constexpr uint32_t kMaxTransientRetries = 16;
  static constexpr int64_t kFirstRetryDelayUs = 100;
  static constexpr int64_t kMaxRetryDelayUs = 20'000;
  // The wait before the retry-th resubmission (1-based) after -EAGAIN.
  static constexpr int64_t RetryDelayUs(uint32_t retry) {
    return retry >= 9 ? kMaxRetryDelayUs : std::min(kMaxRetryDelayUs, kFirstRetryDelayUs << (retry - 1));
  }

  unsigned queue_depth() const { return queue_depth_; }
  bool registered_buffers() const { return registered_; }

 private:
  struct Pending {
    Batch* batch;
    IoOp op;
    size_t index = 0;   // of the op in its batch
    uint32_t done = 0;  // bytes completed (short transfers are resubmitted)
    uint32_t retries = 0;  // resubmissions after -EAGAIN / -EINTR
  };
  UringEngine() = default;
  void Loop();
  int FixedIndex(const std::byte* p, uint32_t bytes) const;

  int fd_ = -1;
  int event_fd_ = -1;
  unsigned queue_depth_ = 0;
  bool registered_ = false;
  std::vector<std::pair<std::byte*, uint64_t>> fixed_;  // registered chunks
  io_uring ring_{};
  bool ring_ready_ = false;  // io_uring_queue_init succeeded (the destructor tears it down)
  std::thread thread_;
  std::function<int(const IoOp&, int)> fault_;

  absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvpool::pool_node
