// SPDX-License-Identifier: BSD-3-Clause
// What the reducer needs of autograd: a post-hook on a parameter's
// AccumulateGrad node (its `.grad` holds this backward's contribution),
// and the nodes reachable from forward's outputs (the unused-parameter
// walk).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/torch.h>

namespace ddpkit::parallel {

namespace detail {

/// Runs after a parameter's AccumulateGrad node, i.e. once its `.grad` holds
/// this backward's contribution. `target` is cleared when the reducer goes.
class AccumulatedHook : public torch::autograd::FunctionPostHook {
 public:
  using Callback = std::function<void(std::size_t)>;
  AccumulatedHook(std::shared_ptr<Callback> target, std::size_t index)
      : target_(std::move(target)), index_(index) {}
  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (*target_) (*target_)(index_);
    return outputs;
  }

 private:
  std::shared_ptr<Callback> target_;
  std::size_t index_;
};

/// The autograd nodes reachable from `outputs` (their grad_fns and every
/// node behind them): a parameter whose AccumulateGrad node is not among
/// them gets no gradient in this backward (find_unused_parameters).
inline std::unordered_set<torch::autograd::Node*> reachable_nodes(
    const std::vector<torch::Tensor>& outputs) {
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const auto& o : outputs) {
    if (o.defined() && o.grad_fn() && seen.insert(o.grad_fn().get()).second) {
      stack.push_back(o.grad_fn().get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      auto* next = edge.function.get();
      if (next && seen.insert(next).second) stack.push_back(next);
    }
  }
  return seen;
}

}  // namespace detail

}  // namespace ddpkit::parallel
