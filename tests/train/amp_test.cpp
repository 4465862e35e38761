// Mixed precision: the fused unscale-and-check (LossScaler) and autocast;
// the multi-tensor optimizer steps (ForeachSGD, ForeachAdam, ForeachAdamW).
#include "../support.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/parallel/foreach_adam.hpp"
#include "ddpkit/parallel/foreach_sgd.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/train/capture_safety.hpp"

using namespace ddpkit;

namespace {

/// Steps a `_foreach` optimizer (`Foreach`) and libtorch's (`Base`) over
/// copies of the same parameters (one never with a gradient, one without
/// one at the second step, so its state starts later and, for Adam, its
/// step count lags; a second group with its own learning rate) with the
/// same gradients for `steps` steps, the last half after moving the state
/// through a checkpoint (the Foreach one's saved, libtorch's loads it and
/// the reverse); returns the largest absolute difference between the two
/// sets of parameters (0: the same arithmetic).
template <class Foreach, class Base, class Options>
double foreach_vs_libtorch(const Options& opts, torch::Device device,
                           int steps = 6) {
  torch::manual_seed(3);
  std::vector<std::vector<int64_t>> shapes{{4, 3, 3, 3}, {4}, {5, 7}, {1}, {3}};
  std::vector<torch::Tensor> a, b;
  for (const auto& s : shapes) {
    auto t = torch::randn(s).to(device);
    a.push_back(t.clone().requires_grad_(true));
    b.push_back(t.clone().requires_grad_(true));
  }
  auto groups = [&](std::vector<torch::Tensor>& p) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<torch::Tensor>{p[0], p[1], p[2], p[3]});
    auto other = std::make_unique<Options>(opts);
    other->lr(opts.lr() * 0.5);
    g.emplace_back(std::vector<torch::Tensor>{p[4]}, std::move(other));
    return g;
  };
  std::unique_ptr<Base> fa = std::make_unique<Foreach>(groups(a), opts);
  std::unique_ptr<Base> fb = std::make_unique<Base>(groups(b), opts);
  for (int s = 0; s < steps; ++s) {
    if (s == steps / 2) {  // each one's state through the other's loader
      torch::serialize::OutputArchive oa, ob;
      fa->save(oa);
      fb->save(ob);
      std::stringstream sa, sb;
      oa.save_to(sa);
      ob.save_to(sb);
      auto na = std::make_unique<Foreach>(groups(a), opts);
      auto nb = std::make_unique<Base>(groups(b), opts);
      torch::serialize::InputArchive ia, ib;
      ib.load_from(sa);  // the Foreach one's state into libtorch's
      ia.load_from(sb);
      nb->load(ib);
      na->load(ia);
      fa = std::move(na);
      fb = std::move(nb);
    }
    for (std::size_t i = 0; i < a.size(); ++i) {
      if (i == 3) continue;    // never has a gradient
      if (i == 2 && s == 1) {  // none at this step
        a[i].mutable_grad() = torch::Tensor();
        b[i].mutable_grad() = torch::Tensor();
        continue;
      }
      auto g = torch::randn(a[i].sizes()).to(device);
      // In place after the first step, as backward accumulates: a buffer
      // that aliased the gradient would move with it.
      for (auto* t : {&a[i], &b[i]}) {
        if (t->grad().defined()) {
          t->mutable_grad().copy_(g);
        } else {
          t->mutable_grad() = g.clone();
        }
      }
    }
    fa->step();
    fb->step();
  }
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    // The same in-place operations on the parameter as libtorch's loop
    // (none recorded by autograd).
    CHECK(a[i]._version() == b[i]._version());
    worst = test::worse(
        worst, (a[i] - b[i]).abs().max().to(torch::kCPU).item<double>());
  }
  return worst;
}

double foreach_sgd_vs_sgd(const torch::optim::SGDOptions& opts,
                          torch::Device device) {
  return foreach_vs_libtorch<parallel::ForeachSGD, torch::optim::SGD>(opts,
                                                                      device);
}

