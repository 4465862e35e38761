// SPDX-License-Identifier: BSD-3-Clause
// The engine contract: what a parallel policy's `engine<Model>` must offer
// the Trainer (`parallel_engine`, built from one-requirement pieces so a
// failed check names the missing piece), and what its training step returns
// (`StepOutput`). SingleDevice, DataParallel and DDP meet it; so must a
// policy of your own.
#pragma once

#include <concepts>

#include <torch/torch.h>

#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"

namespace ddpkit::parallel {

/// What one training step returns: the batch's mean loss and the model's
/// outputs, both detached.
struct StepOutput {
  torch::Tensor loss;
  torch::Tensor output;
};

/// The housekeeping of an engine whose gradients live in one process's
/// module (SingleDevice, DataParallel): zero_grad sets them to None, no_sync
/// has nothing to skip, AMP unscales the module's gradients, no step waits
/// for communication. `Engine` provides `module()`.
template <class Engine>
class OneProcessGradients {
 public:
  /// Before each step: gradients to None.
  void zero_grad() {
    clear_grads(as_module(self().module()));
  }
  /// Nothing to skip without communication: accumulation needs no scope.
  struct NoSync {};
  [[nodiscard]] NoSync no_sync() {
    return {};
  }
  /// Mixed precision: divides the gradients by the loss scale; false (skip
  /// the step) if any is inf/NaN.
  bool unscale_and_check(LossScaler& scaler) {
    return scaler.unscale_and_check(
        unique_parameters(as_module(self().module())), dist::Group(), false);
  }
  double last_wait_seconds() const {
    return 0;
  }

 private:
  Engine& self() {
    return static_cast<Engine&>(*this);
  }
};

}  // namespace ddpkit::parallel

namespace ddpkit {

// What a policy's engine must offer the Trainer. `Group` is
// ddpkit::dist::Group (a parameter, so the contract can be checked against
// any group type).

template <class P, class M>
concept has_engine_for = requires {
  typename P::template engine<M>;
  typename P::options_type;
};

template <class E, class M, class Group, class Options>
concept engine_constructible_from =
    std::constructible_from<E, M, Group, Options, torch::Device>;

template <class E>
concept engine_exposes_module = requires(E e) {
  e.module();
  { e.device() } -> std::convertible_to<torch::Device>;
};

template <class E>
concept engine_runs_forward = requires(E e, const torch::Tensor& x) {
  { e.forward(x) } -> std::convertible_to<torch::Tensor>;
};

template <class E>
concept engine_runs_steps = requires(
    E e, const torch::Tensor& x,
    torch::Tensor (*loss)(const torch::Tensor&, const torch::Tensor&)) {
  { e.forward_backward(x, x, loss).loss } -> std::convertible_to<torch::Tensor>;
  {
    e.forward_backward(x, x, loss).output
  } -> std::convertible_to<torch::Tensor>;
};

template <class E>
concept engine_zeroes_gradients = requires(E e) { e.zero_grad(); };

template <class E>
concept engine_accumulates_without_sync = requires(E e) { e.no_sync(); };

template <class E>
concept engine_reports_wait = requires(E e) {
  { e.last_wait_seconds() } -> std::convertible_to<double>;
};

template <class E>
concept engine_unscales_gradients = requires(E e, parallel::LossScaler& s) {
  { e.unscale_and_check(s) } -> std::convertible_to<bool>;
};

/// The contract of `P::engine<M>`: built from (model, group, options,
/// device); forward, forward_backward returning {loss, output} (both given
/// a tensor; ddpkit's engines take a `data::Inputs`, which a tensor
/// converts to, and the Trainer passes a batch's several inputs only to an
/// engine that takes one), zero_grad
/// (the only way the Trainer zeroes gradients), no_sync, AMP's
/// unscale_and_check(LossScaler&) (the only way the Trainer unscales), and
/// the seconds the last step waited for communication.
template <class P, class M, class Group>
concept parallel_engine =
    has_engine_for<P, M> &&
    engine_constructible_from<typename P::template engine<M>, M, Group,
                              typename P::options_type> &&
    engine_exposes_module<typename P::template engine<M>> &&
    engine_runs_forward<typename P::template engine<M>> &&
    engine_runs_steps<typename P::template engine<M>> &&
    engine_zeroes_gradients<typename P::template engine<M>> &&
    engine_accumulates_without_sync<typename P::template engine<M>> &&
    engine_unscales_gradients<typename P::template engine<M>> &&
    engine_reports_wait<typename P::template engine<M>>;

}  // namespace ddpkit
