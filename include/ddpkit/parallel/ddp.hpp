// SPDX-License-Identifier: BSD-3-Clause
// DDP: one process per device. At construction the model's structure is
// checked across ranks and rank 0's parameters and buffers are broadcast;
// during backward the reducer averages gradients bucket by bucket.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/inputs.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/nn/batch_norm.hpp"
#include "ddpkit/parallel/grad_comm.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/reducer.hpp"
#include "ddpkit/parallel/single_device.hpp"
#include "ddpkit/parallel/trace.hpp"

namespace ddpkit::parallel {

// Note [Uneven inputs: refuse or join]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Uneven inputs: refuse or join. By default the Trainer refuses different
// batch counts before the epoch, on every rank.
// `TrainerOptions::uneven_inputs(UnevenInputs::join)` (or
// `engine.join_round(has_batch)` in a loop of one's own) follows PyTorch's
// `Join`: each round starts with a one-element all-reduce of "has a batch"; a
// rank without one shadows the step (every bucket all-reduced holding zeros,
// plus the used-flags with `find_unused_parameters`), so the others' averages
// divide by the whole world size, as PyTorch's default
// `divide_by_initial_world_size`; when no rank has a batch the lowest of the
// ranks active in the last round broadcasts its parameters and buffers.
// Buckets are not rebuilt in a round where a rank has joined. Refused with a
// UsageError on every rank while a rank has joined if the model has
// SyncBatchNorm or `broadcast_buffers` is on (their collectives run in
// forward). Tests: ranks with 2 and 3 batches against PyTorch's own DDP under
// `Join` in Python: relative difference 0 for every parameter on both ranks;
// through the Trainer (1 and 2 batches per epoch), both ranks end with
// byte-identical parameters and metrics. The joined rank's optimizer does not
// step (as in PyTorch), so its optimizer state differs from the last rank's.

// Note [Unused parameters follow PyTorch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Unused parameters follow PyTorch (`find_unused_parameters(true)`). The
// engine's forward walks the autograd graph from the output (every node's
// next edges); parameters whose grad accumulator it does not reach are marked
// ready at the first gradient hook, so the buckets holding them launch while
// backward runs (the test counts 30 of 30 bucket launches inside backward; 0
// of 30 without the walk, when such a parameter sits in the first bucket). A
// used-flag per parameter is all-reduced after the buckets (one small
// collective per step): a parameter no rank used gets back the undefined
// gradient it had before the step (the engine's `zero_grad` remembers which
// it bound), so the optimizer skips it (no weight decay, no momentum), as
// PyTorch's default `zero_grad(set_to_none)` gives; one used on some ranks is
// averaged over all ranks. Flags count `no_sync` micro-steps, so a parameter
// used only there is averaged, and is not "missing" even without
// `find_unused_parameters`. Test: the same model, data and pattern (used on
// rank 0 only, on no rank, only under no_sync) through PyTorch's own
// `DistributedDataParallel` in Python at world 2: relative difference 0 for
// every parameter, `b.grad` None on both sides. A parameter the walk found
// unreachable that still gets a gradient (used in the loss outside the model)
// is the "marked ready twice" error, saying so.

/// DDP settings (PyTorch's DistributedDataParallel arguments).
struct DDPOptions {
  TORCH_ARG(ReducerOptions, reducer) = {};
  /// Broadcast rank 0's buffers (e.g. BatchNorm running stats) before every
  /// forward in training mode.
  TORCH_ARG(bool, broadcast_buffers) = false;
  /// Write per-step timings (forward, backward, each bucket's all-reduce, the
  /// wait) as a Chrome trace to this path; `{rank}` is replaced by the rank.
  TORCH_ARG(std::string, trace_path) = "";
  /// Settings of the communication hook (PowerSGD's rank, RuntimeComm's
  /// choice), given to a hook constructible from CommOptions.
  TORCH_ARG(CommOptions, comm) = {};

 public:
  /// PyTorch's static_graph (ReducerOptions::static_graph): the same graph
  /// every step, recorded in the first; what it buys is a parameter whose
  /// gradient is accumulated several times in one backward (a module run
  /// twice under reentrant activation checkpointing, nn::checkpoint), which
  /// the dynamic path refuses. See Note [Static graphs] (reducer.hpp).
  DDPOptions& static_graph(bool on) {
    reducer_.static_graph(on);
    return *this;
  }
  bool static_graph() const {
    return reducer_.static_graph();
  }
};

/// One process per device; gradients averaged across processes by the
/// communication hook `Comm` (AllReduceMean, Fp16Compression,
/// Bf16Compression, PowerSGD, RuntimeComm, or your own: see grad_comm.hpp).
template <comm_hook Comm = AllReduceMean>
struct BasicDDP {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = true;
  static constexpr bool is_multi_replica = false;
  static constexpr const char* name = "ddp";
  using options_type = DDPOptions;
  using comm_type = Comm;