std::vector<torch::optim::SGDOptions> sgd_variants() {
  return {
      torch::optim::SGDOptions(0.1),
      torch::optim::SGDOptions(0.1).weight_decay(0.01),
      torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.005),
      torch::optim::SGDOptions(0.05).momentum(0.9).dampening(0.1),
      torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(
          1e-3)};
}

std::vector<torch::optim::AdamOptions> adam_variants() {
  return {torch::optim::AdamOptions(0.01),
          torch::optim::AdamOptions(0.01).weight_decay(0.01),
          torch::optim::AdamOptions(0.02).betas({0.8, 0.99}).eps(1e-6),
          torch::optim::AdamOptions(0.01).amsgrad(true).weight_decay(1e-3)};
}

std::vector<torch::optim::AdamWOptions> adamw_variants() {
  return {torch::optim::AdamWOptions(0.01),
          torch::optim::AdamWOptions(0.01).weight_decay(0.05),
          torch::optim::AdamWOptions(0.02).betas({0.8, 0.99}).eps(1e-6),
          torch::optim::AdamWOptions(0.01).amsgrad(true).weight_decay(0.1)};
}

/// The largest difference over every Adam and AdamW variant.
double foreach_adam_worst(torch::Device device) {
  double worst = 0;
  const auto adam = adam_variants();
  for (std::size_t k = 0; k < adam.size(); ++k) {
    CAPTURE(k);
    const double d =
        foreach_vs_libtorch<parallel::ForeachAdam, torch::optim::Adam>(adam[k],
                                                                       device);
    MESSAGE("ForeachAdam vs Adam, variant ", k, ": ", d);
    worst = test::worse(worst, d);
  }
  const auto adamw = adamw_variants();
  for (std::size_t k = 0; k < adamw.size(); ++k) {
    CAPTURE(k);
    const double d =
        foreach_vs_libtorch<parallel::ForeachAdamW, torch::optim::AdamW>(
            adamw[k], device);
    MESSAGE("ForeachAdamW vs AdamW, variant ", k, ": ", d);
    worst = test::worse(worst, d);
  }
  return worst;
}

}  // namespace

TEST_SUITE("train") {
  TEST_CASE(
      "ForeachSGD equals libtorch's SGD (weight decay, momentum, dampening, "
      "Nesterov; two groups; a parameter without a gradient) and shares its "
      "checkpoints") {
    const auto variants = sgd_variants();
    for (std::size_t k = 0; k < variants.size(); ++k) {
      CAPTURE(k);
      CHECK(foreach_sgd_vs_sgd(variants[k], torch::kCPU) == 0);
    }
  }

  TEST_CASE("ForeachSGD with a sparse gradient steps as libtorch's SGD") {
    torch::manual_seed(5);
    auto start = torch::randn({6, 3});
    auto a = start.clone().requires_grad_(true);
    auto b = start.clone().requires_grad_(true);
    parallel::ForeachSGD fa({a}, torch::optim::SGDOptions(0.1));
    torch::optim::SGD fb({b}, torch::optim::SGDOptions(0.1));
    for (int s = 0; s < 3; ++s) {
      auto g = torch::sparse_coo_tensor(torch::tensor({{0, 2 + s}}),
                                        torch::randn({2, 3}), {6, 3});
      a.mutable_grad() = g.clone();
      b.mutable_grad() = g.clone();
      fa.step();
      fb.step();
    }
    CHECK(torch::equal(a, b));
    CHECK_FALSE(torch::equal(a, start));
  }

  TEST_CASE(
      "ForeachAdam and ForeachAdamW equal libtorch's Adam and AdamW (weight "
      "decay, betas, eps, AMSGrad; two groups; parameters without a gradient "
      "and with lagging step counts) and share their checkpoints") {
    CHECK(foreach_adam_worst(torch::kCPU) == 0);
  }

  TEST_CASE("ForeachAdam refuses a sparse gradient as libtorch's Adam does") {
    auto a = torch::randn({6, 3}).requires_grad_(true);
    parallel::ForeachAdam fa({a}, torch::optim::AdamOptions(0.1));
    a.mutable_grad() = torch::sparse_coo_tensor(torch::tensor({{0, 2}}),
                                                torch::randn({2, 3}), {6, 3});
    CHECK_THROWS(fa.step());
  }
}  // TEST_SUITE("train")

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
#endif

