// SPDX-License-Identifier: BSD-3-Clause
// ZeRO stage 1 as a parallel policy: DDP's engine with the optimizer state
// sharded (sharded_optimizer.hpp; Note [ZeRO's ownership]).
#pragma once

#include <cstdint>
#include <memory>
#include <utility>

#include <torch/torch.h>

#include "ddpkit/parallel/ddp.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/zero/sharded_optimizer.hpp"

namespace ddpkit::parallel {

/// ZeRO stage 1 as a parallel policy: DDP's engine (same reducer, hooks,
/// SyncBN, accumulation, join) whose optimizer the Trainer makes through
/// `make_optimizer`, sharded across the ranks (see ShardedOptimizer).
/// Usable wherever DDP is: `Trainer<Model, ZeRO1, DistributedSampling,
/// SyncBN>`.
template <comm_hook Comm = AllReduceMean>
struct BasicZeRO1 {
  using parallel_concept = parallel_tag;
  static constexpr bool is_multi_process = true;
  static constexpr bool is_multi_replica = false;
  static constexpr const char* name = "zero1";
  using options_type = DDPOptions;
  using comm_type = Comm;

  template <class Model>
  class engine : public BasicDDP<Comm>::template engine<Model> {
    using base = typename BasicDDP<Comm>::template engine<Model>;

   public:
    /// DDP's, and the optimizer sharded (Note [Engine capabilities]).
    using capabilities = typename base::capabilities::template with<
        capability::shards_optimizer>;
    using base::base;

    /// The Trainer's optimizer: `make` builds the user's optimizer over
    /// this rank's shard of the parameters.
    template <class Factory>
    std::unique_ptr<torch::optim::Optimizer> make_optimizer(Factory make) {
      auto opt = std::make_unique<ShardedOptimizer>(
          unique_parameters(as_module(this->module())),
          ShardedOptimizer::Factory(std::move(make)), this->group());
      sharded_ = opt.get();
      return opt;
    }
    /// Every rank, before rank 0 writes a checkpoint.
    void consolidate_optimizer() {
      if (sharded_) sharded_->consolidate(0);
    }
    /// Bytes of optimizer state this rank keeps.
    uint64_t optimizer_state_bytes() const {
      return sharded_ ? sharded_->state_bytes() : 0;
    }
    /// The largest buffer the parameters' gather used (measured).
    uint64_t gather_buffer_bytes() const {
      return sharded_ ? sharded_->gather_buffer_bytes() : 0;
    }

   protected:
    ShardedOptimizer* sharded_ = nullptr;
  };
};

/// ZeRO stage 1 with plain all-reduce of float32 gradients.
using ZeRO1 = BasicZeRO1<AllReduceMean>;

}  // namespace ddpkit::parallel
