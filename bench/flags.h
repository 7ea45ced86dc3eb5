// Flag parsing shared by the benchmarks: `--help` lists every flag with its default, and an unknown
// flag, a missing or bad value is one line naming it (a dtrain::UsageError: exit code 2 under
// dtrain::run_main). CLI11 does the parsing behind this small facade, in flags.cpp alone: its
// headers would double each benchmark's compile time.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace bench {

class Flags {
 public:
  Flags(const std::string& program, const std::string& description);
  ~Flags();
  Flags(const Flags&) = delete;
  Flags& operator=(const Flags&) = delete;

  // "--name N": an integer of at least `at_least`.
  Flags& integer(const std::string& name, int64_t& value, const std::string& help,
                 int64_t at_least = 1);
  Flags& integer(const std::string& name, int& value, const std::string& help, int at_least = 1);
  // "--name X": a finite number above zero, or at least zero with `zero_allowed`.
  Flags& number(const std::string& name, double& value, const std::string& help,
                bool zero_allowed = false);
  // "--name TEXT": any non-empty text, or one of `choices` when given.
  Flags& text(const std::string& name, std::string& value, const std::string& help,
              const std::vector<std::string>& choices = {});
  // "--name 1,2,4": integers of at least 1.
  Flags& integers(const std::string& name, std::vector<int>& values, const std::string& help);
  // "--name": sets `value` to true.
  Flags& on(const std::string& name, bool& value, const std::string& help);

  // --help prints the usage and exits 0; anything wrong throws dtrain::UsageError.
  void parse(int argc, char** argv);

 private:
  std::unique_ptr<CLI::App> app_;
};

}  // namespace bench
