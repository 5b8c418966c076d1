#include "kvpool/common/checksum.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// libxxhash's implementation, inlined into this file only: its default secret, its scalar
// stripe and scramble steps and its final merge, so that only the vector loops that fuse
// the copy are kvpool's (their arithmetic is XXH3's accumulate/scramble, lane for lane).
#define XXH_INLINE_ALL
#include "xxhash.h"

namespace kvpool {
namespace {

constexpr size_t kStripe = XXH_STRIPE_LEN;                                          // 64
constexpr size_t kStripesPerBlock = (XXH3_SECRET_DEFAULT_SIZE - kStripe) / XXH_SECRET_CONSUME_RATE;  // 16
const uint8_t* Secret() { return XXH3_kSecret; }
const uint8_t* ScrambleKey() { return XXH3_kSecret + XXH3_SECRET_DEFAULT_SIZE - kStripe; }
const uint8_t* LastStripeKey() { return ScrambleKey() - XXH_SECRET_LASTACC_START; }

// Folds `count` stripes of src into acc, starting `stripe` stripes into a 1 KiB block,
// and copies them to dst unless it is null. Each stripe is read once: the copy stores
// the very bytes that are folded in.
using FoldFn = void (*)(uint64_t* acc, uint32_t& stripe, std::byte* dst, const std::byte* src,
                        size_t count, bool stream);

void FoldScalar(uint64_t* acc, uint32_t& stripe, std::byte* dst, const std::byte* src, size_t count,
                bool /*stream*/) {
  alignas(64) std::byte s[kStripe];
  for (size_t i = 0; i < count; ++i) {
    std::memcpy(s, src + i * kStripe, kStripe);
    if (dst != nullptr) std::memcpy(dst + i * kStripe, s, kStripe);
    XXH3_accumulate_512_scalar(acc, s, Secret() + stripe * XXH_SECRET_CONSUME_RATE);
    if (++stripe == kStripesPerBlock) {
      XXH3_scrambleAcc_scalar(acc, ScrambleKey());
      stripe = 0;
    }
  }
}

#if defined(__x86_64__)
// Per 64-bit lane, as XXH3_accumulate_512: acc[i ^ 1] += data[i];
// acc[i] += lo32(data[i] ^ key[i]) * hi32(data[i] ^ key[i]).
// Scramble: acc ^= acc >> 47; acc ^= key; acc *= PRIME32_1 (mod 2^64).

#define KVPOOL_AVX512 __attribute__((target("avx512f"), always_inline)) inline

// One stripe: v = src's 64 bytes, stored to dst (streaming if nt) unless dst is null.
KVPOOL_AVX512 __m512i StripeAvx512(__m512i a, std::byte* dst, const std::byte* src, const uint8_t* key,
                                   bool nt) {
  const __m512i v = _mm512_loadu_si512(src);
  if (nt) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  } else if (dst != nullptr) {
    _mm512_storeu_si512(dst, v);
  }
  const __m512i dk = _mm512_xor_si512(v, _mm512_loadu_si512(key));
  const __m512i prod = _mm512_mul_epu32(dk, _mm512_srli_epi64(dk, 32));
  const __m512i swapped = _mm512_shuffle_epi32(v, static_cast<_MM_PERM_ENUM>(_MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_add_epi64(_mm512_add_epi64(a, swapped), prod);
}

KVPOOL_AVX512 __m512i ScrambleAvx512(__m512i a) {
  const __m512i prime = _mm512_set1_epi32(static_cast<int>(XXH_PRIME32_1));
  a = _mm512_xor_si512(_mm512_xor_si512(a, _mm512_srli_epi64(a, 47)), _mm512_loadu_si512(ScrambleKey()));
  const __m512i lo = _mm512_mul_epu32(a, prime);
  const __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
  return _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

__attribute__((target("avx512f"))) void FoldAvx512(uint64_t* acc, uint32_t& stripe, std::byte* dst,
                                                   const std::byte* src, size_t count, bool stream) {
  const bool nt = stream && dst != nullptr && (reinterpret_cast<uintptr_t>(dst) & 63) == 0;
  auto d = [&](size_t i) { return dst != nullptr ? dst + i * kStripe : nullptr; };
  __m512i a = _mm512_loadu_si512(acc);
  size_t i = 0;
  uint32_t s = stripe;
  // Up to the next block edge, whole blocks (16 stripes: constant key offsets), the rest.
  for (; i < count && s != 0; ++i) {
    a = StripeAvx512(a, d(i), src + i * kStripe, Secret() + s * XXH_SECRET_CONSUME_RATE, nt);
    if (++s == kStripesPerBlock) {
      a = ScrambleAvx512(a);
      s = 0;
    }
  }
  for (; i + kStripesPerBlock <= count; i += kStripesPerBlock) {
    for (size_t k = 0; k < kStripesPerBlock; ++k) {
      a = StripeAvx512(a, d(i + k), src + (i + k) * kStripe, Secret() + k * XXH_SECRET_CONSUME_RATE, nt);
    }
    a = ScrambleAvx512(a);
  }
  for (; i < count; ++i, ++s) {
    a = StripeAvx512(a, d(i), src + i * kStripe, Secret() + s * XXH_SECRET_CONSUME_RATE, nt);
  }
  _mm512_storeu_si512(acc, a);
  stripe = s;
}

__attribute__((target("avx2"))) void FoldAvx2(uint64_t* acc, uint32_t& stripe, std::byte* dst,
                                              const std::byte* src, size_t count, bool stream) {
  const __m256i prime = _mm256_set1_epi32(static_cast<int>(XXH_PRIME32_1));
  const bool nt = stream && dst != nullptr && (reinterpret_cast<uintptr_t>(dst) & 31) == 0;
  __m256i a[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc)),
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + 4))};
  uint32_t s = stripe;
  for (size_t i = 0; i < count; ++i) {
    for (int h = 0; h < 2; ++h) {
      const size_t off = i * kStripe + h * 32;
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + off));
      if (nt) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + off), v);
      } else if (dst != nullptr) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + off), v);
      }
      const __m256i key = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(Secret() + s * XXH_SECRET_CONSUME_RATE + h * 32));
      const __m256i dk = _mm256_xor_si256(v, key);
      const __m256i prod = _mm256_mul_epu32(dk, _mm256_srli_epi64(dk, 32));
      const __m256i swapped = _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2));
      a[h] = _mm256_add_epi64(_mm256_add_epi64(a[h], swapped), prod);
    }
    if (++s == kStripesPerBlock) {
      for (int h = 0; h < 2; ++h) {
        const __m256i key = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ScrambleKey() + h * 32));
        const __m256i x = _mm256_xor_si256(_mm256_xor_si256(a[h], _mm256_srli_epi64(a[h], 47)), key);
        const __m256i lo = _mm256_mul_epu32(x, prime);
        const __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(x, 32), prime);
        a[h] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
      }
      s = 0;
    }
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc), a[0]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc + 4), a[1]);
  stripe = s;
}
#endif