  template <class Model>
  class engine {
   public:
    /// See Note [Engine capabilities].
    using capabilities = ::ddpkit::parallel::capabilities<
        capability::takes_inputs, capability::measures_gradients,
        capability::counts_traffic, capability::names_comm, capability::joins>;
    engine(Model model, dist::Group group, options_type opts,
           torch::Device device)
        : model_(std::move(model)),
          group_(std::move(group)),
          opts_(std::move(opts)),
          device_(device) {
      auto& m = as_module(model_);
      m.to(device_);
      verify_same_structure(group_, m);
      // Ranks that initialised differently start identical.
      broadcast_state(0);
      if (!opts_.trace_path().empty()) {
        std::string path = opts_.trace_path();
        auto at = path.find("{rank}");
        if (at != std::string::npos) {
          path.replace(at, 6, std::to_string(group_.rank()));
        }
        trace_ = std::make_unique<Trace>(path, group_.rank());
      }
      std::vector<torch::Tensor> params;
      std::vector<std::string> names;
      for (auto& p : m.named_parameters()) {
        names.push_back(p.key());
        params.push_back(p.value());
      }
      if (group_.size() > 1) {
        reducer_ = std::make_unique<Reducer<Comm>>(
            params, names, group_, opts_.reducer(), trace_.get(), make_hook());
      }
    }

    ~engine() {
      if (trace_) {
        try {
          trace_->flush();
        } catch (...) {
        }
      }
    }

    Model& module() {
      return model_;
    }
    torch::Device device() const {
      return device_;
    }
    const dist::Group& group() const {
      return group_;
    }
    Reducer<Comm>* reducer() {
      return reducer_.get();
    }
    Trace* trace() {
      return trace_.get();
    }

    /// Forward; before a backward (grad mode on) it also finishes a step an
    /// earlier backward abandoned by throwing (see Reducer).
    torch::Tensor forward(const data::Inputs& x) {
      if (reducer_ && torch::GradMode::is_enabled()) {
        reducer_->prepare_for_backward();
      }
      if (opts_.broadcast_buffers() && as_module(model_).is_training()) {
        broadcast_coalesced(group_, as_module(model_).buffers(), 0);
      }
      torch::Tensor out = data::forward_inputs(model_, x);
      if (reducer_ && torch::GradMode::is_enabled()) {
        // The unused-parameter walk, where the reducer needs one
        // (find_unused_parameters without a static graph).
        reducer_->prepare_for_backward({out});
      }
      return out;
    }

    template <class LossFn>
    StepOutput forward_backward(const data::Inputs& x, const torch::Tensor& y,
                                LossFn&& loss_fn) {
      torch::Tensor out, loss;
      {
        Trace::Span span(*trace_or_null(), "forward");
        out = forward(x);
        loss = loss_fn(out, y);
      }
      {
        Trace::Span span(*trace_or_null(), "backward + reduce");
        try {
          loss.backward();
          if (reducer_) reducer_->finish_backward();
        } catch (...) {
          // A throwing backward (a failing op, a refused step) leaves no
          // all-reduce in flight: the caller may skip this batch and go on.
          if (reducer_) reducer_->abandon_step();
          throw;
        }
      }
      return {loss.detach(), out.detach()};
    }

    /// Before each step: zeroes the gradient buckets in place, so `.grad`
    /// stays a view of its bucket (an optimizer's `zero_grad()` sets
    /// gradients to None in libtorch 2.x, which would cost a copy of every
    /// gradient in the next backward).
    void zero_grad() {
      if (reducer_) {
        reducer_->zero_grad();
      } else {
        clear_grads(as_module(model_));
      }
    }

    /// Gradient accumulation: backward inside this scope does not
    /// communicate; the next synced backward averages the accumulated sum.
    class NoSync {
     public:
      explicit NoSync(Reducer<Comm>* r) {
        if (r) guard_.emplace(*r);
      }

     private:
      std::optional<typename Reducer<Comm>::NoSyncGuard> guard_;
    };
    [[nodiscard]] NoSync no_sync() {
      return NoSync(reducer_.get());
    }

    /// Mixed precision: divides every gradient by the loss scale (through
    /// the reducer's flat buckets, which hold them all: a few large tensors,
    /// not one per parameter) and tells whether the step may be taken: false
    /// on every rank if any rank found an inf/NaN (one max all-reduce).
    bool unscale_and_check(LossScaler& scaler) {
      if (!reducer_) {
        return scaler.unscale_and_check(unique_parameters(as_module(model_)),
                                        group_, false);
      }
      std::vector<torch::Tensor> flats;
      for (const auto& b : reducer_->buckets()) flats.push_back(b.flat);
      return scaler.unscale_and_check_gradients(flats, group_, true);
    }
    double last_wait_seconds() const {
      return reducer_ ? reducer_->last_wait_seconds() : 0.0;
    }
    /// The communication hook's name (RuntimeComm's choice for it).
    std::string comm_name() const {
      if (reducer_) {
        if constexpr (requires { reducer_->comm_hook().chosen(); }) {
          return std::string(reducer_->comm_hook().chosen());
        }
      }
      return Comm::name;
    }
    /// Bytes the last synchronised step's gradient collectives carried (0 in
    /// a world of one).
    uint64_t last_step_bytes() const {
      return reducer_ ? reducer_->last_step_bytes() : 0;
    }
    /// The most bytes of gradients this rank has held at once (measured by
    /// the reducer: its bucket buffers, and gradients outside them; in a
    /// world of one, the gradients held now).
    uint64_t peak_gradient_bytes() {
      if (reducer_) return reducer_->peak_gradient_bytes();
      return held_gradient_bytes(as_module(model_));
    }

