// SPDX-License-Identifier: BSD-3-Clause
// Activation checkpointing for libtorch's C++ API, which has none: the
// reentrant form of Python's torch.utils.checkpoint.checkpoint.
#pragma once

#include <functional>
#include <utility>

#include <torch/torch.h>

namespace ddpkit::nn {

namespace detail {

/// The checkpointed function, kept in the autograd node's saved data.
struct CheckpointedFn : torch::CustomClassHolder {
  explicit CheckpointedFn(std::function<torch::Tensor(torch::Tensor)> f)
      : fn(std::move(f)) {}
  std::function<torch::Tensor(torch::Tensor)> fn;
};

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               torch::Tensor x,
                               c10::intrusive_ptr<CheckpointedFn> holder) {
    ctx->save_for_backward({x});
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["rng"] = at::detail::getDefaultCPUGenerator().get_state();
    torch::NoGradGuard no_grad;
    return holder->fn(x);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    auto x = ctx->get_saved_variables()[0];
    auto holder = c10::static_intrusive_pointer_cast<CheckpointedFn>(
        ctx->saved_data["fn"].toCapsule());
    auto input = x.detach().requires_grad_(x.requires_grad());
    // The recomputation draws the random numbers forward drew (dropout),
    // and leaves the generator where backward found it.
    auto gen = at::detail::getDefaultCPUGenerator();
    const auto resume = gen.get_state();
    gen.set_state(ctx->saved_data["rng"].toTensor());
    torch::Tensor out;
    {
      torch::AutoGradMode grad(true);
      out = holder->fn(input);
    }
    gen.set_state(resume);
    // A backward of its own (reentrant): the parameters the function uses
    // get their gradients accumulated here, once per checkpointed call.
    if (out.requires_grad()) torch::autograd::backward({out}, {grads[0]});
    return {input.requires_grad() ? input.grad() : torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace detail

/// Activation checkpointing (reentrant, as Python's
/// `torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=True)`): runs
/// `fn(x)` without keeping its intermediate activations, and runs it again
/// during backward to compute its gradients there, in a backward of its own.
/// Memory: only `x` is kept for the segment. Cost: `fn`'s forward twice.
/// `fn` must compute the same thing both times: the CPU random generator is
/// restored for the recomputation (dropout draws the same mask; CUDA's
/// generators are not), but buffers it updates (BatchNorm's running
/// statistics) are updated twice, as in PyTorch.
///
/// Under DDP each call's parameters receive their gradients inside that
/// call's own backward; a module used by two checkpointed calls receives
/// two, which DDP's dynamic path refuses ("marked ready twice") and
/// `DDPOptions::static_graph(true)` accepts (see Note [Static graphs]).
///
/// Example:
/// ```
/// auto y = ddpkit::nn::checkpoint([&](torch::Tensor t) { return block(t); },
///                                 x);
/// ```
inline torch::Tensor checkpoint(std::function<torch::Tensor(torch::Tensor)> fn,
                                torch::Tensor x) {
  return detail::CheckpointFunction::apply(
      x, c10::make_intrusive<detail::CheckpointedFn>(std::move(fn)));
}

}  // namespace ddpkit::nn