ChecksumIsa Widest() {
  static const ChecksumIsa widest = [] {
#if defined(__x86_64__)
    __builtin_cpu_init();  // in case a stream is made before the CPU model is (static init)
    if (__builtin_cpu_supports("avx512f")) return ChecksumIsa::kAvx512;
    if (__builtin_cpu_supports("avx2")) return ChecksumIsa::kAvx2;
#endif
    return ChecksumIsa::kScalar;
  }();
  return widest;
}

FoldFn FoldFor(ChecksumIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case ChecksumIsa::kAvx512:
      return &FoldAvx512;
    case ChecksumIsa::kAvx2:
      return &FoldAvx2;
#endif
    default:
      return &FoldScalar;
  }
}

}  // namespace

bool ChecksumIsaSupported(ChecksumIsa isa) {
  switch (isa) {
    case ChecksumIsa::kAuto:
    case ChecksumIsa::kScalar:
      return true;
#if defined(__x86_64__)
    case ChecksumIsa::kAvx2:
      return Widest() != ChecksumIsa::kScalar;
    case ChecksumIsa::kAvx512:
      return Widest() == ChecksumIsa::kAvx512;
#endif
    default:
      return false;
  }
}

ChecksumStream::ChecksumStream(ChecksumIsa isa) : isa_(isa == ChecksumIsa::kAuto ? Widest() : isa) {
  static constexpr uint64_t kInit[8] = XXH3_INIT_ACC;
  std::memcpy(acc_, kInit, sizeof(acc_));
  if (!ChecksumIsaSupported(isa_)) isa_ = ChecksumIsa::kScalar;  // never run what the CPU lacks
}

