// SPDX-License-Identifier: BSD-3-Clause
// ZeRO stage 2 as a parallel policy: ZeRO-1 with the gradients sharded too
// (each bucket reduced to its owner; Note [ZeRO's ownership]).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/parallel/ddp.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/zero/sharded_optimizer.hpp"
#include "ddpkit/parallel/zero/zero1.hpp"

namespace ddpkit::parallel {

// Note [ZeRO stage 2 shards the gradients in the reducer]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ZeRO stage 2 shards the gradients in the reducer (`ZeRO2`, `ZeRO2Trainer`;
// `ZeROOptions::stage(1)` gives ZeRO-1's behaviour in the same build, for
// comparisons). The engine gives the reducer each parameter's owner
// (`ReducerOptions::gradient_owners`, the optimizer's partition); buckets are
// cut where the owner changes, so each bucket has one owner, and a full
// bucket is reduced to its owner (`dist::reduce_mean_async`) instead of
// all-reduced: over the whole gradient that is a reduce-scatter at bucket
// granularity, each rank sending its gradient once. Over gloo and NCCL it is
// the backend's `reduce`; among the ranks of one host the shared-memory
// channel has only an all-reduce, so that is used (every rank reads the
// others' slices in memory; nothing crosses a link) and the non-owners drop
// their copy. After its reduce a bucket another rank owns is freed and its
// parameters' `.grad` set undefined; it is allocated again when the next
// backward's first gradient of it arrives (that gradient is copied in; the
// bucket's other parameters get their views at once, so autograd accumulates
// in place). So between steps a rank holds only its own buckets (the test
// checks: exactly the bytes of the parameters it steps), and during backward
// at most `unowned_buckets_in_flight` (2) others' while gradients arrive in
// bucket order: when a third is needed, backward first waits for the oldest
// launched one's reduce and frees it (bounded memory for a little less
// overlap). Only a launched bucket can be waited for (one that has not
// launched waits for gradients the same backward makes later), and buckets
// launch in index order, so when gradients arrive out of bucket order more
// are held: in the first step of a model with branches, tied weights or
// modules registered in another order than they run, before the rebuild in
// arrival order; with `rebuild_buckets(false)`; and when the order changes
// between steps. From the second step of a model whose backward keeps its
// order, the bound holds (the reducer's Note [ZeRO-2's buckets in flight];
// the test measures both on a branching model with a tied weight, 12 layers,
// a bucket per layer, world 2: 5 held in its first step at a limit of 1 or 2,
// then 1 or 2). ZeRO-2's default bucket cap is 4 MiB (DDP's 25 MiB default
// would let two others' buckets cost 50 MiB; a value set explicitly is kept).
// Rebuilding the buckets in arrival order still applies (cut at owners). What
// reads gradients changes with them: clipping by global norm goes through the
// engine (`clip_grad_norm`: each rank's sum of its gradients' norms to the
// p-th power, one all-reduce, each rank scales its shard; the Trainer calls
// it when the engine has it), AMP unscales only the rank's own buckets and
// the ranks agree on overflow as before, and the Trainer's finiteness check
// (each rank its shard) is already agreed across ranks. Under gradient
// accumulation the no_sync micro-steps accumulate whole local gradients
// (autograd's own tensors for parameters a rank does not own) until the
// synchronised step, as DDP does: the memory saving is between steps and in
// the synchronised backward, not during accumulation. Only the plain mean:
// ZeRO2 takes no communication hook (compression would need the hook to
// reduce, not all-reduce) and refuses a `DDPOptions::comm().kind()` other
// than `allreduce`, naming `BasicZeRO1<Hook>` (ZeRO-1 over DDP's hooks). Tied
// weights: libtorch's `parameters()` lists a tensor registered under two
// names twice; the partition, the optimizer's shards and the consolidated
// state take each tensor once (`unique_parameters`), and the reducer's owners
// give every entry its tensor's owner. Joined ranks (uneven inputs) allocate
// each bucket for their shadow step and free it after.

/// ZeRO2's settings: DDP's, and which stage.
struct ZeROOptions : DDPOptions {
  ZeROOptions() = default;
  /// DDP's settings, at stage 2.
  ZeROOptions(DDPOptions ddp) : DDPOptions(std::move(ddp)) {}  // NOLINT
  /// 2: the gradients are sharded too (each bucket reduced to its owner);
  /// 1: only the optimizer state (the gradients all-reduced whole, as
  /// ZeRO1 does) — a run-time switch, so one build can compare the two.
  TORCH_ARG(int, stage) = 2;
};

/// ZeRO stage 2: ZeRO-1 plus sharded gradients. Each gradient bucket is
/// reduced to the rank that owns its parameters (the same partition as the
/// optimizer's; buckets never span two owners) while backward runs, and the
/// other ranks free it: between steps a rank holds only its own gradients
/// (about 1/world), and during backward at most
/// `ReducerOptions::unowned_buckets_in_flight` buckets of others' while
/// gradients arrive in bucket order: from the second step on for a model
/// whose backward keeps its order; more before that (see the reducer's
/// Note [ZeRO-2's buckets in flight]). Usable
/// wherever DDP is: `Trainer<Model, ZeRO2, DistributedSampling, SyncBN>`.
///
/// What differs from DDP for code that reads gradients: after a step's
/// backward, `.grad` of a parameter another rank owns is undefined. The
/// Trainer clips by global norm through `clip_grad_norm` (the norm is
/// computed across the shards), and the AMP and finiteness checks agree
/// across ranks. Gradients are averaged with the plain mean only (no
/// compression hook). Under gradient accumulation (no_sync) the micro-
/// steps' gradients are held whole until the synchronised step, as in DDP.
struct ZeRO2 {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = true;
  static constexpr bool is_multi_replica = false;
  static constexpr const char* name = "zero2";
  using options_type = ZeROOptions;
  using comm_type = AllReduceMean;

