// SPDX-License-Identifier: BSD-3-Clause
// ZeRO stage 3 as a parallel policy: the parameters themselves sharded
// across the ranks by unit (nn::Unit), gathered just before a unit runs and
// freed after it, in forward and again in backward; each unit's gradients
// reduce-scattered when they are ready; the optimizer steps only the shard.
// See Note [ZeRO-3's parameter lifecycle].
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>
#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/inputs.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/nn/unit.hpp"
#include "ddpkit/parallel/autograd_hooks.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/grad_comm.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/zero/zero3_optimizer.hpp"

namespace ddpkit::parallel {

// Note [ZeRO-3's parameter lifecycle]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ZeRO-3's parameter lifecycle. When the engine is built, the model's
// parameters are split by unit: each parameter belongs to the innermost
// module marked `nn::Unit` that holds it (Note [Units are marked at the
// call site]), or to the root unit (the model itself) when none does, or
// when two units that do not nest hold it (a tied weight must be whole
// whenever either runs; the root is gathered for the whole step). Per
// unit, its parameters are laid end to end in one flat buffer padded to a
// multiple of the world size, and every parameter is re-pointed
// (`set_data`) at its slice: the parameter tensors the module, autograd and
// the user hold stay the same objects. Rank r keeps slice r of the buffer
// as its *shard*, a leaf tensor of its own: the optimizer is built over the
// shards (elementwise optimizers — SGD, Adam, AdamW, RMSprop, Adagrad —
// give on a flat slice what they give per parameter; the padding stays
// zero). The buffer's memory is then released in place: its StorageImpl
// keeps its identity and its data pointer is set to null (as FSDP1 resizes
// storage to 0), so every parameter, every view of one and every tensor
// autograd saved of one stays valid, and a read while it is released is
// libtorch's error "The tensor has a non-zero number of elements, but its
// data is not allocated yet" rather than a stale value. Gathering
// re-allocates the same StorageImpl and all-gathers the shards into it
// (dist::all_gather_into). Writing it does not touch the parameters'
// version counters (set_data keeps each parameter's own), so autograd's
// checks still catch a user's in-place change of a parameter between
// forward and backward.
//   Forward: the root unit is gathered when the engine's forward starts;
// each unit's call gathers it, runs it and (reshard_after_forward, the
// default) frees it, and hooks the output's gradient: when backward reaches
// the unit's output the hook gathers it again, before any of the unit's own
// backward runs. Backward: a post-hook on each parameter's AccumulateGrad
// counts the unit's parameters whose gradient is complete (autograd calls
// it once all uses of the parameter are differentiated, so when the last of
// a unit's parameters reports, no node left needs its values); the unit's
// gradients are then laid into a flat buffer, reduce-scattered into means
// (dist::reduce_scatter_mean: a reduce to each part's owner over gloo, each
// rank sending the buffer once; the shared-memory channel's all-reduce among
// ranks of one host), this rank's part added to its shard's gradient, and
// the unit's parameters and full gradients freed. Units whose parameters
// did not all get a gradient (unused in this step, frozen) are reduced when
// backward returns, in unit order, with zeros for the missing ones: every
// rank must use the same parameters in a step (as DDP without
// find_unused_parameters). Under no_sync the gradients stay whole in
// `.grad` and are reduced at the next synchronised backward. Evaluation
// (no grad) gathers and frees each unit around its call. Buffers (batch
// norm statistics) are not sharded: broadcast from rank 0 when the engine
// is built, as in DDP. Between steps a rank holds its shards, the root
// unit's parameters only during a step, and at most one non-root unit
// whole at a time in forward (two where units nest) — measured by the
// tests.
//   Prefetch (ZeRO3Options::prefetch, on by default): each step records the
// units it gathers, in order, separately for forward (unit calls) and
// backward (output hooks; nested units make backward's order other than
// forward's reversed). From the next step on, when the k-th gather of a
// phase is the unit recorded k-th, the unit recorded after it is gathered
// asynchronously while this one computes; the next gather waits for it
// (and for any other gather in flight first: one at a time, issued in the
// same order on every rank). A model whose order changes prefetches a
// unit it does not use next: correct, with one unit more held until it is
// used or the step ends; the record is replaced at the step's end. Not
// yet: a separate parameter or reduce dtype (bf16-mixed).
// Checkpoints: Note [ZeRO-3's checkpoints].

/// ZeRO3's settings.
struct ZeRO3Options {
  /// Free each unit's parameters after its forward and gather them again
  /// in backward (the memory saving); false keeps them until the unit's
  /// backward is done (one gather per step, more memory).
  TORCH_ARG(bool, reshard_after_forward) = true;
  /// Broadcast rank 0's buffers (e.g. BatchNorm running stats) before every
  /// forward in training mode.
  TORCH_ARG(bool, broadcast_buffers) = false;
  /// Gather the next unit (in the order the previous step used them)
  /// while the current one computes, in forward and in backward.
  TORCH_ARG(bool, prefetch) = true;
};

namespace detail {

/// Releases `t`'s storage in place: the StorageImpl stays (every tensor on
/// it stays valid) and holds no memory.
inline void release_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(c10::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

/// Gives `t`'s released storage `nbytes` of new memory, from its allocator.
inline void regrow_storage(const torch::Tensor& t, std::size_t nbytes) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

}  // namespace detail

/// ZeRO stage 3: parameters, gradients and optimizer state sharded across
/// the ranks by unit (Note [ZeRO-3's parameter lifecycle]). The model marks
/// its units with `nn::Unit`; without any, the whole model is one unit
/// (sharded between steps, whole during each). Usable wherever ZeRO2 is:
/// `Trainer<Model, ZeRO3, DistributedSampling>`.
struct ZeRO3 {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = true;
  static constexpr bool is_multi_replica = false;
  static constexpr const char* name = "zero3";
  using options_type = ZeRO3Options;
  using comm_type = AllReduceMean;

