// MLA: absorbed decode against a double oracle (paged == contiguous, NaN in unowned
// slots), page-size refusal, materialized prefill against a double oracle, and
// absorbed == materialized.
//
// Tolerances: as in gqa_test.cc, the oracle reads the stored values, so only fp32
// accumulation error remains: 576-wide dots and up to 1.1K tokens (~3e-6 relative);
// atol 2e-5 + rtol 2e-4. Absorbed vs materialized also differ by the order of the
// W_UK / W_UV products (512-wide fp32 dots of O(1) terms): atol 1e-4 + rtol 1e-3.
#include <cmath>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "kernel_test.h"
#include "kvpool/common/status.h"
#include "test_util.h"

namespace kvpool::kernels::testing {
namespace {

constexpr int kRank = 512, kRope = 64, kEntry = 576;
const float kScale = 1.f / std::sqrt(192.f);  // DeepSeek's nope + rope dims

// Absorbed decode of queries `q` (H heads per sequence) over the paged store `c`;
// the output, or the launcher's error.
absl::StatusOr<std::vector<float>> RunAbsorbed(KernelBackend* be, const PagedStore& c, DType dt,
                                              const std::vector<float>& q, int H) {
  const int batch = static_cast<int>(c.seq_lens.size());
  std::vector<float> out(static_cast<size_t>(batch) * H * kRank, std::nanf(""));
  DeviceBuf dc(be, c.bytes), dq(be, q), dout(be, out), dtab(be, c.TableFor(be)), dlen(be, c.seq_lens);
  MlaDecodeParams p;
  p.q = dq.as<float>();
  p.out = dout.as<float>();
  p.kv.entries = dc.as<void>();
  p.kv.dtype = dt;
  p.kv.num_pages = c.num_pages;
  p.table = {dtab.as<int32_t>(), dlen.as<int32_t>(), batch, c.max_blocks};
  p.num_heads = H;
  p.scale = kScale;
  RETURN_IF_ERROR(be->MlaDecodeAbsorbed(p));
  return dout.Read<float>();
}

// The worst tolerance ratio of an absorbed decode's output against the oracle, every
// sequence and head (1: at the tolerance).
double WorstAgainstOracle(const PagedStore& c, const std::vector<float>& q, const std::vector<float>& out, int H) {
  double worst = 0;
  for (size_t b = 0; b < c.seq_lens.size(); ++b) {
    for (int h = 0; h < H; ++h) {
      const size_t qi = b * H + h;
      auto row = [&](int t) { return &c.tokens[b][static_cast<size_t>(t) * kEntry]; };
      auto ref = OracleAttend(&q[qi * kEntry], kEntry, kRank, c.seq_lens[b], kScale, row, row);
      worst = std::max(worst, WorstRatio(&out[qi * kRank], ref, kRank, 2e-5, 2e-4));
    }
  }
  return worst;
}

TEST_P(MlaTest, AbsorbedDecodeMatchesContiguousOracle) {
  uint32_t seed = 300;
  for (DType dt : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    for (int H : {4, 3, 16}) {
      // 1100 (two split-K chunks) only once: the reference is slow under ASan.
      const std::vector<int> lens = {65, 0, 1, 64, H == 4 ? 1100 : 130};
      PagedStore c(dt, 64, kEntry, lens, seed++);
      const int batch = static_cast<int>(lens.size());
      std::vector<float> q = RandomVec(static_cast<size_t>(batch) * H * kEntry, seed++);
      absl::StatusOr<std::vector<float>> got = RunAbsorbed(be_.get(), c, dt, q, H);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_LE(WorstAgainstOracle(c, q, *got, H), 1.0) << DTypeStr(dt) << " heads=" << H;
    }
  }
}

// Head counts beyond one tile of 16 (the CUDA kernel's: a second, partial tile at 20) and
// DeepSeek-V3's full 128, bf16, beside an empty and a one-token sequence.
TEST_P(MlaTest, AbsorbedDecodeWithManyHeadsMatchesOracle) {
  uint32_t seed = 900;
  for (int H : {20, 128}) {
    const std::vector<int> lens = {0, 1, 130};
    PagedStore c(DType::kBf16, 64, kEntry, lens, seed++);
    const int batch = static_cast<int>(lens.size());
    std::vector<float> q = RandomVec(static_cast<size_t>(batch) * H * kEntry, seed++);
    absl::StatusOr<std::vector<float>> got = RunAbsorbed(be_.get(), c, DType::kBf16, q, H);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_LE(WorstAgainstOracle(c, q, *got, H), 1.0) << "heads=" << H;
  }
}

// 16 heads over two split-K chunks: bitwise the same for any thread count.
TEST_P(MlaTest, AbsorbedDecodeIsBitwiseReproducibleAcrossThreads) {
  if (GetParam() != Backend::kCpuOptimized) GTEST_SKIP() << "thread counts apply to cpu_optimized";
  const int H = 16;
  const std::vector<int> lens = {1100, 3};
  PagedStore c(DType::kBf16, 64, kEntry, lens, 77);
  const int batch = static_cast<int>(lens.size());
  const std::vector<float> q = RandomVec(static_cast<size_t>(batch) * H * kEntry, 78);
  auto run = [&](int threads) {
    auto be = MakeBackend(Backend::kCpuOptimized, threads);
    std::vector<float> out(static_cast<size_t>(batch) * H * kRank, std::nanf(""));
    MlaDecodeParams p;
    p.q = q.data();
    p.out = out.data();
    p.kv.entries = c.bytes.data();
    p.kv.dtype = DType::kBf16;
    p.kv.num_pages = c.num_pages;
    p.table = {c.table.data(), c.seq_lens.data(), batch, c.max_blocks};
    p.num_heads = H;
    p.scale = 1.f / std::sqrt(192.f);
    EXPECT_TRUE(be->MlaDecodeAbsorbed(p).ok());
    return out;
  };
  const std::vector<float> a = run(2);
  for (int threads : {1, 3}) {
    const std::vector<float> b = run(threads);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << threads;
  }
}

// A sequence's absorbed decode does not depend on the batch it is in (the worker's
// determinism contract): sequence 0 has the same entries and q alone and batched.
TEST_P(MlaTest, AbsorbedDecodeOfASequenceIsIndependentOfItsBatch) {
  const int H = 16;
  auto run = [&](const std::vector<int>& lens) {
    PagedStore c(DType::kBf16, 64, kEntry, lens, 91);  // sequence b's data: (seed, b) only
    const int batch = static_cast<int>(lens.size());
    const std::vector<float> q = RandomVec(static_cast<size_t>(batch) * H * kEntry, 92);
    absl::StatusOr<std::vector<float>> got = RunAbsorbed(be_.get(), c, DType::kBf16, q, H);
    EXPECT_TRUE(got.ok()) << got.status();
    std::vector<float> out = got.ok() ? *std::move(got) : std::vector<float>();
    out.resize(static_cast<size_t>(H) * kRank);  // sequence 0
    return out;
  };
  const std::vector<float> alone = run({1100});
  const std::vector<float> batched = run({1100, 3, 700});
  EXPECT_EQ(std::memcmp(alone.data(), batched.data(), alone.size() * sizeof(float)), 0);
}

// BackendOptions::bf16_products (see gqa_test.cc): the oracle takes q rounded to bf16;
// the weights' rounding moves an output by at most 2^-9 max|v| (entries in [-1, 1]).
TEST_P(Bf16ProductsTest, MlaAbsorbedDecodeMatchesOracleWithBf16Q) {
  auto be = CreateBackend(Backend::kCpuOptimized, {.num_threads = 2, .bf16_products = true});
  ASSERT_TRUE(be.ok()) << be.status();
  if ((*be)->Describe().find("avx512_bf16") == std::string::npos) {
    GTEST_SKIP() << "this CPU has no avx512_bf16 (" << (*be)->Describe()
                 << "): bf16_products runs the exact path, which the other MlaTest checks cover";
  }
  uint32_t seed = 700;
  for (int H : {1, 3, 4, 16, 128}) {
    const std::vector<int> lens = {65, 0, 1, 64, H == 16 ? 1100 : 131};
    PagedStore c(DType::kBf16, 64, kEntry, lens, seed++);
    const int batch = static_cast<int>(lens.size());
    std::vector<float> q = RandomVec(static_cast<size_t>(batch) * H * kEntry, seed++);
    absl::StatusOr<std::vector<float>> got = RunAbsorbed(be->get(), c, DType::kBf16, q, H);
    ASSERT_TRUE(got.ok()) << got.status();
    double worst = 0;
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < H; ++h) {
        const size_t qi = static_cast<size_t>(b) * H + h;
        std::vector<float> qh(&q[qi * kEntry], &q[qi * kEntry] + kEntry);
        for (float& x : qh) x = RoundTo(DType::kBf16, x);
        auto row = [&](int t) { return &c.tokens[b][static_cast<size_t>(t) * kEntry]; };
        auto ref = OracleAttend(qh.data(), kEntry, kRank, lens[b], kScale, row, row);
        worst = std::max(worst, WorstRatio(&(*got)[qi * kRank], ref, kRank, 1.0 / 512 + 2e-5, 0.0));
      }
    }
    EXPECT_LE(worst, 1.0) << "heads=" << H;
  }
  // Bitwise the same for any thread count.
  const std::vector<int> lens = {1100, 3};
  PagedStore c(DType::kBf16, 64, kEntry, lens, 77);
  const std::vector<float> q = RandomVec(static_cast<size_t>(2) * 16 * kEntry, 78);
  auto a = RunAbsorbed(be->get(), c, DType::kBf16, q, 16);
  ASSERT_TRUE(a.ok());
  for (int threads : {1, 3}) {
    auto other = CreateBackend(Backend::kCpuOptimized, {.num_threads = threads, .bf16_products = true});
    ASSERT_TRUE(other.ok());
    auto b = RunAbsorbed(other->get(), c, DType::kBf16, q, 16);
    ASSERT_TRUE(b.ok());
    EXPECT_EQ(std::memcmp(a->data(), b->data(), a->size() * sizeof(float)), 0) << threads;
  }
}

