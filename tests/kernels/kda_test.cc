// KDA: recurrent decode over a slot pool and chunked prefill, against a double
// recurrence; chunked == recurrent; resumed from a chunk-boundary state ==
// uninterrupted (bit for bit); untouched slots bit-identical; strong decay stays finite.
//
// Tolerances: states and outputs are fp32 with |k| <= 1 and beta in (0, 1), so each
// step is a contraction plus O(1) writes and rounding errors do not grow: ~1e-6 per
// step, a few hundred steps -> ~1e-5. atol 5e-5 + rtol 5e-4 against double.
// The chunked form reorders sums (pairwise decays), same bound.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernel_test.h"
#include "test_util.h"

namespace kvpool::kernels::testing {
namespace {

constexpr double kAtol = 5e-5, kRtol = 5e-4;

// Per-token inputs of T tokens x H heads.
struct KdaInputs {
  int T, H, dk, dv;
  std::vector<float> q, k, v, g, beta;
};

KdaInputs MakeInputs(int T, int H, int dk, int dv, uint32_t seed, float g_lo = -0.3f,
                     float g_hi = 0.f) {
  KdaInputs in{T, H, dk, dv, {}, {}, {}, {}, {}};
  in.q = RandomVec(static_cast<size_t>(T) * H * dk, seed);
  in.k = RandomVec(static_cast<size_t>(T) * H * dk, seed + 1);
  for (size_t r = 0; r < in.k.size() / dk; ++r) {  // |k| = 1 keeps the rule stable
    double n = 0;
    for (int i = 0; i < dk; ++i) n += double{in.k[r * dk + i]} * in.k[r * dk + i];
    for (int i = 0; i < dk; ++i) in.k[r * dk + i] = static_cast<float>(in.k[r * dk + i] / std::sqrt(n));
  }
  in.v = RandomVec(static_cast<size_t>(T) * H * dv, seed + 2);
  in.g = RandomVec(static_cast<size_t>(T) * H * dk, seed + 3, g_lo, g_hi);
  in.beta = RandomVec(static_cast<size_t>(T) * H, seed + 4, 0.05f, 0.95f);
  return in;
}

// Double recurrence of tokens [t0, t1) of `in` on state S ([H][dk][dv]); outputs appended.
void OracleRun(const KdaInputs& in, int t0, int t1, float scale, bool l2, std::vector<double>& S,
               std::vector<double>* out) {
  const int H = in.H, dk = in.dk, dv = in.dv;
  for (int t = t0; t < t1; ++t) {
    for (int h = 0; h < H; ++h) {
      const size_t th = static_cast<size_t>(t) * H + h;
      std::vector<double> q(in.q.begin() + th * dk, in.q.begin() + (th + 1) * dk);
      std::vector<double> k(in.k.begin() + th * dk, in.k.begin() + (th + 1) * dk);
      if (l2) {
        for (auto* x : {&q, &k}) {
          double n = 1e-6;
          for (double e : *x) n += e * e;
          for (double& e : *x) e /= std::sqrt(n);
        }
      }
      double* s = &S[static_cast<size_t>(h) * dk * dv];
      std::vector<double> u(dv, 0.0);
      for (int i = 0; i < dk; ++i) {
        const double a = std::exp(double{in.g[th * dk + i]});
        for (int j = 0; j < dv; ++j) {
          s[i * dv + j] *= a;
          u[j] += k[i] * s[i * dv + j];
        }
      }
      const double beta = in.beta[th];
      for (int i = 0; i < dk; ++i) {
        for (int j = 0; j < dv; ++j) s[i * dv + j] += beta * k[i] * (in.v[th * dv + j] - u[j]);
      }
      for (int j = 0; j < dv; ++j) {
        double o = 0;
        for (int i = 0; i < dk; ++i) o += s[i * dv + j] * q[i];
        out->push_back(scale * o);
      }
    }
  }
}

TEST_P(KdaTest, DecodeStepsMatchOracleAndLeaveOtherSlotsAlone) {
  // The third case has gates above 0 (alpha > 1, outside kda.h's g <= 0): decode still
  // follows the recurrence (the optimized backend then takes std::exp per element).
  // The last two reset channels (g = -inf: alpha = 0) every fourth step, at the
  // d_k = d_v = 64 and 128 shapes the CUDA backend keeps in registers.
  for (auto [dk, dv, l2, g_hi, resets] :
       {std::tuple{64, 64, false, 0.f, false}, std::tuple{17, 33, true, 0.f, false},
        std::tuple{64, 32, false, 0.05f, false}, std::tuple{64, 64, false, 0.f, true},
        std::tuple{128, 128, true, 0.f, true}}) {
    const int H = 2, slots = 5, steps = 12;
    const std::vector<int32_t> slot_ids = {4, 0, 2};
    const int batch = static_cast<int>(slot_ids.size());
    const size_t state_elems = static_cast<size_t>(H) * dk * dv;
    std::vector<float> pool = RandomVec(slots * state_elems, 9, -0.5f, 0.5f);
    const std::vector<float> initial = pool;
    std::vector<std::vector<double>> S(batch);
    for (int b = 0; b < batch; ++b) {
      S[b].assign(pool.begin() + slot_ids[b] * state_elems, pool.begin() + (slot_ids[b] + 1) * state_elems);
    }
    DeviceBuf dpool(be_.get(), pool), dslots(be_.get(), slot_ids);
    const float scale = 1.f / std::sqrt(static_cast<float>(dk));
    double worst = 0;
    for (int step = 0; step < steps; ++step) {
      // Token `step` of every sequence: inputs laid out [batch][H][...].
      KdaInputs in = MakeInputs(batch, H, dk, dv, 1000 + step, -0.3f, g_hi);
      if (resets && step % 4 == 1) {
        const float inf = std::numeric_limits<float>::infinity();
        for (int i = 0; i < dk; ++i) in.g[i] = -inf;                       // sequence 0, head 0: all
        for (int i = 0; i < dk; i += 3) in.g[(1 * H + 1) * dk + i] = -inf;  // sequence 1, head 1: some
      }
      std::vector<float> out(static_cast<size_t>(batch) * H * dv, std::nanf(""));
      DeviceBuf dq(be_.get(), in.q), dk_(be_.get(), in.k), dv_(be_.get(), in.v), dg(be_.get(), in.g),
          db(be_.get(), in.beta), dout(be_.get(), out);
      KdaDecodeParams p;
      p.q = dq.as<float>();
      p.k = dk_.as<float>();
      p.v = dv_.as<float>();
      p.g = dg.as<float>();
      p.beta = db.as<float>();
      p.slots = dslots.as<int32_t>();
      p.out = dout.as<float>();
      p.pool = {dpool.as<float>(), slots, H, dk, dv};
      p.batch = batch;
      p.l2_normalize_qk = l2;
      ASSERT_TRUE(be_->KdaDecode(p).ok());
      out = dout.Read<float>();
      for (int b = 0; b < batch; ++b) {
        // Sequence b's token is row b of `in`: run the oracle on that single row.
        std::vector<double> ref;
        OracleRun(in, b, b + 1, scale, l2, S[b], &ref);
        worst = std::max(worst, WorstRatio(&out[static_cast<size_t>(b) * H * dv], ref, ref.size(), kAtol, kRtol));
      }
    }
    pool = dpool.Read<float>();
    for (int b = 0; b < batch; ++b) {
      worst = std::max(worst, WorstRatio(&pool[slot_ids[b] * state_elems], S[b], state_elems, kAtol, kRtol));
    }
    EXPECT_LE(worst, 1.0) << "dk=" << dk << " dv=" << dv << (resets ? " with resets" : "");
    for (int s : {1, 3}) {  // slots nobody named: bit-identical
      EXPECT_EQ(std::memcmp(&pool[s * state_elems], &initial[s * state_elems], state_elems * sizeof(float)), 0) << s;
    }
  }
}

// Runs a chunked prefill of several runs; returns outputs, final pool, boundary states.
struct PrefillResult {
  std::vector<float> out, pool, boundaries;
};

PrefillResult RunPrefill(KernelBackend* be, const KdaInputs& in, const std::vector<int32_t>& cu,
                         const std::vector<int32_t>& start, const std::vector<int32_t>& slots,
                         const std::vector<float>& pool, int num_slots, bool l2) {
  const int batch = static_cast<int>(slots.size());
  std::vector<int32_t> bind = {0};
  for (int b = 0; b < batch; ++b) bind.push_back(bind.back() + KdaCountBoundaries(start[b], cu[b + 1] - cu[b]));
  const size_t state_elems = static_cast<size_t>(in.H) * in.dk * in.dv;
  PrefillResult r;
  r.out.assign(static_cast<size_t>(cu.back()) * in.H * in.dv, std::nanf(""));
  r.boundaries.assign(std::max<size_t>(1, bind.back() * state_elems), std::nanf(""));
  DeviceBuf dq(be, in.q), dk(be, in.k), dv(be, in.v), dg(be, in.g), db(be, in.beta),
      dcu(be, cu), dstart(be, start), dslots(be, slots), dpool(be, pool), dout(be, r.out),
      dbs(be, r.boundaries), dbind(be, bind);
  KdaPrefillParams p;
  p.q = dq.as<float>();
  p.k = dk.as<float>();
  p.v = dv.as<float>();
  p.g = dg.as<float>();
  p.beta = db.as<float>();
  p.cu_seqlens = dcu.as<int32_t>();
  p.start_pos = dstart.as<int32_t>();
  p.slots = dslots.as<int32_t>();
  p.out = dout.as<float>();
  p.pool = {dpool.as<float>(), num_slots, in.H, in.dk, in.dv};
  p.batch = batch;
  p.l2_normalize_qk = l2;
  p.boundary_states = dbs.as<float>();
  p.boundary_indptr = dbind.as<int32_t>();
  const absl::Status st = be->KdaChunkedPrefill(p);
  EXPECT_TRUE(st.ok()) << st;
  r.out = dout.Read<float>();
  r.pool = dpool.Read<float>();
  r.boundaries = dbs.Read<float>();
  return r;
}

TEST_P(KdaTest, ChunkedPrefillMatchesRecurrence) {
  for (auto [dk, dv, l2] : {std::tuple{64, 64, false}, std::tuple{24, 40, true}}) {
    // Runs: shorter than a chunk, exactly one, one past, starting mid-chunk, long.
    const std::vector<int> lens = {1, 63, 64, 65, 200, 0};
    const std::vector<int32_t> start = {0, 0, 0, 10, 64, 5};
    const std::vector<int32_t> slots = {6, 1, 2, 3, 0, 5};
    std::vector<int32_t> cu = {0};
    for (int len : lens) cu.push_back(cu.back() + len);
    const int H = 2, num_slots = 7;
    const KdaInputs in = MakeInputs(cu.back(), H, dk, dv, 42 + dk);
    const size_t state_elems = static_cast<size_t>(H) * dk * dv;
    const std::vector<float> pool = RandomVec(num_slots * state_elems, 3, -0.5f, 0.5f);
    const PrefillResult r = RunPrefill(be_.get(), in, cu, start, slots, pool, num_slots, l2);
    const float scale = 1.f / std::sqrt(static_cast<float>(dk));
    double worst = 0;
    int boundary = 0;
    for (size_t b = 0; b < lens.size(); ++b) {
      std::vector<double> S(pool.begin() + slots[b] * state_elems, pool.begin() + (slots[b] + 1) * state_elems);
      for (int t = cu[b]; t < cu[b + 1]; ++t) {
        std::vector<double> ref;
        OracleRun(in, t, t + 1, scale, l2, S, &ref);
        worst = std::max(worst, WorstRatio(&r.out[static_cast<size_t>(t) * H * dv], ref, ref.size(), kAtol, kRtol));
        if ((start[b] + (t - cu[b]) + 1) % kKdaChunk == 0) {
          worst = std::max(worst, WorstRatio(&r.boundaries[boundary++ * state_elems], S, state_elems, kAtol, kRtol));
        }
      }
      worst = std::max(worst, WorstRatio(&r.pool[slots[b] * state_elems], S, state_elems, kAtol, kRtol));
    }
    EXPECT_EQ(boundary * state_elems, bool(boundary) ? r.boundaries.size() : 0u);
    EXPECT_LE(worst, 1.0) << "dk=" << dk << " dv=" << dv;
    // Slot 4 was not named: bit-identical.
    EXPECT_EQ(std::memcmp(&r.pool[4 * state_elems], &pool[4 * state_elems], state_elems * sizeof(float)), 0);
  }
}

TEST_P(KdaTest, ResumedFromBoundaryStateEqualsUninterrupted) {
  const int H = 2, dk = 64, dv = 64, T = 300;
  const size_t state_elems = static_cast<size_t>(H) * dk * dv;
  const KdaInputs in = MakeInputs(T, H, dk, dv, 77);
  const std::vector<float> pool = RandomVec(2 * state_elems, 5, -0.5f, 0.5f);
  const PrefillResult full = RunPrefill(be_.get(), in, {0, T}, {0}, {0}, pool, 2, true);
  // Resume at absolute position 128 (the second boundary) from the saved state.
  std::vector<float> pool2 = pool;
  std::copy(full.boundaries.begin() + state_elems, full.boundaries.begin() + 2 * state_elems,
            pool2.begin() + state_elems);
  KdaInputs tail = in;
  const int R = 128;
  auto cut = [&](std::vector<float>& x, int per) { x.erase(x.begin(), x.begin() + static_cast<size_t>(R) * H * per); };
  cut(tail.q, dk), cut(tail.k, dk), cut(tail.v, dv), cut(tail.g, dk), cut(tail.beta, 1);
  tail.T = T - R;
  const PrefillResult resumed = RunPrefill(be_.get(), tail, {0, T - R}, {R}, {1}, pool2, 2, true);
  const size_t out_row = static_cast<size_t>(H) * dv;
  EXPECT_EQ(std::memcmp(resumed.out.data(), full.out.data() + R * out_row, (T - R) * out_row * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(&resumed.pool[state_elems], &full.pool[0], state_elems * sizeof(float)), 0);
  // Its boundaries (after 192 and 256) are the uninterrupted run's third and fourth.
  EXPECT_EQ(std::memcmp(resumed.boundaries.data(), full.boundaries.data() + 2 * state_elems, 2 * state_elems * sizeof(float)), 0);
  // And a second uninterrupted run reproduces the first bit for bit.
  const PrefillResult again = RunPrefill(be_.get(), in, {0, T}, {0}, {0}, pool, 2, true);
  EXPECT_EQ(std::memcmp(again.out.data(), full.out.data(), full.out.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(again.pool.data(), full.pool.data(), full.pool.size() * sizeof(float)), 0);
}

// One sequence of all of `in`'s tokens from a random state in slot 0: the chunked
// prefill's outputs and final state against the double recurrence.
void ExpectPrefillMatchesOracle(KernelBackend* be, const KdaInputs& in, uint32_t seed) {
  const size_t state_elems = static_cast<size_t>(in.H) * in.dk * in.dv;
  const std::vector<float> pool = RandomVec(state_elems, seed, -0.5f, 0.5f);
  const PrefillResult r = RunPrefill(be, in, {0, in.T}, {0}, {0}, pool, 1, false);
  std::vector<double> S(pool.begin(), pool.end()), ref;
  OracleRun(in, 0, in.T, 1.f / std::sqrt(float(in.dk)), false, S, &ref);
  EXPECT_LE(WorstRatio(r.out, ref, ref.size(), kAtol, kRtol), 1.0);
  EXPECT_LE(WorstRatio(r.pool, S, state_elems, kAtol, kRtol), 1.0);
}

// Decays of e^-20 per token across 64-token chunks: pairwise exponents keep it finite.
TEST_P(KdaTest, StrongDecayStaysFinite) {
  ExpectPrefillMatchesOracle(be_.get(), MakeInputs(150, 1, 32, 32, 8, -20.f, -1e-3f), 5);
}

// alpha = exp(g) = 0 resets a channel: g = -inf is allowed (kda.h: g <= 0), and so are
// finite gates whose sum within a chunk overflows to -inf. The chunked form works with
// differences of running sums of g; it must not turn them into -inf - -inf.
TEST_P(KdaTest, ResetGatesOfMinusInfinity) {
  const int H = 2, dk = 32, dv = 32, T = 150;  // three chunks of 64
  KdaInputs in = MakeInputs(T, H, dk, dv, 21, -0.3f, -1e-3f);
  const float inf = std::numeric_limits<float>::infinity();
  auto gate = [&](int t, int h, int i) -> float& { return in.g[(static_cast<size_t>(t) * H + h) * dk + i]; };
  for (int i = 0; i < dk; ++i) {
    gate(1, 0, i) = -inf;      // a whole head reset early in the first chunk
    gate(70, 1, i) = -inf;     // ... and in the second chunk, on the other head
    gate(40, 0, i) = -3e38f;   // two finite gates whose sum is -inf in fp32
    gate(41, 0, i) = -3e38f;
  }
  for (int i = 0; i < dk; i += 3) gate(100, 0, i) = -inf;  // some channels only
  gate(129, 1, 5) = -inf;  // the first token of the third chunk
  ExpectPrefillMatchesOracle(be_.get(), in, 7);
}

// A run of 40 resets (-inf or -80) and then weak gates in one chunk: the chunk's running
// sum of gates is near -88 x 40 there, where fp32 spacing (2e-4) swamped the weak gates
// after it (the optimized chunk was 8x over this tolerance before its sums moved to double).
TEST_P(KdaTest, WeakGatesAfterALongRunOfResets) {
  const int H = 1, dk = 32, dv = 32, T = 64;  // one chunk
  KdaInputs in = MakeInputs(T, H, dk, dv, 31, -2e-3f, -1e-4f);
  const float inf = std::numeric_limits<float>::infinity();
  for (int t = 0; t < 40; ++t) {
    for (int i = 0; i < dk; ++i) in.g[static_cast<size_t>(t) * dk + i] = (t + i) % 2 ? -inf : -80.f;
  }
  ExpectPrefillMatchesOracle(be_.get(), in, 9);
}

TEST_P(KdaTest, LaunchersNameTheWrongArgument) {
  if (!host()) GTEST_SKIP() << "argument checks use host buffers; covered by the CPU backends";
  std::vector<float> pool(2 * 8 * 8), x(2 * 8), beta(2), out(2 * 8);
  std::vector<int32_t> dup = {1, 1}, far = {0, 2};
  KdaDecodeParams p;
  p.q = p.k = p.v = p.g = x.data();
  p.beta = beta.data();
  p.out = out.data();
  p.pool = {pool.data(), 2, 1, 8, 8};
  p.batch = 2;
  p.slots = dup.data();
  absl::Status st = be_->KdaDecode(p);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(st.message()).find("slots[1]=1 appears twice"), std::string::npos) << st;
  p.slots = far.data();
  st = be_->KdaDecode(p);
  EXPECT_NE(std::string(st.message()).find("slots[1]"), std::string::npos) << st;
  p.slots = dup.data();
  p.pool.d_k = 300;
  EXPECT_NE(std::string(be_->KdaDecode(p).message()).find("pool.d_k"), std::string::npos);
  // Boundary buffer sized for the wrong count.
  KdaPrefillParams pf;
  pf.q = pf.k = pf.v = pf.g = x.data();
  pf.beta = beta.data();
  pf.out = out.data();
  pf.pool = {pool.data(), 2, 1, 8, 8};
  std::vector<int32_t> cu = {0, 2}, start = {63}, slot = {0}, bind = {0, 0};
  pf.cu_seqlens = cu.data();
  pf.start_pos = start.data();
  pf.slots = slot.data();
  pf.batch = 1;
  pf.boundary_states = pool.data();
  pf.boundary_indptr = bind.data();
  st = be_->KdaChunkedPrefill(pf);
  EXPECT_NE(std::string(st.message()).find("boundary_indptr[1]"), std::string::npos) << st;
  // cu_seqlens that goes backwards by more than INT_MAX: the int difference overflowed to
  // a positive length, the call was accepted and the kernels indexed token INT_MIN.
  std::vector<int32_t> wrap = {0, 1, INT32_MIN, INT32_MIN + 1}, slots3 = {0, 1, 2};
  std::vector<float> pool3(3 * 8 * 8);
  pf.pool = {pool3.data(), 3, 1, 8, 8};
  pf.cu_seqlens = wrap.data();
  pf.slots = slots3.data();
  pf.start_pos = nullptr;
  pf.boundary_states = nullptr;
  pf.boundary_indptr = nullptr;
  pf.batch = 3;
  st = be_->KdaChunkedPrefill(pf);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("cu_seqlens: decreases at 1"), std::string::npos) << st;
  // No tokens at all: nothing is read or written, so null token buffers (an empty
  // tensor's data pointer) are accepted and the slots stay as they were; the slots and
  // cu_seqlens are still checked.
  std::vector<int32_t> none = {0, 0, 0, 0};
  pf.cu_seqlens = none.data();
  pf.q = pf.k = pf.v = pf.g = pf.beta = pf.out = nullptr;
  std::fill(pool3.begin(), pool3.end(), 0.25f);
  EXPECT_TRUE(be_->KdaChunkedPrefill(pf).ok());
  EXPECT_EQ(pool3, std::vector<float>(3 * 8 * 8, 0.25f));
  std::vector<int32_t> bad_slots = {0, 1, 3};
  pf.slots = bad_slots.data();
  EXPECT_NE(std::string(be_->KdaChunkedPrefill(pf).message()).find("slots[2]"), std::string::npos);
  pf.slots = slots3.data();
  std::vector<int32_t> one = {0, 0, 0, 1};
  pf.cu_seqlens = one.data();
  st = be_->KdaChunkedPrefill(pf);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
  EXPECT_NE(std::string(st.message()).find("q:"), std::string::npos) << st;
}

}  // namespace
}  // namespace kvpool::kernels::testing
