#include "thread_pool.h"

#include <utility>

namespace kvpool::kernels::internal {

ThreadPool::ThreadPool(int num_threads) {
  try {
    for (int i = 1; i < num_threads; ++i) threads_.emplace_back([this] { WorkerLoop(); });
  } catch (...) {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    for (auto& t : threads_) t.join();
    throw;
  }
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  for (auto& t : threads_) t.join();
}

void ThreadPool::RunItems() {
  const std::function<void(int64_t)>* fn;
  {
    absl::MutexLock lock(&mu_);
    fn = job_;
  }
  const int64_t n = job_size_.load(std::memory_order_relaxed);
  for (int64_t i = next_.fetch_add(1, std::memory_order_relaxed); i < n;
       i = next_.fetch_add(1, std::memory_order_relaxed)) {
    try {
      (*fn)(i);
    } catch (...) {
      next_.store(n, std::memory_order_relaxed);  // the rest is skipped
      absl::MutexLock lock(&mu_);
      if (!error_) error_ = std::current_exception();
    }
  }
}

void ThreadPool::WorkerLoop() {
  uint64_t seen = 0;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      struct Wait {
        ThreadPool* pool;
        uint64_t seen;
      } wait{this, seen};
      mu_.Await(absl::Condition(
          +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->pool->stop_ || w->pool->generation_ != w->seen;
          },
          &wait));
      if (stop_) return;
      seen = generation_;
    }
    RunItems();
    absl::MutexLock lock(&mu_);
    --pending_;
  }
}

void ThreadPool::ParallelFor(int64_t n, const std::function<void(int64_t)>& fn) {
  if (n <= 0) return;
  if (threads_.empty() || n == 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    job_ = &fn;
    job_size_.store(n, std::memory_order_relaxed);
    next_.store(0, std::memory_order_relaxed);
    pending_ = static_cast<int>(threads_.size());
    ++generation_;
  }
  RunItems();
  std::exception_ptr error;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(this, &ThreadPool::AllDone));
    job_ = nullptr;
    error = std::exchange(error_, nullptr);
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace kvpool::kernels::internal
