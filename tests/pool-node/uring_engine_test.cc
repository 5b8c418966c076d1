// UringEngine: O_DIRECT batches on io_uring, and how it treats transient errors.
#include "uring_engine.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace kvpool::pool_node {
namespace {

constexpr uint32_t kBlock = 4096;

class UringEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string path = dir_.path() + "/data";
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0600);
    ASSERT_GE(fd_, 0) << std::strerror(errno);
    void* mem = nullptr;
    ASSERT_EQ(posix_memalign(&mem, kBlock, 2 * kBytes), 0);
    mem_.reset(static_cast<std::byte*>(mem));
    out_ = mem_.get();
    in_ = mem_.get() + kBytes;
    for (uint32_t i = 0; i < kBytes; ++i) out_[i] = static_cast<std::byte>(i * 131 + 7);
    std::memset(in_, 0, kBytes);
  }
  void TearDown() override {
    engine_.reset();
    if (fd_ >= 0) ::close(fd_);
  }
  void Start(bool register_memory) {
    auto e = UringEngine::Create(fd_, 32, register_memory ? std::span<std::byte>(mem_.get(), 2 * kBytes)
                                                          : std::span<std::byte>());
    ASSERT_TRUE(e.ok()) << e.status();
    engine_ = std::move(*e);
  }
  // kOps ops of kBlock bytes each, at file offsets i * kBlock.
  std::vector<IoOp> Ops(bool write) const {
    std::vector<IoOp> ops;
    for (uint32_t i = 0; i < kOps; ++i) {
      ops.push_back(IoOp{write, uint64_t{i} * kBlock, (write ? out_ : in_) + i * kBlock, kBlock});
    }
    return ops;
  }

  static constexpr uint32_t kOps = 8;
  static constexpr uint32_t kBytes = kOps * kBlock;
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  pool_node::testing::TempDir dir_;
  int fd_ = -1;
  std::unique_ptr<std::byte, Free> mem_;
  std::byte* out_ = nullptr;
  std::byte* in_ = nullptr;
  std::unique_ptr<UringEngine> engine_;
};

TEST_F(UringEngineTest, WritesAndReadsBack) {
  Start(/*register_memory=*/true);
  ASSERT_TRUE(engine_->Run(Ops(true)).ok());
  ASSERT_TRUE(engine_->Run(Ops(false)).ok());
  EXPECT_EQ(std::memcmp(out_, in_, kBytes), 0);
}

// -EAGAIN and -EINTR say the kernel did not do the op this time (a device queue full, a
// signal): the op is submitted again, and the data arrives intact.
TEST_F(UringEngineTest, TransientErrorsAreRetried) {
  for (bool registered : {true, false}) {
    SCOPED_TRACE(registered ? "registered buffers" : "plain buffers");
    engine_.reset();
    std::memset(in_, 0, kBytes);
    Start(registered);
    absl::Mutex mu;
    std::map<uint64_t, int> calls;  // per (write, offset): completions seen
    engine_->SetCompletionFaultForTest([&](const IoOp& op, int res) {
      absl::MutexLock l(&mu);
      const int n = calls[op.file_offset * 2 + (op.write ? 1 : 0)]++;
      if (n < 3) return (n % 2 == 0) ? -EAGAIN : -EINTR;  // three transient failures per op
      return res;
    });
    std::vector<absl::Status> per_op;
    ASSERT_TRUE(engine_->Run(Ops(true), &per_op).ok());
    ASSERT_TRUE(engine_->Run(Ops(false), &per_op).ok());
    EXPECT_EQ(std::memcmp(out_, in_, kBytes), 0);
    absl::MutexLock l(&mu);
    ASSERT_EQ(calls.size(), 2u * kOps);
    for (const auto& [key, n] : calls) EXPECT_EQ(n, 4) << "op key " << key;
  }
}

// An error that persists fails the op (and its batch) after a bounded number of tries,
// spaced by a growing delay (EAGAIN: the device has no room now; resubmitting at once
// would spend the tries within microseconds); the other ops of the batch still
// complete, and the engine keeps serving.
TEST_F(UringEngineTest, PersistentTransientErrorsFailTheOpAfterBoundedRetries) {
  Start(/*register_memory=*/true);
  std::atomic<int> tries{0};
  absl::Mutex mu;
  std::vector<std::chrono::steady_clock::time_point> seen;  // completions of the failing op
  engine_->SetCompletionFaultForTest([&](const IoOp& op, int res) {
    if (op.file_offset != 3 * kBlock) return res;
    ++tries;
    absl::MutexLock l(&mu);
    seen.push_back(std::chrono::steady_clock::now());
    return -EAGAIN;
  });
  std::vector<absl::Status> per_op;
  const absl::Status st = engine_->Run(Ops(true), &per_op);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("offset 12288"), std::string::npos) << st;
  EXPECT_NE(st.message().find("retries"), std::string::npos) << st;
  EXPECT_EQ(tries.load(), static_cast<int>(UringEngine::kMaxTransientRetries) + 1);
  {
    // Each resubmission waited at least its delay (a lower bound: never flaky).
    absl::MutexLock l(&mu);
    ASSERT_EQ(seen.size(), UringEngine::kMaxTransientRetries + 1);
    for (uint32_t k = 1; k < seen.size(); ++k) {
      EXPECT_GE(seen[k] - seen[k - 1], std::chrono::microseconds(UringEngine::RetryDelayUs(k))) << "retry " << k;
    }
  }
  ASSERT_EQ(per_op.size(), kOps);
  for (uint32_t i = 0; i < kOps; ++i) EXPECT_EQ(per_op[i].ok(), i != 3) << i;
  // Other offsets still work.
  std::vector<IoOp> one = {IoOp{false, 0, in_, kBlock}};
  ASSERT_TRUE(engine_->Run(one).ok());
  EXPECT_EQ(std::memcmp(out_, in_, kBlock), 0);
}

}  // namespace
}  // namespace kvpool::pool_node
