// GQA paged decode and prefill against a double-precision oracle over contiguous
// copies of the cache (paged == contiguous), with shuffled block tables and NaN in
// every page slot no sequence owns.
//
// Tolerances. The oracle reads exactly the values the pages hold, so the cache dtype
// does not enter the comparison: what is left is fp32 accumulation over <= 2.1K
// tokens (about sqrt(n) * 6e-8 relative, ~3e-6) plus the CPU's vector exp (< 2e-7
// relative). atol 2e-5 + rtol 2e-4 leaves a 5x margin and is still ~1000x below the
// error of reading one wrong token. Fidelity to the unrounded fp32 inputs, per dtype,
// is checked separately (see DTypeFidelity).
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel_test.h"
#include "test_util.h"

namespace kvpool::kernels::testing {
namespace {

constexpr double kAtol = 2e-5, kRtol = 2e-4;

struct GqaShape {
  int head_dim, num_q, num_kv;
};

// bf16 products (BackendOptions::bf16_products) multiply q rounded to bf16, and the
// softmax weights p rounded to bf16, by the cached values. The oracle then takes q
// rounded the same way (exactly what the kernel multiplies), which leaves the weights:
// the output is sum_t p'_t v_t / sum_t p_t with |p'_t - p_t| <= 2^-9 p_t (round to
// nearest; the denominator sums the fp32 weights), so it moves by at most 2^-9 max|v|
// = 1.5e-3 for this file's V values (|v| <= 0.75), plus fp32 accumulation (kAtol).
// Reading one wrong token among n moves an output by ~0.5 / n (0.004 at n = 130).
constexpr double kBf16ProductAtol = 1.5e-3 + kAtol;

// Runs a decode on `be` over `lens`; returns the output and checks it against the oracle
// (with q rounded to bf16 and kBf16ProductAtol where `q_bf16`).
std::vector<float> RunDecode(KernelBackend* be, DType dt, int page, GqaShape s,
                             const std::vector<int>& lens, uint32_t seed, double* worst,
                             bool q_bf16 = false) {
  const int row = s.num_kv * s.head_dim;
  PagedStore k(dt, page, row, lens, seed), v(dt, page, row, lens, seed);
  // v has k's block table (same seed, same shuffle); give it different values.
  const int batch = static_cast<int>(lens.size());
  std::vector<float> q = RandomVec(static_cast<size_t>(batch) * s.num_q * s.head_dim, seed + 7);
  std::vector<float> out(q.size(), std::nanf(""));
  // Different V values, same layout: regenerate V's pages with another seed mapping.
  for (size_t b = 0; b < lens.size(); ++b) {
    for (auto& x : v.tokens[b]) x = RoundTo(dt, -0.5f * x + 0.25f);
    for (int t = 0; t < lens[b]; ++t) {
      const int64_t slot = int64_t{v.table[b * v.max_blocks + t / page]} * page + t % page;
      for (int i = 0; i < row; ++i) {
        StoreFromFloat(v.bytes.data(), dt, slot * row + i, v.tokens[b][static_cast<size_t>(t) * row + i]);
      }
    }
  }
  DeviceBuf dk(be, k.bytes), dv(be, v.bytes), dq(be, q), dout(be, out), dtab(be, k.TableFor(be)),
      dlen(be, k.seq_lens);
  GqaDecodeParams p;
  p.q = dq.as<float>();
  p.out = dout.as<float>();
  p.kv = {dk.as<void>(), dv.as<void>(), dt, k.num_pages, page, s.num_kv, s.head_dim};
  p.table = {dtab.as<int32_t>(), dlen.as<int32_t>(), batch, k.max_blocks};
  p.num_q_heads = s.num_q;
  const absl::Status st = be->GqaDecode(p);
  EXPECT_TRUE(st.ok()) << st;
  out = dout.Read<float>();
  const int G = s.num_q / s.num_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  *worst = 0;
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < s.num_q; ++h) {
      const int kvh = h / G;
      const size_t at = (static_cast<size_t>(b) * s.num_q + h) * s.head_dim;
      std::vector<float> qh(&q[at], &q[at] + s.head_dim);
      if (q_bf16) {
        for (float& x : qh) x = RoundTo(DType::kBf16, x);
      }
      auto ref = OracleAttend(
          qh.data(), s.head_dim, s.head_dim, lens[b], scale,
          [&](int t) { return &k.tokens[b][static_cast<size_t>(t) * row + kvh * s.head_dim]; },
          [&](int t) { return &v.tokens[b][static_cast<size_t>(t) * row + kvh * s.head_dim]; });
      *worst = std::max(*worst, WorstRatio(&out[at], ref, s.head_dim, q_bf16 ? kBf16ProductAtol : kAtol,
                                           q_bf16 ? 0.0 : kRtol));
      if (lens[b] == 0) {  // zero-length sequences give exact zeros (no NaN)
        for (int j = 0; j < s.head_dim; ++j) EXPECT_EQ(out[at + j], 0.f);
      }
    }
  }
  return out;
}

