// SPDX-License-Identifier: BSD-3-Clause
// Dynamic loss scaling for mixed-precision training (PyTorch's GradScaler):
// the loss is multiplied by a scale before backward; afterwards every
// gradient is divided by it and checked for inf/NaN in one fused pass on the
// device (ATen's `_amp_foreach_non_finite_check_and_unscale_`), the
// "found inf" flag is max-reduced over the ranks on the device, and the
// host reads it once per step. A step with an overflow anywhere is skipped
// on every rank and the scale halves; 2000 good steps double it.
#pragma once

#include <algorithm>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/distributed/collectives.hpp"

namespace ddpkit::parallel {

class LossScaler {
 public:
  explicit LossScaler(double scale = 65536.0) : scale_(scale) {}

  double scale() const {
    return scale_;
  }
  void set_scale(double s) {
    scale_ = s;
  }

  /// Divides every defined gradient of `params` by the scale and tells
  /// whether the step may be taken (no inf/NaN on any rank of `group` when
  /// `distributed`). Updates the scale. One host synchronisation.
  bool unscale_and_check(const std::vector<torch::Tensor>& params,
                         const dist::Group& group, bool distributed) {
    std::vector<torch::Tensor> grads;
    for (const auto& p : params) {
      if (p.grad().defined()) grads.push_back(p.grad());
    }
    return unscale_and_check_gradients(grads, group, distributed);
  }

  /// The same on gradient tensors themselves (e.g. the DDP reducer's flat
  /// buckets, which hold every gradient: a few large tensors instead of one
  /// per parameter).
  bool unscale_and_check_gradients(const std::vector<torch::Tensor>& grads,
                                   const dist::Group& group, bool distributed) {
    // One flag per device holding gradients, summed into the group's device.
    std::vector<std::vector<torch::Tensor>> by_device;
    for (const auto& g : grads) {
      if (!g.defined()) continue;
      auto it = std::find_if(
          by_device.begin(), by_device.end(),
          [&](const auto& v) { return v.front().device() == g.device(); });
      if (it == by_device.end()) {
        by_device.push_back({g});
      } else {
        it->push_back(g);
      }
    }
    auto found_inf = torch::zeros(
        {1},
        torch::TensorOptions().dtype(torch::kFloat32).device(group.device()));
    for (auto& list : by_device) {
      const auto opts = list.front().options().dtype(torch::kFloat32);
      auto found = torch::zeros({1}, opts);
      at::_amp_foreach_non_finite_check_and_unscale_(
          list, found, torch::full({1}, 1.0 / scale_, opts));
      found_inf.add_(found.to(found_inf.device()));
    }
    if (distributed) dist::all_reduce(group, found_inf, dist::Reduce::max);
    const bool overflow = found_inf.item<float>() != 0.0f;
    if (overflow) {
      scale_ /= 2;
      good_steps_ = 0;
    } else if (++good_steps_ >= kGrowthInterval) {
      scale_ *= 2;
      good_steps_ = 0;
    }
    return !overflow;
  }

 private:
  static constexpr int kGrowthInterval = 2000;
  double scale_;
  int good_steps_ = 0;
};

}  // namespace ddpkit::parallel
