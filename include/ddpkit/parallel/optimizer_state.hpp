// SPDX-License-Identifier: BSD-3-Clause
// The per-parameter state of libtorch's optimizers, field by field: what
// ZeRO's optimizers cut into shards and lay end to end, what asynchronous
// checkpoints copy, and what a sharded checkpoint writes per piece and
// rebuilds on load (a fresh state of the optimizer's type, each field set
// by name).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"

namespace ddpkit::parallel {

/// One rank's part of one parameter, for a sharded checkpoint: elements
/// [begin, begin + values.numel()) of the parameter in the order they lie
/// in memory, the values and each optimizer state field over the same
/// elements (1-D runs), and the optimizer's step count for the parameter
/// where its type keeps one.
struct ParamPart {
  torch::Tensor param;  ///< the whole parameter (its identity and layout)
  int64_t begin = 0;
  torch::Tensor values;
  std::vector<std::pair<std::string, torch::Tensor>> state;
  std::optional<int64_t> step;
};

namespace detail {

inline UsageError unknown_state_type() {
  return UsageError(
      "this optimizer's state cannot be cut into shards or rebuilt from "
      "them (known: libtorch's SGD, Adam, AdamW, RMSprop, Adagrad and types "
      "derived from them)");
}

/// The tensor fields of a libtorch optimizer's per-parameter state, by
/// name, in a fixed order (defined or not): references into `s`. Throws
/// for a state type it does not know.
inline std::vector<std::pair<const char*, torch::Tensor*>> state_fields(
    torch::optim::OptimizerParamState& s) {
  namespace o = torch::optim;
  if (auto* sgd = dynamic_cast<o::SGDParamState*>(&s)) {
    return {{"momentum_buffer", &sgd->momentum_buffer()}};
  }
  if (auto* adamw = dynamic_cast<o::AdamWParamState*>(&s)) {
    return {{"exp_avg", &adamw->exp_avg()},
            {"exp_avg_sq", &adamw->exp_avg_sq()},
            {"max_exp_avg_sq", &adamw->max_exp_avg_sq()}};
  }
  if (auto* adam = dynamic_cast<o::AdamParamState*>(&s)) {
    return {{"exp_avg", &adam->exp_avg()},
            {"exp_avg_sq", &adam->exp_avg_sq()},
            {"max_exp_avg_sq", &adam->max_exp_avg_sq()}};
  }
  if (auto* rms = dynamic_cast<o::RMSpropParamState*>(&s)) {
    return {{"square_avg", &rms->square_avg()},
            {"momentum_buffer", &rms->momentum_buffer()},
            {"grad_avg", &rms->grad_avg()}};
  }
  if (auto* ada = dynamic_cast<o::AdagradParamState*>(&s)) {
    return {{"sum", &ada->sum()}};
  }
  throw unknown_state_type();
}

/// The step count of `s` (Adam, AdamW, RMSprop, Adagrad), or null (SGD).
inline int64_t* state_step(torch::optim::OptimizerParamState& s) {
  namespace o = torch::optim;
  if (auto* adamw = dynamic_cast<o::AdamWParamState*>(&s)) {
    return &adamw->step();
  }
  if (auto* adam = dynamic_cast<o::AdamParamState*>(&s)) return &adam->step();
  if (auto* rms = dynamic_cast<o::RMSpropParamState*>(&s)) return &rms->step();
  if (auto* ada = dynamic_cast<o::AdagradParamState*>(&s)) return &ada->step();
  return nullptr;
}

/// A fresh, empty per-parameter state of the type `optimizer` keeps.
inline std::unique_ptr<torch::optim::OptimizerParamState> new_state_like(
    const torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  if (dynamic_cast<const o::SGD*>(&optimizer)) {
    return std::make_unique<o::SGDParamState>();
  }
  if (dynamic_cast<const o::AdamW*>(&optimizer)) {
    return std::make_unique<o::AdamWParamState>();
  }
  if (dynamic_cast<const o::Adam*>(&optimizer)) {
    return std::make_unique<o::AdamParamState>();
  }
  if (dynamic_cast<const o::RMSprop*>(&optimizer)) {
    return std::make_unique<o::RMSpropParamState>();
  }
  if (dynamic_cast<const o::Adagrad*>(&optimizer)) {
    return std::make_unique<o::AdagradParamState>();
  }
  throw unknown_state_type();
}

/// Each defined tensor field of `s`, in state_fields' order, replaced by
/// `f(field)`. Throws for a state type it does not know.
inline void map_state_tensors(
    torch::optim::OptimizerParamState& s,
    const std::function<torch::Tensor(const torch::Tensor&)>& f) {
  for (auto& [name, t] : state_fields(s)) {
    (void)name;
    if (t->defined()) *t = f(*t);
  }
}

/// The defined tensor fields of `s`, in state_fields' order.
inline std::vector<torch::Tensor> state_tensors(
    torch::optim::OptimizerParamState& s) {
  std::vector<torch::Tensor> out;
  for (auto& [name, t] : state_fields(s)) {
    (void)name;
    if (t->defined()) out.push_back(*t);
  }
  return out;
}

/// `t` in `like`'s strides (a copy where they differ), so that its memory
/// order is `like`'s.
inline torch::Tensor in_layout_of(const torch::Tensor& t,
                                  const torch::Tensor& like) {
  if (t.strides() == like.strides()) return t;
  auto out = torch::empty_strided(like.sizes(), like.strides(), t.options());
  out.copy_(t);
  return out;
}

/// Parameter `p` whole, with its state in `optimizer` (if any): the part
/// a rank that owns `p` writes.
inline ParamPart whole_part(const torch::Tensor& p,
                            const torch::optim::Optimizer& optimizer) {
  ParamPart part;
  part.param = p;
  const auto n = p.numel();
  auto run = [&](const torch::Tensor& t) {
    const auto laid = in_layout_of(t.detach(), p);
    return laid.as_strided({n}, {1}, laid.storage_offset());
  };
  part.values = run(p);
  auto& states = const_cast<torch::optim::Optimizer&>(optimizer).state();
  const auto it = states.find(compat::optimizer_state_key(p));
  if (it != states.end()) {
    for (auto& [name, t] : state_fields(*it->second)) {
      if (t->defined()) part.state.emplace_back(name, run(*t));
    }
    if (const int64_t* step = state_step(*it->second)) part.step = *step;
  }
  return part;
}

}  // namespace detail

}  // namespace ddpkit::parallel
