// Parsing and printing of sizes, rates and counts given on command lines.
//
//   ParseBytes("64GiB") == 68719476736, ParseBytes("1.5e9") == 1500000000,
//   ParseRate("64GB/s") == 64e9, FormatBytes(327680) == "320.00 KiB".
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"

#include "absl/status/statusor.h"

namespace kvpool {

// Bytes with an optional unit: B, K/KB (1e3), KiB (2^10), M/MB, MiB, G/GB, GiB, T/TB, TiB;
// a whole number of bytes ("1.5KiB" is 1536, "1.4" is refused).
// `field` names the flag or field in the error ("--hbm-free").
absl::StatusOr<uint64_t> ParseBytes(absl::string_view text, absl::string_view field);
// A rate in bytes/s: a number with an optional unit as above and an optional "/s".
absl::StatusOr<double> ParseRate(absl::string_view text, absl::string_view field);
// A plain finite number, with SI suffixes k, M, G, T, P (e.g. "400T" FLOP/s); one that
// overflows to infinity is refused.
absl::StatusOr<double> ParseNumber(absl::string_view text, absl::string_view field);
// The same, limited to [lo, hi] (e.g. what a cost model's arithmetic takes without
// overflowing to inf or NaN); the error names the field and the range.
absl::StatusOr<double> ParseRateIn(absl::string_view text, absl::string_view field, double lo, double hi);
absl::StatusOr<double> ParseNumberIn(absl::string_view text, absl::string_view field, double lo, double hi);

// What FLOP/s flags (--flops) and bandwidth flags (bytes/s) of the cost models accept
// (kvctl, kvpool-router): beyond these their figures overflow to inf or NaN (1e-300
// FLOP/s used to print them).
inline constexpr double kMinFlops = 1e6, kMaxFlops = 1e21;
inline constexpr double kMinBandwidth = 1e3, kMaxBandwidth = 1e15;

std::string FormatBytes(double bytes);        // binary units: "3.00 MiB"
std::string FormatRate(double bytes_per_s);   // decimal units: "64.00 GB/s"
std::string FormatSeconds(double seconds);    // "2.896 s", "33.6 ms", "12.0 us"

}  // namespace kvpool