TEST_P(GqaTest, DecodeMatchesContiguousOracle) {
  const GqaShape shapes[] = {{64, 4, 2}, {128, 9, 3}, {64, 7, 1}, {128, 8, 8}};
  uint32_t seed = 1;
  for (DType dt : {DType::kBf16, DType::kFp16, DType::kFp32}) {
    for (int page : {1, 16, 64}) {
      for (const GqaShape& s : shapes) {
        // 0: empty; 1: one token; 37 and 130: partial pages (splits: the next test).
        double worst = 0;
        RunDecode(be_.get(), dt, page, s, {37, 0, 1, 130}, seed++, &worst);
        EXPECT_LE(worst, 1.0) << DTypeStr(dt) << " page=" << page << " d=" << s.head_dim
                              << " q=" << s.num_q << " kv=" << s.num_kv;
      }
    }
  }
}

TEST_P(GqaTest, DecodeLongContextSplitsAndMerges) {
  double worst = 0;
  // 2049: three splits, the last of one token; 1024: exactly one split.
  RunDecode(be_.get(), DType::kBf16, 16, {128, 8, 2}, {2049, 1024, 5}, 99, &worst);
  EXPECT_LE(worst, 1.0);
  // Groups of 20 q heads (two head tiles of 16 on the GPU, the second partial), and a
  // long sequence beside an empty one on pages of one token (many pages per split).
  worst = 0;
  RunDecode(be_.get(), DType::kBf16, 16, {128, 40, 2}, {0, 1, 1025}, 100, &worst);
  EXPECT_LE(worst, 1.0) << "q=40 kv=2";
  worst = 0;
  RunDecode(be_.get(), DType::kBf16, 1, {64, 4, 2}, {0, 2049}, 101, &worst);
  EXPECT_LE(worst, 1.0) << "page=1, lens {0, 2049}";
}

TEST_P(GqaTest, DecodeIsBitwiseReproducible) {
  double w1 = 0, w2 = 0;
  const auto a = RunDecode(be_.get(), DType::kBf16, 16, {64, 4, 2}, {3000, 5, 700}, 5, &w1);
  const auto b = RunDecode(be_.get(), DType::kBf16, 16, {64, 4, 2}, {3000, 5, 700}, 5, &w2);
  ASSERT_EQ(a.size(), b.size());
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  if (GetParam() == Backend::kCpuOptimized) {  // and independent of the thread count
    for (int threads : {1, 3}) {
      auto other = MakeBackend(Backend::kCpuOptimized, threads);
      const auto c = RunDecode(other.get(), DType::kBf16, 16, {64, 4, 2}, {3000, 5, 700}, 5, &w2);
      EXPECT_EQ(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0) << threads;
    }
  }
}