  template <class Model>
  class engine : private nn::detail::UnitCalls {
   public:
    /// See Note [Engine capabilities].
    using capabilities = ::ddpkit::parallel::capabilities<
        capability::takes_inputs, capability::shards_optimizer,
        capability::clips_globally, capability::measures_gradients,
        capability::shards_parameters>;

    engine(Model model, dist::Group group, options_type opts,
           torch::Device device)
        : model_(std::move(model)),
          group_(std::move(group)),
          opts_(std::move(opts)),
          device_(device) {
      auto& m = as_module(model_);
      m.to(device_);
      verify_same_structure(group_, m);
      if (group_.size() > 1) {
        // Ranks that initialised differently start identical: the buffers
        // here, the parameters unit by unit as they are flattened (one
        // unit's bytes at a time, not the whole model's again).
        broadcast_coalesced(group_, m.buffers(), 0);
      }
      build_units();
      install_hooks();
    }
    engine(const engine&) = delete;
    engine& operator=(const engine&) = delete;
    ~engine() {
      if (target_) *target_ = nullptr;
      for (std::size_t i = 0; i < accumulators_.size(); ++i) {
        try {
          accumulators_[i]->del_post_hook(hook_keys_[i]);
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

    /// Forward. With grad mode on, a step begins: the root unit is
    /// gathered until its backward; each unit is gathered for its call.
    torch::Tensor forward(const data::Inputs& x) {
      auto& m = as_module(model_);
      if (opts_.broadcast_buffers() && m.is_training() && group_.size() > 1) {
        broadcast_coalesced(group_, m.buffers(), 0);
      }
      const bool grad = torch::GradMode::is_enabled();
      if (grad) begin_step();
      nn::detail::ActiveUnitCalls active(this);
      gather(0, grad ? kForward : kNoPhase);
      torch::Tensor out = data::forward_inputs(model_, x);
      if (!grad && !holding()) free_all();
      return out;
    }

    template <class LossFn>
    StepOutput forward_backward(const data::Inputs& x, const torch::Tensor& y,
                                LossFn&& loss_fn) {
      torch::Tensor out = forward(x);
      torch::Tensor loss = loss_fn(out, y);
      try {
        loss.backward();
      } catch (...) {
        if (!holding()) free_all();
        in_step_ = false;
        throw;
      }
      finish_backward();
      return {loss.detach(), out.detach()};
    }

    /// After a backward the engine did not run itself (`forward`, then the
    /// caller's `loss.backward()`): reduces what is left and frees every
    /// unit. forward_backward calls it.
    void finish_backward() {
      if (!in_step_) return;
      torch::NoGradGuard no_grad;
      for (std::size_t u = 0; u < units_.size(); ++u) {
        if (!units_[u].reduced) reduce_unit(u);
      }
      if (!holding()) free_all();
      in_step_ = false;
      // This step's order is the next step's prefetch plan.
      for (int phase : {kForward, kBackward}) {
        planned_[phase].swap(seen_[phase]);
      }
    }

    /// Before each step: every gradient (shards' and parameters') to None.
    void zero_grad() {
      for (auto& u : units_) {
        if (u.shard.grad().defined()) u.shard.mutable_grad() = torch::Tensor();
        for (auto& p : u.params) {
          if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
        }
      }
    }

    /// Gradient accumulation: backward inside this scope keeps whole
    /// gradients in `.grad`; the next synchronised backward reduces the
    /// sum.
    class NoSync {
     public:
      explicit NoSync(engine& e) : e_(e), was_(e.sync_) {
        e_.sync_ = false;
      }
      NoSync(const NoSync&) = delete;
      NoSync& operator=(const NoSync&) = delete;
      ~NoSync() {
        e_.sync_ = was_;
      }

     private:
      engine& e_;
      bool was_;
    };
    [[nodiscard]] NoSync no_sync() {
      return NoSync(*this);
    }

    /// The Trainer's optimizer: `make` builds the user's optimizer over
    /// this rank's shards (one flat tensor per unit), wrapped so that its
    /// checkpoints hold the whole per-parameter state (Zero3Optimizer).
    template <class Factory>
    std::unique_ptr<torch::optim::Optimizer> make_optimizer(Factory make) {
      std::vector<Zero3Layout> layout;
      for (const auto& u : units_) {
        layout.push_back({u.shard, u.params, u.offsets, u.padded});
      }
      auto opt = std::make_unique<Zero3Optimizer>(
          unique_parameters(as_module(model_)), std::move(layout),
          Zero3Optimizer::Factory(std::move(make)), group_);
      optimizer_ = opt.get();
      return opt;
    }
    /// This rank's shards, one per unit with parameters (what the optimizer
    /// steps; their gradients are the reduced means).
    std::vector<torch::Tensor> shards() const {
      std::vector<torch::Tensor> out;
      for (const auto& u : units_) out.push_back(u.shard);
      return out;
    }
    /// Every rank, before rank 0 writes a checkpoint: the optimizer's
    /// whole per-parameter state on rank 0 (Note [ZeRO-3's checkpoints]).
    /// The parameters are gathered too and stay whole until the next
    /// training forward (rank 0 writes them).
    void consolidate_optimizer() {
      if (optimizer_) optimizer_->consolidate(0);
      for (std::size_t u = 0; u < units_.size(); ++u) gather(u);
      held_for_checkpoint_ = true;
    }
    /// Bytes of optimizer state this rank keeps.
    uint64_t optimizer_state_bytes() const {
      return optimizer_ ? optimizer_->state_bytes() : 0;
    }
    /// The largest unit's whole buffer (bytes): what one gather allocates.
    uint64_t gather_buffer_bytes() const {
      uint64_t most = 0;
      for (const auto& u : units_) most = std::max(most, u.full_bytes());
      return most;
    }

    /// Mixed precision: unscales the shards' gradients; the ranks agree on
    /// whether any overflowed.
    bool unscale_and_check(LossScaler& scaler) {
      return scaler.unscale_and_check(shards(), group_, group_.size() > 1);
    }
    /// PyTorch's clip_grad_norm_ over the whole model's gradients, which
    /// are sharded: each rank's sum of its shards' norms to the power
    /// `norm_type` (the maximum for inf), one all-reduce, each rank scales
    /// its shards. Returns the total norm (the same on every rank).
    double clip_grad_norm(double max_norm, double norm_type = 2.0) {
      std::vector<torch::Tensor> grads;
      for (const auto& u : units_) {
        if (u.shard.grad().defined()) grads.push_back(u.shard.grad());
      }
      return clip_sharded_grad_norm(group_, std::move(grads), max_norm,
                                    norm_type);
    }

    /// Seconds the last forward and backward spent in gradient
    /// reductions.
    double last_wait_seconds() const {
      return last_comm_seconds_;
    }
    /// Seconds the last forward and backward waited for parameters to be
    /// gathered (blocking gathers, and prefetches not done in time).
    double last_gather_seconds() const {
      return last_gather_seconds_;
    }
    /// The most bytes of gradients (whole and sharded) held at once.
    uint64_t peak_gradient_bytes() const {
      return peak_grad_bytes_;
    }
    /// The most bytes of parameters held whole at once (gathered units).
    uint64_t peak_gathered_bytes() const {
      return peak_gathered_bytes_;
    }
    /// Starts the peaks (gathered parameters, gradients) afresh.
    void reset_peaks() {
      peak_gathered_bytes_ = gathered_bytes_;
      peak_grad_bytes_ = 0;
    }
    /// Gathers started ahead of their unit's use so far.
    uint64_t prefetches() const {
      return prefetches_;
    }
    /// Bytes of parameters held whole now (gathered units).
    uint64_t gathered_bytes() const {
      return gathered_bytes_;
    }
    /// Bytes of this rank's shards (the parameters it keeps between steps).
    uint64_t shard_bytes() const {
      uint64_t n = 0;
      for (const auto& u : units_) n += u.shard.nbytes();
      return n;
    }
    /// The units: their names ("" the root) and parameter counts.
    std::vector<std::pair<std::string, int64_t>> units() const {
      std::vector<std::pair<std::string, int64_t>> out;
      for (const auto& u : units_) out.emplace_back(u.name, u.numel);
      return out;
    }
    /// What whole_parameters returns.
    class WholeParameters {
     public:
      WholeParameters(engine& e, bool write_back)
          : e_(e), write_back_(write_back) {
        for (std::size_t u = 0; u < e_.units_.size(); ++u) {
          was_.push_back(e_.units_[u].gathered);
          e_.gather(u);
        }
        ++e_.holds_;
      }
      WholeParameters(const WholeParameters&) = delete;
      WholeParameters& operator=(const WholeParameters&) = delete;
      ~WholeParameters() {
        --e_.holds_;
        if (write_back_) e_.write_back();
        if (e_.holding()) return;
        for (std::size_t u = 0; u < e_.units_.size(); ++u) {
          if (!was_[u]) e_.free(u);
        }
      }

     private:
      engine& e_;
      bool write_back_;
      std::vector<bool> was_;
    };

    /// Every rank: gathers every unit (the whole model's parameters
    /// readable, and no gather or free in forward) until the returned
    /// object goes; then the units it gathered are freed. `write_back`:
    /// values written into the parameters meanwhile (a checkpoint loaded)
    /// are kept: each rank copies its part into its shards.
    [[nodiscard]] std::unique_ptr<WholeParameters> whole_parameters(
        bool write_back = false) {
      return std::make_unique<WholeParameters>(*this, write_back);
    }

   private:
    struct UnitState {
      std::string name;
      const torch::nn::Module* module = nullptr;
      std::vector<torch::Tensor> params;  // each tensor once
      std::vector<int64_t> offsets;
      int64_t numel = 0, padded = 0;
      torch::Tensor full;   // flat, padded; storage released unless gathered
      torch::Tensor shard;  // this rank's slice, a leaf of its own
      bool gathered = false;
      bool reduced = true;
      std::size_t pending = 0, trainable = 0;
      uint64_t full_bytes() const {
        return static_cast<uint64_t>(padded) * full.element_size();
      }
    };

    // Splits the parameters by unit; see Note [ZeRO-3's parameter
    // lifecycle].
    void build_units() {
      auto& m = as_module(model_);
      struct Found {
        std::string name;
        const torch::nn::Module* module;
      };
      std::vector<Found> found{{"", &m}};
      for (const auto& item : m.named_modules("", /*include_self=*/false)) {
        if (nn::is_unit(*item.value())) {
          found.push_back({item.key(), item.value().get()});
        }
      }
      auto nested_in = [](const std::string& inner, const std::string& outer) {
        return outer.empty() || inner == outer ||
               (inner.size() > outer.size() &&
                inner.compare(0, outer.size(), outer) == 0 &&
                inner[outer.size()] == '.');
      };
      // Each unique parameter's unit: the innermost unit holding every
      // module it is registered in (a weight tied across two units, or a
      // unit and its parent, belongs to the unit enclosing both; the root
      // at worst).
      const auto unique = unique_parameters(m);
      std::vector<std::vector<std::string>> where(unique.size());
      for (const auto& item : m.named_parameters()) {
        const auto& name = item.key();
        const auto dot = name.rfind('.');
        const std::string mod =
            dot == std::string::npos ? "" : name.substr(0, dot);
        for (std::size_t i = 0; i < unique.size(); ++i) {
          if (unique[i].is_same(item.value())) {
            where[i].push_back(mod);
            break;
          }
        }
      }
      std::vector<std::size_t> owner(unique.size(), 0);
      for (std::size_t i = 0; i < unique.size(); ++i) {
        for (std::size_t f = 1; f < found.size(); ++f) {
          bool holds_all = true;
          for (const auto& mod : where[i]) {
            holds_all = holds_all && nested_in(mod, found[f].name);
          }
          // Deeper units come later in named_modules' order.
          if (holds_all && nested_in(found[f].name, found[owner[i]].name)) {
            owner[i] = f;
          }
        }
      }
      const int w = group_.size(), r = group_.rank();
      std::vector<std::size_t> unit_of_found(found.size(), SIZE_MAX);
      for (std::size_t f = 0; f < found.size(); ++f) {
        UnitState u;
        u.name = found[f].name;
        u.module = found[f].module;
        for (std::size_t i = 0; i < unique.size(); ++i) {
          if (owner[i] == f) u.params.push_back(unique[i]);
        }
        if (u.params.empty() && f != 0) continue;
        for (const auto& p : u.params) {
          if (!p.is_non_overlapping_and_dense()) {
            throw UsageError(ddpkit::detail::cat(
                "ZeRO3: a parameter of unit '",
                u.name.empty() ? "(root)" : u.name, "' (sizes ", p.sizes(),
                ", strides ", p.strides(),
                ") is not dense; ZeRO-3 lays each parameter in a flat "
                "buffer as its memory lies (contiguous or channels-last)"));
          }
          if (p.scalar_type() != u.params[0].scalar_type()) {
            throw UsageError(ddpkit::detail::cat(
                "ZeRO3: unit '", u.name.empty() ? "(root)" : u.name,
                "' mixes parameter dtypes (", u.params[0].scalar_type(),
                " and ", p.scalar_type(),
                "); a unit's parameters share one flat buffer"));
          }
          u.offsets.push_back(u.numel);
          u.numel += p.numel();
        }
        const int64_t chunk = std::max<int64_t>(1, (u.numel + w - 1) / w);
        u.padded = chunk * w;
        auto opts = u.params.empty()
                        ? torch::TensorOptions().device(device_)
                        : u.params[0].options().requires_grad(false);
        {
          torch::NoGradGuard no_grad;
          u.full = torch::zeros({u.padded}, opts);
          for (std::size_t k = 0; k < u.params.size(); ++k) {
            auto& p = u.params[k];
            auto view = detail::param_view(u.full, u.offsets[k], p);
            view.copy_(p.detach());
            p.set_data(view);
            if (p.requires_grad()) ++u.trainable;
          }
          if (w > 1) dist::broadcast(group_, u.full, 0);
          u.shard = u.full.narrow(0, r * chunk, chunk).clone();
        }
        u.shard.set_requires_grad(u.trainable > 0);
        detail::release_storage(u.full);
        unit_of_found[f] = units_.size();
        units_.push_back(std::move(u));
      }
      for (std::size_t f = 0; f < found.size(); ++f) {
        if (unit_of_found[f] != SIZE_MAX) {
          unit_index_[found[f].module] = unit_of_found[f];
        }
      }
    }

    void install_hooks() {
      target_ = std::make_shared<detail::AccumulatedHook::Callback>(
          [this](std::size_t i) { on_accumulated(i); });
      for (std::size_t u = 0; u < units_.size(); ++u) {
        for (const auto& p : units_[u].params) {
          if (!p.requires_grad()) continue;
          auto acc = torch::autograd::impl::grad_accumulator(p);
          if (!acc) {
            throw Error(
                "ZeRO3: a parameter is not a leaf tensor (it has a grad_fn)");
          }
          hook_keys_.push_back(
              acc->add_post_hook(std::make_unique<detail::AccumulatedHook>(
                  target_, param_unit_.size())));
          param_unit_.push_back(u);
          accumulators_.push_back(std::move(acc));
        }
      }
    }

    void begin_step() {
      for (auto& seen : seen_) seen.clear();
      if (held_for_checkpoint_ && holds_ == 0) {
        held_for_checkpoint_ = false;
        free_all();
      }
      if (in_step_ && !holding()) {
        // A forward whose backward never ran (or threw): start afresh.
        free_all();
      }
      for (auto& u : units_) {
        u.pending = u.trainable;
        u.reduced = u.trainable == 0;
      }
      in_step_ = true;
      last_comm_seconds_ = 0;
      last_gather_seconds_ = 0;
    }

    void on_accumulated(std::size_t i) {
      if (!in_step_) return;
      const std::size_t u = param_unit_[i];
      auto& unit = units_[u];
      note_gradients();
      if (unit.pending == 0 || --unit.pending > 0) return;
      torch::NoGradGuard no_grad;
      reduce_unit(u);
      if (!holding()) free(u);
    }

    // The unit's gradients, reduced into means, this rank's part added to
    // its shard's gradient; the whole gradients freed. Under no_sync: kept
    // whole for the next synchronised backward.
    void reduce_unit(std::size_t u) {
      auto& unit = units_[u];
      if (!sync_ || unit.reduced) return;
      unit.reduced = true;
      if (unit.trainable == 0) return;
      const auto t0 = std::chrono::steady_clock::now();
      auto flat = torch::zeros({unit.padded}, unit.full.options());
      for (std::size_t k = 0; k < unit.params.size(); ++k) {
        auto& p = unit.params[k];
        if (!p.grad().defined()) continue;
        detail::param_view(flat, unit.offsets[k], p).copy_(p.grad());
      }
      note_gradients(static_cast<uint64_t>(flat.nbytes()));
      for (auto& p : unit.params) {
        if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
      }
      dist::reduce_scatter_mean(group_, flat);
      const int64_t chunk = unit.padded / group_.size();
      auto mine = flat.narrow(0, group_.rank() * chunk, chunk);
      if (unit.shard.grad().defined()) {
        unit.shard.mutable_grad().add_(mine);
      } else {
        unit.shard.mutable_grad() = mine.clone();
      }
      last_comm_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
    }

    // Gathers unit `u`, waiting for it (and for any gather in flight
    // first). `phase` kForward or kBackward: a step's gather, recorded, and
    // the unit planned next prefetched.
    void gather(std::size_t u, int phase = kNoPhase) {
      settle_gather();
      if (!units_[u].gathered) {
        start_gather(u);
        settle_gather();
      }
      if (phase == kNoPhase || !in_step_) return;
      const std::size_t k = seen_[phase].size();
      seen_[phase].push_back(u);
      const auto& plan = planned_[phase];
      if (!opts_.prefetch() || group_.size() == 1 || k + 1 >= plan.size() ||
          plan[k] != u) {
        return;
      }
      if (!units_[plan[k + 1]].gathered) {
        start_gather(plan[k + 1]);  // waited for at its use
        ++prefetches_;
      }
    }

    // Starts gathering unit `u` (not whole) into its regrown buffer; it is
    // whole once `settle_gather` has waited. One gather in flight at a
    // time.
    void start_gather(std::size_t u) {
      auto& unit = units_[u];
      detail::regrow_storage(unit.full, unit.full_bytes());
      torch::NoGradGuard no_grad;
      inflight_work_ =
          dist::all_gather_into_async(group_, unit.shard, unit.full);
      inflight_unit_ = u;
      unit.gathered = true;
      gathered_bytes_ += unit.full_bytes();
      peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
    }

    // Waits for the gather in flight, if any.
    void settle_gather() {
      if (inflight_unit_ == SIZE_MAX) return;
      const auto t0 = std::chrono::steady_clock::now();
      auto work = std::move(inflight_work_);
      inflight_unit_ = SIZE_MAX;
      if (work) dist::detail::wait(group_, work, "all_gather");
      last_gather_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
    }

    void free(std::size_t u) {
      if (inflight_unit_ == u) settle_gather();
      auto& unit = units_[u];
      if (!unit.gathered) return;
      detail::release_storage(unit.full);
      unit.gathered = false;
      gathered_bytes_ -= unit.full_bytes();
    }

    void free_all() {
      settle_gather();
      for (std::size_t u = 0; u < units_.size(); ++u) free(u);
    }

    // Whole parameters are held (whole_parameters, a checkpoint): forward
    // neither gathers nor frees.
    bool holding() const {
      return holds_ > 0 || held_for_checkpoint_;
    }

    // Each rank's part of the (gathered) parameters into its shards.
    void write_back() {
      torch::NoGradGuard no_grad;
      const int r = group_.rank();
      for (auto& u : units_) {
        const int64_t chunk = u.padded / group_.size();
        u.shard.detach().copy_(u.full.narrow(0, r * chunk, chunk));
      }
    }

    // Gradient bytes held now (whole `.grad`s, shards' gradients, plus
    // `extra` in flight), kept as the peak.
    void note_gradients(uint64_t extra = 0) {
      uint64_t n = extra;
      for (const auto& u : units_) {
        if (u.shard.grad().defined()) n += u.shard.grad().nbytes();
        for (const auto& p : u.params) {
          if (p.grad().defined()) n += p.grad().nbytes();
        }
      }
      peak_grad_bytes_ = std::max(peak_grad_bytes_, n);
    }

    std::size_t unit_of(const torch::nn::Module& m) const {
      auto it = unit_index_.find(&m);
      return it == unit_index_.end() ? SIZE_MAX : it->second;
    }

    // nn::detail::UnitCalls: around a unit's call in forward.
    void before_unit(const torch::nn::Module& m) override {
      const auto u = unit_of(m);
      if (u != SIZE_MAX) {
        gather(u, torch::GradMode::is_enabled() ? kForward : kNoPhase);
      }
    }
    torch::Tensor after_unit(const torch::nn::Module& m,
                             torch::Tensor out) override {
      const auto u = unit_of(m);
      if (u == SIZE_MAX || u == 0 || holding()) return out;
      if (!torch::GradMode::is_enabled()) {
        free(u);
        return out;
      }
      if (!opts_.reshard_after_forward()) return out;
      if (!out.requires_grad()) return out;  // no backward through it
      free(u);
      out.register_hook(
          [this, u](const torch::Tensor&) { gather(u, kBackward); });
      return out;
    }
    void keep_unit(const torch::nn::Module& /*unit*/) override {}

    Model model_;
    dist::Group group_;
    options_type opts_;
    torch::Device device_;
    std::vector<UnitState> units_;
    std::unordered_map<const torch::nn::Module*, std::size_t> unit_index_;
    std::shared_ptr<detail::AccumulatedHook::Callback> target_;
    std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;
    std::vector<std::size_t> param_unit_;
    std::vector<uintptr_t> hook_keys_;
    Zero3Optimizer* optimizer_ = nullptr;
    int holds_ = 0;
    bool held_for_checkpoint_ = false;
    bool sync_ = true;
    bool in_step_ = false;
    double last_comm_seconds_ = 0;    // gradient reductions this step
    double last_gather_seconds_ = 0;  // waiting for gathers this step
    uint64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0;
    uint64_t peak_grad_bytes_ = 0;
    // Prefetch: the units each phase gathered this step, in order, and
    // the previous step's (the plan); the gather in flight.
    static constexpr int kNoPhase = -1, kForward = 0, kBackward = 1;
    std::vector<std::size_t> seen_[2], planned_[2];
    dist::compat::WorkPtr inflight_work_;
    std::size_t inflight_unit_ = SIZE_MAX;
    uint64_t prefetches_ = 0;
  };
};

}  // namespace ddpkit::parallel
