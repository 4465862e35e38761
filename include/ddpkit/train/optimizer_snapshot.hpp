// SPDX-License-Identifier: BSD-3-Clause
// A copy of an optimizer's state taken now and serialised later: what an
// asynchronous checkpoint blocks for instead of the serialisation. See
// Note [Asynchronous checkpoints] (checkpoint_queue.hpp).
#pragma once

#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/parallel/zero/sharded_optimizer.hpp"
#include "ddpkit/parallel/zero/zero3_optimizer.hpp"
#include "ddpkit/train/checkpoint.hpp"

namespace ddpkit::train {

namespace detail {

/// `t` copied to new memory on its device (undefined stays undefined).
inline torch::Tensor copy_of(const torch::Tensor& t) {
  return t.defined() ? t.detach().clone(torch::MemoryFormat::Preserve) : t;
}

/// A fresh `Opt` (libtorch's SGD, Adam, AdamW, RMSprop or Adagrad, whose
/// `save` the copy uses) over `source`'s parameter groups, holding copies of
/// `source`'s per-parameter states, every state tensor copied
/// (parallel::detail::map_state_tensors knows each type's tensors).
template <class Opt, class Options>
std::shared_ptr<torch::optim::Optimizer> frozen_copy(
    const torch::optim::Optimizer& source) {
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.reserve(source.param_groups().size());
  for (const auto& g : source.param_groups()) {
    groups.emplace_back(g.params(), g.options().clone());
  }
  auto frozen = std::make_shared<Opt>(
      groups, static_cast<const Options&>(source.defaults()));
  frozen->state().clear();  // Adagrad makes states when it is built
  for (const auto& kv : source.state()) {
    auto st = kv.second->clone();  // its tensors shared with the source
    ddpkit::parallel::detail::map_state_tensors(*st, copy_of);
    frozen->state()[kv.first] = std::move(st);
  }
  return frozen;
}

/// The optimizer whose state `optimizer` saves: a ShardedOptimizer's or a
/// Zero3Optimizer's consolidated one (after `consolidate()`), else itself.
inline const torch::optim::Optimizer& saved_optimizer(
    const torch::optim::Optimizer& optimizer) {
  if (const auto* s =
          dynamic_cast<const ddpkit::parallel::ShardedOptimizer*>(&optimizer)) {
    if (const auto* full = s->consolidated()) return *full;
  }
  if (const auto* z =
          dynamic_cast<const ddpkit::parallel::Zero3Optimizer*>(&optimizer)) {
    if (const auto* full = z->consolidated()) return *full;
  }
  return optimizer;
}

/// frozen_copy of `opt` by its type (libtorch's SGD, Adam, AdamW, RMSprop,
/// Adagrad and what derives from them); null for another type.
inline std::shared_ptr<torch::optim::Optimizer> frozen_of(
    const torch::optim::Optimizer& opt) {
  namespace o = torch::optim;
  if (dynamic_cast<const o::SGD*>(&opt)) {
    return frozen_copy<o::SGD, o::SGDOptions>(opt);
  }
  if (dynamic_cast<const o::AdamW*>(&opt)) {
    return frozen_copy<o::AdamW, o::AdamWOptions>(opt);
  }
  if (dynamic_cast<const o::Adam*>(&opt)) {
    return frozen_copy<o::Adam, o::AdamOptions>(opt);
  }
  if (dynamic_cast<const o::RMSprop*>(&opt)) {
    return frozen_copy<o::RMSprop, o::RMSpropOptions>(opt);
  }
  if (dynamic_cast<const o::Adagrad*>(&opt)) {
    return frozen_copy<o::Adagrad, o::AdagradOptions>(opt);
  }
  return nullptr;
}

}  // namespace detail

/// A copy of `optimizer`'s state (every state tensor copied now, nothing
/// shared with training) and a function that serialises it later, on any
/// thread, to what `optimizer_bytes(optimizer)` gives now (the same states,
/// parameter groups and options; the states' order in the archive may
/// differ, they are keyed by parameter). For libtorch's SGD, Adam, AdamW,
/// RMSprop and Adagrad and what derives from them (ddpkit's Foreach*), also
/// inside a consolidated ShardedOptimizer or Zero3Optimizer; for any other
/// type the state is
/// serialised now and the function returns those bytes.
inline std::function<torch::Tensor()> optimizer_snapshot(
    const torch::optim::Optimizer& optimizer) {
  const torch::optim::Optimizer& opt = detail::saved_optimizer(optimizer);
  std::shared_ptr<torch::optim::Optimizer> frozen = detail::frozen_of(opt);
  if (!frozen) {
    auto bytes = optimizer_bytes(opt);
    return [bytes] { return bytes; };
  }
  return [frozen] { return optimizer_bytes(*frozen); };
}

}  // namespace ddpkit::train