// BackendOptions::bf16_products: decode on bf16 products (vdpbf16ps) where the CPU has
// avx512_bf16, against the oracle with q rounded to bf16 (tolerance above): group sizes
// 1-12 (4-row score blocks and 1-3-row remainders), d 64/128, pages 1/16/64, odd tiles (37,
// 130 tokens: a token pair with no second row), splits, NaN in every unowned slot; then
// bitwise independence of the thread count and of the batch.
std::unique_ptr<KernelBackend> Bf16ProductBackend(int threads) {
  auto be = CreateBackend(Backend::kCpuOptimized, {.num_threads = threads, .bf16_products = true});
  EXPECT_TRUE(be.ok()) << be.status();
  return be.ok() ? std::move(*be) : nullptr;
}

TEST_P(Bf16ProductsTest, GqaDecodeMatchesOracleWithBf16Q) {
  auto be = Bf16ProductBackend(2);
  ASSERT_NE(be, nullptr);
  if (be->Describe().find("avx512_bf16") == std::string::npos) {
    GTEST_SKIP() << "this CPU has no avx512_bf16 (" << be->Describe()
                 << "): bf16_products runs the exact path, which the other GqaTest checks cover";
  }
  const GqaShape shapes[] = {{64, 4, 2}, {128, 9, 3}, {64, 7, 1}, {128, 8, 8}, {128, 64, 8}, {64, 12, 1}};
  uint32_t seed = 1000;
  for (int page : {1, 16, 64}) {
    for (const GqaShape& s : shapes) {
      double worst = 0;
      RunDecode(be.get(), DType::kBf16, page, s, {37, 0, 1, 130}, seed++, &worst, /*q_bf16=*/true);
      EXPECT_LE(worst, 1.0) << "page=" << page << " d=" << s.head_dim << " q=" << s.num_q << " kv=" << s.num_kv;
    }
  }
  double worst = 0;
  RunDecode(be.get(), DType::kBf16, 16, {128, 8, 2}, {2049, 1024, 5}, 99, &worst, true);
  EXPECT_LE(worst, 1.0) << "splits";
  // fp16 and fp32 caches take the exact path.
  RunDecode(be.get(), DType::kFp16, 16, {128, 8, 2}, {300}, 98, &worst);
  EXPECT_LE(worst, 1.0) << "fp16";
}

TEST_P(Bf16ProductsTest, GqaDecodeIsBitwiseReproducible) {
  auto be = Bf16ProductBackend(2);
  ASSERT_NE(be, nullptr);
  for (GqaShape s : {GqaShape{64, 12, 1}, GqaShape{128, 8, 1}}) {
    double w = 0;
    const std::vector<int> lens = {2100, 77, 0};
    const auto a = RunDecode(be.get(), DType::kBf16, 16, s, lens, 11, &w, true);
    for (int threads : {1, 3}) {
      auto other = Bf16ProductBackend(threads);
      const auto c = RunDecode(other.get(), DType::kBf16, 16, s, lens, 11, &w, true);
      ASSERT_EQ(a.size(), c.size());
      EXPECT_EQ(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0) << threads;
    }
    // Sequence 0 alone (its data depends on the seed and its index only).
    const auto alone = RunDecode(be.get(), DType::kBf16, 16, s, {2100}, 11, &w, true);
    EXPECT_EQ(std::memcmp(alone.data(), a.data(), alone.size() * sizeof(float)), 0);
  }
}

// A wide group (12 q heads per K/V head: three blocks of 4 rows in the score and
// accum kernels) over split-K chunks: same oracle tolerance, and bitwise independent of
// the thread count.
TEST_P(GqaTest, DecodeWideGroupIsBitwiseReproducibleAcrossThreads) {
  double w1 = 0, w2 = 0;
  const std::vector<int> lens = {2100, 77, 0};
  const auto a = RunDecode(be_.get(), DType::kBf16, 16, {64, 12, 1}, lens, 11, &w1);
  EXPECT_LE(w1, 1.0);
  if (GetParam() == Backend::kCpuOptimized) {
    for (int threads : {1, 3}) {
      auto other = MakeBackend(Backend::kCpuOptimized, threads);
      const auto c = RunDecode(other.get(), DType::kBf16, 16, {64, 12, 1}, lens, 11, &w2);
      ASSERT_EQ(a.size(), c.size());
      EXPECT_EQ(std::memcmp(a.data(), c.data(), a.size() * sizeof(float)), 0) << threads;
    }
  }
}

