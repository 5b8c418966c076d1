// Fixtures for the kernel tests: paged caches with shuffled block tables whose unused
// pages and tail slots hold NaN, contiguous fp32 copies of what the pages hold, and a
// double-precision attention oracle over the contiguous copies.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvpool/kernels/backend.h"

namespace kvpool::kernels::testing {

inline std::vector<float> RandomVec(size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Rounds through `dtype` (what a cache of that dtype can hold).
inline float RoundTo(DType dtype, float x) {
  switch (dtype) {
    case DType::kBf16: return Bf16ToFloat(FloatToBf16(x));
    case DType::kFp16: return Fp16ToFloat(FloatToFp16(x));
    default: return x;
  }
}

// A paged cache of `num_heads` heads x `dim` per token ("rows"), with one page set
// per sequence from a shuffled pool and `extra_pages` no sequence uses. Everything
// not holding a token (unused pages, the tail of each last page) is NaN. The table
// entries past each sequence's last block (the contract lets them hold anything) are -1
// in `table`; TableFor(be) gives device backends a table whose entries there name an
// unused NaN page instead: a device kernel skips page -1 (reads zeros, masked), so an
// over-read past seq_len would go unseen, while on host a read of page -1 lands before
// the buffer, where ASan (and the oracle comparison) catch it.
struct PagedStore {
  DType dtype;
  int page_size, row_elems;  // elements per token slot
  int num_pages, max_blocks;
  std::vector<int32_t> table;      // [batch][max_blocks], -1 past the used blocks
  int32_t unused_page = -1;        // a page no sequence uses (-1 when extra_pages is 0)
  std::vector<int32_t> seq_lens;
  std::vector<uint8_t> bytes;      // the pages
  std::vector<std::vector<float>> tokens;  // per sequence: [len][row_elems] as stored

  PagedStore(DType dt, int page, int row, const std::vector<int>& lens, uint32_t seed,
             int extra_pages = 3)
      : dtype(dt), page_size(page), row_elems(row), seq_lens(lens.begin(), lens.end()) {
    max_blocks = 1;
    int used = 0;
    for (int len : lens) {
      max_blocks = std::max(max_blocks, (len + page - 1) / page + 1);  // +1: a spare column
      used += (len + page - 1) / page;
    }
    num_pages = used + extra_pages;
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(seed));
    const size_t esz = ElementBytes(dt);
    bytes.resize(static_cast<size_t>(num_pages) * page * row * esz);
    const float nan = std::numeric_limits<float>::quiet_NaN();
    for (size_t i = 0; i < bytes.size() / esz; ++i) StoreFromFloat(bytes.data(), dt, i, nan);
    table.assign(lens.size() * max_blocks, -1);
    if (extra_pages > 0) unused_page = perm[used];
    int next = 0;
    for (size_t b = 0; b < lens.size(); ++b) {
      const int len = lens[b];
      std::vector<float> v = RandomVec(static_cast<size_t>(len) * row, seed * 131 + static_cast<uint32_t>(b));
      for (auto& x : v) x = RoundTo(dt, x);
      for (int blk = 0; blk < (len + page - 1) / page; ++blk) table[b * max_blocks + blk] = perm[next++];
      for (int t = 0; t < len; ++t) {
        const int64_t slot = int64_t{table[b * max_blocks + t / page]} * page + t % page;
        for (int i = 0; i < row; ++i) StoreFromFloat(bytes.data(), dt, slot * row + i, v[static_cast<size_t>(t) * row + i]);
      }
      tokens.push_back(std::move(v));
    }
  }

  // The table to hand `be` (see above): -1 past the used blocks on host, the unused NaN
  // page on a device.
  std::vector<int32_t> TableFor(const KernelBackend* be) const {
    if (be->memory_space() == MemorySpace::kHost) return table;
    std::vector<int32_t> t = table;
    for (int32_t& e : t) {
      if (e < 0) e = unused_page;
    }
    return t;
  }

  BlockTable Table() const {
    return {table.data(), seq_lens.data(), static_cast<int>(seq_lens.size()), max_blocks};
  }
};

// softmax(scale * q.k_t) . v_t over tokens [0, n), in double. k(t) and v(t) return
// pointers to fp32 rows of length dk / dv.
template <typename KFn, typename VFn>
std::vector<double> OracleAttend(const float* q, int dk, int dv, int n, double scale, KFn k, VFn v) {
  std::vector<double> out(dv, 0.0);
  if (n == 0) return out;
  std::vector<double> s(n);
  double m = -1e300;
  for (int t = 0; t < n; ++t) {
    double dot = 0;
    const float* kt = k(t);
    for (int i = 0; i < dk; ++i) dot += static_cast<double>(q[i]) * kt[i];
    s[t] = scale * dot;
    m = std::max(m, s[t]);
  }
  double l = 0;
  for (int t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    l += s[t];
  }
  for (int t = 0; t < n; ++t) {
    const float* vt = v(t);
    for (int j = 0; j < dv; ++j) out[j] += s[t] * vt[j];
  }
  for (auto& x : out) x /= l;
  return out;
}

// Largest |a - b| / (atol + rtol |b|) over the arrays (<= 1 passes).
template <typename A, typename B>
double WorstRatio(const A& a, const B& b, size_t n, double atol, double rtol) {
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i]));
    if (!(d == d)) return std::numeric_limits<double>::infinity();  // NaN
    worst = std::max(worst, d / (atol + rtol * std::abs(static_cast<double>(b[i]))));
  }
  return worst;
}

// A buffer in the backend's memory, filled from and read back into host vectors.
class DeviceBuf {
 public:
  DeviceBuf(KernelBackend* be, const void* host, size_t bytes) : be_(be), bytes_(bytes) {
    auto p = be->Allocate(bytes);
    EXPECT_TRUE(p.ok()) << p.status();
    ptr_ = p.ok() ? *p : nullptr;
    if (ptr_ && host) {
      EXPECT_TRUE(be->CopyIn(ptr_, host, bytes).ok());
    }
  }
  template <typename T>
  DeviceBuf(KernelBackend* be, const std::vector<T>& v) : DeviceBuf(be, v.data(), v.size() * sizeof(T)) {}
  ~DeviceBuf() { if (ptr_) be_->Free(ptr_); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  template <typename T>
  std::vector<T> Read() const {
    std::vector<T> out(bytes_ / sizeof(T));
    EXPECT_TRUE(be_->CopyOut(out.data(), ptr_, bytes_).ok());
    return out;
  }

 private:
  KernelBackend* be_;
  size_t bytes_;
  void* ptr_ = nullptr;
};

inline std::unique_ptr<KernelBackend> MakeBackend(Backend kind, int threads = 2) {
  auto be = CreateBackend(kind, {.num_threads = threads});
  EXPECT_TRUE(be.ok()) << be.status();
  return be.ok() ? std::move(*be) : nullptr;
}

inline const char* DTypeStr(DType d) {
  return d == DType::kBf16 ? "bf16" : (d == DType::kFp16 ? "fp16" : "fp32");
}

}  // namespace kvpool::kernels::testing
