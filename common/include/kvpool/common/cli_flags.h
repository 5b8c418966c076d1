// Integer flags in plain decimal. CLI11 converts integers with strtoll(..., base 0), so
// `--port 010` became 8 and `--num-blocks 0x40` 64 without a word. RequireDecimalIntegers
// adds a check to every integer option of an app and its subcommands that refuses a
// leading zero (octal or hex to CLI11), naming the value and the fix.
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

#include <string>

namespace kvpool {

inline void RequireDecimalIntegers(CLI::App& app) {
  static const CLI::Validator kDecimal(
      [](std::string& s) -> std::string {
        const size_t sign = !s.empty() && (s[0] == '-' || s[0] == '+') ? 1 : 0;
        if (s.size() <= sign + 1 || s[sign] != '0') return "";
        size_t first = s.find_first_not_of('0', sign);
        const bool hex = first != std::string::npos && (s[first] == 'x' || s[first] == 'X');
        if (hex || first == std::string::npos) first = s.size() - 1;
        return "'" + s + "' has a leading zero (read as " + (hex ? "hex" : "octal") +
               "); write the number in decimal" + (hex ? "" : ", e.g. " + s.substr(0, sign) + s.substr(first));
      },
      "", "decimal");
  for (CLI::Option* o : app.get_options()) {
    const std::string type = o->get_type_name();  // "INT", or "INT:<validators>"
    const std::string base = type.substr(0, type.find(':'));
    if (base == "INT" || base == "UINT") o->check(kDecimal);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) RequireDecimalIntegers(*sub);
}

}  // namespace kvpool
