// What some tests need from the machine beyond dtrain's build: a Python with torch (the PyTorch
// peer tests; scripts/bootstrap's .venv/) and Fashion-MNIST (the trainer tests; Debian's package at
// a fixed path). Other machines say where through the environment. A test that cannot find them
// skips with the reason instead of failing. Header-only, LibTorch-free: the launcher tests use it.
#pragma once

#include <sys/stat.h>

#include <cstdlib>
#include <string>

namespace dtrain::testing {

// A Python interpreter that imports torch.distributed: $DTRAIN_TEST_PYTHON, else
// $DTRAIN_BUILD_PYTHON (ctest sets it to the build's DTRAIN_PYTHON: scripts/bootstrap's
// .venv/bin/python), else python3 on PATH. Empty when none does. Probed once per test process.
inline const std::string& python_with_torch() {
  static const std::string found = [] {
    const char* configured = std::getenv("DTRAIN_TEST_PYTHON");
    const char* build = std::getenv("DTRAIN_BUILD_PYTHON");
    for (std::string candidate : {std::string(configured ? configured : ""),
                                  std::string(build ? build : ""), std::string("python3")}) {
      if (candidate.empty()) continue;
      const std::string probe = "'" + candidate + "' -c 'import torch.distributed' >/dev/null 2>&1";
      if (std::system(probe.c_str()) == 0) return candidate;
    }
    return std::string();
  }();
  return found;
}
inline constexpr const char* kNoPythonWithTorch =
    "no Python that imports torch.distributed (tried $DTRAIN_TEST_PYTHON, the build's "
    "DTRAIN_PYTHON and "
    "python3; scripts/bootstrap installs torch into .venv/)";

// Where the trainer will look for Fashion-MNIST (as datasets::default_fashion_mnist_dir()).
inline std::string fashion_mnist_dir() {
  const char* dir = std::getenv("DTRAIN_FASHION_MNIST_DIR");
  return dir && *dir ? dir : "/usr/share/datasets/fashion-mnist";
}
inline bool have_fashion_mnist() {
  struct stat info;
  for (const char* name : {"/train-images-idx3-ubyte", "/train-images-idx3-ubyte.gz"}) {
    if (::stat((fashion_mnist_dir() + name).c_str(), &info) == 0) return true;
  }
  return false;
}
inline constexpr const char* kNoFashionMnist =
    "Fashion-MNIST is not in $DTRAIN_FASHION_MNIST_DIR or /usr/share/datasets/fashion-mnist "
    "(Debian: apt-get install dataset-fashion-mnist)";

}  // namespace dtrain::testing
