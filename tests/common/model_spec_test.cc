#include "kvpool/common/model_spec.h"

#include <cstdio>
#include <unistd.h>

#include <fstream>

#include <gtest/gtest.h>

namespace kvpool {
namespace {

ModelSpec Preset(absl::string_view name) {
  auto s = GetPreset(name);
  EXPECT_TRUE(s.ok()) << s.status();
  return *s;
}

TEST(ModelSpecTest, Llama33_70bIs320KiBPerToken) {
  ModelSpec s = Preset("llama-3.3-70b");
  EXPECT_EQ(s.NumLayers(AttentionKind::kGqa), 80);
  EXPECT_EQ(s.KvBytesPerTokenPerLayer(AttentionKind::kGqa), 4096);  // 2 x 8 x 128 x 2 B
  EXPECT_EQ(s.KvBytesPerToken(), 327680);
  EXPECT_EQ(s.FixedStateBytes(), 0);
  EXPECT_EQ(s.block_tokens, 16);
  EXPECT_EQ(s.BlockBytes(), 16 * 327680);
}

TEST(ModelSpecTest, DeepSeekV3MlaIs576ElementsPerLayer) {
  ModelSpec s = Preset("deepseek-v3");
  EXPECT_EQ(s.NumLayers(AttentionKind::kMla), 61);
  EXPECT_EQ(s.mla.EntryDim(), 576);
  EXPECT_EQ(s.KvBytesPerToken(), 70272);  // bf16
  s.kv_dtype = DType::kFp8;
  EXPECT_EQ(s.KvBytesPerToken(), 35136);
  EXPECT_NEAR(327680.0 / 35136.0, 9.33, 0.01);
  EXPECT_EQ(s.block_tokens, 64);
}

TEST(ModelSpecTest, KimiK3IsHybrid) {
  ModelSpec s = Preset("kimi-k3");
  EXPECT_EQ(s.NumLayers(), 93);
  EXPECT_EQ(s.NumLayers(AttentionKind::kMla), 24);
  EXPECT_EQ(s.NumLayers(AttentionKind::kKda), 69);
  EXPECT_EQ(s.layers[3], AttentionKind::kMla);   // position 4 (1-based)
  EXPECT_EQ(s.layers[91], AttentionKind::kMla);  // position 92
  EXPECT_EQ(s.layers[0], AttentionKind::kKda);
  EXPECT_EQ(s.KvBytesPerToken(), 27648);
  EXPECT_EQ(s.StateBytesPerLayer(), 3 * 1024 * 1024);
  EXPECT_NEAR(static_cast<double>(s.FixedStateBytes()) / (1 << 30), 0.20, 0.005);
  EXPECT_NEAR(s.CrossoverTokens(), 7851.0, 1.0);
  EXPECT_TRUE(s.IsHybrid());
  EXPECT_EQ(s.checkpoint_tokens, 6144);
}

TEST(ModelSpecTest, TinyPresetsMirrorTheRealStructures) {
  for (const auto& name : {"tiny-gqa", "tiny-mla", "tiny-hybrid"}) {
    ModelSpec s = Preset(name);
    EXPECT_TRUE(s.computable) << name;
    EXPECT_TRUE(s.Validate().ok()) << s.Validate();
  }
  ModelSpec g = Preset("tiny-gqa");
  EXPECT_EQ(g.KvBytesPerToken(), 4 * 2 * 2 * 64 * 2);
  ModelSpec m = Preset("tiny-mla");
  EXPECT_EQ(m.mla.EntryDim(), 576);
  EXPECT_EQ(m.KvBytesPerToken(), 2 * 576 * 2);
  ModelSpec h = Preset("tiny-hybrid");
  EXPECT_TRUE(h.IsHybrid());
  EXPECT_EQ(h.NumLayers(AttentionKind::kMla), 1);
  EXPECT_EQ(h.StateBytesPerLayer(), 2 * 64 * 64 * 4);
  EXPECT_EQ(h.checkpoint_tokens % h.block_tokens, 0);
}

TEST(ModelSpecTest, EveryPresetValidates) {
  for (const auto& name : PresetNames()) {
    EXPECT_TRUE(Preset(name).Validate().ok()) << name;
  }
}

TEST(ModelSpecTest, UnknownPresetListsTheKnownOnes) {
  auto s = GetPreset("gpt-5");
  EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(s.status().message().find("llama-3.3-70b"), absl::string_view::npos);
}

TEST(ModelSpecTest, LoadsFromJsonFile) {
  const std::string path = ::testing::TempDir() + "/spec.json";
  {
    std::ofstream f(path);
    f << R"({"name": "my-gqa", "active_params": 8e9, "hidden_size": 4096, "vocab_size": 32000,
             "layers": {"pattern": ["gqa"], "repeat": 32},
             "gqa": {"num_q_heads": 32, "num_kv_heads": 8, "head_dim": 128},
             "kv_dtype": "fp16", "block_tokens": 16})";
  }
  auto s = ResolveModelSpec(path);
  std::remove(path.c_str());
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->name, "my-gqa");
  EXPECT_EQ(s->KvBytesPerToken(), 32 * 2 * 8 * 128 * 2);
}

