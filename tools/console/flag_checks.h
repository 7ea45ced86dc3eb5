// The value checks of the tools' programs (train_fashion_mnist, train_gpt), as CLI11 validators:
// a bad value is one line, "<program>: --flag 'value': expected <what>", thrown as
// dtrain::UsageError (exit code 2 under dtrain::run_main). CLI11's own validators say "Value -1
// not in range 0.000000 to 1797693134862315708145274237317043567980705675258449965989174768..."
// for a number that must not be negative, and "not in range" for a value that is no number.
// Include after <CLI/CLI.hpp>, in the one file of a program that parses its flags (CLI11's headers
// double the compile time of a file that includes them).
#pragma once

#include <CLI/CLI.hpp>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "dtrain/errors.h"

namespace console {

// The checks throw the UsageError themselves, where a CLI11 validator would return a message that
// CLI11 prefixes with the flag but not the value. CLI11 catches only its own ValidationError
// there, so the UsageError leaves app.parse() as it is. Add them with ->transform() where a check
// rewrites the value (integer_in) and CLI11 must convert what it wrote.
class FlagChecks {
 public:
  explicit FlagChecks(std::string program) : program_(std::move(program)) {}

  [[noreturn]] void bad_flag(const std::string& flag, const std::string& value,
                             const std::string& accepted) const {
    throw dtrain::UsageError(program_ + ": " + flag + " '" + value + "': expected " + accepted);
  }

  // An integer in min..max, written in base 10. The text is rewritten in canonical form: CLI11
  // reads integers in any base (strtoll's base 0), so "010" would otherwise be 8.
  CLI::Validator integer_in(const std::string& flag, int64_t min,
                            int64_t max = int64_t{1} << 40) const {
    return CLI::Validator(
        [*this, flag, min, max](std::string& text) -> std::string {
          char* end = nullptr;
          errno = 0;
          const long long parsed = std::strtoll(text.c_str(), &end, 10);
          if (text.empty() || *end != '\0' || errno == ERANGE || parsed < min || parsed > max) {
            bad_flag(flag, text,
                     "an integer in " + std::to_string(min) + ".." + std::to_string(max));
          }
          text = std::to_string(parsed);
          return {};
        },
        "");
  }

  // A finite number above 0, or from 0 with `zero_allowed`.
  CLI::Validator number(const std::string& flag, bool zero_allowed = false) const {
    return CLI::Validator(
        [*this, flag, zero_allowed](std::string& text) -> std::string {
          char* end = nullptr;
          const double parsed = std::strtod(text.c_str(), &end);
          if (text.empty() || *end != '\0' || !std::isfinite(parsed) ||
              !(zero_allowed ? parsed >= 0 : parsed > 0)) {
            bad_flag(flag, text,
                     zero_allowed ? "a finite number of at least 0" : "a positive finite number");
          }
          return {};
        },
        "");
  }

  // `accepted` lists the choices in words for the message: "mlp or cnn".
  CLI::Validator one_of(const std::string& flag, const std::vector<std::string>& choices,
                        const std::string& accepted) const {
    return CLI::Validator(
        [*this, flag, choices, accepted](std::string& text) -> std::string {
          for (const auto& choice : choices) {
            if (text == choice) return {};
          }
          bad_flag(flag, text, accepted);
        },
        "");
  }

  CLI::Validator non_empty(const std::string& flag, const std::string& accepted) const {
    return CLI::Validator(
        [*this, flag, accepted](std::string& text) -> std::string {
          if (text.empty()) bad_flag(flag, text, accepted);
          return {};
        },
        "");
  }

 private:
  std::string program_;
};

}  // namespace console
