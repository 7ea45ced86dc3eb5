// The launcher's command lines over CLI11 (see flags.h).
#include "launcher/cli/flags.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <system_error>

#include "dtrain/errors.h"

namespace dtrain::cli {
namespace {

// CLI11 2.1 reads "--flag=" (nothing after '=') as "--flag" and takes the next word as the value,
// where torchrun's argparse gives the flag an empty value, which its check then rejects. So a bare
// '=' reaches CLI11 followed by this marker, which not_a_flag() turns back into the empty value (a
// switch shows it as ''), and which is taken out of the program's words again. No word of a
// command line can hold a NUL, so the marker is never a real value.
const std::string kEmptyValue(1, '\0');

std::string shown(std::string_view value) {
  return value == kEmptyValue ? std::string() : std::string(value);
}

bool is_flag(std::string_view word) { return word.rfind("--", 0) == 0; }

// Whether `word` starts the launcher's flags or is the program: "-" and words without a leading
// '-' are programs (or values), "-h" and "--name" are flags.
bool looks_like_flag(std::string_view word) { return word.size() > 1 && word[0] == '-'; }

// One line for an error of CLI11's own. The checks of flags.h write ValidationError's text
// themselves ("--flag: expected ..."); what else reaches here is a flag that wants a value as the
// last word, which CLI11 reports in its words ("--steps: 1 required INT missing").
std::string one_line(const CLI::App& app, const CLI::Error& error,
                     const std::vector<std::string>& args) {
  if (dynamic_cast<const CLI::ArgumentMismatch*>(&error) != nullptr && !args.empty()) {
    if (const CLI::Option* option = app.get_option_no_throw(args.back())) {
      return option->get_name() + ": missing value";
    }
  }
  std::string text = error.what();
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

}  // namespace

void prepare_command_line(CLI::App& app, const std::string& command) {
  app.name(command);
  // The first word that is neither a flag nor a flag's value starts the program: it and everything
  // after it (its own flags included) go to remaining() untouched.
  app.prefix_command();
  // A flag given twice: the last one counts, as in torchrun.
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // CLI11's help flag is honoured only after every value was checked; this one stops the parse
  // where it stands, so "-h --nproc-per-node 0" prints the usage.
  app.set_help_flag();
  app.add_flag_callback("-h,--help", [] { throw CLI::CallForHelp(); })->trigger_on_parse();
}

std::string with_underscores(std::string_view dashed) {
  std::string underscored(dashed);
  std::replace(underscored.begin() + 2, underscored.end(), '-', '_');
  return underscored == dashed ? underscored : std::string(dashed) + "," + underscored;
}

std::optional<std::vector<std::string>> parse_command_line(CLI::App& app,
                                                           const std::vector<std::string>& args) {
  // CLI11 takes the words last first.
  std::vector<std::string> words(args.rbegin(), args.rend());
  for (std::string& word : words) {
    if (is_flag(word) && word.find('=') == word.size() - 1) word += kEmptyValue;
  }
  try {
    app.parse(words);
  } catch (const CLI::CallForHelp&) {
    return std::nullopt;
  } catch (const CLI::Error& error) {
    throw UsageError(app.get_name() + ": " + one_line(app, error, args));
  }
  std::vector<std::string> rest = app.remaining();
  for (std::string& word : rest) {
    if (is_flag(word) && word.ends_with("=" + kEmptyValue)) word.pop_back();
  }
  // A flag CLI11 does not know is left in remaining() as it stands, before the program.
  if (!rest.empty() && rest.front() != "--" && looks_like_flag(rest.front())) {
    std::string name = rest.front().substr(0, rest.front().find('='));
    throw UsageError(app.get_name() + ": unknown flag '" + name + "'; see `" + app.get_name() +
                     " --help` (the program's own flags go after the program, or after --)");
  }
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  return rest;
}

std::string expected_but_got(std::string_view expected, std::string_view value) {
  return "expected " + std::string(expected) + ", got '" + shown(value) + "'";
}

std::optional<long long> integer_in(std::string_view text, long long low, long long high) {
  long long value = 0;
  const char* end = text.data() + text.size();
  auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end || value < low || value > high) {
    return std::nullopt;
  }
  return value;
}

std::optional<double> number_in(const std::string& text, double low, double high,
                                bool low_inclusive) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(value) || value > high) return std::nullopt;
  if (low_inclusive ? value < low : value <= low) return std::nullopt;
  return value;
}

CLI::Validator not_a_flag() {
  return CLI::Validator(
      [](std::string& value) -> std::string {
        if (value == kEmptyValue) {
          value.clear();
          return {};
        }
        return is_flag(value) ? "missing value before '" + value + "'" : std::string();
      },
      "");
}

CLI::Option* add_switch(CLI::App& app, const std::string& names, bool& target) {
  // CLI11 hands a switch given alone "true", and one given "=VALUE" the value.
  return app.add_flag(names, target)
      ->check(CLI::Validator(
          [](std::string& value) -> std::string {
            return value == "true" ? std::string() : "takes no value, got '" + shown(value) + "'";
          },
          ""));
}

CLI::Validator integer(long long low, long long high, std::string expected) {
  return CLI::Validator(
      [low, high, expected](std::string& text) -> std::string {
        std::optional<long long> value = integer_in(text, low, high);
        if (!value) return expected_but_got(expected, text);
        text = std::to_string(*value);
        return {};
      },
      "");
}

CLI::Validator number(double low, double high, std::string expected, bool low_inclusive) {
  return CLI::Validator(
      [low, high, expected, low_inclusive](std::string& text) -> std::string {
        return number_in(text, low, high, low_inclusive) ? std::string()
                                                         : expected_but_got(expected, text);
      },
      "");
}

CLI::Validator non_empty(std::string expected) {
  return CLI::Validator(
      [expected](std::string& text) -> std::string {
        return text.empty() ? expected_but_got(expected, text) : std::string();
      },
      "");
}

CLI::Validator one_of(std::vector<std::string> choices) {
  std::string expected = "one of";
  for (const std::string& choice : choices) {
    expected += (&choice == &choices.front() ? " " : ", ") + choice;
  }
  return CLI::Validator(
      [choices, expected](std::string& text) -> std::string {
        bool known = std::find(choices.begin(), choices.end(), text) != choices.end();
        return known ? std::string() : expected_but_got(expected, text);
      },
      "");
}

}  // namespace dtrain::cli
