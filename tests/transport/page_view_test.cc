// Page views: index math against a contiguous reference, pages of odd sizes.
#include "kvpool/transport/page_view.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <vector>

namespace kvpool::transport {
namespace {

// Splits `buf` into pages of `page` bytes, in a scrambled order of the pages of a second
// buffer, so a view that assumed contiguity would read the wrong bytes.
struct Scattered {
  std::vector<std::byte> storage;
  std::vector<std::span<std::byte>> pages;
};

Scattered Scatter(const std::vector<std::byte>& logical, size_t page) {
  Scattered s;
  const size_t n = (logical.size() + page - 1) / page;
  s.storage.resize(n * page);
  for (size_t k = 0; k < n; ++k) {
    const size_t slot = (k * 7 + 3) % n;  // n is not a multiple of 7 in these tests
    const size_t len = std::min(page, logical.size() - k * page);
    std::memcpy(s.storage.data() + slot * page, logical.data() + k * page, len);
    s.pages.emplace_back(s.storage.data() + slot * page, len);
  }
  return s;
}

std::vector<std::byte> Iota(size_t n) {
  std::vector<std::byte> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<std::byte>(i * 31 + (i >> 8));
  return v;
}

template <typename T>
T Ref(const std::vector<std::byte>& v, size_t elem) {
  T t;
  std::memcpy(&t, v.data() + elem * sizeof(T), sizeof(T));
  return t;
}

TEST(PageViewTest, GqaKThenVAcrossPages) {
  GqaBlockView<uint16_t>::Shape s{.layers = 3, .tokens = 5, .kv_heads = 2, .head_dim = 12};
  auto logical = Iota(GqaBlockView<uint16_t>::Bytes(s));
  auto sc = Scatter(logical, 100);  // rows straddle pages
  auto v = GqaBlockView<uint16_t>::Create(PagedBytes(sc.pages), s);
  ASSERT_TRUE(v.ok()) << v.status();
  const size_t half = logical.size() / 2 / sizeof(uint16_t);
  for (int l = 0; l < 3; ++l)
    for (int t = 0; t < 5; ++t)
      for (int h = 0; h < 2; ++h)
        for (int d = 0; d < 12; ++d) {
          const size_t e = ((l * 5 + t) * 2 + h) * 12 + d;
          ASSERT_EQ(v->K(l, t, h, d), Ref<uint16_t>(logical, e));
          ASSERT_EQ(v->V(l, t, h, d), Ref<uint16_t>(logical, half + e));
        }
  // Writes go to the pages in place (zero copy).
  v->K(0, 0, 0, 0) = 0xBEEF;
  uint16_t got;
  std::memcpy(&got, sc.pages[0].data(), 2);
  EXPECT_EQ(got, 0xBEEF);
}

TEST(PageViewTest, MlaRowsAreSpansWhenInsideAPage) {
  MlaBlockView<uint8_t>::Shape s{.layers = 2, .tokens = 4, .entry_dim = 576};
  auto logical = Iota(MlaBlockView<uint8_t>::Bytes(s));
  auto sc = Scatter(logical, 576 * 2);  // two rows per page: rows never straddle
  auto v = MlaBlockView<uint8_t>::Create(PagedBytes(sc.pages), s);
  ASSERT_TRUE(v.ok()) << v.status();
  for (int l = 0; l < 2; ++l)
    for (int t = 0; t < 4; ++t) {
      auto row = v->Row(l, t);
      ASSERT_EQ(row.size(), 576u);
      const size_t base = (l * 4 + t) * 576;
      for (int i = 0; i < 576; ++i) ASSERT_EQ(row[i], Ref<uint8_t>(logical, base + i));
    }
}

TEST(PageViewTest, KdaStateAndStraddlingRowIsEmpty) {
  KdaCheckpointView<float>::Shape s{.layers = 2, .heads = 3, .d_k = 4, .d_v = 8};
  auto logical = Iota(KdaCheckpointView<float>::Bytes(s));
  auto sc = Scatter(logical, 40);  // 10 floats per page; rows of 8 straddle
  auto v = KdaCheckpointView<float>::Create(PagedBytes(sc.pages), s);
  ASSERT_TRUE(v.ok()) << v.status();
  for (int l = 0; l < 2; ++l)
    for (int h = 0; h < 3; ++h)
      for (int k = 0; k < 4; ++k)
        for (int d = 0; d < 8; ++d) {
          const size_t e = ((l * 3 + h) * 4 + k) * 8 + d;
          float want = Ref<float>(logical, e);
          ASSERT_EQ(std::memcmp(&v->At(l, h, k, d), &want, 4), 0);
        }
  EXPECT_TRUE(v->Row(0, 0, 1).empty());  // elements 8..15 span pages 0 and 1
  EXPECT_EQ(v->Row(0, 0, 0).size(), 8u);
}

TEST(PageViewTest, RefusesShortRunsAndSplitElements) {
  std::vector<std::byte> buf(4096);
  std::vector<std::span<std::byte>> pages = {{buf.data(), 1000}, {buf.data() + 1000, 1000}};
  auto small = MlaBlockView<uint8_t>::Create(PagedBytes(pages), {.layers = 4, .tokens = 1});
  EXPECT_EQ(small.status().code(), absl::StatusCode::kInvalidArgument);
  std::vector<std::span<std::byte>> odd = {{buf.data(), 999}, {buf.data() + 999, 999}};
  auto split = KdaCheckpointView<float>::Create(PagedBytes(odd),
                                                {.layers = 1, .heads = 1, .d_k = 2, .d_v = 2});
  EXPECT_EQ(split.status().code(), absl::StatusCode::kInvalidArgument);
}

// A shape whose byte count wraps around 64 bits, or has a negative dim (which converts to
// a huge index), is refused naming the dim: it used to pass the size check with a small
// wrapped product and index far outside the pages.
TEST(PageViewTest, RefusesShapesThatOverflowOrAreNotPositive) {
  std::vector<std::byte> buf(4096);
  std::vector<std::span<std::byte>> pages = {{buf.data(), 4096}};
  // 2 * 2^31-1 * 2^31-1 * 2^31-1 * 4 * 2 bytes: far beyond 2^64.
  auto wrapped = KdaCheckpointView<float>::Create(
      PagedBytes(pages), {.layers = 0x7fffffff, .heads = 0x7fffffff, .d_k = 0x7fffffff, .d_v = 8});
  ASSERT_EQ(wrapped.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrapped.status().message()), ::testing::HasSubstr("overflow"));
  auto negative = GqaBlockView<uint16_t>::Create(
      PagedBytes(pages), {.layers = 1, .tokens = -2, .kv_heads = 1, .head_dim = 8});
  ASSERT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(negative.status().message()), ::testing::HasSubstr("Shape.tokens=-2"));
  auto zero = MlaBlockView<uint8_t>::Create(PagedBytes(pages), {.layers = 0, .tokens = 1});
  EXPECT_EQ(zero.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvpool::transport
