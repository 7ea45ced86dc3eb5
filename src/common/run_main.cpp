// dtrain::run_main: exceptions to exit codes at the edge of a program (see dtrain/errors.h).
#include <iostream>

#include "dtrain/errors.h"

namespace dtrain {

int run_main(const std::function<int()>& body) {
  try {
    return body();
  } catch (const UsageError& e) {
    std::cerr << e.what() << std::endl;
    return 2;
  } catch (const std::exception& e) {
    std::cerr << e.what() << std::endl;
    return 1;
  }
}

}  // namespace dtrain
