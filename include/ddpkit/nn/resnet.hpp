// SPDX-License-Identifier: BSD-3-Clause
// ResNet-18/34/50 with torchvision's exact structure, parameter names and
// initialisation, so state dicts line up key for key with
// `torchvision.models.resnet*` (see state_dict.hpp for the file format).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/nn/batch_norm.hpp"
#include "ddpkit/nn/unit.hpp"

namespace ddpkit::nn {

namespace detail {

inline torch::nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride = 1) {
  return torch::nn::Conv2d(torch::nn::Conv2dOptions(in, out, 3)
                               .stride(stride)
                               .padding(1)
                               .bias(false));
}
inline torch::nn::Conv2d conv1x1(int64_t in, int64_t out, int64_t stride = 1) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, 1).stride(stride).bias(false));
}

}  // namespace detail

/// torchvision's `BasicBlock` (ResNet-18/34): two 3×3 convs; `downsample`
/// (1×1 conv + BN) when the shape changes.
class BasicBlockImpl : public torch::nn::Cloneable<BasicBlockImpl> {
 public:
  static constexpr int64_t expansion = 1;
  BasicBlockImpl(int64_t inplanes, int64_t planes, int64_t stride,
                 bool downsample)
      : inplanes_(inplanes),
        planes_(planes),
        stride_(stride),
        has_down_(downsample) {
    reset();
  }
  void reset() override {
    conv1 =
        register_module("conv1", detail::conv3x3(inplanes_, planes_, stride_));
    bn1 = register_module("bn1", ddpkit::nn::BatchNorm2d(planes_));
    conv2 = register_module("conv2", detail::conv3x3(planes_, planes_));
    bn2 = register_module("bn2", ddpkit::nn::BatchNorm2d(planes_));
    if (has_down_) {
      downsample = register_module(
          "downsample",
          torch::nn::Sequential(
              detail::conv1x1(inplanes_, planes_ * expansion, stride_),
              ddpkit::nn::BatchNorm2d(planes_ * expansion)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto out = (bn1->forward(conv1->forward(x))).relu_();
    out = bn2->forward(conv2->forward(out));
    auto identity = has_down_ ? downsample->forward(x) : x;
    return (out += identity).relu_();
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  ddpkit::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Sequential downsample{nullptr};

 private:
  int64_t inplanes_, planes_, stride_;
  bool has_down_;
};
TORCH_MODULE(BasicBlock);

/// torchvision's `Bottleneck` (ResNet-50, v1.5: the stride sits on the 3×3
/// conv): 1×1, 3×3, 1×1 convs expanding by 4.
class BottleneckImpl : public torch::nn::Cloneable<BottleneckImpl> {
 public:
  static constexpr int64_t expansion = 4;
  BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride,
                 bool downsample)
      : inplanes_(inplanes),
        planes_(planes),
        stride_(stride),
        has_down_(downsample) {
    reset();
  }
  void reset() override {
    conv1 = register_module("conv1", detail::conv1x1(inplanes_, planes_));
    bn1 = register_module("bn1", ddpkit::nn::BatchNorm2d(planes_));
    conv2 =
        register_module("conv2", detail::conv3x3(planes_, planes_, stride_));
    bn2 = register_module("bn2", ddpkit::nn::BatchNorm2d(planes_));
    conv3 =
        register_module("conv3", detail::conv1x1(planes_, planes_ * expansion));
    bn3 = register_module("bn3", ddpkit::nn::BatchNorm2d(planes_ * expansion));
    if (has_down_) {
      downsample = register_module(
          "downsample",
          torch::nn::Sequential(
              detail::conv1x1(inplanes_, planes_ * expansion, stride_),
              ddpkit::nn::BatchNorm2d(planes_ * expansion)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    auto out = (bn1->forward(conv1->forward(x))).relu_();
    out = (bn2->forward(conv2->forward(out))).relu_();
    out = bn3->forward(conv3->forward(out));
    auto identity = has_down_ ? downsample->forward(x) : x;
    return (out += identity).relu_();
  }

  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr}, conv3{nullptr};
  ddpkit::nn::BatchNorm2d bn1{nullptr}, bn2{nullptr}, bn3{nullptr};
  torch::nn::Sequential downsample{nullptr};

 private:
  int64_t inplanes_, planes_, stride_;
  bool has_down_;
};
TORCH_MODULE(Bottleneck);

/// Options of `ResNet`.
struct ResNetOptions {
  ResNetOptions(std::vector<int64_t> layers, bool bottleneck,
                int64_t num_classes = 1000)
      : layers_(std::move(layers)),
        bottleneck_(bottleneck),
        num_classes_(num_classes) {}
  /// Blocks per stage: {2,2,2,2} ResNet-18, {3,4,6,3} ResNet-34/50.
  TORCH_ARG(std::vector<int64_t>, layers);
  /// Bottleneck blocks (ResNet-50) instead of basic blocks.
  TORCH_ARG(bool, bottleneck);
  TORCH_ARG(int64_t, num_classes);
  /// torchvision's `zero_init_residual`: the last BN of each block starts
  /// at zero.
  TORCH_ARG(bool, zero_init_residual) = false;
};

/// A ResNet equal to torchvision's: `conv1, bn1, relu, maxpool,
/// layer1..layer4, avgpool, fc`, blocks named `layerN.i`, shortcuts
/// `layerN.i.downsample.{0,1}`. Convs start kaiming-normal (fan_out, relu),
/// BN weight 1 bias 0, `fc` as `nn.Linear`'s default.
///
/// Example:
/// ```
/// auto net = ddpkit::nn::resnet34(/*num_classes=*/5);
/// auto logits = net->forward(torch::randn({2, 3, 224, 224}));  // 2×5
/// ddpkit::nn::save_state_dict(*net, "resnet34.pt");  // torch.load-able
/// ```
class ResNetImpl : public torch::nn::Cloneable<ResNetImpl> {
 public:
  explicit ResNetImpl(ResNetOptions options) : options(std::move(options)) {
    reset();
  }

  void reset() override {
    namespace tnn = torch::nn;
    if (options.layers().size() != 4) {
      throw UsageError(ddpkit::detail::cat(
          "ResNet: expected 4 stage sizes, got ", options.layers().size()));
    }
    inplanes_ = 64;
    conv1 = register_module(
        "conv1",
        tnn::Conv2d(
            tnn::Conv2dOptions(3, 64, 7).stride(2).padding(3).bias(false)));
    bn1 = register_module("bn1", ddpkit::nn::BatchNorm2d(64));
    layer1 = register_module("layer1", make_layer(64, options.layers()[0], 1));
    layer2 = register_module("layer2", make_layer(128, options.layers()[1], 2));
    layer3 = register_module("layer3", make_layer(256, options.layers()[2], 2));
    layer4 = register_module("layer4", make_layer(512, options.layers()[3], 2));
    fc = register_module("fc",
                         tnn::Linear(512 * expansion(), options.num_classes()));
    list_units();

    torch::NoGradGuard no_grad;
    for (auto& m : modules(/*include_self=*/false)) {
      if (auto* conv = m->as<tnn::Conv2d>()) {
        tnn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut,
                                   torch::kReLU);
      } else if (auto* bn = m->as<ddpkit::nn::BatchNorm2d>()) {
        tnn::init::ones_(bn->weight);
        tnn::init::zeros_(bn->bias);
      }
    }
    if (options.zero_init_residual()) {
      for (auto& m : modules(false)) {
        if (auto* b = m->as<BasicBlock>()) tnn::init::zeros_(b->bn2->weight);
        if (auto* b = m->as<Bottleneck>()) tnn::init::zeros_(b->bn3->weight);
      }
    }
  }

  torch::Tensor forward(torch::Tensor x) {
    x = (bn1->forward(conv1->forward(x))).relu_();
    x = torch::max_pool2d(x, 3, 2, 1);
    // layer1..layer4, block by block: each block is a ZeRO-3 unit.
    if (options.bottleneck()) {
      for (auto& block : bottleneck_units_) x = block(x);
    } else {
      for (auto& block : basic_units_) x = block(x);
    }
    x = torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1);
    return fc->forward(x);
  }

  /// A deep copy (Cloneable's), whose own blocks are its units.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device =
          c10::nullopt) const override {
    auto copy = Cloneable<ResNetImpl>::clone(device);
    std::dynamic_pointer_cast<ResNetImpl>(copy)->list_units();
    return copy;
  }

  int64_t expansion() const {
    return options.bottleneck() ? 4 : 1;
  }

  ResNetOptions options;
  torch::nn::Conv2d conv1{nullptr};
  ddpkit::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Sequential layer1{nullptr}, layer2{nullptr}, layer3{nullptr},
      layer4{nullptr};
  torch::nn::Linear fc{nullptr};

 private:
  torch::nn::Sequential make_layer(int64_t planes, int64_t blocks,
                                   int64_t stride) {
    torch::nn::Sequential seq;
    const bool down = stride != 1 || inplanes_ != planes * expansion();
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t s = i == 0 ? stride : 1;
      const bool d = i == 0 && down;
      if (options.bottleneck())
        seq->push_back(Bottleneck(inplanes_, planes, s, d));
      else
        seq->push_back(BasicBlock(inplanes_, planes, s, d));
      inplanes_ = planes * expansion();
    }
    return seq;
  }
  // The blocks of layer1..layer4, listed (and marked) as units.
  void list_units() {
    basic_units_.clear();
    bottleneck_units_.clear();
    for (auto* layer : {&layer1, &layer2, &layer3, &layer4}) {
      for (const auto& m : (*layer)->children()) {
        if (auto b = std::dynamic_pointer_cast<BottleneckImpl>(m)) {
          bottleneck_units_.emplace_back(Bottleneck(b));
        } else if (auto c = std::dynamic_pointer_cast<BasicBlockImpl>(m)) {
          basic_units_.emplace_back(BasicBlock(c));
        }
      }
    }
  }
  int64_t inplanes_ = 64;
  // The blocks of layer1..layer4 in order, each marked as a unit of a
  // fully sharded model (nn/unit.hpp; a no-op elsewhere). The Sequentials
  // hold them under torchvision's names; forward calls them through these.
  std::vector<ddpkit::nn::Unit<BasicBlock>> basic_units_;
  std::vector<ddpkit::nn::Unit<Bottleneck>> bottleneck_units_;
};
TORCH_MODULE(ResNet);

inline ResNet resnet18(int64_t num_classes = 1000) {
  return ResNet(ResNetOptions({2, 2, 2, 2}, false, num_classes));
}
inline ResNet resnet34(int64_t num_classes = 1000) {
  return ResNet(ResNetOptions({3, 4, 6, 3}, false, num_classes));
}
inline ResNet resnet50(int64_t num_classes = 1000) {
  return ResNet(ResNetOptions({3, 4, 6, 3}, true, num_classes));
}

/// Number of parameters (not buffers) of a module.
inline int64_t count_parameters(const torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

}  // namespace ddpkit::nn
