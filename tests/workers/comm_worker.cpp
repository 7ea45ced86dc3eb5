// A worker for the multi-process tests of the communication layer, run under `dtrain run`.
//   comm_worker sum                          all-reduce rank+1 and check the total
//   comm_worker skip RANK TIMEOUT_S          RANK skips the second all-reduce; the others must
//                                            time out
//   comm_worker vanish RANK TIMEOUT_S        RANK exits (status 0) before the second all-reduce;
//                                            the others must notice it long before the timeout
//   comm_worker recv-vanish RANK TIMEOUT_S   RANK exits instead of sending to rank 0, which waits
//                                            in a recv (shared memory on one host) and must
//                                            notice it at once
//   comm_worker ddp-vanish RANK TIMEOUT_S    one DDP step, then RANK exits before the second
//                                            backward; the others wait in the gradient all-reduce
//                                            (buckets in shared memory on one host) and must
//                                            notice it at once
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "dtrain/comm.h"
#include "dtrain/ddp.h"

int main(int argc, char** argv) {
  std::string mode = argc > 1 ? argv[1] : "sum";
  return dtrain::run_main([&] {
    dtrain::InitOptions options;
    if (mode == "skip" || mode == "vanish" || mode == "recv-vanish" || mode == "ddp-vanish") {
      options.timeout = std::chrono::milliseconds(static_cast<int>(std::stod(argv[3]) * 1000));
    }
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
    if (mode == "recv-vanish") {
      const int vanishing = std::stoi(argv[2]);
      if (pg->rank() == vanishing) _exit(0);
      if (pg->rank() == 0) {
        // Messages from the others first: the fast path works before one goes missing.
        for (int r = 1; r < pg->size(); ++r) {
          if (r == vanishing) continue;
          at::Tensor got = torch::empty({1000});
          pg->recv(got, r, /*tag=*/9);
          if (!torch::equal(got, torch::full({1000}, static_cast<float>(r)))) {
            std::cerr << "rank 0: wrong message from rank " << r << std::endl;
            return 1;
          }
        }
        at::Tensor never = torch::empty({1000});
        pg->recv(never, vanishing, /*tag=*/9);
      } else {
        pg->send(torch::full({1000}, static_cast<float>(pg->rank())), 0, /*tag=*/9);
      }
    }
    if (mode == "ddp-vanish") {
      torch::nn::Linear net(64, 64);
      dtrain::DistributedDataParallel<torch::nn::LinearImpl> ddp(net.ptr(), pg);
      for (int step = 0; step < 2; ++step) {
        if (step == 1 && pg->rank() == std::stoi(argv[2])) _exit(0);
        ddp->forward(torch::ones({4, 64})).sum().backward();
      }
    }
    std::cout << "rank " << pg->rank() << " sum " << expected << std::endl;
    return 0;
  });
}
