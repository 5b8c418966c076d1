#include "kvpool/common/units.h"
#include "kvpool/common/percentile.h"

#include <gtest/gtest.h>

namespace kvpool {
namespace {

TEST(UnitsTest, ParsesSizes) {
  EXPECT_EQ(*ParseBytes("4096", "--x"), 4096u);
  EXPECT_EQ(*ParseBytes("64GiB", "--x"), 64ull << 30);
  EXPECT_EQ(*ParseBytes("1.5e9", "--x"), 1500000000u);
  EXPECT_EQ(*ParseBytes("2MB", "--x"), 2000000u);
  EXPECT_EQ(*ParseRate("64GB/s", "--x"), 64e9);
  EXPECT_EQ(*ParseNumber("400T", "--flops"), 400e12);
}

TEST(UnitsTest, ErrorsNameTheField) {
  auto a = ParseBytes("lots", "--hbm-free");
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("--hbm-free"), absl::string_view::npos);
  EXPECT_FALSE(ParseBytes("-5GiB", "--x").ok());
  EXPECT_FALSE(ParseBytes("5 parsecs", "--x").ok());
  EXPECT_FALSE(ParseRate("0", "--bandwidth").ok());
  EXPECT_FALSE(ParseNumber("abc", "--flops").ok());
  EXPECT_FALSE(ParseNumber("4X", "--flops").ok());
}

// Sizes from 2^63 up used to go through llround (signed) and all came back as 2^63.
TEST(UnitsTest, SizesNearAndAbove64BitsAreExactOrRefused) {
  EXPECT_EQ(*ParseBytes("9.3e18", "--x"), 9300000000000000000ull);
  EXPECT_EQ(*ParseBytes("1e19", "--x"), 10000000000000000000ull);
  EXPECT_EQ(ParseBytes("15EB", "--x").status().code(), absl::StatusCode::kInvalidArgument);  // no EB unit
  EXPECT_EQ(*ParseBytes("1.8e19", "--x"), 18000000000000000000ull);
  for (const char* big : {"1.85e19", "18446744073709551616", "16384PiB", "1e300"}) {
    auto r = ParseBytes(big, "--dram");
    ASSERT_FALSE(r.ok()) << big << " -> " << *r;
    EXPECT_NE(r.status().message().find("--dram"), absl::string_view::npos);
  }
  EXPECT_EQ(*ParseBytes("16383TiB", "--x"), 16383ull << 40);
  EXPECT_EQ(*ParseBytes("1.5KiB", "--x"), 1536u);
  EXPECT_EQ(*ParseBytes("0", "--x"), 0u);
  EXPECT_FALSE(ParseBytes("0.4", "--x").ok());        // less than a byte, not 0
  EXPECT_FALSE(ParseBytes("1e-300GiB", "--x").ok());
  EXPECT_FALSE(ParseRate("1e300TB/s", "--bandwidth").ok());  // inf
  // Fractions of a byte are typos, not sizes to round.
  for (const char* frac : {"1.4", "0.6", "2.5", "1.0001KiB"}) {
    const auto r = ParseBytes(frac, "--dram");
    ASSERT_FALSE(r.ok()) << frac << " -> " << *r;
    EXPECT_NE(r.status().message().find("whole number of bytes"), absl::string_view::npos) << r.status();
  }
  // Decimal sizes whose double product is a hair off a whole number are whole sizes.
  for (const auto& [text, want] : std::vector<std::pair<const char*, uint64_t>>{
           {"4.1MB", 4100000}, {"4.1GB", 4100000000}, {"1.07GB", 1070000000}, {"2.01KB", 2010}, {"0.27TB", 270000000000}}) {
    const auto r = ParseBytes(text, "--dram");
    ASSERT_TRUE(r.ok()) << text << ": " << r.status();
    EXPECT_EQ(*r, want) << text;
  }
  // Numbers that overflow to infinity are refused, not returned.
  EXPECT_FALSE(ParseNumber("1e300P", "--flops").ok());
  EXPECT_FALSE(ParseNumber("-1e308k", "--flops").ok());
  EXPECT_EQ(*ParseNumber("400T", "--flops"), 400e12);
}

TEST(UnitsTest, Formats) {
  EXPECT_EQ(FormatBytes(327680), "320.00 KiB");
  EXPECT_EQ(FormatBytes(3 * 1024 * 1024), "3.00 MiB");
  EXPECT_EQ(FormatRate(64e9), "64.00 GB/s");
  EXPECT_EQ(FormatSeconds(2.896), "2.896 s");
  EXPECT_EQ(FormatSeconds(0.0336), "33.60 ms");
}

// Nearest rank: ceil(q n)-th smallest (p50 of two samples is the smaller one, p99 of
// 100 the 99th, not the largest).
TEST(Percentile, NearestRank) {
  std::vector<double> two = {2, 1};
  EXPECT_EQ(NearestRank(two, 0.5), 1);
  std::vector<double> hundred;
  for (int i = 100; i >= 1; --i) hundred.push_back(i);
  EXPECT_EQ(NearestRank(hundred, 0.99), 99);
  EXPECT_EQ(NearestRank(hundred, 1.0), 100);
  EXPECT_EQ(NearestRank(hundred, 0.0), 1);
  EXPECT_EQ(NearestRankSorted({1, 2, 3}, 0.5), 2);
  EXPECT_EQ(NearestRankSorted({}, 0.5), 0);
}

}  // namespace
}  // namespace kvpool
