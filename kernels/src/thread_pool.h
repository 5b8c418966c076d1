// A small fixed thread pool for the CPU optimized kernels: ParallelFor over
// independent work items.
//
// Work items are claimed dynamically (an atomic counter), so which thread runs an
// item varies; kernels keep results deterministic by making every item write only
// its own outputs, with no cross-item reduction in claim order.
//
// Thread safety: ParallelFor may be called by one thread at a time (it is not
// reentrant); the pool's own threads only run inside ParallelFor.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvpool::kernels::internal {

class ThreadPool {
 public:
  // `num_threads` >= 1 counts the calling thread; num_threads - 1 threads are started.
  // Throws std::system_error (the threads started so far are joined) when one cannot be.
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return static_cast<int>(threads_.size()) + 1; }

  // Runs fn(i) for every i in [0, n) on the pool and the calling thread; returns when
  // all are done. If an item throws, items not yet claimed are skipped and the first
  // exception is rethrown here once every thread is out of the job.
  void ParallelFor(int64_t n, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunItems();
  bool AllDone() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return pending_ == 0; }

  absl::Mutex mu_;
  const std::function<void(int64_t)>* job_ ABSL_GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  int pending_ ABSL_GUARDED_BY(mu_) = 0;  // workers yet to finish this generation
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  // Written by ParallelFor before publishing a generation under mu_ (release via the
  // mutex), read by workers after acquiring mu_; relaxed is enough for both.
  std::atomic<int64_t> job_size_{0};
  // Next unclaimed item; relaxed fetch_add: items are independent.
  std::atomic<int64_t> next_{0};
  std::exception_ptr error_ ABSL_GUARDED_BY(mu_);  // the job's first exception
  std::vector<std::thread> threads_;
};

}  // namespace kvpool::kernels::internal
