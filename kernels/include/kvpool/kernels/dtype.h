// Element types the kernels read, and exact conversions between them and fp32.
//
// K/V caches hold bf16, fp16 or fp32 (kvpool::DType, from common/); queries, outputs,
// KDA states and every accumulator are fp32. fp8 caches are not supported by these
// kernels (launchers answer INVALID_ARGUMENT).
//
// The conversions are bit-exact and portable (no F16C needed): FloatToBf16 and
// FloatToFp16 round to nearest even, as torch and CUDA's __float2bfloat16_rn do.
//
// Example:
//   std::vector<uint16_t> k(n);
//   for (size_t i = 0; i < n; ++i) k[i] = kvpool::kernels::FloatToBf16(k_fp32[i]);
#pragma once

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "kvpool/common/model_spec.h"

namespace kvpool::kernels {

using ::kvpool::DType;

// Bytes of one element of a K/V cache of `dtype` (2 for bf16/fp16, 4 for fp32).
inline size_t ElementBytes(DType dtype) {
  return dtype == DType::kFp32 ? 4 : (dtype == DType::kFp8 ? 1 : 2);
}

// OK for bf16/fp16/fp32; INVALID_ARGUMENT naming `arg` otherwise.
absl::Status CheckCacheDType(DType dtype, absl::string_view arg);

inline float Bf16ToFloat(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

// Reads element `i` of an array of `dtype` as fp32.
inline float LoadAsFloat(const void* base, DType dtype, size_t i) {
  switch (dtype) {
    case DType::kBf16: return Bf16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kFp16: return Fp16ToFloat(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// Writes `v` rounded to `dtype` into element `i`.
inline void StoreFromFloat(void* base, DType dtype, size_t i, float v) {
  switch (dtype) {
    case DType::kBf16: static_cast<uint16_t*>(base)[i] = FloatToBf16(v); break;
    case DType::kFp16: static_cast<uint16_t*>(base)[i] = FloatToFp16(v); break;
    default: static_cast<float*>(base)[i] = v; break;
  }
}

}  // namespace kvpool::kernels
