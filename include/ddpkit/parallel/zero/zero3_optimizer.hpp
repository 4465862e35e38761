// SPDX-License-Identifier: BSD-3-Clause
// ZeRO stage 3's optimizer: the user's libtorch optimizer over this rank's
// flat shards (one per unit), seen from outside as an optimizer over every
// parameter whose checkpoints hold the whole model's state per parameter,
// as DDP's plain optimizer saves it. See Note [ZeRO-3's checkpoints].
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/parallel/optimizer_state.hpp"
#include "ddpkit/parallel/zero/sharded_optimizer.hpp"

namespace ddpkit::parallel {

// Note [ZeRO-3's checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// ZeRO-3's checkpoints are DDP's format. The optimizer steps one flat shard
// per unit (Note [ZeRO-3's parameter lifecycle]); its per-parameter state
// for a checkpoint is rebuilt by `consolidate` on every rank: for each
// unit, each state tensor of the shard (momentum, Adam's moments) is
// all-gathered into the unit's flat layout and cut at the parameters'
// offsets into per-parameter tensors of the parameters' shapes, the
// scalars (Adam's step) copied; rank `to` keeps them in a plain optimizer
// of the user's type over every parameter (each tensor once, in
// `unique_parameters` order: DDP's), which `save` writes. `load` is the
// reverse on every rank: a plain optimizer reads the file, and each unit's
// parameters' states are laid end to end and this rank's part kept. So a
// checkpoint written under stage 3 resumes under DDP, ZeRO-1/2, one
// process or stage 3 at any world size, and the other way. Which state
// tensors an optimizer has is known per type: libtorch's SGD, Adam, AdamW,
// RMSprop and Adagrad (and types derived from them); another optimizer is
// refused by name when consolidated or loaded. The optimizer factory must
// make one parameter group (the shards carry no per-parameter settings).
// Rank `to` holds the whole state while it writes (as ZeRO-1/2); the others
// hold one unit's gathered state at a time. Sharded checkpoints gather
// nothing: each rank writes its `checkpoint_parts` (the runs of each
// parameter inside its shards, with the state over the same elements;
// Note [Sharded training checkpoints], train/sharded_state.hpp).

namespace detail {

/// Parameter `p`'s place in a flat buffer `flat` at element `offset`: a
/// view of `flat` with `p`'s sizes and strides (p dense: contiguous or
/// channels-last), so values lie as they lie in `p`'s memory.
inline torch::Tensor param_view(const torch::Tensor& flat, int64_t offset,
                                const torch::Tensor& p) {
  return flat.as_strided(p.sizes(), p.strides(),
                         flat.storage_offset() + offset);
}

}  // namespace detail

/// How the parameters of one ZeRO-3 unit lie in its flat buffer.
struct Zero3Layout {
  torch::Tensor shard;                // this rank's part, what is stepped
  std::vector<torch::Tensor> params;  // the unit's parameters
  std::vector<int64_t> offsets;       // of each in the flat buffer
  int64_t padded = 0;                 // the flat buffer's length
};

/// ZeRO stage 3's optimizer (see Note [ZeRO-3's checkpoints]): an optimizer
/// over every parameter (each tensor once) for code that walks
/// `param_groups()` — setting the learning rate — holding the user's
/// optimizer over this rank's shards.
class Zero3Optimizer : public torch::optim::Optimizer {
 public:
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::Tensor>)>;

  /// `params`: the model's parameters, each tensor once (DDP's order);
  /// `units`: the layout of every unit; `make`: the user's factory.
  Zero3Optimizer(const std::vector<torch::Tensor>& params,
                 const std::vector<Zero3Layout>& units, const Factory& make,
                 const dist::Group& group)
      : Zero3Optimizer(checked(make, shards_of(units)), params, units, make,
                       group) {}