TEST_P(MlaTest, RefusesPagesOtherThan64) {
  std::vector<uint16_t> pages(16 * kEntry);
  std::vector<int32_t> table = {0}, lens = {4};
  std::vector<float> q(kEntry), out(kRank);
  MlaDecodeParams p;
  p.q = q.data();
  p.out = out.data();
  p.kv.entries = pages.data();
  p.kv.num_pages = 1;
  p.kv.page_size = 16;
  p.table = {table.data(), lens.data(), 1, 1};
  p.num_heads = 1;
  p.scale = 0.1f;
  const absl::Status st = be_->MlaDecodeAbsorbed(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("kv.page_size=16 but MLA kernels need 64"),
            std::string::npos)
      << st;
  p.kv.page_size = 64;
  p.kv.kv_lora_rank = 256;
  EXPECT_NE(std::string(be_->MlaDecodeAbsorbed(p).message()).find("kv.kv_lora_rank"), std::string::npos);
}

// Materialized attention over (prefix, new) sequences, checked against a double
// oracle; returns outputs [total_q][H][dv].
struct Materialized {
  int H, nope, dv;
  std::vector<float> w_uk, w_uv, q_nope, q_rope;
};

std::vector<float> RunMaterialized(KernelBackend* be, const PagedStore& c, const Materialized& m,
                                   const std::vector<int32_t>& indptr, float scale) {
  const int batch = static_cast<int>(c.seq_lens.size());
  std::vector<float> out(static_cast<size_t>(indptr.back()) * m.H * m.dv, std::nanf(""));
  DeviceBuf dc(be, c.bytes), dwk(be, m.w_uk), dwv(be, m.w_uv), dqn(be, m.q_nope),
      dqr(be, m.q_rope), dout(be, out), dtab(be, c.TableFor(be)), dlen(be, c.seq_lens), dind(be, indptr);
  MlaMaterializedParams p;
  p.q_nope = dqn.as<float>();
  p.q_rope = dqr.as<float>();
  p.q_indptr = dind.as<int32_t>();
  p.w_uk = dwk.as<float>();
  p.w_uv = dwv.as<float>();
  p.out = dout.as<float>();
  p.kv.entries = dc.as<void>();
  p.kv.dtype = c.dtype;
  p.kv.num_pages = c.num_pages;
  p.table = {dtab.as<int32_t>(), dlen.as<int32_t>(), batch, c.max_blocks};
  p.num_heads = m.H;
  p.qk_nope_dim = m.nope;
  p.v_head_dim = m.dv;
  p.scale = scale;
  const absl::Status st = be->MlaMaterialized(p);
  EXPECT_TRUE(st.ok()) << st;
  return dout.Read<float>();
}