// The determinism contract the worker relies on (kernels/README.md): a sequence's result
// does not depend on the batch it is in (nor on where its pages lie). Sequence 0 has the
// same K/V and q in both runs (the test data of sequence b depends only on the seed and
// b); bf16 with d = 64 / 128 exercises the paired bf16 fast path where the ISA has one.
TEST_P(GqaTest, DecodeOfASequenceIsIndependentOfItsBatch) {
  for (GqaShape s : {GqaShape{64, 4, 2}, GqaShape{128, 8, 1}, GqaShape{128, 9, 3}}) {
    double w1 = 0, w2 = 0;
    const auto alone = RunDecode(be_.get(), DType::kBf16, 16, s, {2100}, 21, &w1);
    const auto batched = RunDecode(be_.get(), DType::kBf16, 16, s, {2100, 5, 1500, 0}, 21, &w2);
    EXPECT_LE(w1, 1.0);
    EXPECT_LE(w2, 1.0);
    const size_t n = static_cast<size_t>(s.num_q) * s.head_dim;
    ASSERT_GE(batched.size(), n);
    EXPECT_EQ(std::memcmp(alone.data(), batched.data(), n * sizeof(float)), 0)
        << "d=" << s.head_dim << " q=" << s.num_q << " kv=" << s.num_kv;
  }
}

// Lengths around the decode loops' edges: the prefetch distances (256-byte rows: 16
// tokens; 12 and 32 for the 4/2 shape; never past the split), the 4-token score
// sub-blocks and 2-/4-token score groups (odd tails), the 64-token tiles and the
// 1024-token splits; tiny-gqa's and llama-70b-tp8's shapes on the paired bf16 path,
// every page size.
// Matches the oracle and, on cpu_optimized, is bitwise the same on 1 and 3 threads.
TEST_P(GqaTest, DecodeLengthsAroundLoopEdges) {
  const std::vector<int> lens = {1, 3, 5, 11, 12, 13, 31, 33, 63, 65, 1023, 1025};
  uint32_t seed = 500;
  for (GqaShape s : {GqaShape{64, 4, 2}, GqaShape{128, 8, 1}}) {
    for (int page : {1, 16, 64}) {
      double worst = 0;
      const auto a = RunDecode(be_.get(), DType::kBf16, page, s, lens, seed, &worst);
      EXPECT_LE(worst, 1.0) << "page=" << page << " d=" << s.head_dim << " q=" << s.num_q;
      if (GetParam() == Backend::kCpuOptimized) {
        for (int threads : {1, 3}) {
          auto other = MakeBackend(Backend::kCpuOptimized, threads);
          double w = 0;
          const auto b = RunDecode(other.get(), DType::kBf16, page, s, lens, seed, &w);
          ASSERT_EQ(a.size(), b.size());
          EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
              << "threads=" << threads << " page=" << page << " d=" << s.head_dim;
        }
      }
      ++seed;
    }
  }
}

