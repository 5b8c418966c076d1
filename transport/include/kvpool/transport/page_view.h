// Typed, zero-copy views over a page run.
//
// The transport moves pages and never looks at their type. These views give the same
// bytes a shape, on either side of a transfer:
//
//   GqaBlockView<T>       K: [layer][token][kv_head][head_dim], then V of the same shape
//   MlaBlockView<T>       [layer][token][entry_dim]            (entry_dim 576 = 512 + 64)
//   KdaCheckpointView<T>  [layer][head][d_k][d_v]
//
// An object's logical bytes are its pages concatenated in run order (page 0 first), so
// one element lives at logical offset o in page o / page_bytes at o % page_bytes.
// T is the storage type (uint16_t for bf16/fp16, uint8_t for fp8, float for fp32).
// REQUIRES: page_bytes is a multiple of sizeof(T), so no element straddles two pages.
//
// Example:
//   ASSIGN_OR_RETURN(auto spans, arena->Spans(run));
//   ASSIGN_OR_RETURN(auto mla, MlaBlockView<uint8_t>::Create(
//       PagedBytes(spans), {.layers = 61, .tokens = 64, .entry_dim = 576}));
//   uint8_t first = mla.At(0, 0, 0);
//   std::span<uint8_t> row = mla.Row(3, 10);  // empty if the row straddles two pages
//
// Thread safety: views are cheap value types over memory they do not own; the caller
// synchronizes access to the bytes (no batch writing these pages may be in flight).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace kvpool::transport {

// A logical byte range laid over equally sized pages (the last may be short).
class PagedBytes {
 public:
  PagedBytes() = default;
  // Every span but the last must have the same size (the page size).
  explicit PagedBytes(std::vector<std::span<std::byte>> pages) : pages_(std::move(pages)) {
    page_bytes_ = pages_.empty() ? 0 : pages_.front().size();
    for (const auto& p : pages_) size_ += p.size();
  }

  uint64_t size() const { return size_; }
  uint64_t page_bytes() const { return page_bytes_; }
  const std::vector<std::span<std::byte>>& pages() const { return pages_; }

  // REQUIRES: offset < size().
  std::byte* At(uint64_t offset) const {
    return pages_[offset / page_bytes_].data() + offset % page_bytes_;
  }
  // [offset, offset + len) as one span when it lies in one page; empty otherwise.
  std::span<std::byte> Contiguous(uint64_t offset, uint64_t len) const {
    if (len == 0 || offset + len > size_) return {};
    const uint64_t in_page = offset % page_bytes_;
    if (in_page + len > page_bytes_) return {};
    return {At(offset), len};
  }

 private:
  std::vector<std::span<std::byte>> pages_;
  uint64_t page_bytes_ = 0;
  uint64_t size_ = 0;
};

// A row-major tensor of rank N over PagedBytes, at a byte offset. Shared by the views.
template <typename T, size_t N>
class PagedTensor {
 public:
  PagedTensor() = default;
  PagedTensor(PagedBytes bytes, uint64_t offset, std::array<uint64_t, N> dims)
      : bytes_(std::move(bytes)), offset_(offset), dims_(dims) {
    uint64_t s = 1;
    for (size_t i = N; i-- > 0;) {
      strides_[i] = s;
      s *= dims_[i];
    }
    elements_ = s;
  }

  uint64_t elements() const { return elements_; }
  uint64_t bytes() const { return elements_ * sizeof(T); }
  const std::array<uint64_t, N>& dims() const { return dims_; }

  // REQUIRES: each index within its dim.
  template <typename... I>
  T& At(I... idx) const {
    static_assert(sizeof...(I) == N);
    return *reinterpret_cast<T*>(bytes_.At(ByteOffset({static_cast<uint64_t>(idx)...})));
  }
  // The innermost row at the leading N-1 indices, when it lies in one page; else empty.
  template <typename... I>
  std::span<T> Row(I... idx) const {
    static_assert(sizeof...(I) == N - 1);
    std::array<uint64_t, N> full = {static_cast<uint64_t>(idx)..., 0};
    auto s = bytes_.Contiguous(ByteOffset(full), dims_[N - 1] * sizeof(T));
    return {reinterpret_cast<T*>(s.data()), s.size() / sizeof(T)};
  }

 private:
  uint64_t ByteOffset(const std::array<uint64_t, N>& idx) const {
    uint64_t e = 0;
    for (size_t i = 0; i < N; ++i) e += idx[i] * strides_[i];
    return offset_ + e * sizeof(T);
  }
  PagedBytes bytes_;
  uint64_t offset_ = 0;
  std::array<uint64_t, N> dims_{};
  std::array<uint64_t, N> strides_{};
  uint64_t elements_ = 0;
};

namespace view_internal {
// The bytes of a shape's dims (times `copies`), or InvalidArgument naming a dim that is
// not positive or a product that overflows 64 bits (a view over it would wrap around).
inline absl::StatusOr<uint64_t> ShapeBytes(
    std::initializer_list<std::pair<const char*, int>> dims, uint64_t copies, size_t elem,
    const char* what) {
  uint64_t n = copies * elem;
  for (const auto& [name, d] : dims) {
    if (d <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": Shape.", name, "=", d, " must be positive"));
    }
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": the shape's bytes overflow 64 bits at Shape.", name, "=", d,
          "; check the model configuration"));
    }
  }
  return n;
}