Materialized MakeWeights(int H, int nope, int dv, int total_q, uint32_t seed) {
  Materialized m{H, nope, dv, {}, {}, {}, {}};
  // Weights ~ U(-1,1)/sqrt(512) keep the up-projected K/V at O(1).
  m.w_uk = RandomVec(static_cast<size_t>(H) * nope * kRank, seed, -0.0442f, 0.0442f);
  m.w_uv = RandomVec(static_cast<size_t>(H) * dv * kRank, seed + 1, -0.0442f, 0.0442f);
  m.q_nope = RandomVec(static_cast<size_t>(total_q) * H * nope, seed + 2);
  m.q_rope = RandomVec(static_cast<size_t>(total_q) * H * kRope, seed + 3);
  return m;
}

TEST_P(MlaTest, MaterializedPrefillMatchesOracle) {
  const std::vector<std::pair<int, int>> seqs = {{0, 7}, {100, 30}, {64, 0}, {0, 0}, {20, 1}};
  std::vector<int> lens;
  std::vector<int32_t> indptr = {0};
  for (auto [prefix, n] : seqs) {
    lens.push_back(prefix + n);
    indptr.push_back(indptr.back() + n);
  }
  PagedStore c(DType::kBf16, 64, kEntry, lens, 77);
  const Materialized m = MakeWeights(3, 32, 24, indptr.back(), 78);
  const float scale = 1.f / std::sqrt(96.f);
  const std::vector<float> out = RunMaterialized(be_.get(), c, m, indptr, scale);
  double worst = 0;
  for (size_t b = 0; b < seqs.size(); ++b) {
    const int n = lens[b], q_len = indptr[b + 1] - indptr[b];
    for (int h = 0; h < m.H; ++h) {
      // Up-project in double, store as fp32 rows for the oracle.
      std::vector<float> K(static_cast<size_t>(n) * (m.nope + kRope)), V(static_cast<size_t>(n) * m.dv);
      for (int t = 0; t < n; ++t) {
        const float* e = &c.tokens[b][static_cast<size_t>(t) * kEntry];
        for (int j = 0; j < m.nope; ++j) {
          double a = 0;
          for (int i = 0; i < kRank; ++i) a += double{m.w_uk[(static_cast<size_t>(h) * m.nope + j) * kRank + i]} * e[i];
          K[static_cast<size_t>(t) * (m.nope + kRope) + j] = static_cast<float>(a);
        }
        for (int j = 0; j < kRope; ++j) K[static_cast<size_t>(t) * (m.nope + kRope) + m.nope + j] = e[kRank + j];
        for (int j = 0; j < m.dv; ++j) {
          double a = 0;
          for (int i = 0; i < kRank; ++i) a += double{m.w_uv[(static_cast<size_t>(h) * m.dv + j) * kRank + i]} * e[i];
          V[static_cast<size_t>(t) * m.dv + j] = static_cast<float>(a);
        }
      }
      for (int i = 0; i < q_len; ++i) {
        const size_t qi = static_cast<size_t>(indptr[b] + i) * m.H + h;
        std::vector<float> qcat(m.nope + kRope);
        std::memcpy(qcat.data(), &m.q_nope[qi * m.nope], m.nope * sizeof(float));
        std::memcpy(qcat.data() + m.nope, &m.q_rope[qi * kRope], kRope * sizeof(float));
        auto ref = OracleAttend(
            qcat.data(), m.nope + kRope, m.dv, n - q_len + i + 1, scale,
            [&](int t) { return &K[static_cast<size_t>(t) * (m.nope + kRope)]; },
            [&](int t) { return &V[static_cast<size_t>(t) * m.dv]; });
        worst = std::max(worst, WorstRatio(&out[qi * m.dv], ref, m.dv, 5e-5, 5e-4));
      }
    }
  }
  EXPECT_LE(worst, 1.0);
}