  /// Steps the shards at this optimizer's learning rate (its first
  /// group's, copied in).
  torch::Tensor step(LossClosure closure = nullptr) override {
    if (closure) {
      throw UsageError(
          "ZeRO3: a step with a closure is not supported (each rank steps "
          "only its shards)");
    }
    full_.reset();
    const double lr = param_groups_.at(0).options().get_lr();
    for (auto& g : inner_->param_groups()) g.options().set_lr(lr);
    torch::NoGradGuard no_grad;
    inner_->step();
    return {};
  }

  /// Every rank: rank `to` then holds the whole per-parameter state (for
  /// `save`) until the next step.
  void consolidate(int to = 0) {
    dist::CollectiveTag tag("zero3 consolidate");
    std::unique_ptr<torch::optim::Optimizer> full;
    if (group_.rank() == to) full = fresh(params_);
    for (const auto& u : units_) {
      auto it = inner_->state().find(compat::optimizer_state_key(u.shard));
      // (Every rank has state for the same shards: they step together.)
      if (it == inner_->state().end()) continue;
      auto whole = it->second->clone();
      detail::map_state_tensors(*whole, [&](const torch::Tensor& t) {
        auto flat = torch::empty({u.padded}, t.options());
        dist::all_gather_into(group_, t, flat);
        return flat;
      });
      if (!full) continue;
      for (std::size_t k = 0; k < u.params.size(); ++k) {
        const auto& p = u.params[k];
        auto s = whole->clone();
        detail::map_state_tensors(*s, [&](const torch::Tensor& flat) {
          return detail::param_view(flat, u.offsets[k], p)
              .clone(torch::MemoryFormat::Preserve);
        });
        full->state()[compat::optimizer_state_key(p)] = std::move(s);
      }
    }
    full_ = std::move(full);
  }

  /// The whole optimizer `consolidate` built on this rank, or null.
  const torch::optim::Optimizer* consolidated() const {
    return full_.get();
  }

  /// The whole model's optimizer state, on the rank `consolidate` built it.
  void save(torch::serialize::OutputArchive& archive) const override {
    if (!full_) {
      throw UsageError(
          "ZeRO3: call consolidate() on every rank before saving the "
          "optimizer (each rank holds only its shards of the state)");
    }
    full_->save(archive);
  }

  /// Every rank: reads a whole state (saved by `save`, or by a plain
  /// optimizer of the same type over the same parameters, e.g. DDP's) and
  /// keeps its part of each unit's.
  void load(torch::serialize::InputArchive& archive) override {
    auto full = fresh(params_);
    full->load(archive);
    inner_->state().clear();
    const int w = group_.size(), r = group_.rank();
    for (const auto& u : units_) {
      std::unique_ptr<torch::optim::OptimizerParamState> like;
      for (const auto& p : u.params) {
        auto it = full->state().find(compat::optimizer_state_key(p));
        if (it != full->state().end()) {
          like = it->second->clone();
          break;
        }
      }
      if (!like) continue;  // no state (not stepped yet)
      auto fields = detail::state_tensors(*like);
      std::vector<torch::Tensor> flats;
      for (const auto& f : fields) {
        flats.push_back(torch::zeros({u.padded}, f.options()));
      }
      for (std::size_t k = 0; k < u.params.size(); ++k) {
        auto it = full->state().find(compat::optimizer_state_key(u.params[k]));
        if (it == full->state().end()) continue;
        auto mine = detail::state_tensors(*it->second);
        if (mine.size() != flats.size()) {
          throw UsageError(
              "ZeRO3: the checkpoint's optimizer state differs between the "
              "parameters of one unit (fields defined for some only)");
        }
        for (std::size_t f = 0; f < flats.size(); ++f) {
          detail::param_view(flats[f], u.offsets[k], u.params[k])
              .copy_(mine[f]);
        }
      }
      const int64_t chunk = u.padded / w;
      std::size_t f = 0;
      detail::map_state_tensors(*like, [&](const torch::Tensor&) {
        return flats[f++].narrow(0, r * chunk, chunk).clone();
      });
      inner_->state()[compat::optimizer_state_key(u.shard)] = std::move(like);
    }
    full_.reset();
  }

