#include "format.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <sstream>

#include "kvpool/router/trace.h"

namespace kvpool::kvctl {

void ReportTraceLoad(std::ostream& err, const char* command, const std::string& path, size_t limit,
                     const trace::Trace& t) {
  if (t.limited) {
    err << "kvctl " << command << ": --limit " << limit << ": using the first " << limit << " valid lines of " << path
        << " (it has more)\n";
  }
  for (size_t i = 0; i < t.issues.size() && i < 10; ++i) {
    err << "kvctl " << command << ": " << path << ":" << t.issues[i].line << ": skipped: " << t.issues[i].reason << "\n";
  }
  if (t.issues.size() > 10) err << "kvctl " << command << ": ... and " << t.issues.size() - 10 << " more bad lines\n";
}

const CLI::Validator& FiniteNumber() {
  static const CLI::Validator check(
      [](std::string& v) -> std::string {
        char* end = nullptr;
        const double d = std::strtod(v.c_str(), &end);
        if (end == v.c_str() || *end != '\0') return "";  // not a number: the option's own parse says so
        return std::isfinite(d) ? "" : "Value " + v + " is not a finite number";
      },
      "FINITE", "finite");
  return check;
}

std::string Fixed(double v, int digits) {
  std::ostringstream s;
  s << std::fixed << std::setprecision(digits) << v;
  return s.str();
}

std::string WithCommas(int64_t v) {
  const std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out = v < 0 ? "-" : "";
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

void Report::Print(std::ostream& out) const {
  size_t w = 0;
  for (const auto& [l, v] : rows_) {
    if (!v.empty()) w = std::max(w, l.size());
  }
  for (const auto& [l, v] : rows_) {
    if (v.empty()) {
      out << l << "\n";
    } else {
      out << "  " << std::left << std::setw(static_cast<int>(w) + 2) << l << v << "\n";
    }
  }
}

}  // namespace kvpool::kvctl
