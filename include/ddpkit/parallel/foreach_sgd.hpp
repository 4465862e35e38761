// SPDX-License-Identifier: BSD-3-Clause
// ForeachSGD: libtorch's SGD stepped with multi-tensor (_foreach) kernels.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "ddpkit/detail/compat.hpp"

namespace ddpkit::parallel {

namespace detail {

/// Whether a parameter of `groups` has a sparse gradient: the `_foreach`
/// optimizers then take libtorch's own step (libtorch 1.13 has no sparse
/// `_foreach`; Adam refuses sparse gradients with its own message).
inline bool any_sparse_grad(
    const std::vector<torch::optim::OptimizerParamGroup>& groups) {
  for (const auto& group : groups) {
    for (const auto& p : group.params()) {
      if (p.grad().defined() && p.grad().is_sparse()) return true;
    }
  }
  return false;
}

}  // namespace detail

/// libtorch's `torch::optim::SGD` (the same options, per-parameter state
/// and checkpoints: either loads the other's), whose step updates all of a
/// group's parameters with a few multi-tensor `_foreach` operations instead
/// of several operations per parameter: the update PyTorch's Python SGD
/// runs by default on CUDA (`foreach=True`), the same arithmetic as
/// libtorch's loop (weight decay, momentum with dampening, Nesterov).
///
/// Where it pays: on a GPU, where each operation is a kernel launch. On an
/// H200, ResNet-34 (224 px, batch 64) stepped 1.03x faster than with
/// libtorch's loop in float32 NCHW and 1.16-1.44x (median 1.21) in
/// bf16-mixed channels-last, alternated over 4 rounds (scripts/gpu-check.sh
/// part 6, docs/GPU.md). On a CPU the `_foreach` operations run per
/// tensor, so it is libtorch's loop by another name. A step with a sparse
/// gradient is libtorch's own (libtorch 1.13 has no sparse `_foreach`).
///
/// Example:
/// ```
/// ddpkit::parallel::ForeachSGD sgd(model->parameters(),
///     torch::optim::SGDOptions(0.01).momentum(0.9).weight_decay(5e-4));
/// ```
class ForeachSGD : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;

  torch::Tensor step(LossClosure closure = nullptr) override {
    torch::NoGradGuard no_grad;
    torch::Tensor loss;
    if (closure != nullptr) {
      at::AutoGradMode enable_grad(true);
      loss = closure();
    }
    if (detail::any_sparse_grad(param_groups_)) {
      torch::optim::SGD::step();  // the closure has run
      return loss;
    }
    for (auto& group : param_groups_) {
      const auto& o =
          static_cast<const torch::optim::SGDOptions&>(group.options());
      // `.data()`, as libtorch's loop: the update is not an autograd
      // operation on the parameter (its version counter stays).
      std::vector<torch::Tensor> owners, params, grads;
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        owners.push_back(p);  // the optimizer state's key
        params.push_back(p.data());
        grads.push_back(p.grad().data());
      }
      if (params.empty()) continue;
      // d_p = grad + weight_decay * p
      std::vector<torch::Tensor> d_p =
          o.weight_decay() != 0
              ? at::_foreach_add(grads, params, o.weight_decay())
              : grads;
      if (o.momentum() != 0) {
        // buf = momentum * buf + (1 - dampening) * d_p; a new buffer is
        // d_p itself (libtorch's first step).
        std::vector<torch::Tensor> bufs, old_bufs, old_d_p;
        bufs.reserve(params.size());
        for (std::size_t i = 0; i < params.size(); ++i) {
          const auto key = ddpkit::compat::optimizer_state_key(owners[i]);
          auto it = state_.find(key);
          if (it == state_.end()) {
            auto buf = torch::clone(d_p[i]).detach();
            auto st = std::make_unique<torch::optim::SGDParamState>();
            st->momentum_buffer(buf);
            state_[key] = std::move(st);
            bufs.push_back(buf);
          } else {
            auto buf = static_cast<torch::optim::SGDParamState&>(*it->second)
                           .momentum_buffer();
            old_bufs.push_back(buf);
            old_d_p.push_back(d_p[i]);
            bufs.push_back(buf);
          }
        }
        if (!old_bufs.empty()) {
          at::_foreach_mul_(old_bufs, o.momentum());
          at::_foreach_add_(old_bufs, old_d_p, 1 - o.dampening());
        }
        d_p = o.nesterov() ? at::_foreach_add(d_p, bufs, o.momentum())
                           : std::move(bufs);
      }
      at::_foreach_add_(params, d_p, -1 * o.lr());
    }
    return loss;
  }
};

}  // namespace ddpkit::parallel