// Prefill: sequences of (cached prefix, new tokens); the new tokens' K/V are the last
// q_len entries of each sequence.
void CheckPrefill(KernelBackend* be, DType dt, int page, GqaShape s,
                  const std::vector<std::pair<int, int>>& seqs, uint32_t seed) {
  std::vector<int> lens;
  std::vector<int32_t> indptr = {0};
  for (auto [prefix, q_len] : seqs) {
    lens.push_back(prefix + q_len);
    indptr.push_back(indptr.back() + q_len);
  }
  const int row = s.num_kv * s.head_dim, batch = static_cast<int>(seqs.size());
  PagedStore k(dt, page, row, lens, seed), v(dt, page, row, lens, seed + 1000);
  v.table = k.table;  // V must follow K's block table: rewrite V's pages under it
  for (size_t i = 0; i < v.bytes.size() / ElementBytes(dt); ++i) {
    StoreFromFloat(v.bytes.data(), dt, i, std::nanf(""));
  }
  for (size_t b = 0; b < lens.size(); ++b) {
    for (int t = 0; t < lens[b]; ++t) {
      const int64_t slot = int64_t{k.table[b * k.max_blocks + t / page]} * page + t % page;
      for (int i = 0; i < row; ++i) {
        StoreFromFloat(v.bytes.data(), dt, slot * row + i, v.tokens[b][static_cast<size_t>(t) * row + i]);
      }
    }
  }
  const int total = indptr.back();
  std::vector<float> q = RandomVec(static_cast<size_t>(total) * s.num_q * s.head_dim, seed + 3);
  std::vector<float> out(q.size(), std::nanf(""));
  DeviceBuf dk(be, k.bytes), dv(be, v.bytes), dq(be, q), dout(be, out), dtab(be, k.TableFor(be)),
      dlen(be, k.seq_lens), dind(be, indptr);
  GqaPrefillParams p;
  p.q = dq.as<float>();
  p.q_indptr = dind.as<int32_t>();
  p.out = dout.as<float>();
  p.kv = {dk.as<void>(), dv.as<void>(), dt, std::max(k.num_pages, v.num_pages), page, s.num_kv,
          s.head_dim};
  p.table = {dtab.as<int32_t>(), dlen.as<int32_t>(), batch, k.max_blocks};
  p.num_q_heads = s.num_q;
  ASSERT_TRUE(be->GqaPrefill(p).ok());
  out = dout.Read<float>();
  const int G = s.num_q / s.num_kv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  double worst = 0;
  for (int b = 0; b < batch; ++b) {
    const int q_len = indptr[b + 1] - indptr[b], prefix = lens[b] - q_len;
    for (int i = 0; i < q_len; ++i) {
      for (int h = 0; h < s.num_q; ++h) {
        const size_t at = (static_cast<size_t>(indptr[b] + i) * s.num_q + h) * s.head_dim;
        const int kvh = h / G;
        auto ref = OracleAttend(
            &q[at], s.head_dim, s.head_dim, prefix + i + 1, scale,
            [&](int t) { return &k.tokens[b][static_cast<size_t>(t) * row + kvh * s.head_dim]; },
            [&](int t) { return &v.tokens[b][static_cast<size_t>(t) * row + kvh * s.head_dim]; });
        worst = std::max(worst, WorstRatio(&out[at], ref, s.head_dim, kAtol, kRtol));
      }
    }
  }
  EXPECT_LE(worst, 1.0) << DTypeStr(dt) << " page=" << page << " d=" << s.head_dim;
}

TEST_P(GqaTest, PrefillCausalOverCachedPrefix) {
  // (prefix, new): no prefix; prefix + new spanning pages; no new tokens; empty; long.
  const std::vector<std::pair<int, int>> seqs = {{0, 5}, {30, 20}, {70, 0}, {0, 0}, {200, 33}, {3, 1}};
  CheckPrefill(be_.get(), DType::kBf16, 1, {64, 4, 2}, seqs, 40);
  CheckPrefill(be_.get(), DType::kFp16, 16, {128, 6, 3}, seqs, 41);
  CheckPrefill(be_.get(), DType::kFp32, 64, {64, 5, 1}, seqs, 42);
  CheckPrefill(be_.get(), DType::kBf16, 16, {128, 8, 8}, seqs, 43);
}

