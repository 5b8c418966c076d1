#include "kvpool/common/units.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace kvpool {
namespace {

// Splits "12.5GiB" into 12.5 and "GiB".
bool SplitNumber(absl::string_view text, double& value, absl::string_view& unit) {
  size_t i = 0;
  while (i < text.size() && (absl::ascii_isdigit(text[i]) || text[i] == '.' || text[i] == '-' ||
                             text[i] == '+' ||
                             ((text[i] == 'e' || text[i] == 'E') && i > 0 && i + 1 < text.size() &&
                              (absl::ascii_isdigit(text[i + 1]) || text[i + 1] == '-' ||
                               text[i + 1] == '+')))) {
    ++i;
  }
  if (i == 0 || !absl::SimpleAtod(text.substr(0, i), &value) || !std::isfinite(value)) return false;
  unit = absl::StripAsciiWhitespace(text.substr(i));
  return true;
}

bool UnitMultiplier(absl::string_view unit, double& mult) {
  struct U { absl::string_view name; double mult; };
  static constexpr U kUnits[] = {
      {"", 1}, {"B", 1},
      {"K", 1e3}, {"KB", 1e3}, {"k", 1e3}, {"kB", 1e3}, {"KiB", 1024.0},
      {"M", 1e6}, {"MB", 1e6}, {"MiB", 1048576.0},
      {"G", 1e9}, {"GB", 1e9}, {"GiB", 1073741824.0},
      {"T", 1e12}, {"TB", 1e12}, {"TiB", 1099511627776.0},
  };
  for (const auto& u : kUnits) {
    if (u.name == unit) {
      mult = u.mult;
      return true;
    }
  }
  return false;
}

}  // namespace

absl::StatusOr<uint64_t> ParseBytes(absl::string_view text, absl::string_view field) {
  double v;
  absl::string_view unit;
  double mult;
  if (!SplitNumber(absl::StripAsciiWhitespace(text), v, unit) || !UnitMultiplier(unit, mult)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, "='", text, "' is not a size; write bytes like 4096, 64GiB or 1.5e9"));
  }
  // Rounded to whole bytes first: 2^64 itself does not fit (and llround, signed, wrapped
  // everything from 2^63 up to 9223372036854775808).
  const double bytes = std::nearbyint(v * mult);
  if (!(bytes >= 0) || bytes >= 0x1p64) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, "='", text, "' must be a non-negative size below 16 EiB (2^64 bytes)"));
  }
  // 1.4 bytes is a typo, not a size (1.5KiB = 1536 is whole). Relative slack: 4.1 * 1e6
  // is 4099999.9999999995 in doubles, and 4.1MB is a whole size.
  if ((bytes == 0 && v * mult > 0) || std::fabs(v * mult - bytes) > 1e-9 * std::max(1.0, v * mult)) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, "='", text, "' is not a whole number of bytes; write a whole number of bytes"));
  }
  return static_cast<uint64_t>(bytes);
}

absl::StatusOr<double> ParseRate(absl::string_view text, absl::string_view field) {
  absl::string_view t = absl::StripAsciiWhitespace(text);
  absl::ConsumeSuffix(&t, "/s");
  absl::ConsumeSuffix(&t, "ps");
  double v;
  absl::string_view unit;
  double mult;
  if (!SplitNumber(t, v, unit) || !UnitMultiplier(unit, mult)) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, "='", text, "' is not a bandwidth; write bytes/s like 64GB/s or 7e9"));
  }
  if (!(v > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(field, "='", text, "' must be > 0"));
  }
  if (!std::isfinite(v * mult)) {
    return absl::InvalidArgumentError(absl::StrCat(field, "='", text, "' is too large to be a bandwidth"));
  }
  return v * mult;
}

absl::StatusOr<double> ParseNumber(absl::string_view text, absl::string_view field) {
  double v;
  absl::string_view unit;
  double mult = 1;
  const bool ok = SplitNumber(absl::StripAsciiWhitespace(text), v, unit);
  if (ok && !unit.empty()) {
    static constexpr std::pair<absl::string_view, double> kSi[] = {
        {"k", 1e3}, {"K", 1e3}, {"M", 1e6}, {"G", 1e9}, {"T", 1e12}, {"P", 1e15}};
    bool found = false;
    for (const auto& [name, m] : kSi) {
      if (unit == name) { mult = m; found = true; }
    }
    if (!found) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, "='", text, "' has an unknown suffix '", unit, "'; use k, M, G, T or P"));
    }
  }
  if (!ok) {
    return absl::InvalidArgumentError(absl::StrCat(field, "='", text, "' is not a number"));
  }
  if (!std::isfinite(v * mult)) {
    return absl::InvalidArgumentError(absl::StrCat(field, "='", text, "' is too large (not a finite number)"));
  }
  return v * mult;
}

namespace {
absl::StatusOr<double> InRange(absl::StatusOr<double> v, absl::string_view text, absl::string_view field,
                               double lo, double hi) {
  if (!v.ok() || (*v >= lo && *v <= hi)) return v;
  return absl::InvalidArgumentError(
      absl::StrCat(field, "='", text, "' is outside ", absl::SixDigits(lo), "..", absl::SixDigits(hi)));
}
}  // namespace

absl::StatusOr<double> ParseRateIn(absl::string_view text, absl::string_view field, double lo, double hi) {
  return InRange(ParseRate(text, field), text, field, lo, hi);
}

absl::StatusOr<double> ParseNumberIn(absl::string_view text, absl::string_view field, double lo, double hi) {
  return InRange(ParseNumber(text, field), text, field, lo, hi);
}

std::string FormatBytes(double bytes) {
  static constexpr const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  int i = 0;
  double v = bytes;
  while (std::fabs(v) >= 1024.0 && i < 5) {
    v /= 1024.0;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), i == 0 ? "%.0f %s" : "%.2f %s", v, kNames[i]);
  return buf;
}

std::string FormatRate(double bytes_per_s) {
  static constexpr const char* kNames[] = {"B/s", "KB/s", "MB/s", "GB/s", "TB/s"};
  int i = 0;
  double v = bytes_per_s;
  while (std::fabs(v) >= 1000.0 && i < 4) {
    v /= 1000.0;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f %s", v, kNames[i]);
  return buf;
}

std::string FormatSeconds(double s) {
  char buf[64];
  if (s >= 1.0 || s == 0.0) std::snprintf(buf, sizeof(buf), "%.3f s", s);
  else if (s >= 1e-3) std::snprintf(buf, sizeof(buf), "%.2f ms", s * 1e3);
  else std::snprintf(buf, sizeof(buf), "%.2f us", s * 1e6);
  return buf;
}

}  // namespace kvpool
