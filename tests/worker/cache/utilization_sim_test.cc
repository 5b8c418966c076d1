// The contiguous-vs-paged utilization simulator behind cache_bench: bad traces and
// options are refused with a message instead of looping or running on nonsense.
#include "utilization_sim.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvpool::cache::bench {
namespace {

using ::testing::HasSubstr;

std::string WriteTrace(const std::string& body) {
  const std::string path = ::testing::TempDir() + "/trace_" + std::to_string(::getpid()) + ".jsonl";
  std::ofstream(path) << body;
  return path;
}

// Every prompt at or past max_model_len: nothing can ever be admitted. The admission
// loop used to skip those requests forever (the queue refills from the trace).
TEST(UtilizationSimTest, NoRequestThatFitsIsRefused) {
  const std::vector<TraceRequest> trace = {{1, 0}, {40, 3}};
  for (const char* policy : {"paged", "contiguous"}) {
    auto r = SimulateUtilization(trace, {.policy = policy, .num_blocks = 64, .block_tokens = 16,
                                         .prompt_tokens = 1, .max_model_len = 1, .steps = 10});
    ASSERT_FALSE(r.ok()) << policy;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("max_model_len")) << r.status();
  }
  // One request that fits is enough.
  auto r = SimulateUtilization(trace, {.policy = "paged", .num_blocks = 64, .block_tokens = 16,
                                       .max_model_len = 8, .steps = 10});
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_GT(r->finished, 0);
}

TEST(UtilizationSimTest, TraceLengthsAreChecked) {
  const std::string path = WriteTrace("{\"input_length\": 10, \"output_length\": 5}\n"
                                      "{\"input_length\": 0, \"output_length\": 5}\n");
  auto t = LoadTrace(path);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(":2: input_length=0 must be in [1, 2^30]")) << t.status();
  std::ofstream(path) << "{\"input_length\": 10, \"output_length\": -1}\n";
  t = LoadTrace(path);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(":1: output_length=-1 must be in [0, 2^30]")) << t.status();
  std::ofstream(path) << "{\"input_length\": 9223372036854775807, \"output_length\": 1}\n";
  t = LoadTrace(path);
  ASSERT_FALSE(t.ok());
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(":1: input_length=9223372036854775807")) << t.status();
  std::ofstream(path) << "{\"input_length\": 10, \"output_length\": 0}\n";
  t = LoadTrace(path);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ((*t)[0].output_length, 0);
  std::remove(path.c_str());
}

}  // namespace
}  // namespace kvpool::cache::bench