    /// Uneven inputs, as PyTorch's `Join`: every rank calls this once per
    /// round, saying whether it has a batch, and stops when it returns
    /// false. While some ranks still have batches, a rank without one takes
    /// part in their gradient all-reduces with zeros (so they average over
    /// the whole world size, PyTorch's default) and skips the step. When
    /// no rank has a batch left, the model of the last rank to run out (the
    /// lowest such rank) is broadcast to every rank, so all end identical.
    /// One one-element all-reduce per round.
    ///
    /// ```
    /// for (;;) {
    ///   auto batch = batches.next();
    ///   if (!engine.join_round(batch.has_value())) break;
    ///   if (!batch) continue;                  // joined: shadowed a step
    ///   engine.zero_grad();
    ///   engine.forward_backward(batch->data, batch->target, loss_fn);
    ///   optimizer.step();
    /// }
    /// ```
    /// Refused (UsageError, on every rank) while a rank has joined if the
    /// model has synchronised BatchNorm or broadcast_buffers is on: their
    /// collectives run in forward, which a joined rank does not run.
    /// See Note [Uneven inputs: refuse or join].
    bool join_round(bool has_batch) {
      if (group_.size() == 1) return has_batch;
      const auto active =
          dist::all_reduce_value<int64_t>(group_, has_batch ? 1 : 0);
      if (active == 0) {
        const int src = static_cast<int>(dist::all_reduce_value<int64_t>(
            group_, join_last_active_ ? group_.rank() : group_.size(),
            dist::Reduce::min));
        join_last_active_ = false;
        if (reducer_) reducer_->allow_rebuild(true);
        if (src < group_.size()) broadcast_state(src);
        return false;
      }
      if (active < group_.size()) {
        std::string why;
        if (opts_.broadcast_buffers()) why = "broadcast_buffers is on";
        for (auto& m : as_module(model_).modules()) {
          auto* bn = dynamic_cast<nn::BatchNorm2dImpl*>(m.get());
          if (bn && bn->is_synchronized()) why = "the model has SyncBatchNorm";
        }
        if (!why.empty()) {
          throw UsageError(ddpkit::detail::cat(
              "DDP join: ", group_.size() - active, " of ", group_.size(),
              " ranks have run out of batches, but ", why,
              ", whose collectives run in forward, which a joined rank does "
              "not run; give every rank the same number of batches (e.g. "
              "DistributedSampling) instead"));
        }
      }
      if (reducer_) reducer_->allow_rebuild(active == group_.size());
      join_last_active_ = has_batch;
      if (!has_batch && reducer_) reducer_->join_shadow_step();
      return true;
    }

   private:
    Comm make_hook() const {
      if constexpr (std::is_constructible_v<Comm, const CommOptions&>) {
        return Comm(opts_.comm());
      } else {
        return Comm();
      }
    }

    // Every parameter and buffer from rank `src` to all ranks.
    void broadcast_state(int src) {
      auto& m = as_module(model_);
      std::vector<torch::Tensor> state;
      for (auto& p : m.parameters()) state.push_back(p);
      for (auto& b : m.buffers()) state.push_back(b);
      broadcast_coalesced(group_, state, src);
    }

    Trace* trace_or_null() {
      return trace_ ? trace_.get() : &null_trace_;
    }

    Model model_;
    dist::Group group_;
    options_type opts_;
    torch::Device device_;
    std::unique_ptr<Trace> trace_;
    Trace null_trace_;
    std::unique_ptr<Reducer<Comm>> reducer_;
    bool join_last_active_ = false;
  };
};

/// Plain DDP (all-reduce mean in float32).
using DDP = BasicDDP<AllReduceMean>;
/// DDP with gradients sent as fp16.
using DDPFp16 = BasicDDP<Fp16Compression>;
/// DDP with gradients sent as bf16.
using DDPBf16 = BasicDDP<Bf16Compression>;
/// DDP with PowerSGD low-rank gradients (settings: DDPOptions::comm).
using DDPPowerSGD = BasicDDP<PowerSGD>;
/// DDP whose hook is chosen at run time (DDPOptions::comm().kind()).
using DDPRuntimeComm = BasicDDP<RuntimeComm>;

}  // namespace ddpkit::parallel
