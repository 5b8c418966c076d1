// Integer flags in plain decimal. CLI11 converts integers with strtoll(..., base 0), so
// `--port 010` became 8 and `--num-blocks 0x40` 64 without a word, and unsigned ones with
// strtoull, so `-1` became 2^64 - 1. RequireDecimalIntegers adds checks to every integer
// option of an app and its subcommands that refuse a leading zero (octal or hex to CLI11)
// and a negative unsigned value, naming the value and the fix. They run before an
// option's own checks (CLI::Range), so `--x 04000` against Range(1, 1024) is refused for
// its leading zero, not as 2048 out of range.
//
// Example:
//   CLI::App app{"kvpool-node"};
//   app.add_option("--metrics-port", port);
//   RequireDecimalIntegers(app);  // after the options, before parse
//   app.parse(argc, argv);        // --metrics-port 09101: "... write 9101"
//
// Thread safety: call while building the app, from one thread.
#pragma once

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cctype>
#include <string>

namespace kvpool {

inline void RequireDecimalIntegers(CLI::App& app) {
  // What CLI11 would read in another base: a 0 followed by digits (octal) or by x and a
  // hex digit. Anything else (0, 0.5, words) is left to CLI11's own conversion errors.
  static const CLI::Validator kDecimal(
      [](std::string& s) -> std::string {
        // strtoll skips leading blanks: so does this check.
        const size_t b = std::min(s.size(), s.find_first_not_of(" \t\n\v\f\r"));
        const size_t sign = b < s.size() && (s[b] == '-' || s[b] == '+') ? b + 1 : b;
        if (s.size() < sign + 2 || s[sign] != '0') return "";
        const char next = s[sign + 1];
        const bool octal = std::isdigit(static_cast<unsigned char>(next)) != 0;
        const bool hex = (next == 'x' || next == 'X') && s.size() > sign + 2 &&
                         std::isxdigit(static_cast<unsigned char>(s[sign + 2])) != 0;
        if (!octal && !hex) return "";
        std::string msg = "'" + s + "' has a leading zero (read as " + (hex ? "hex" : "octal") +
                          "); write the number in decimal";
        if (octal) {
          const size_t first = s.find_first_not_of('0', sign);
          msg += ", e.g. " + s.substr(b, sign - b) + (first == std::string::npos ? "0" : s.substr(first));
        }
        return msg;
      },
      "", "decimal");
  // CLI11 reads an unsigned option with strtoull, which wraps "-1" to 2^64 - 1.
  static const CLI::Validator kNotNegative(
      [](std::string& s) -> std::string {
        const size_t b = s.find_first_not_of(" \t\n\v\f\r");  // strtoull skips leading blanks
        return b != std::string::npos && s[b] == '-' ? "'" + s + "' is negative; give a number >= 0" : "";
      },
      "", "not_negative");
  for (CLI::Option* o : app.get_options()) {
    const std::string type = o->get_type_name();  // "INT", or "INT:<validators>"
    const std::string base = type.substr(0, type.find(':'));
    // transform(): put in front of the option's validators (check() appends); neither
    // changes the value.
    if (base == "INT" || base == "UINT") o->transform(kDecimal);
    if (base == "UINT") o->transform(kNotNegative);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) RequireDecimalIntegers(*sub);
}

}  // namespace kvpool
