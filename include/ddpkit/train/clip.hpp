// SPDX-License-Identifier: BSD-3-Clause
// Gradient clipping as the Trainer applies it: after the gradients are
// averaged across ranks (so every rank clips the same numbers the same
// way) and, with mixed precision, after they are unscaled; before the
// optimizer step.
#pragma once

#include <cmath>
#include <limits>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"

namespace ddpkit::train {

/// What to clip: by global norm (PyTorch's `clip_grad_norm_`) or by value
/// (`clip_grad_value_`), not both. Zero turns each off.
struct ClipOptions {
  /// Scale all gradients together so their global `norm_type` norm is at
  /// most this (0: off).
  TORCH_ARG(double, max_norm) = 0;
  /// The norm's order: 2 by default; any p > 0, or infinity (max |g|).
  TORCH_ARG(double, norm_type) = 2.0;
  /// Clamp every gradient element into [-max_value, max_value] (0: off).
  TORCH_ARG(double, max_value) = 0;

 public:  // TORCH_ARG leaves the section private
  bool enabled() const {
    return max_norm() > 0 || max_value() > 0;
  }
  /// A UsageError naming the option and value when these make no sense.
  void check() const {
    using ddpkit::detail::cat;
    if (!(max_norm() >= 0) || std::isinf(max_norm())) {
      throw UsageError(cat("clip max_norm ", max_norm(),
                           " must be a finite number >= 0 (0: off)"));
    }
    if (!(norm_type() > 0)) {
      throw UsageError(cat("clip norm_type ", norm_type(),
                           " must be > 0 (2: Euclidean; inf: largest |g|)"));
    }
    if (!(max_value() >= 0) || std::isinf(max_value())) {
      throw UsageError(cat("clip max_value ", max_value(),
                           " must be a finite number >= 0 (0: off)"));
    }
    if (max_norm() > 0 && max_value() > 0) {
      throw UsageError(cat("clip by norm (", max_norm(), ") or by value (",
                           max_value(), "), not both"));
    }
  }
};

/// Clips the gradients of `params` as `o` says; parameters without a
/// gradient are left alone. Returns the total gradient norm before
/// clipping when clipping by norm, else NaN.
inline double clip_gradients(const std::vector<torch::Tensor>& params,
                             const ClipOptions& o) {
  if (o.max_norm() > 0) {
    return torch::nn::utils::clip_grad_norm_(params, o.max_norm(),
                                             o.norm_type());
  }
  if (o.max_value() > 0) {
    torch::nn::utils::clip_grad_value_(params, o.max_value());
  }
  return std::numeric_limits<double>::quiet_NaN();
}

/// Whether every gradient of `params` is finite (parameters without one
/// count as finite); one host sync. A sum is finite only if every term is
/// (NaN and infinities propagate through it), so one summing pass decides
/// for the usual finite case; only a non-finite sum, which finite terms
/// can also give by overflowing, is checked element by element. (The
/// element check alone, isfinite(g).all() per gradient, took 93 ms for
/// ResNet-34's 21.3M gradients on one core here; the sums 10 ms.)
inline bool gradients_finite(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> grads, sums;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    sums.push_back(p.grad().sum().to(torch::kFloat32));
  }
  if (grads.empty()) return true;
  if (torch::isfinite(torch::stack(sums).sum()).template item<bool>()) {
    return true;
  }
  std::vector<torch::Tensor> flags;
  for (const auto& g : grads) flags.push_back(torch::isfinite(g).all());
  return torch::stack(flags).all().template item<bool>();
}

}  // namespace ddpkit::train