// Against the unrounded fp32 values: the error a cache dtype costs. Outputs are
// convex combinations of V (|v| <= 1). bf16 keeps 8 significant bits (relative
// rounding <= 2^-9 = 2e-3 per element); a score moves by at most
// scale * sum |q||dk| <= sqrt(d) * 2^-9 ~ 0.02 (d = 128), so probabilities move by
// ~2%, plus 2e-3 on V: bound 3e-2. fp16 keeps 11 bits: 8x smaller, 4e-3. fp32: the
// accumulation tolerance above.
TEST_P(GqaTest, DTypeFidelity) {
  const struct {
    DType dt;
    double atol;
  } cases[] = {{DType::kBf16, 3e-2}, {DType::kFp16, 4e-3}, {DType::kFp32, 2e-5}};
  for (const auto& c : cases) {
    const int d = 128, nkv = 2, nq = 4, len = 300, page = 16;
    std::vector<float> kf = RandomVec(static_cast<size_t>(len) * nkv * d, 11);
    std::vector<float> vf = RandomVec(kf.size(), 12);
    std::vector<float> q = RandomVec(static_cast<size_t>(nq) * d, 13);
    const int pages = (len + page - 1) / page;
    std::vector<int32_t> table(pages), lens = {len};
    for (int i = 0; i < pages; ++i) table[i] = pages - 1 - i;  // reversed
    const size_t esz = ElementBytes(c.dt);
    std::vector<uint8_t> kb(static_cast<size_t>(pages) * page * nkv * d * esz), vb(kb.size());
    for (int t = 0; t < len; ++t) {
      const int64_t slot = int64_t{table[t / page]} * page + t % page;
      for (int i = 0; i < nkv * d; ++i) {
        StoreFromFloat(kb.data(), c.dt, slot * nkv * d + i, kf[static_cast<size_t>(t) * nkv * d + i]);
        StoreFromFloat(vb.data(), c.dt, slot * nkv * d + i, vf[static_cast<size_t>(t) * nkv * d + i]);
      }
    }
    std::vector<float> out(q.size());
    DeviceBuf dk(be_.get(), kb), dv(be_.get(), vb), dq(be_.get(), q), dout(be_.get(), out),
        dtab(be_.get(), table), dlen(be_.get(), lens);
    GqaDecodeParams p;
    p.q = dq.as<float>();
    p.out = dout.as<float>();
    p.kv = {dk.as<void>(), dv.as<void>(), c.dt, pages, page, nkv, d};
    p.table = {dtab.as<int32_t>(), dlen.as<int32_t>(), 1, pages};
    p.num_q_heads = nq;
    ASSERT_TRUE(be_->GqaDecode(p).ok());
    out = dout.Read<float>();
    double worst = 0;
    for (int h = 0; h < nq; ++h) {
      auto ref = OracleAttend(
          &q[static_cast<size_t>(h) * d], d, d, len, 1.0 / std::sqrt(double{d}),
          [&](int t) { return &kf[(static_cast<size_t>(t) * nkv + h / 2) * d]; },
          [&](int t) { return &vf[(static_cast<size_t>(t) * nkv + h / 2) * d]; });
      worst = std::max(worst, WorstRatio(&out[static_cast<size_t>(h) * d], ref, d, c.atol, 0.0));
    }
    EXPECT_LE(worst, 1.0) << DTypeStr(c.dt);
  }
}

// Every score -inf (q.k overflowed past -FLT_MAX at a huge scale): no token has any
// weight, and the output is zeros on every backend (the reference divided 0 by 0,
// NaN, where the optimized tiles gave zeros).
TEST_P(GqaTest, EveryScoreMinusInfinityGivesZeros) {
  const std::vector<uint16_t> pages(2 * 16 * 1 * 64, 0x3F80);  // bf16 1.0 everywhere
  const std::vector<int32_t> table = {0, 1}, lens = {20};
  const std::vector<float> q(2 * 64, -1.f), out(2 * 64, 7.f);
  DeviceBuf dpages(be_.get(), pages), dq(be_.get(), q), dout(be_.get(), out), dtab(be_.get(), table),
      dlen(be_.get(), lens);
  GqaDecodeParams p;
  p.q = dq.as<float>();
  p.out = dout.as<float>();
  p.kv = {dpages.as<void>(), dpages.as<void>(), DType::kBf16, 2, 16, 1, 64};
  p.table = {dtab.as<int32_t>(), dlen.as<int32_t>(), 1, 2};
  p.num_q_heads = 2;
  p.scale = std::numeric_limits<float>::max();  // -64 x FLT_MAX = -inf
  ASSERT_TRUE(be_->GqaDecode(p).ok());
  for (float x : dout.Read<float>()) ASSERT_EQ(x, 0.f);
}