inline absl::Status CheckFits(const PagedBytes& b, uint64_t need, size_t elem,
                              const char* what) {
  if (b.page_bytes() == 0 || b.page_bytes() % elem != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": page_bytes=", b.page_bytes(), " is not a positive multiple of the ", elem,
        "-byte element; use pages sized in whole elements"));
  }
  if (b.size() < need) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": needs ", need,
                                                   " bytes but the page run holds ",
                                                   b.size(), "; give it more pages"));
  }
  return absl::OkStatus();
}
}  // namespace view_internal

// GQA block: K then V, each [layer][token][kv_head][head_dim].
template <typename T>
class GqaBlockView {
 public:
  struct Shape {
    int layers = 0;
    int tokens = 0;    // block_tokens
    int kv_heads = 0;
    int head_dim = 0;
  };
  // REQUIRES: a shape Create accepts (positive dims, bytes below 2^64); unchecked.
  static uint64_t Bytes(const Shape& s) {
    return 2ull * s.layers * s.tokens * s.kv_heads * s.head_dim * sizeof(T);
  }
  static absl::StatusOr<GqaBlockView> Create(PagedBytes bytes, const Shape& s) {
    absl::StatusOr<uint64_t> need = view_internal::ShapeBytes(
        {{"layers", s.layers}, {"tokens", s.tokens}, {"kv_heads", s.kv_heads}, {"head_dim", s.head_dim}},
        2, sizeof(T), "GqaBlockView");
    if (!need.ok()) return need.status();
    absl::Status st = view_internal::CheckFits(bytes, *need, sizeof(T), "GqaBlockView");
    if (!st.ok()) return st;
    const std::array<uint64_t, 4> dims = {uint64_t(s.layers), uint64_t(s.tokens),
                                          uint64_t(s.kv_heads), uint64_t(s.head_dim)};
    GqaBlockView v;
    v.k_ = PagedTensor<T, 4>(bytes, 0, dims);
    v.v_ = PagedTensor<T, 4>(bytes, Bytes(s) / 2, dims);
    return v;
  }
  T& K(int layer, int token, int head, int d) const { return k_.At(layer, token, head, d); }
  T& V(int layer, int token, int head, int d) const { return v_.At(layer, token, head, d); }
  std::span<T> KRow(int layer, int token, int head) const { return k_.Row(layer, token, head); }
  std::span<T> VRow(int layer, int token, int head) const { return v_.Row(layer, token, head); }
  const PagedTensor<T, 4>& k() const { return k_; }
  const PagedTensor<T, 4>& v() const { return v_; }

 private:
  PagedTensor<T, 4> k_, v_;
};

// MLA block: [layer][token][entry_dim] (latent kv_lora_rank + rope_dim per token).
template <typename T>
class MlaBlockView {
 public:
  struct Shape {
    int layers = 0;
    int tokens = 0;
    int entry_dim = 576;
  };
  // REQUIRES: a shape Create accepts (positive dims, bytes below 2^64); unchecked.
  static uint64_t Bytes(const Shape& s) {
    return uint64_t(s.layers) * s.tokens * s.entry_dim * sizeof(T);
  }
  static absl::StatusOr<MlaBlockView> Create(PagedBytes bytes, const Shape& s) {
    absl::StatusOr<uint64_t> need = view_internal::ShapeBytes(
        {{"layers", s.layers}, {"tokens", s.tokens}, {"entry_dim", s.entry_dim}}, 1, sizeof(T),
        "MlaBlockView");
    if (!need.ok()) return need.status();
    absl::Status st = view_internal::CheckFits(bytes, *need, sizeof(T), "MlaBlockView");
    if (!st.ok()) return st;
    MlaBlockView v;
    v.t_ = PagedTensor<T, 3>(std::move(bytes), 0,
                             {uint64_t(s.layers), uint64_t(s.tokens), uint64_t(s.entry_dim)});
    return v;
  }
  T& At(int layer, int token, int i) const { return t_.At(layer, token, i); }
  std::span<T> Row(int layer, int token) const { return t_.Row(layer, token); }
  const PagedTensor<T, 3>& tensor() const { return t_; }

 private:
  PagedTensor<T, 3> t_;
};

// KDA checkpoint: the fixed linear-attention state, [layer][head][d_k][d_v].
template <typename T>
class KdaCheckpointView {
 public:
  struct Shape {
    int layers = 0;
    int heads = 0;
    int d_k = 0;
    int d_v = 0;
  };
  // REQUIRES: a shape Create accepts (positive dims, bytes below 2^64); unchecked.
  static uint64_t Bytes(const Shape& s) {
    return uint64_t(s.layers) * s.heads * s.d_k * s.d_v * sizeof(T);
  }
  static absl::StatusOr<KdaCheckpointView> Create(PagedBytes bytes, const Shape& s) {
    absl::StatusOr<uint64_t> need = view_internal::ShapeBytes(
        {{"layers", s.layers}, {"heads", s.heads}, {"d_k", s.d_k}, {"d_v", s.d_v}}, 1, sizeof(T),
        "KdaCheckpointView");
    if (!need.ok()) return need.status();
    absl::Status st = view_internal::CheckFits(bytes, *need, sizeof(T), "KdaCheckpointView");
    if (!st.ok()) return st;
    KdaCheckpointView v;
    v.t_ = PagedTensor<T, 4>(std::move(bytes), 0,
                             {uint64_t(s.layers), uint64_t(s.heads), uint64_t(s.d_k),
                              uint64_t(s.d_v)});
    return v;
  }
  T& At(int layer, int head, int k, int v) const { return t_.At(layer, head, k, v); }
  std::span<T> Row(int layer, int head, int k) const { return t_.Row(layer, head, k); }
  const PagedTensor<T, 4>& tensor() const { return t_; }

 private:
  PagedTensor<T, 4> t_;
};

}  // namespace kvpool::transport