// Absorbed decode, then W_UV on the latent == materialized attention with one query.
TEST_P(MlaTest, AbsorbedEqualsMaterialized) {
  for (auto [nope, dv] : {std::pair{32, 32}, std::pair{128, 128}}) {
    const std::vector<int> lens = {1, 70, 300};
    const int batch = 3, H = 4;
    PagedStore c(DType::kBf16, 64, kEntry, lens, 500 + nope);
    const Materialized m = MakeWeights(H, nope, dv, batch, 600 + nope);
    const float scale = 1.f / std::sqrt(static_cast<float>(nope + kRope));
    const std::vector<int32_t> indptr = {0, 1, 2, 3};
    const std::vector<float> mat = RunMaterialized(be_.get(), c, m, indptr, scale);
    // Absorb: q_abs = W_UK^T q_nope (512), then [q_abs | q_rope].
    std::vector<float> q(static_cast<size_t>(batch) * H * kEntry);
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < H; ++h) {
        const size_t qi = static_cast<size_t>(b) * H + h;
        for (int i = 0; i < kRank; ++i) {
          double a = 0;
          for (int j = 0; j < nope; ++j) a += double{m.w_uk[(static_cast<size_t>(h) * nope + j) * kRank + i]} * m.q_nope[qi * nope + j];
          q[qi * kEntry + i] = static_cast<float>(a);
        }
        std::memcpy(&q[qi * kEntry + kRank], &m.q_rope[qi * kRope], kRope * sizeof(float));
      }
    }
    std::vector<float> latent(static_cast<size_t>(batch) * H * kRank);
    DeviceBuf dc(be_.get(), c.bytes), dq(be_.get(), q), dout(be_.get(), latent),
        dtab(be_.get(), c.TableFor(be_.get())), dlen(be_.get(), c.seq_lens);
    MlaDecodeParams p;
    p.q = dq.as<float>();
    p.out = dout.as<float>();
    p.kv.entries = dc.as<void>();
    p.kv.dtype = c.dtype;
    p.kv.num_pages = c.num_pages;
    p.table = {dtab.as<int32_t>(), dlen.as<int32_t>(), batch, c.max_blocks};
    p.num_heads = H;
    p.scale = scale;
    ASSERT_TRUE(be_->MlaDecodeAbsorbed(p).ok());
    latent = dout.Read<float>();
    double worst = 0;
    for (int b = 0; b < batch; ++b) {
      for (int h = 0; h < H; ++h) {
        const size_t qi = static_cast<size_t>(b) * H + h;
        std::vector<double> o(dv);
        for (int j = 0; j < dv; ++j) {
          for (int i = 0; i < kRank; ++i) o[j] += double{m.w_uv[(static_cast<size_t>(h) * dv + j) * kRank + i]} * latent[qi * kRank + i];
        }
        worst = std::max(worst, WorstRatio(&mat[qi * dv], o, dv, 1e-4, 1e-3));
      }
    }
    EXPECT_LE(worst, 1.0) << "nope=" << nope << " dv=" << dv;
  }
}

}  // namespace
}  // namespace kvpool::kernels::testing