  /// This rank's part of each parameter (a sharded checkpoint's pieces):
  /// per unit, the run of each parameter inside this rank's shard, with
  /// the shard's optimizer state over the same elements. Views of the
  /// shards: copy them before training changes them.
  std::vector<ParamPart> checkpoint_parts() const {
    std::vector<ParamPart> out;
    const int64_t r = group_.rank(), w = group_.size();
    for (const auto& u : units_) {
      const int64_t chunk = u.padded / w, lo = r * chunk, hi = lo + chunk;
      const auto it =
          inner_->state().find(compat::optimizer_state_key(u.shard));
      for (std::size_t k = 0; k < u.params.size(); ++k) {
        const auto& p = u.params[k];
        const int64_t b = std::max(lo, u.offsets[k]);
        const int64_t e = std::min(hi, u.offsets[k] + p.numel());
        if (b >= e) continue;
        ParamPart part;
        part.param = p;
        part.begin = b - u.offsets[k];
        part.values = u.shard.detach().narrow(0, b - lo, e - b);
        if (it != inner_->state().end()) {
          for (auto& [name, t] : detail::state_fields(*it->second)) {
            if (t->defined()) {
              part.state.emplace_back(name, t->narrow(0, b - lo, e - b));
            }
          }
          if (const int64_t* step = detail::state_step(*it->second)) {
            part.step = *step;
          }
        }
        out.push_back(std::move(part));
      }
    }
    return out;
  }
  /// A new optimizer of the user's type over every parameter, at this
  /// one's learning rate, with no state.
  std::unique_ptr<torch::optim::Optimizer> whole() const {
    return fresh(params_);
  }

  /// Bytes of optimizer state this rank keeps (measured).
  uint64_t state_bytes() const {
    return optimizer_state_bytes(*inner_);
  }
  const torch::optim::Optimizer& shard_optimizer() const {
    return *inner_;
  }

 private:
  static std::vector<torch::Tensor> shards_of(
      const std::vector<Zero3Layout>& units) {
    std::vector<torch::Tensor> out;
    for (const auto& u : units) out.push_back(u.shard);
    return out;
  }

  static std::unique_ptr<torch::optim::Optimizer> checked(
      const Factory& make, std::vector<torch::Tensor> params) {
    auto opt = make(std::move(params));
    if (!opt) throw UsageError("the optimizer factory returned nothing");
    if (opt->param_groups().size() != 1) {
      throw UsageError(ddpkit::detail::cat(
          "ZeRO3: the optimizer factory made ", opt->param_groups().size(),
          " parameter groups; a sharded optimizer takes one"));
    }
    return opt;
  }

  // (Copies, not moves, in the delegating call above: its arguments are
  // evaluated in no set order, and `shards_of` must see the units.)
  Zero3Optimizer(std::unique_ptr<torch::optim::Optimizer> inner,
                 const std::vector<torch::Tensor>& params,
                 const std::vector<Zero3Layout>& units, const Factory& make,
                 const dist::Group& group)
      : torch::optim::Optimizer(
            std::vector<torch::optim::OptimizerParamGroup>{
                torch::optim::OptimizerParamGroup(params)},
            inner->param_groups().at(0).options().clone()),
        inner_(std::move(inner)),
        params_(params),
        units_(units),
        make_(make),
        group_(group) {}

  std::unique_ptr<torch::optim::Optimizer> fresh(
      std::vector<torch::Tensor> params) const {
    auto opt = checked(make_, std::move(params));
    const double lr = param_groups_.at(0).options().get_lr();
    for (auto& g : opt->param_groups()) g.options().set_lr(lr);
    return opt;
  }

  std::unique_ptr<torch::optim::Optimizer> inner_;
  std::vector<torch::Tensor> params_;
  std::vector<Zero3Layout> units_;
  Factory make_;
  dist::Group group_;
  std::unique_ptr<torch::optim::Optimizer> full_;
};

}  // namespace ddpkit::parallel
