// Rendering kvctl's charts with gnuplot, without a shell: the script path goes to gnuplot
// as one argv entry, and every path or title written into the script is a gnuplot
// single-quoted string (GnuplotQuote), so a quote, `$(...)` or `;` in --chart is just a
// character of the file name.
//
// Example:
//   f << "set output " << GnuplotQuote(png) << "\n";
//   absl::Status s = RunGnuplot(script_path);
#pragma once

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace kvpool::kvctl {

// `s` as a gnuplot single-quoted string: '...' with each ' doubled (gnuplot's only escape
// inside single quotes). REQUIRES: `s` has no newline (a gnuplot string cannot span lines;
// callers reject or replace them).
std::string GnuplotQuote(absl::string_view s);

// Runs `gnuplot <script>` (found on PATH) with no shell and waits for it. UNAVAILABLE when
// gnuplot cannot be started or exits non-zero, with its output in the message.
absl::Status RunGnuplot(const std::string& script);

}  // namespace kvpool::kvctl
