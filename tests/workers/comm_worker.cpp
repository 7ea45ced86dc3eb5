// A worker for the multi-process tests of the communication layer, run under `dtrain run`.
//   comm_worker sum                          all-reduce rank+1 and check the total
//   comm_worker skip RANK TIMEOUT_S          RANK skips the second all-reduce; the others must time out
//   comm_worker vanish RANK TIMEOUT_S        RANK exits (status 0) before the second all-reduce; the others
//                                            must notice it long before the timeout
#include <torch/torch.h>

#include <chrono>
#include <iostream>
#include <thread>

#include <unistd.h>

#include "dtrain/comm.h"

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "sum";
  return dtrain::run_main([&] {
    dtrain::InitOptions options;
    if (mode == "skip" || mode == "vanish") options.timeout = std::chrono::milliseconds(static_cast<int>(std::stod(argv[3]) * 1000));
    auto pg = dtrain::init_process_group(options);
    at::Tensor t = torch::full({1000}, static_cast<float>(pg->rank() + 1));
    pg->all_reduce(t);
    float expected = pg->size() * (pg->size() + 1) / 2.0f;
    if (t[999].item<float>() != expected) {
      std::cerr << "rank " << pg->rank() << ": wrong sum " << t[999].item<float>() << std::endl;
      return 1;
    }
    if (mode == "skip") {
      if (pg->rank() == std::stoi(argv[2])) {
        std::this_thread::sleep_for(std::chrono::seconds(60));  // the launcher stops it
        return 0;
      }
      pg->all_reduce(t);
    }
    if (mode == "vanish") {
      if (pg->rank() == std::stoi(argv[2])) _exit(0);  // no goodbye to anyone
      pg->all_reduce(t);
    }
    std::cout << "rank " << pg->rank() << " sum " << expected << std::endl;
    return 0;
  });
}
