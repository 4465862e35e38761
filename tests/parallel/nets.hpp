// Small deterministic models and data for the parallel-engine tests.
#pragma once

#include <limits>

#include <torch/torch.h>

#include "ddpkit/nn/batch_norm.hpp"
#include "ddpkit/nn/unit.hpp"

namespace ddpkit::test {

/// conv(3→8) [BN] relu conv(8→8) relu avgpool fc(8→5): small but with every
/// kind of layer the reducer has to handle.
struct SmallNetImpl : torch::nn::Cloneable<SmallNetImpl> {
  explicit SmallNetImpl(bool with_bn = false, bool with_unused = false)
      : with_bn(with_bn), with_unused(with_unused) {
    reset();
  }
  void reset() override {
    conv1 = register_module(
        "conv1",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    if (with_bn) bn1 = register_module("bn1", ddpkit::nn::BatchNorm2d(8));
    conv2 = register_module(
        "conv2",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    if (with_bn) bn2 = register_module("bn2", ddpkit::nn::BatchNorm2d(8));
    fc = register_module("fc", torch::nn::Linear(8, 5));
    if (with_unused)
      unused = register_module("unused", torch::nn::Linear(5, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = conv1(x);
    if (with_bn) x = bn1(x);
    x = torch::relu(x);
    x = conv2(x);
    if (with_bn) x = bn2(x);
    x = torch::relu(x);
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
    return fc(x);
  }
  bool with_bn, with_unused;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  ddpkit::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc{nullptr}, unused{nullptr};
};
TORCH_MODULE(SmallNet);

inline SmallNet make_net(uint64_t seed, bool bn = false, bool unused = false) {
  torch::manual_seed(seed);
  return SmallNet(bn, unused);
}

/// A block with a unit inside it (nested units): conv(8→8) relu pool,
/// then a Linear(8→8) unit.
struct UnitBlockImpl : torch::nn::Module {
  UnitBlockImpl() {
    conv = register_module(
        "conv",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    inner = register_module("inner", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv(x));
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
    return torch::tanh(inner(x));
  }
  torch::nn::Conv2d conv{nullptr};
  ddpkit::nn::Unit<torch::nn::Linear> inner{nullptr};
};
TORCH_MODULE(UnitBlock);

/// SmallNet's shape with ZeRO-3 units (nn::Unit): stem conv(3→8) [BN]
/// relu, a block unit holding a nested Linear unit, a head Linear(8→5)
/// unit, and a scale parameter of the root. `tied`: the block's inner
/// weight is also the root's "tied", applied once more after the block
/// (a weight of a unit and of its parent: it must be the parent's).
struct UnitNetImpl : torch::nn::Module {
  explicit UnitNetImpl(bool with_bn = false, bool tied = false)
      : with_bn(with_bn), with_tied(tied) {
    // No bias before batch norm (its gradient would be rounding noise,
    // which AdamW turns into steps of the learning rate's size).
    stem = register_module(
        "stem",
        torch::nn::Conv2d(
            torch::nn::Conv2dOptions(3, 8, 3).padding(1).bias(!with_bn)));
    if (with_bn) bn = register_module("bn", ddpkit::nn::BatchNorm2d(8));
    block = register_module("block", UnitBlock());
    if (tied) tied_weight = register_parameter("tied", block->inner->weight);
    head = register_module("head", torch::nn::Linear(8, 5));
    scale = register_parameter("scale", torch::ones({5}));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = stem(x);
    if (with_bn) x = bn(x);
    x = block(torch::relu(x));
    if (with_tied) {
      x = torch::tanh(torch::nn::functional::linear(x, tied_weight));
    }
    return head(x) * scale;
  }
  bool with_bn, with_tied;
  ddpkit::nn::Unit<torch::nn::Conv2d> stem{nullptr};
  ddpkit::nn::BatchNorm2d bn{nullptr};
  ddpkit::nn::Unit<UnitBlock> block{nullptr};
  ddpkit::nn::Unit<torch::nn::Linear> head{nullptr};
  torch::Tensor scale, tied_weight;
};
TORCH_MODULE(UnitNet);

inline UnitNet make_unit_net(uint64_t seed, bool bn = false,
                             bool tied = false) {
  torch::manual_seed(seed);
  return UnitNet(bn, tied);
}

/// The whole (global) batch of step `step`.
inline std::pair<torch::Tensor, torch::Tensor> global_batch(int step,
                                                            int64_t n) {
  auto gen = at::detail::createCPUGenerator(1000 + step);
  auto x = torch::randn({n, 3, 8, 8}, gen);
  auto y = torch::randint(0, 5, {n}, gen, torch::kLong);
  return {x, y};
}

inline torch::Tensor ce_loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

inline torch::optim::SGD make_sgd(torch::nn::Module& m) {
  return torch::optim::SGD(m.parameters(),
                           torch::optim::SGDOptions(0.1).momentum(0.9));
}

/// Largest |a-b| over largest |b| (0 when b is all zero and a equals it);
/// infinity when either holds a NaN or an infinity (so that a maximum over
/// several, and a `d <= tol` check, cannot pass over it: std::max(0, NaN)
/// is 0).
inline double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!torch::isfinite(a).all().item<bool>() ||
      !torch::isfinite(b).all().item<bool>()) {
    return std::numeric_limits<double>::infinity();
  }
  auto d = (a.to(torch::kFloat64) - b.to(torch::kFloat64))
               .abs()
               .max()
               .item<double>();
  auto s = b.to(torch::kFloat64).abs().max().item<double>();
  return s > 0 ? d / s : d;
}

/// The worst rel_diff over a module's parameters and buffers.
inline double max_state_diff(torch::nn::Module& a, torch::nn::Module& b) {
  double worst = 0;
  auto pa = a.named_parameters(), pb = b.named_parameters();
  for (auto& p : pa) worst = std::max(worst, rel_diff(p.value(), pb[p.key()]));
  auto ba = a.named_buffers(), bb = b.named_buffers();
  for (auto& p : ba) {
    if (p.value().is_floating_point())
      worst = std::max(worst, rel_diff(p.value(), bb[p.key()]));
  }
  return worst;
}

}  // namespace ddpkit::test
