// dtype conversions, the backend registry, and the thread pool.
#include <atomic>
#include <cstdint>
#include <new>
#include <string>
#include <cmath>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kernels/backend.h"
#include "kvpool/kernels/dtype.h"
#include "../../kernels/src/thread_pool.h"  // internal: exceptions from work items

namespace kvpool::kernels {
namespace {

TEST(DType, Fp16RoundTripsEveryHalf) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = Fp16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(FloatToFp16(f), h) << std::hex << h;
  }
}

TEST(DType, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.f + 1.f / 256), FloatToBf16(1.f));          // tie -> even
  EXPECT_EQ(Bf16ToFloat(FloatToBf16(1.f + 3.f / 256)), 1.f + 4.f / 256);  // tie -> even (up)
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(1.f + 1.f / 2048)), 1.f);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(65520.f)), INFINITY);
  EXPECT_EQ(Fp16ToFloat(FloatToFp16(5.9604645e-8f)), 5.9604645e-8f);  // smallest subnormal
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(NAN))));
}

TEST(Registry, NamesParseAndCpuBackendsExist) {
  for (Backend b : {Backend::kCpuReference, Backend::kCpuOptimized, Backend::kCuda}) {
    auto parsed = ParseBackend(BackendName(b));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, b);
  }
  EXPECT_FALSE(ParseBackend("tpu").ok());
  auto ref = CreateBackend(Backend::kCpuReference);
  ASSERT_TRUE(ref.ok());
  EXPECT_EQ((*ref)->num_threads(), 1);
  auto opt = CreateBackend(Backend::kCpuOptimized, {.num_threads = 3});
  ASSERT_TRUE(opt.ok());
  EXPECT_EQ((*opt)->num_threads(), 3);
  EXPECT_FALSE(CreateBackend(Backend::kCpuOptimized, {.num_threads = -1}).ok());
  auto many = CreateBackend(Backend::kCpuOptimized, {.num_threads = 5000});  // would start 4999 threads
  EXPECT_EQ(many.status().code(), absl::StatusCode::kInvalidArgument) << many.status();
  EXPECT_NE(std::string(many.status().message()).find("num_threads=5000"), std::string::npos) << many.status();
  // A size whose rounding up to 64 bytes would wrap to a tiny buffer.
  EXPECT_EQ((*ref)->Allocate(SIZE_MAX - 10).status().code(), absl::StatusCode::kResourceExhausted);
  auto cuda = CreateBackend(Backend::kCuda);
  if (!cuda.ok()) {  // an actionable reason, not a crash
    EXPECT_TRUE(cuda.status().code() == absl::StatusCode::kFailedPrecondition ||
                cuda.status().code() == absl::StatusCode::kUnavailable)
        << cuda.status();
  }
}

}  // namespace
}  // namespace kvpool::kernels

namespace kvpool::kernels {
namespace {

// The portable loops (the fallback on CPUs without AVX2) agree with the AVX2 ones.
// A work item that throws (a scratch buffer that does not fit: std::bad_alloc) reaches
// the caller of ParallelFor once every thread is out of the job, not std::terminate on a
// pool thread; the pool serves the next job. The launchers turn it into
// RESOURCE_EXHAUSTED.
TEST(ThreadPool, AnItemThatThrowsIsRethrownToTheCaller) {
  internal::ThreadPool pool(3);
  std::atomic<int> ran{0};
  EXPECT_THROW(pool.ParallelFor(10'000,
                                [&](int64_t i) {
                                  if (i == 7) throw std::bad_alloc();
                                  ran.fetch_add(1);
                                }),
               std::bad_alloc);
  EXPECT_LT(ran.load(), 10'000);
  std::atomic<int> again{0};
  pool.ParallelFor(1'000, [&](int64_t) { again.fetch_add(1); });
  EXPECT_EQ(again.load(), 1'000);
}

TEST(PortableLoops, MatchTheVectorizedBackend) {
  auto fast = CreateBackend(Backend::kCpuOptimized, {.num_threads = 2});
  auto portable = CreateBackend(Backend::kCpuOptimized, {.num_threads = 2, .portable_loops = true});
  ASSERT_TRUE(fast.ok() && portable.ok());
  EXPECT_NE((*portable)->Describe().find("generic"), std::string::npos);
  // GQA decode, bf16, odd group size, a partial page.
  const int d = 64, nkv = 2, nq = 6, len = 150, page = 16, pages = 10;
  std::vector<uint16_t> k(static_cast<size_t>(pages) * page * nkv * d), v(k.size());
  for (size_t i = 0; i < k.size(); ++i) {
    k[i] = FloatToBf16(std::sin(0.37f * static_cast<float>(i)));
    v[i] = FloatToBf16(std::cos(0.11f * static_cast<float>(i)));
  }
  std::vector<int32_t> table = {3, 1, 4, 0, 5, 9, 2, 6, 8, 7}, lens = {len};
  std::vector<float> q(nq * d);
  for (size_t i = 0; i < q.size(); ++i) q[i] = std::sin(1.3f * static_cast<float>(i));
  std::vector<float> out_fast(q.size()), out_portable(q.size());
  GqaDecodeParams p;
  p.q = q.data();
  p.kv = {k.data(), v.data(), DType::kBf16, pages, page, nkv, d};
  p.table = {table.data(), lens.data(), 1, pages};
  p.num_q_heads = nq;
  p.out = out_fast.data();
  ASSERT_TRUE((*fast)->GqaDecode(p).ok());
  p.out = out_portable.data();
  ASSERT_TRUE((*portable)->GqaDecode(p).ok());
  for (size_t i = 0; i < q.size(); ++i) EXPECT_NEAR(out_fast[i], out_portable[i], 2e-5) << i;
  // KDA chunked prefill over 100 tokens (two chunks).
  const int T = 100, dk = 16, dv = 24;
  std::vector<float> kq(T * dk), kk(T * dk), kv(T * dv), g(T * dk), beta(T, 0.5f);
  for (int i = 0; i < T * dk; ++i) {
    kq[i] = std::sin(0.7f * i);
    kk[i] = 0.25f * std::cos(0.3f * i);
    g[i] = -0.05f * (1 + (i % 3));
  }
  for (int i = 0; i < T * dv; ++i) kv[i] = std::sin(0.9f * i);
  std::vector<int32_t> cu = {0, T}, slot = {0};
  std::vector<float> s_fast(dk * dv, 0.1f), s_portable = s_fast, o_fast(T * dv), o_portable(T * dv);
  KdaPrefillParams kp;
  kp.q = kq.data();
  kp.k = kk.data();
  kp.v = kv.data();
  kp.g = g.data();
  kp.beta = beta.data();
  kp.cu_seqlens = cu.data();
  kp.slots = slot.data();
  kp.batch = 1;
  kp.pool = {s_fast.data(), 1, 1, dk, dv};
  kp.out = o_fast.data();
  ASSERT_TRUE((*fast)->KdaChunkedPrefill(kp).ok());
  kp.pool.states = s_portable.data();
  kp.out = o_portable.data();
  ASSERT_TRUE((*portable)->KdaChunkedPrefill(kp).ok());
  for (int i = 0; i < T * dv; ++i) EXPECT_NEAR(o_fast[i], o_portable[i], 1e-4) << i;
  for (int i = 0; i < dk * dv; ++i) EXPECT_NEAR(s_fast[i], s_portable[i], 1e-4) << i;
}

}  // namespace
}  // namespace kvpool::kernels
