// bench::Flags over CLI11; see flags.h.
#include "flags.h"

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdlib>
#include <iostream>

#include "dtrain/errors.h"

namespace bench {
namespace {

// The bound goes into the flag's help text; the error says it, with the value that broke it.
CLI::Validator at_least(int64_t low) {
  return CLI::Validator(
      [low](std::string& text) -> std::string {
        int64_t value = 0;
        if (CLI::detail::lexical_cast(text, value) && value >= low) return {};
        return "expected an integer of at least " + std::to_string(low) + ", got '" + text + "'";
      },
      "");
}

CLI::Validator number_from(bool zero_allowed) {
  return CLI::Validator(
      [zero_allowed](std::string& text) -> std::string {
        double value = 0;
        if (CLI::detail::lexical_cast(text, value) && std::isfinite(value) &&
            (zero_allowed ? value >= 0 : value > 0)) {
          return {};
        }
        return std::string("expected a number ") + (zero_allowed ? "of at least 0" : "above 0") +
               ", got '" + text + "'";
      },
      "");
}

CLI::Validator one_of(const std::vector<std::string>& choices) {
  std::string listed;
  for (const auto& choice : choices) listed += (listed.empty() ? "'" : ", '") + choice + "'";
  return CLI::Validator(
      [choices, listed](std::string& text) -> std::string {
        for (const auto& choice : choices) {
          if (text == choice) return {};
        }
        return "expected one of " + listed + ", got '" + text + "'";
      },
      "");
}

CLI::Validator non_empty() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        return text.empty() ? "expected a non-empty value" : "";
      },
      "");
}

}  // namespace

Flags::Flags(const std::string& program, const std::string& description)
    : app_(std::make_unique<CLI::App>(description, program)) {}

Flags::~Flags() = default;

// The two integer widths differ only in the variable CLI11 writes.
template <typename Int>
void add_integer(CLI::App& app, const std::string& name, Int& value, const std::string& help,
                 int64_t low) {
  app.add_option(name, value, help + " (at least " + std::to_string(low) + ")")
      ->check(at_least(low))
      ->capture_default_str();
}

Flags& Flags::integer(const std::string& name, int64_t& value, const std::string& help,
                      int64_t low) {
  add_integer(*app_, name, value, help, low);
  return *this;
}

Flags& Flags::integer(const std::string& name, int& value, const std::string& help, int low) {
  add_integer(*app_, name, value, help, low);
  return *this;
}

Flags& Flags::number(const std::string& name, double& value, const std::string& help,
                     bool zero_allowed) {
  app_->add_option(name, value, help + (zero_allowed ? " (at least 0)" : " (above 0)"))
      ->check(number_from(zero_allowed))
      ->capture_default_str();
  return *this;
}

Flags& Flags::text(const std::string& name, std::string& value, const std::string& help,
                   const std::vector<std::string>& choices) {
  std::string listed;
  for (const auto& choice : choices) listed += (listed.empty() ? " (" : " | ") + choice;
  auto* option = app_->add_option(name, value, help + (listed.empty() ? "" : listed + ")"))
                     ->capture_default_str();
  if (!choices.empty()) {
    option->check(one_of(choices));
  } else {
    option->check(non_empty());
  }
  return *this;
}

Flags& Flags::integers(const std::string& name, std::vector<int>& values, const std::string& help) {
  app_->add_option(name, values, help)->delimiter(',')->check(at_least(1));
  return *this;
}

Flags& Flags::on(const std::string& name, bool& value, const std::string& help) {
  app_->add_flag(name, value, help);
  return *this;
}

void Flags::parse(int argc, char** argv) {
  try {
    app_->parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app_->help();
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    throw dtrain::UsageError(app_->get_name() + ": " + e.what() + " (--help lists the flags)");
  }
}

}  // namespace bench
