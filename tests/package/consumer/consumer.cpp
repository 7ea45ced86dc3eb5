// A user's program built against an installed dtrain: a few DDP steps of a small model, then a
// check that every rank holds the same parameters and that the loss went down. Run under `dtrain
// run`.
#include <dtrain/comm.h>
#include <dtrain/ddp.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  try {
    auto pg = dtrain::init_process_group();
    torch::manual_seed(1 +
                       pg->rank());  // different on purpose: DDP must broadcast rank 0's parameters
    auto net = std::make_shared<torch::nn::LinearImpl>(8, 1);
    dtrain::DistributedDataParallel ddp(net, pg);
    torch::optim::SGD optimizer(net->parameters(), 0.1);

    torch::manual_seed(100 + pg->rank());  // each rank its own share of the data
    auto x = torch::randn({32, 8});
    auto y = x.sum(1, true);
    double first_loss = 0, last_loss = 0;
    for (int step = 0; step < 20; ++step) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(ddp->forward(x), y);
      loss.backward();
      optimizer.step();
      (step == 0 ? first_loss : last_loss) = loss.item<double>();
    }

    // Replicas in step: the parameters' spread over ranks is zero.
    auto flat = torch::cat({net->weight.detach().flatten(), net->bias.detach()});
    auto max = flat.clone(), min = flat.clone();
    pg->all_reduce(max, dtrain::ReduceOp::kMax);
    pg->all_reduce(min, dtrain::ReduceOp::kMin);
    const bool in_step = torch::equal(max, min);
    const bool learned = last_loss < 0.5 * first_loss;
    std::cout << "consumer rank " << pg->rank() << "/" << pg->size() << " in_step=" << in_step
              << " learned=" << learned << std::endl;
    return in_step && learned ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "consumer: " << e.what() << std::endl;
    return 1;
  }
}
