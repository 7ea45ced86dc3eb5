// The launcher's command lines (`dtrain run`, `dtrain scale`) over CLI11: how a line is split into
// the launcher's flags and the program, the value checks the flags share, and CLI11's errors turned
// into dtrain's one line ("dtrain run: --flag: expected ..., got '...'", exit code 2).
//
// Every command line has the same shape: flags as "--flag value" or "--flag=value", then the
// program and its arguments, which start at "--" or at the first word that is not a flag and are
// passed on untouched (CLI11's prefix command). -h/--help wins over everything else on the line.
// The usage texts are written by hand (run_usage(), scale_usage()): they explain more than a list
// of flags can.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dtrain::cli {

// Sets `app` up for a launcher command line; call before adding flags. `command` ("dtrain run")
// starts every error message and is the app's name.
void prepare_command_line(CLI::App& app, const std::string& command);

// "--nproc-per-node,--nproc_per_node": the flag as CLI11 names it with torchrun's second spelling,
// '_' for '-'.
std::string with_underscores(std::string_view dashed);

// Parses `args` (the words after "dtrain run") with `app`: fills the flags' variables and returns
// the program and its arguments, or nothing when -h/--help was given. Throws dtrain::UsageError
// with one line naming the flag, the value and what is accepted.
std::optional<std::vector<std::string>> parse_command_line(CLI::App& app,
                                                           const std::vector<std::string>& args);

// "expected <expected>, got '<value>'": how every rejected value is described.
std::string expected_but_got(std::string_view expected, std::string_view value);

// The whole of `text` as a decimal integer in low..high, or nothing: no sign but '-', no spaces.
std::optional<long long> integer_in(std::string_view text, long long low, long long high);
// The whole of `text` as a finite number above `low` (or from `low` when `low_inclusive`) up to
// `high`, or nothing.
std::optional<double> number_in(const std::string& text, double low, double high,
                                bool low_inclusive = false);

// A flag that takes a value, bound to `target`: the value goes through not_a_flag(), then through
// `checks` in their order. (CLI11 runs transforms before checks, the last added first: they are
// all added as transforms, so that a check may also rewrite the value for CLI11's conversion.)
template <typename T>
CLI::Option* add_valued_flag(CLI::App& app, const std::string& names, T& target,
                             std::vector<CLI::Validator> checks = {});
// A switch (--standalone): sets `target`; rejects a value (--standalone=yes).
CLI::Option* add_switch(CLI::App& app, const std::string& names, bool& target);

// Checks for add_valued_flag. A failed check says "expected <expected>, got '<value>'"; CLI11 puts
// the flag's name in front.
//
// What every flag's value passes first: it is not another flag (a missing value in "--log-dir
// --nnodes 2", where CLI11 would take "--nnodes" as the directory).
CLI::Validator not_a_flag();
// An integer in low..high, rewritten in plain decimal for CLI11 to convert ("010" is ten).
CLI::Validator integer(long long low, long long high, std::string expected);
// A number of seconds (see number_in).
CLI::Validator number(double low, double high, std::string expected, bool low_inclusive = false);
// Any text but the empty one.
CLI::Validator non_empty(std::string expected);
// One of `choices` ("expected one of a, b, c").
CLI::Validator one_of(std::vector<std::string> choices);

template <typename T>
CLI::Option* add_valued_flag(CLI::App& app, const std::string& names, T& target,
                             std::vector<CLI::Validator> checks) {
  CLI::Option* option = app.add_option(names, target);
  for (auto check = checks.rbegin(); check != checks.rend(); ++check) option->transform(*check);
  return option->transform(not_a_flag());
}

}  // namespace dtrain::cli