TEST_SUITE("train") {
  // libtorch 1.13 has the fused kernel on CUDA only: excluded by name there
  // (tests/CMakeLists.txt).
  TEST_CASE("LossScaler: unscales in one pass, skips steps with inf/NaN") {
    DDPKIT_REQUIRE_BUILD(DDPKIT_TORCH_AT_LEAST(2, 0),
                         "libtorch < 2.0 has no CPU kernel for the fused "
                         "unscale");
#if DDPKIT_TORCH_AT_LEAST(2, 0)
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
#endif
  }
}  // TEST_SUITE("train")

TEST_SUITE("train") {
  TEST_CASE(
      "check_capture_safety: a plain SGD step passes; an inserted item() and "
      "a shrinking batch are named") {
    torch::manual_seed(5);
    torch::nn::Linear net(6, 3);
    torch::optim::SGD opt(net->parameters(),
                          torch::optim::SGDOptions(0.1).momentum(0.9));
    const auto x = torch::randn({8, 6});
    const auto y = torch::randint(0, 3, {8}, torch::kLong);
    bool read_loss = false;
    int64_t n = 8;
    auto step = [&] {
      opt.zero_grad();
      auto loss = torch::nn::functional::cross_entropy(net(x.narrow(0, 0, n)),
                                                       y.narrow(0, 0, n));
      if (read_loss) (void)loss.item<float>();  // the host sync
      loss.backward();
      opt.step();
    };
    const auto plain = train::check_capture_safety(step);
    MESSAGE("plain step: ", plain.summary());
    CHECK(plain.ok());
    REQUIRE(plain.ops_per_step.size() == 2);
    CHECK(plain.ops_per_step[0] >= 10);  // forward, backward and the step

    read_loss = true;
    const auto synced = train::check_capture_safety(step);
    MESSAGE("with loss.item(): ", synced.summary());
    REQUIRE(synced.violations.size() == 2);  // once per checked step
    CHECK(synced.violations[0].kind == "host sync");
    CHECK(synced.violations[0].op == "aten::item");
    CHECK(synced.violations[0].index > 0);

    read_loss = false;
    const auto shrinking = train::check_capture_safety([&] {
      step();
      --n;
    });
    MESSAGE("shrinking batch: ", shrinking.summary());
    REQUIRE(shrinking.violations.size() == 1);
    CHECK(shrinking.violations[0].kind == "step differs");
    CHECK(shrinking.violations[0].step == 1);
    CHECK(shrinking.violations[0].detail.find("[4, 6]") != std::string::npos);
    CHECK_THROWS_AS(train::check_capture_safety(
                        step, train::CaptureSafetyOptions().checked_steps(0)),
                    UsageError);
  }
}  // TEST_SUITE("train")

// Run by scripts/gpu-check.sh on a GPU machine (see parallel_test.cpp).
TEST_SUITE("cuda") {
  TEST_CASE("cuda: ForeachSGD equals libtorch's SGD on CUDA tensors") {
    REQUIRE(torch::cuda::is_available());
    const auto variants = sgd_variants();
    for (std::size_t k = 0; k < variants.size(); ++k) {
      CAPTURE(k);
      const double d = foreach_sgd_vs_sgd(variants[k], torch::kCUDA);
      MESSAGE("ForeachSGD vs SGD on CUDA, variant ", k, ": ", d);
      CHECK(d <= 1e-6);  // fused kernels may round a multiply-add once
    }
  }

  TEST_CASE("cuda: ForeachAdam and ForeachAdamW equal libtorch's on CUDA") {
    REQUIRE(torch::cuda::is_available());
    CHECK(foreach_adam_worst(torch::kCUDA) <= 1e-6);
  }

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
