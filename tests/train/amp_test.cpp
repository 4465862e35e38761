// Mixed precision: the fused unscale-and-check (LossScaler) and autocast.
#include "../support.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"

using namespace ddpkit;

#if DDPKIT_TORCH_AT_LEAST(2, 0)
namespace {

// Params whose gradients are set by hand.
std::vector<torch::Tensor> params_with_grads(
    const std::vector<torch::Tensor>& grads, torch::Device device) {
  std::vector<torch::Tensor> params;
  for (const auto& g : grads) {
    auto p = torch::zeros_like(g, torch::TensorOptions().device(device))
                 .requires_grad_(true);
    p.mutable_grad() = g.to(device);
    params.push_back(p);
  }
  return params;
}

}  // namespace

TEST_SUITE("train") {
  // libtorch 1.13 has the fused kernel on CUDA only.
  TEST_CASE("LossScaler: unscales in one pass, skips steps with inf/NaN") {
    dist::Group solo;  // a world of one
    parallel::LossScaler scaler(1024.0);
    auto params = params_with_grads(
        {torch::full({3}, 2048.0), torch::full({2, 2}, -512.0)}, torch::kCPU);
    CHECK(scaler.unscale_and_check(params, solo, false));
    CHECK(torch::equal(params[0].grad(), torch::full({3}, 2.0)));
    CHECK(torch::equal(params[1].grad(), torch::full({2, 2}, -0.5)));
    CHECK(scaler.scale() == 1024.0);
    for (float bad : {std::numeric_limits<float>::infinity(),
                      std::numeric_limits<float>::quiet_NaN()}) {
      CAPTURE(bad);
      auto g = torch::ones({4});
      g[2] = bad;
      auto ps = params_with_grads({torch::ones({2}), g}, torch::kCPU);
      const double before = scaler.scale();
      CHECK_FALSE(scaler.unscale_and_check(ps, solo, false));
      CHECK(scaler.scale() == before / 2);
    }
  }
}  // TEST_SUITE("train")
#endif

// Run by scripts/gpu-check.sh on a GPU machine (see parallel_test.cpp).
TEST_SUITE("cuda") {
  TEST_CASE("cuda: AMP training lowers the loss and never steps on inf") {
    REQUIRE(torch::cuda::is_available());
    torch::manual_seed(0);
    const torch::Device dev(torch::kCUDA, 0);
    torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 4));
    net->to(dev);
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    auto x = torch::randn({256, 32}, dev);
    auto y = (x.narrow(1, 0, 4).argmax(1));
    dist::Group solo;
    // A scale far beyond float16's range: the first steps overflow and
    // must be skipped (weights untouched) while the scale halves.
    parallel::LossScaler scaler(1e30);
    double first_loss = -1, last_loss = 0;
    int skipped = 0;
    for (int step = 0; step < 200; ++step) {
      for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();
      torch::Tensor loss;
      {
        compat::AutocastGuard autocast(true, torch::kHalf);
        auto out = net->forward(x);
        CHECK((out.scalar_type() == torch::kHalf));
        loss = torch::nn::functional::cross_entropy(out.to(torch::kFloat32), y);
      }
      (loss * scaler.scale()).backward();
      std::vector<torch::Tensor> before;
      for (auto& p : net->parameters()) before.push_back(p.detach().clone());
      if (scaler.unscale_and_check(net->parameters(), solo, false)) {
        sgd.step();
      } else {
        ++skipped;
        auto now = net->parameters();
        for (std::size_t i = 0; i < now.size(); ++i)
          CHECK(torch::equal(now[i].detach(), before[i]));
      }
      if (first_loss < 0) first_loss = loss.item<double>();
      last_loss = loss.item<double>();
    }
    MESSAGE("AMP: ", skipped, " skipped steps, loss ", first_loss, " -> ",
            last_loss, ", final scale ", scaler.scale());
    CHECK(skipped > 0);
    CHECK(scaler.scale() < 1e30);
    CHECK(last_loss < 0.5 * first_loss);
  }
}  // TEST_SUITE("cuda")
