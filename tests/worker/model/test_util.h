// Helpers for the model runner tests.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/common/model_spec.h"
#include "kvpool/worker/model/model_runner.h"
#include "kvpool/worker/model/weights.h"

namespace kvpool::model::testing {

// `n` token ids in [0, vocab), a fixed function of (seed, i).
inline std::vector<TokenId> Tokens(int n, uint64_t seed, int vocab = 512) {
  SplitMix64 rng(seed);
  std::vector<TokenId> t(static_cast<size_t>(n));
  for (auto& x : t) x = static_cast<TokenId>(rng.Next() % static_cast<uint64_t>(vocab));
  return t;
}

inline std::vector<TokenId> Concat(std::vector<TokenId> a, const std::vector<TokenId>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

inline std::unique_ptr<ModelRunner> MakeRunner(const std::string& preset,
                                               RunnerOptions options = {}) {
  auto spec = GetPreset(preset);
  EXPECT_TRUE(spec.ok()) << spec.status();
  auto r = ModelRunner::Create(*spec, options);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? std::move(*r) : nullptr;
}

inline GenerateRequest Req(std::vector<TokenId> prompt, int max_new, std::string salt = "") {
  GenerateRequest r;
  r.prompt_tokens = std::move(prompt);
  r.max_new_tokens = max_new;
  r.tenant_salt = std::move(salt);
  return r;
}

inline GenerateResult Gen(ModelRunner& r, const std::vector<TokenId>& prompt, int max_new,
                          const std::string& salt = "") {
  auto res = r.Generate(Req(prompt, max_new, salt));
  EXPECT_TRUE(res.ok()) << res.status();
  return res.ok() ? *res : GenerateResult{};
}

// Bit-identical outputs: the tokens and the hidden-state digest.
#define EXPECT_SAME_OUTPUT(a, b)                               \
  do {                                                         \
    EXPECT_EQ((a).output_tokens, (b).output_tokens);           \
    EXPECT_EQ((a).hidden_digest.ToHex(), (b).hidden_digest.ToHex()); \
  } while (0)

}  // namespace kvpool::model::testing