// Shape checks name the argument (host content checks only where tables are on host).
TEST_P(GqaTest, LaunchersNameTheWrongArgument) {
  std::vector<uint16_t> pages(64 * 16 * 2 * 64);
  std::vector<int32_t> table = {0, 1}, lens = {20};
  std::vector<float> q(4 * 64), out(4 * 64);
  GqaDecodeParams p;
  p.q = q.data();
  p.out = out.data();
  p.kv = {pages.data(), pages.data(), DType::kBf16, 2, 16, 2, 64};
  p.table = {table.data(), lens.data(), 1, 2};
  p.num_q_heads = 4;
  if (!host()) GTEST_SKIP() << "argument checks use host buffers; covered by the CPU backends";
  ASSERT_TRUE(be_->GqaDecode(p).ok());
  auto expect = [&](GqaDecodeParams bad, const char* arg) {
    const absl::Status st = be_->GqaDecode(bad);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << arg;
    EXPECT_NE(std::string(st.message()).find(arg), std::string::npos) << st;
  };
  GqaDecodeParams b = p;
  b.kv.head_dim = 96;
  expect(b, "kv.head_dim");
  b = p;
  b.kv.page_size = 8;
  expect(b, "kv.page_size");
  b = p;
  b.kv.dtype = DType::kFp8;
  expect(b, "kv.dtype");
  b = p;
  b.num_q_heads = 3;
  expect(b, "num_q_heads");
  b = p;
  b.q = nullptr;
  expect(b, "q");
  b = p;
  b.scale = -1.f;
  expect(b, "scale=-1 must be >= 0");
  std::vector<int32_t> bad_table = {0, 2};
  b = p;
  b.table.block_table = bad_table.data();
  expect(b, "table.block_table[0][1]");
  std::vector<int32_t> long_len = {33};
  b = p;
  b.table.seq_lens = long_len.data();
  expect(b, "table.seq_lens[0]");
  // A length near INT_MAX with a table wide enough for it: ceil(len / page) overflowed
  // int, which skipped every page check, and the kernel read the bad pages (SIGSEGV).
  {
    const int wide = (1 << 25) + 1;  // max_blocks * 64 > INT_MAX
    std::vector<int32_t> bad_wide(wide, 999999), huge_len = {INT32_MAX - 20};
    GqaDecodeParams w = p;
    w.kv.page_size = 64;
    w.kv.num_pages = 1;
    w.table = {bad_wide.data(), huge_len.data(), 1, wide};
    expect(w, "table.seq_lens[0]=2147483627 exceeds kMaxSeqLen");
  }
  GqaPrefillParams pf;
  pf.q = q.data();
  pf.out = out.data();
  pf.kv = p.kv;
  pf.table = p.table;
  pf.num_q_heads = 4;
  std::vector<int32_t> indptr = {0, 21};
  pf.q_indptr = indptr.data();
  const absl::Status st = be_->GqaPrefill(pf);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("q_indptr"), std::string::npos) << st;
  // A q_indptr that goes backwards by more than INT_MAX (the int difference overflowed).
  std::vector<int32_t> lens2 = {20, 20}, table2 = {0, 1, 0, 1}, wrap = {0, 1, INT32_MIN};
  pf.table = {table2.data(), lens2.data(), 2, 2};
  pf.q_indptr = wrap.data();
  const absl::Status st2 = be_->GqaPrefill(pf);
  EXPECT_EQ(st2.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st2.message()).find("q_indptr: decreases at 1"), std::string::npos) << st2;
  // No new tokens anywhere: nothing to read or write, so null q / out (an empty
  // tensor's data pointer) are accepted; with one new token they are not.
  std::vector<int32_t> none = {0, 0, 0}, one = {0, 0, 1};
  pf.q_indptr = none.data();
  pf.q = nullptr;
  pf.out = nullptr;
  EXPECT_TRUE(be_->GqaPrefill(pf).ok());
  pf.q_indptr = one.data();
  const absl::Status st3 = be_->GqaPrefill(pf);
  EXPECT_EQ(st3.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st3.message()).find("q:"), std::string::npos) << st3;
}

}  // namespace
}  // namespace kvpool::kernels::testing
