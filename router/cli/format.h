// Text formatting shared by kvctl's commands: fixed-point numbers, thousands separators,
// and aligned "label  value" reports.
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace CLI {
class Validator;
}
namespace kvpool::trace {
struct Trace;
}

namespace kvpool::kvctl {

// A CLI11 check that the value is a finite number: CLI11's PositiveNumber, Range and
// NonNegativeNumber let nan (and inf) through, e.g. `replay --max-duration nan` never
// stopped. Chain it before those: ->check(FiniteNumber())->check(CLI::Range(...)).
const CLI::Validator& FiniteNumber();

// `v` with `digits` digits after the point: Fixed(2.8959, 3) == "2.896".
std::string Fixed(double v, int digits);
// Thousands separators: WithCommas(327680) == "327,680".
std::string WithCommas(int64_t v);

// What `kvctl <command>` says on `err` about a trace it loaded from `path`: that --limit
// cut it, and the first 10 lines it skipped (with how many more there were).
void ReportTraceLoad(std::ostream& err, const char* command, const std::string& path, size_t limit,
                     const trace::Trace& t);

// Prints "label  value" lines with the values aligned; a line with an empty value is a
// heading and does not widen the label column.
class Report {
 public:
  void Line(std::string label, std::string value) {
    rows_.emplace_back(std::move(label), std::move(value));
  }
  void Print(std::ostream& out) const;

 private:
  std::vector<std::pair<std::string, std::string>> rows_;
};

}  // namespace kvpool::kvctl
