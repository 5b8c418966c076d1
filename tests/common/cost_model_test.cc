#include "kvpool/common/cost_model.h"

#include <gtest/gtest.h>

namespace kvpool {
namespace {

ModelSpec Llama() { return *GetPreset("llama-3.3-70b"); }

TEST(CostModelTest, PrefillOf8kLlamaTokensAt400Tflops) {
  CostModel cm;
  EXPECT_NEAR(cm.PrefillSeconds(Llama(), 8192), 2.896, 0.001);
}

// 8K-token Llama-3.3-70B prompt, 80% hit in DRAM over PCIe 5.0 x16, 0.1 s queue.
TEST(CostModelTest, TextbookTtftDecomposition) {
  CostModel cm;
  auto t = EstimateTtft(cm, Llama(), {8192, 0.8, DefaultBandwidth(FetchTier::kDram), 0.1});
  ASSERT_TRUE(t.ok());
  EXPECT_NEAR(t->queue_s, 0.1, 1e-12);
  EXPECT_NEAR(t->recompute_s, 0.2 * 2.896, 0.001);
  EXPECT_NEAR(t->transfer_s, 0.8 * 8192 * 327680 / 64e9, 1e-9);
  EXPECT_NEAR(t->total_s, 0.71, 0.005);
}

TEST(CostModelTest, HitRateThatHalvesTtftOverPcie) {
  CostModel cm;
  const double h = HitRateForSpeedup(cm, Llama(), 8192, DefaultBandwidth(FetchTier::kDram), 2.0);
  EXPECT_NEAR(h, 0.51, 0.005);
  // Check by substitution: the prefill part at h is half of full recompute.
  auto t = EstimateTtft(cm, Llama(), {8192, h, DefaultBandwidth(FetchTier::kDram), 0});
  EXPECT_NEAR(t->total_s, cm.PrefillSeconds(Llama(), 8192) / 2, 1e-9);
  // Counting a queue the hit cannot shorten needs a higher rate.
  EXPECT_GT(HitRateForSpeedupWithQueue(cm, Llama(), 8192, 64e9, 0.1, 2.0), h);
}

TEST(CostModelTest, SlowTierMakesSpeedupUnreachable) {
  CostModel cm;
  // At 1 MB/s, moving KV is slower than recomputing it.
  EXPECT_GT(HitRateForSpeedup(cm, Llama(), 8192, 1e6, 2.0), 1.0);
  EXPECT_NEAR(BreakEvenBandwidth(cm, Llama()), 327680.0 * 400e12 / (2 * 70.7e9), 1.0);
}

TEST(CostModelTest, HybridFetchIncludesOneCheckpoint) {
  ModelSpec k = *GetPreset("kimi-k3");
  EXPECT_EQ(CostModel::FetchBytes(k, 1000), 27648.0 * 1000 + 69.0 * 3 * 1024 * 1024);
  EXPECT_EQ(CostModel::FetchBytes(k, 0), 0);
}

TEST(CostModelTest, RejectsBadInputsNamingTheField) {
  CostModel cm;
  auto bad_hit = EstimateTtft(cm, Llama(), {8192, 1.5, 64e9, 0});
  EXPECT_NE(bad_hit.status().message().find("hit"), absl::string_view::npos);
  auto bad_ctx = EstimateTtft(cm, Llama(), {0, 0.5, 64e9, 0});
  EXPECT_NE(bad_ctx.status().message().find("context"), absl::string_view::npos);
  auto bad_q = EstimateTtft(cm, Llama(), {10, 0.5, 64e9, -1});
  EXPECT_NE(bad_q.status().message().find("queue"), absl::string_view::npos);
  auto bad_bw = EstimateTtft(cm, Llama(), {10, 0.5, 0, 0});
  EXPECT_NE(bad_bw.status().message().find("bandwidth"), absl::string_view::npos);
}

TEST(FetchTierTest, DefaultsAndParsing) {
  EXPECT_EQ(DefaultBandwidth(FetchTier::kHbm), 3.35e12);
  EXPECT_EQ(DefaultBandwidth(FetchTier::kNvme), 7e9);
  EXPECT_EQ(*ParseFetchTier("RDMA"), FetchTier::kRdma);
  EXPECT_FALSE(ParseFetchTier("tape").ok());
}

}  // namespace
}  // namespace kvpool
