// SPDX-License-Identifier: BSD-3-Clause
// A model's input of one tensor or several (`Inputs`): what a batch hands
// the engines, which pass it on as `forward(x0, x1, ...)`. Every tensor's
// first dimension is the batch's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit::data {

// Note [Inputs of several tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Inputs of several tensors. A model whose `forward` takes several tensors
// (`forward(x, mask)`, up to four) gets them from `data::Inputs`, a list of
// tensors made implicitly from one tensor, so `engine.forward(x)` reads as
// before. A batch holds `data` (the first input) and `extra` (the rest): a
// sample whose input is a tuple, pair, vector or `Inputs` is collated input
// by input (`Stack` stacks, `PadSequences` pads each); samples with different
// input counts are refused naming both. The engines take `Inputs` and call
// `forward` with as many arguments (`data::forward_inputs`: the arity is
// chosen at run time among those the forward accepts at compile time, and a
// count it does not take is a `UsageError` naming it); DataParallel splits
// every input along the batch (PyTorch's scatter of a tuple; inputs with
// different batch sizes are refused). A user engine whose `forward` takes one
// tensor still works: the Trainer passes the first input and refuses a batch
// of several. Targets stay one tensor. Test: a two-input model through DDP at
// world 2 and DataParallel over two CPU replicas equals one process on the
// joined batch (task_test.cpp).

/// The tensors a model's forward takes, in order: one (made implicitly from
/// a torch::Tensor, so `engine.forward(x)` reads as before) or up to
/// `kMax`, passed as `forward(x0, x1, ...)`.
class Inputs {
 public:
  /// The most tensors a forward is called with.
  static constexpr std::size_t kMax = 4;

  Inputs() = default;
  Inputs(torch::Tensor x) : tensors_{std::move(x)} {}  // NOLINT: implicit
  Inputs(std::vector<torch::Tensor> xs) : tensors_(std::move(xs)) {}  // NOLINT
  Inputs(std::initializer_list<torch::Tensor> xs) : tensors_(xs) {}
  /// From a tuple or pair of tensors.
  template <class... T>
    requires(sizeof...(T) >= 1 &&
             (std::convertible_to<const T&, torch::Tensor> && ...))
  Inputs(const std::tuple<T...>& t) {  // NOLINT: implicit
    std::apply([&](const auto&... x) { (tensors_.emplace_back(x), ...); }, t);
  }
  template <class A, class B>
    requires std::convertible_to<const A&, torch::Tensor> &&
             std::convertible_to<const B&, torch::Tensor>
  Inputs(const std::pair<A, B>& p)  // NOLINT: implicit
      : tensors_{p.first, p.second} {}

  std::size_t size() const {
    return tensors_.size();
  }
  bool empty() const {
    return tensors_.empty();
  }
  const torch::Tensor& operator[](std::size_t i) const {
    return tensors_[i];
  }
  torch::Tensor& operator[](std::size_t i) {
    return tensors_[i];
  }
  auto begin() const {
    return tensors_.begin();
  }
  auto end() const {
    return tensors_.end();
  }
  const std::vector<torch::Tensor>& tensors() const {
    return tensors_;
  }

  /// The batch size: every tensor's first dimension, which must agree.
  int64_t rows() const {
    if (tensors_.empty() || !tensors_[0].defined()) return 0;
    const int64_t n = tensors_[0].dim() == 0 ? 1 : tensors_[0].size(0);
    for (std::size_t i = 1; i < tensors_.size(); ++i) {
      const auto& t = tensors_[i];
      if (!t.defined() || t.dim() == 0 || t.size(0) != n) {
        throw UsageError(ddpkit::detail::cat(
            "a batch's inputs differ in their first (batch) dimension: input 0 "
            "has ",
            n, " rows, input ", i, " has shape ",
            t.defined() ? t.sizes() : torch::IntArrayRef{}));
      }
    }
    return n;
  }

  /// `f` applied to each tensor.
  template <class F>
  Inputs map(F&& f) const {
    std::vector<torch::Tensor> out;
    out.reserve(tensors_.size());
    for (const auto& t : tensors_) out.push_back(f(t));
    return Inputs(std::move(out));
  }

  /// The rows split into `parts` (tensor_split of each tensor): part k of
  /// every tensor forms the k-th Inputs.
  std::vector<Inputs> split(int64_t parts) const {
    rows();  // they must agree
    std::vector<Inputs> out(static_cast<std::size_t>(parts));
    for (const auto& t : tensors_) {
      auto pieces = t.tensor_split(parts);
      for (std::size_t k = 0; k < out.size(); ++k) {
        out[k].tensors_.push_back(std::move(pieces[k]));
      }
    }
    return out;
  }

 private:
  std::vector<torch::Tensor> tensors_;
};

/// Calls `model->forward` with the inputs as its arguments (1 to
/// `Inputs::kMax` tensors); a count the forward does not take is an error
/// naming both.
template <class Model>
torch::Tensor forward_inputs(Model& model, const Inputs& in) {
  const auto& x = in.tensors();
  static_assert(
      requires { model->forward(x[0]); } ||
          requires { model->forward(x[0], x[1]); } ||
          requires { model->forward(x[0], x[1], x[2]); } ||
          requires { model->forward(x[0], x[1], x[2], x[3]); },
      "the model's forward must take 1 to 4 tensors (data::Inputs::kMax)");
  if (x.size() > 1) in.rows();  // the batch sizes agree, or say so
  switch (x.size()) {
    case 1:
      if constexpr (requires { model->forward(x[0]); }) {
        return model->forward(x[0]);
      }
      break;
    case 2:
      if constexpr (requires { model->forward(x[0], x[1]); }) {
        return model->forward(x[0], x[1]);
      }
      break;
    case 3:
      if constexpr (requires { model->forward(x[0], x[1], x[2]); }) {
        return model->forward(x[0], x[1], x[2]);
      }
      break;
    case 4:
      if constexpr (requires { model->forward(x[0], x[1], x[2], x[3]); }) {
        return model->forward(x[0], x[1], x[2], x[3]);
      }
      break;
    default: break;
  }
  throw UsageError(ddpkit::detail::cat(
      "the model's forward was called with ", x.size(),
      " input tensor(s), a count it does not take (a batch's inputs are its "
      "`data` and then its `extra` tensors; up to ",
      Inputs::kMax, ")"));
}

}  // namespace ddpkit::data
