// SPDX-License-Identifier: BSD-3-Clause
// CifarNet: the compact CIFAR-10 classifier of the CIFAR recipe (seed 000's
// `models/classifier.py`, `build_model(cfg)` with `model.num_classes: 10`).
// Small enough to train for a few epochs on a CPU.
#pragma once

#include <cstdint>

#include <torch/torch.h>

#include "ddpkit/nn/batch_norm.hpp"
#include "ddpkit/nn/unit.hpp"

namespace ddpkit::nn {

/// Options of `CifarNet`.
struct CifarNetOptions {
  explicit CifarNetOptions(int64_t num_classes = 10)
      : num_classes_(num_classes) {}
  /// Outputs of the last layer (changing it after construction needs
  /// `reset()`).
  TORCH_ARG(int64_t, num_classes);
  /// Channels of the first block; the next two double it.
  TORCH_ARG(int64_t, width) = 32;
  /// Dropout before each fully connected layer.
  TORCH_ARG(double, dropout) = 0.25;
};

/// The recipe names the classifier but its chapter does not print it, so
/// the layers are ours, chosen to be the recipe's kind of net (three
/// conv-BN-ReLU-pool blocks and a two-layer head, with BatchNorm so SyncBN
/// has something to convert):
///
/// | name            | layer                                  | output (32×32 in) |
/// |-----------------|----------------------------------------|-------------------|
/// | features.0/1/2  | Conv2d(3, w, 3, pad 1), BN, ReLU       | w×32×32           |
/// | features.3      | MaxPool2d(2)                           | w×16×16           |
/// | features.4/5/6  | Conv2d(w, 2w, 3, pad 1), BN, ReLU      | 2w×16×16          |
/// | features.7      | MaxPool2d(2)                           | 2w×8×8            |
/// | features.8/9/10 | Conv2d(2w, 4w, 3, pad 1), BN, ReLU     | 4w×8×8            |
/// | features.11     | MaxPool2d(2)                           | 4w×4×4            |
/// | classifier.0/1  | Dropout, Linear(16·4w, 256)            | 256               |
/// | classifier.2/3  | ReLU, Dropout                          | 256               |
/// | classifier.4    | Linear(256, num_classes)               | num_classes       |
///
/// With w = 32 that is 620,586 parameters for 10 classes and about 11 M
/// multiply-adds per image. Inputs must be 32×32.
///
/// Example:
/// ```
/// ddpkit::nn::CifarNet net(ddpkit::nn::CifarNetOptions(10));
/// auto logits = net->forward(torch::randn({8, 3, 32, 32}));  // 8×10
/// ```
class CifarNetImpl : public torch::nn::Cloneable<CifarNetImpl> {
 public:
  explicit CifarNetImpl(CifarNetOptions options = CifarNetOptions())
      : options(options) {
    reset();
  }

  void reset() override {
    namespace tnn = torch::nn;
    const auto w = options.width();
    auto block = [](tnn::Sequential& s, int64_t in, int64_t out) {
      s->push_back(
          tnn::Conv2d(tnn::Conv2dOptions(in, out, 3).padding(1).bias(false)));
      s->push_back(ddpkit::nn::BatchNorm2d(out));
      s->push_back(tnn::ReLU(tnn::ReLUOptions(true)));
      s->push_back(tnn::MaxPool2d(2));
    };
    // The pool sits after the ReLU, so the table's indices hold.
    tnn::Sequential f;
    block(f, 3, w);
    block(f, w, 2 * w);
    block(f, 2 * w, 4 * w);
    features = register_module("features", f);
    classifier = register_module(
        "classifier",
        tnn::Sequential(tnn::Dropout(options.dropout()),
                        tnn::Linear(16 * 4 * w, 256), tnn::ReLU(true),
                        tnn::Dropout(options.dropout()),
                        tnn::Linear(256, options.num_classes())));
  }

  torch::Tensor forward(torch::Tensor x) {
    return classifier(features(x).flatten(1));
  }

  CifarNetOptions options;
  // Each a unit of a fully sharded model (nn/unit.hpp; a no-op elsewhere).
  ddpkit::nn::Unit<torch::nn::Sequential> features{nullptr};
  ddpkit::nn::Unit<torch::nn::Sequential> classifier{nullptr};
};
TORCH_MODULE(CifarNet);

}  // namespace ddpkit::nn
