// SPDX-License-Identifier: BSD-3-Clause
// Learning-rate policies: scaling with the world size (none, linear as in
// the flowers recipe, square root), optional linear warm-up, and per-epoch
// schedules (step, cosine to a floor, none).
#pragma once

#include <cmath>
#include <numbers>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/detail/error.hpp"

namespace ddpkit::train {

/// The reference LR-scaling policy: copy it to write your own.
struct NoScaling {
  using lr_scaling_concept = lr_scaling_tag;
  static constexpr const char* name = "none";
  static double scale(double lr, int /*world_size*/) {
    return lr;
  }
};

/// `lr × world_size` (Goyal et al.; the flowers recipe's `args.lr *=
/// world_size`).
struct LinearScaling {
  using lr_scaling_concept = lr_scaling_tag;
  static constexpr const char* name = "linear";
  static double scale(double lr, int world_size) {
    return lr * world_size;
  }
};

/// `lr × sqrt(world_size)`, gentler for adaptive optimisers.
struct SqrtScaling {
  using lr_scaling_concept = lr_scaling_tag;
  static constexpr const char* name = "sqrt";
  static double scale(double lr, int world_size) {
    return lr * std::sqrt(static_cast<double>(world_size));
  }
};

enum class Schedule { none, step, cosine };

/// Per-epoch schedule of the (scaled) learning rate.
struct ScheduleOptions {
  TORCH_ARG(Schedule, kind) = Schedule::none;
  /// step: multiply by `gamma` every `step_size` epochs (StepLR).
  TORCH_ARG(int, step_size) = 30;
  TORCH_ARG(double, gamma) = 0.1;
  /// cosine: `lf(x) = ((1 + cos(x·π/epochs)) / 2)·(1 − lrf) + lrf`.
  TORCH_ARG(double, lrf) = 0.1;
  /// Linear warm-up from lr/warmup to lr over the first `warmup_epochs`.
  TORCH_ARG(int, warmup_epochs) = 0;
};

/// The factor the schedule applies at `epoch` (0-based) of `epochs`.
inline double schedule_factor(const ScheduleOptions& s, int epoch, int epochs) {
  double f = 1.0;
  switch (s.kind()) {
    case Schedule::none: break;
    case Schedule::step:
      if (s.step_size() < 1) {
        throw UsageError(ddpkit::detail::cat("step schedule: step_size ",
                                             s.step_size(), " must be >= 1"));
      }
      f = std::pow(s.gamma(), epoch / s.step_size());
      break;
    case Schedule::cosine:
      f = ((1 + std::cos(epoch * std::numbers::pi / epochs)) / 2) *
              (1 - s.lrf()) +
          s.lrf();
      break;
  }
  if (s.warmup_epochs() > 0 && epoch < s.warmup_epochs()) {
    f *= static_cast<double>(epoch + 1) / s.warmup_epochs();
  }
  return f;
}

/// The learning rate of `epoch`: the base rate scaled for the world size by
/// `Scaling`, times the schedule's factor.
template <lr_scaling_policy Scaling>
double lr_at(double base_lr, int world_size, const ScheduleOptions& s,
             int epoch, int epochs) {
  return Scaling::scale(base_lr, world_size) *
         schedule_factor(s, epoch, epochs);
}

/// Sets every parameter group's learning rate.
inline void set_lr(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

}  // namespace ddpkit::train