void ChecksumStream::Update(std::span<const std::byte> bytes) {
  Append(nullptr, bytes.data(), bytes.size(), false);
}

void ChecksumStream::CopyUpdate(std::byte* dst, const std::byte* src, size_t n, bool stream) {
  Append(dst, src, n, stream);
}

void ChecksumStream::Append(std::byte* dst, const std::byte* src, size_t n, bool stream) {
  if (n == 0) return;
  const FoldFn fold = FoldFor(isa_);
  // This call's bytes as appended: where they were stored (so that a src changed
  // meanwhile cannot make the digest disagree with dst), else where they were read.
  const std::byte* const appended = dst != nullptr ? dst : src;
  const size_t appended_n = n;
  // Top up a partial stripe first. A full one waits until more bytes follow: the input's
  // last stripe is folded with another key, at Digest.
  if (pending_bytes_ > 0 && pending_bytes_ < kStripe) {
    const size_t k = std::min<size_t>(n, kStripe - pending_bytes_);
    std::memcpy(pending_ + pending_bytes_, src, k);
    if (dst != nullptr) std::memcpy(dst, pending_ + pending_bytes_, k);
    pending_bytes_ += static_cast<uint32_t>(k);
    src += k;
    if (dst != nullptr) dst += k;
    n -= k;
  }
  if (n > 0) {
    if (pending_bytes_ == kStripe) fold(acc_, stripe_, nullptr, pending_, 1, false);
    const size_t whole = (n - 1) / kStripe;  // all but the last (possibly full) stripe
    fold(acc_, stripe_, dst, src, whole, stream);
    const size_t rest = n - whole * kStripe;  // 1..64
    std::memcpy(pending_, src + whole * kStripe, rest);
    if (dst != nullptr) std::memcpy(dst + whole * kStripe, pending_, rest);
    pending_bytes_ = static_cast<uint32_t>(rest);
  }
  // The first 240 bytes (a short input is hashed whole at Digest) and the last 64.
  if (total_ < sizeof(head_)) {
    std::memcpy(head_ + total_, appended, std::min<uint64_t>(appended_n, sizeof(head_) - total_));
  }
  if (appended_n >= kStripe) {
    std::memcpy(last_, appended + appended_n - kStripe, kStripe);
  } else {
    std::memmove(last_, last_ + appended_n, kStripe - appended_n);
    std::memcpy(last_ + kStripe - appended_n, appended, appended_n);
  }
  total_ += appended_n;
}

uint64_t ChecksumStream::Digest() const {
  if (total_ <= XXH3_MIDSIZE_MAX) return XXH3_64bits(head_, total_);
  alignas(64) uint64_t acc[8];
  std::memcpy(acc, acc_, sizeof(acc));
  XXH3_accumulate_512_scalar(acc, last_, LastStripeKey());
  return XXH3_mergeAccs(acc, XXH3_kSecret + XXH_SECRET_MERGEACCS_START, total_ * XXH_PRIME64_1);
}

}  // namespace kvpool