  /// The mode's name at ZeROOptions::stage `stage`: "zero1" at 1, else
  /// "zero2" (what summary.json and the examples call it).
  static constexpr const char* name_of_stage(int stage) {
    return stage == 1 ? BasicZeRO1<AllReduceMean>::name : name;
  }

  /// The bucket cap ZeRO-2 uses where DDPOptions sets none.
  static constexpr int64_t kBucketCapBytes = int64_t{4} << 20;
  /// The bucket cap ZeRO-2 runs with under `r`: the one set there, else
  /// kBucketCapBytes.
  static int64_t bucket_cap(const ReducerOptions& r) {
    return r.bucket_cap_set() ? r.bucket_cap_bytes() : kBucketCapBytes;
  }

  template <class Model>
  class engine : public BasicZeRO1<AllReduceMean>::template engine<Model> {
    using base = typename BasicZeRO1<AllReduceMean>::template engine<Model>;

   public:
    /// ZeRO-1's, the norm clipped across gradient shards, and a mode name
    /// by stage (Note [Engine capabilities]).
    using capabilities =
        typename base::capabilities::template with<capability::clips_globally,
                                                   capability::names_mode>;
    engine(Model model, dist::Group group, options_type opts,
           torch::Device device)
        : engine(with_owners(model, group, opts), std::move(model),
                 std::move(group), device) {
      stage_ = opts.stage();
    }

    /// "zero2", or "zero1" when ZeROOptions::stage is 1 (what summary.json
    /// calls the mode).
    const char* mode_name() const {
      return name_of_stage(stage_);
    }

    /// Mixed precision: unscales this rank's gradient shard; the ranks
    /// agree on whether any shard overflowed.
    bool unscale_and_check(LossScaler& scaler) {
      auto* r = this->reducer();
      if (!r) return base::unscale_and_check(scaler);
      std::vector<torch::Tensor> flats;
      for (const auto& b : r->buckets()) {
        if (b.flat.defined()) flats.push_back(b.flat);
      }
      return scaler.unscale_and_check_gradients(flats, this->group(), true);
    }

    /// PyTorch's clip_grad_norm_ over the whole model's averaged gradients,
    /// which are sharded: each rank sums its own gradients' norms (to the
    /// power `norm_type`; the maximum for inf), one all-reduce adds them,
    /// and each rank scales its shard by max_norm / (total + 1e-6) when
    /// that is below 1. Returns the total norm (the same on every rank).
    double clip_grad_norm(double max_norm, double norm_type = 2.0) {
      auto& m = as_module(this->module());
      if (stage_ == 1 || !this->reducer()) {  // every gradient is here
        return torch::nn::utils::clip_grad_norm_(unique_parameters(m), max_norm,
                                                 norm_type);
      }
      std::vector<torch::Tensor> grads;
      for (const auto& p : unique_parameters(m)) {
        if (p.grad().defined()) grads.push_back(p.grad());
      }
      return clip_sharded_grad_norm(this->group(), std::move(grads), max_norm,
                                    norm_type);
    }

   private:
    // DDP's options with every parameter's gradient owner: the optimizer's
    // partition (partition_parameters over the module's parameters, each
    // tensor once), given to every entry of parameters().
    // See Note [ZeRO's ownership] (sharded_optimizer.hpp).
    static DDPOptions with_owners(Model& model, const dist::Group& group,
                                  const options_type& zero) {
      if (zero.stage() != 1 && zero.stage() != 2) {
        throw UsageError(ddpkit::detail::cat(
            "ZeROOptions::stage is ", zero.stage(), "; expected 1 or 2"));
      }
      if (zero.comm().kind() != CommKind::allreduce) {
        const char* names[] = {"allreduce", "fp16", "bf16", "powersgd"};
        throw UsageError(ddpkit::detail::cat(
            "ZeRO2: DDPOptions::comm().kind() is ",
            names[static_cast<int>(zero.comm().kind())],
            "; ZeRO2 averages gradients in float32 only (at stage 2 each "
            "bucket is reduced to its owner). For compressed gradients with "
            "the optimizer state sharded use BasicZeRO1<RuntimeComm> (or "
            "BasicZeRO1<Fp16Compression>, <Bf16Compression>, <PowerSGD>)"));
      }
      DDPOptions opts = zero;
      if (zero.stage() == 1) return opts;
      // A bucket of others' gradients is memory held beyond the shard:
      // 4 MiB here unless a cap was set (any set cap is kept, 25 MiB too).
      opts.reducer().bucket_cap_bytes(bucket_cap(opts.reducer()));
      // The optimizer's partition is over each tensor once; the reducer
      // takes an owner per entry of parameters() (a tied weight's every
      // entry gets its tensor's owner).
      const auto unique = unique_parameters(as_module(model));
      const auto owner_of_unique = partition_parameters(unique, group.size());
      std::vector<int> owners;
      for (const auto& p : as_module(model).parameters()) {
        std::size_t k = 0;
        while (!unique[k].is_same(p)) ++k;
        owners.push_back(owner_of_unique[k]);
      }
      opts.reducer().gradient_owners(std::move(owners));
      return opts;
    }
    // (Reference parameters: nothing is moved before `with_owners` has
    // read the model, whatever order the arguments above are evaluated in.)
    engine(DDPOptions opts, Model&& model, dist::Group&& group,
           torch::Device device)
        : base(std::move(model), std::move(group), std::move(opts), device) {}

    int stage_ = 2;
  };
};

}  // namespace ddpkit::parallel
