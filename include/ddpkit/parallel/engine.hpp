// SPDX-License-Identifier: BSD-3-Clause
// The engine contract: what a parallel policy's `engine<Model>` must offer
// the Trainer (`parallel_engine`, built from one-requirement pieces so a
// failed check names the missing piece), what it may offer besides (its
// declared capabilities, each a named concept), and what its training step
// returns (`StepOutput`). SingleDevice, DataParallel, DDP and ZeRO meet it;
// so must a policy of your own.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/inputs.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"

namespace ddpkit::parallel {

// Note [Zeroing gradients goes through the engine]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Zeroing gradients goes through the engine. 2.x optimizers set `.grad` to
// None by default, which would detach DDP's bucket views; the Trainer calls
// `engine.zero_grad()` (DDP: one fill per bucket, views kept; other modes:
// set to None).

// Note [The engine contract is a concept]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The engine contract is a concept (`parallel_engine<P, Model, Group>` in
// `parallel/engine.hpp`, one piece per requirement: built from (model, group,
// options, device), `module()`/`device()`, `forward`, `forward_backward`
// returning {loss, output}, `zero_grad`, `no_sync`, `unscale_and_check`,
// `last_wait_seconds`), required where the Trainer is declared: a policy of
// one's own that lacks a piece fails naming it (compile-fail case
// `engine_without_zero_grad`: "engine_zeroes_gradients"). AMP unscaling is
// the engine's too (`unscale_and_check(LossScaler&)`, concept
// `engine_unscales_gradients`): DDP unscales and checks the reducer's flat
// buckets (a few tensors, not one per parameter) and max-reduces the overflow
// flag over the ranks (test "DDP engine's AMP unscale…": an inf put into rank
// 1's gradients after the all-reduce makes both ranks skip the step and halve
// the scale; the next step's gradients are divided by exactly the new scale);
// the Trainer only calls it.

/// Makes the optimizer over the parameters it is given (the model's, after
/// they are on the device and, for DDP, broadcast from rank 0; a sharding
/// engine's: this rank's shard).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::Tensor>)>;

// Note [Engine capabilities]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Beyond the contract every engine meets (`parallel_engine`), an engine
// may do more: shard the optimizer state, clip by a norm taken across
// gradient shards, take a batch's several inputs, join uneven inputs,
// report what it measured. The Trainer does not probe for these (a
// misspelt method would silently turn the feature off: a ZeRO engine whose
// `consolidate_optimizer` is misspelt would write a checkpoint holding one
// rank's shard). An engine *declares* them, as
//
//   using capabilities = parallel::capabilities<capability::takes_inputs,
//                                               capability::joins>;
//
// (a derived engine extends its base's: `base::capabilities::with<...>`),
// and each declared capability is a named concept below that the engine
// must satisfy (`engine_keeps_its_declarations`, part of `parallel_engine`):
// a misspelt method is a compile error naming the capability. The three
// whose absence would be silently wrong — `shards_optimizer`,
// `shards_parameters` and `clips_globally` — must also be declared when the
// methods exist. The Trainer asks `declares<Engine, capability::X>` and calls the method.

/// The capabilities an engine may declare (see Note [Engine capabilities]).
namespace capability {
/// forward(const data::Inputs&) and forward_backward(const data::Inputs&,
/// y, loss_fn): a batch's several inputs (without it the Trainer passes the
/// first and refuses a batch of several).
struct takes_inputs {};
/// make_optimizer(OptimizerFactory) over this rank's shard,
/// consolidate_optimizer() on every rank before rank 0 writes a checkpoint,
/// gather_buffer_bytes(), optimizer_state_bytes() (this rank's).
struct shards_optimizer {};
/// whole_parameters(bool write_back) -> a guard (every rank) under which
/// the model's parameters are whole (reading, saving, evaluating; with
/// write_back, loading into them), and shards(): the tensors this rank
/// steps, which hold its gradients (finiteness and clipping by value read
/// them), shard_bytes() (the parameters it keeps between steps) and
/// last_gather_seconds() (the last forward and backward's wait for
/// gathers): the parameters themselves are sharded (ZeRO3).
struct shards_parameters {};
/// clip_grad_norm(max_norm, norm_type) -> the total norm, taken across
/// gradient shards (the Trainer clips by norm only through it).
struct clips_globally {};
/// peak_gradient_bytes(): the most bytes of gradients held at once.
struct measures_gradients {};
/// last_step_bytes(): the bytes the last step's gradient collectives
/// carried.
struct counts_traffic {};
/// mode_name(): the mode's name where it differs from the policy's `name`
/// (ZeRO2 at stage 1 is "zero1").
struct names_mode {};
/// comm_name(): the gradient communication hook's name.
struct names_comm {};
/// join_round(bool has_batch) -> whether to go on: uneven inputs.
struct joins {};
}  // namespace capability

/// A list of capability tags: an engine's `capabilities`.
template <class... Caps>
struct capabilities {
  /// This list and `More`.
  template <class... More>
  using with = capabilities<Caps..., More...>;
  /// Whether `Cap` is in the list.
  template <class Cap>
  static constexpr bool has = (std::is_same_v<Cap, Caps> || ...);
};

namespace detail {
template <class E>
struct capabilities_of {
  using type = capabilities<>;
};
template <class E>
  requires requires { typename E::capabilities; }
struct capabilities_of<E> {
  using type = typename E::capabilities;
};
}  // namespace detail

/// Whether engine `E` declares capability `Cap`.
template <class E, class Cap>
inline constexpr bool declares =
    detail::capabilities_of<std::remove_cvref_t<E>>::type::template has<Cap>;

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

// The capabilities' concepts (see Note [Engine capabilities]).

template <class E>
concept engine_takes_inputs = requires(
    E e, const data::Inputs& x, const torch::Tensor& y,
    torch::Tensor (*loss)(const torch::Tensor&, const torch::Tensor&)) {
  { e.forward(x) } -> std::convertible_to<torch::Tensor>;
  { e.forward_backward(x, y, loss).loss } -> std::convertible_to<torch::Tensor>;
};

template <class E>
concept engine_shards_optimizer =
    requires(E e, parallel::OptimizerFactory make) {
      {
        e.make_optimizer(make)
      } -> std::convertible_to<std::unique_ptr<torch::optim::Optimizer>>;
      e.consolidate_optimizer();
      { e.gather_buffer_bytes() } -> std::convertible_to<std::uint64_t>;
      { e.optimizer_state_bytes() } -> std::convertible_to<std::uint64_t>;
    };

template <class E>
concept engine_shards_parameters = requires(E e, bool write_back) {
  e.whole_parameters(write_back);
  { e.shards() } -> std::convertible_to<std::vector<torch::Tensor>>;
  { e.shard_bytes() } -> std::convertible_to<std::uint64_t>;
  { e.last_gather_seconds() } -> std::convertible_to<double>;
};

template <class E>
concept engine_clips_globally = requires(E e, double max_norm) {
  { e.clip_grad_norm(max_norm, max_norm) } -> std::convertible_to<double>;
};

template <class E>
concept engine_measures_gradients = requires(E e) {
  { e.peak_gradient_bytes() } -> std::convertible_to<std::uint64_t>;
};

template <class E>
concept engine_counts_traffic = requires(const E e) {
  { e.last_step_bytes() } -> std::convertible_to<std::uint64_t>;
};

template <class E>
concept engine_names_mode = requires(const E e) {
  { e.mode_name() } -> std::convertible_to<std::string>;
};

template <class E>
concept engine_names_comm = requires(const E e) {
  { e.comm_name() } -> std::convertible_to<std::string>;
};

template <class E>
concept engine_joins = requires(E e, bool has_batch) {
  { e.join_round(has_batch) } -> std::convertible_to<bool>;
};

// Each declared capability kept: one concept per capability, so a failed
// check names it.

template <class E>
concept keeps_takes_inputs =
    !parallel::declares<E, parallel::capability::takes_inputs> ||
    engine_takes_inputs<E>;
template <class E>
concept keeps_shards_optimizer =
    !parallel::declares<E, parallel::capability::shards_optimizer> ||
    engine_shards_optimizer<E>;
template <class E>
concept keeps_shards_parameters =
    !parallel::declares<E, parallel::capability::shards_parameters> ||
    engine_shards_parameters<E>;
template <class E>
concept keeps_clips_globally =
    !parallel::declares<E, parallel::capability::clips_globally> ||
    engine_clips_globally<E>;
template <class E>
concept keeps_measures_gradients =
    !parallel::declares<E, parallel::capability::measures_gradients> ||
    engine_measures_gradients<E>;
template <class E>
concept keeps_counts_traffic =
    !parallel::declares<E, parallel::capability::counts_traffic> ||
    engine_counts_traffic<E>;
template <class E>
concept keeps_names_mode =
    !parallel::declares<E, parallel::capability::names_mode> ||
    engine_names_mode<E>;
template <class E>
concept keeps_names_comm =
    !parallel::declares<E, parallel::capability::names_comm> ||
    engine_names_comm<E>;
template <class E>
concept keeps_joins =
    !parallel::declares<E, parallel::capability::joins> || engine_joins<E>;

// The two capabilities whose silent absence would be wrong (a whole-model
// optimizer beside a sharding engine; a norm clipped over one shard):
// declared wherever the methods are.
template <class E>
concept declares_optimizer_sharding =
    !engine_shards_optimizer<E> ||
    parallel::declares<E, parallel::capability::shards_optimizer>;
template <class E>
concept declares_parameter_sharding =
    !engine_shards_parameters<E> ||
    parallel::declares<E, parallel::capability::shards_parameters>;
template <class E>
concept declares_global_clipping =
    !engine_clips_globally<E> ||
    parallel::declares<E, parallel::capability::clips_globally>;

/// Every capability engine `E` declares is there, and the two that must be
/// declared are.
template <class E>
concept engine_keeps_its_declarations =
    keeps_takes_inputs<E> && keeps_shards_optimizer<E> &&
    keeps_shards_parameters<E> && keeps_clips_globally<E> &&
    keeps_measures_gradients<E> && keeps_counts_traffic<E> &&
    keeps_names_mode<E> && keeps_names_comm<E> && keeps_joins<E> &&
    declares_optimizer_sharding<E> && declares_parameter_sharding<E> &&
    declares_global_clipping<E>;

/// The contract of `P::engine<M>`: built from (model, group, options,
/// device); forward, forward_backward returning {loss, output} (both given
/// a tensor; ddpkit's engines take a `data::Inputs`, which a tensor
/// converts to, and the Trainer passes a batch's several inputs only to an
/// engine that takes one), zero_grad
/// (the only way the Trainer zeroes gradients), no_sync, AMP's
/// unscale_and_check(LossScaler&) (the only way the Trainer unscales), and
/// the seconds the last step waited for communication; and every
/// capability it declares (Note [Engine capabilities]).
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
    engine_reports_wait<typename P::template engine<M>> &&
    engine_keeps_its_declarations<typename P::template engine<M>>;

}  // namespace ddpkit