TEST(ModelSpecTest, BadSpecFilesNameTheField) {
  const std::string path = ::testing::TempDir() + "/bad.json";
  {
    std::ofstream f(path);
    f << R"({"name": "bad", "active_params": 1e9, "hidden_size": 64, "vocab_size": 10,
             "layers": ["gqa"], "gqa": {"num_q_heads": 3, "num_kv_heads": 2, "head_dim": 64}})";
  }
  auto s = LoadModelSpecFile(path);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("num_q_heads"), absl::string_view::npos) << s.status();
  {
    std::ofstream f(path);
    f << "{not json";
  }
  EXPECT_EQ(LoadModelSpecFile(path).status().code(), absl::StatusCode::kInvalidArgument);
  std::remove(path.c_str());
  EXPECT_EQ(LoadModelSpecFile("/nonexistent/x.json").status().code(), absl::StatusCode::kNotFound);
}

// Writes `json` to a temp file of this test's own (ctest runs tests in parallel, each
// in its own process) and loads it.
absl::StatusOr<ModelSpec> LoadJson(const std::string& json) {
  const std::string path = ::testing::TempDir() + "/spec-" +
                           ::testing::UnitTest::GetInstance()->current_test_info()->name() + "-" +
                           std::to_string(getpid()) + ".json";
  {
    std::ofstream f(path);
    f << json;
  }
  auto spec = LoadModelSpecFile(path);
  std::remove(path.c_str());  // one file per test and process: left behind, they piled up in /tmp
  return spec;
}

// A valid spec with `field` (a top-level key, or "gqa": {...} fragment) replaced.
std::string GqaSpec(const std::string& top, const std::string& gqa = R"("head_dim": 64)",
                    const std::string& layers = R"(["gqa"])") {
  return R"({"name": "x", "active_params": 1e6, "vocab_size": 512, "hidden_size": 256,
             "layers": )" + layers + R"(, "gqa": {"num_q_heads": 4, "num_kv_heads": 2, )" +
         gqa + "}" + (top.empty() ? "" : ", " + top) + "}";
}

// Regression: get<int>() wrapped 4294967552 to 256 and truncated 16.9 to 16.
TEST(ModelSpecTest, JsonNumbersMustBeIntegralAndFit) {
  ASSERT_TRUE(LoadJson(GqaSpec("")).ok()) << LoadJson(GqaSpec("")).status();
  struct Case {
    std::string json;
    const char* field;
  };
  const Case cases[] = {
      {GqaSpec(R"("hidden_size": 4294967552)"), "hidden_size"},
      {GqaSpec(R"("block_tokens": 16.9)"), "block_tokens"},
      {GqaSpec(R"("vocab_size": -4294967295)"), "vocab_size"},
      {GqaSpec(R"("block_tokens": 1e300)"), "block_tokens"},
      {GqaSpec(R"("block_tokens": "16")"), "block_tokens"},
      {GqaSpec("", R"("head_dim": 18446744073709551615)"), "gqa.head_dim"},
      {GqaSpec("", R"("head_dim": 64.5)"), "gqa.head_dim"},
      {GqaSpec(R"("checkpoint_tokens": 2147483648)"), "checkpoint_tokens"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    auto s = LoadJson(c.json);
    ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find(c.field), absl::string_view::npos) << s.status();
  }
  // An integral float is the integer.
  auto s = LoadJson(GqaSpec(R"("block_tokens": 64.0)"));
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->block_tokens, 64);
}

// Regression: a huge repeat threw std::bad_alloc out of LoadModelSpecFile.
TEST(ModelSpecTest, HugeRepeatAndDimsAreRefusedNotAllocated) {
  for (const char* repeat : {"2147483647", "4294967296", "1e18", "0", "-1"}) {
    SCOPED_TRACE(repeat);
    auto s = LoadJson(GqaSpec("", R"("head_dim": 64)",
                              std::string(R"({"pattern": ["gqa", "gqa"], "repeat": )") + repeat +
                                  "}"));
    ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("repeat"), absl::string_view::npos) << s.status();
  }
  // Dims that fit in int but whose byte counts would overflow int64.
  auto s = LoadJson(GqaSpec(R"("block_tokens": 1000000000)",
                            R"("head_dim": 1000000000)",
                            R"({"pattern": ["gqa"], "repeat": 4096})"));
  ASSERT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
  EXPECT_NE(s.status().message().find("block_tokens"), absl::string_view::npos) << s.status();
  ModelSpec big = Preset("llama-3.3-70b");
  big.gqa.head_dim = 1 << 30;
  EXPECT_EQ(big.Validate().code(), absl::StatusCode::kInvalidArgument);
  // At the caps every derived size still fits in int64.
  ModelSpec max = Preset("llama-3.3-70b");
  max.layers.assign(kMaxSpecLayers, AttentionKind::kGqa);
  max.gqa = {.num_q_heads = static_cast<int>(kMaxSpecHeads),
             .num_kv_heads = static_cast<int>(kMaxSpecHeads),
             .head_dim = static_cast<int>(kMaxSpecDim)};
  max.kv_dtype = DType::kFp32;
  max.block_tokens = static_cast<int>(kMaxSpecBlockTokens);
  ASSERT_TRUE(max.Validate().ok()) << max.Validate();
  EXPECT_EQ(max.BlockBytes(), int64_t{1} << 60);
}

TEST(DTypeTest, ParsesNamesAndRejectsOthers) {
  EXPECT_EQ(*ParseDType("bf16"), DType::kBf16);
  EXPECT_EQ(*ParseDType("FP8"), DType::kFp8);
  EXPECT_EQ(DTypeBytes(DType::kFp32), 4u);
  EXPECT_FALSE(ParseDType("int4").ok());
}

}  // namespace
}  // namespace kvpool
