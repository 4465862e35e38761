// SPDX-License-Identifier: BSD-3-Clause
// The task policy: what is being learnt. A task says the loss of a batch,
// the batch's metrics as sums that add across batches and ranks, how the
// sums become metrics, and which metric is monitored ("best") in which
// direction. The Trainer's sixth axis (beside parallel, sampler, BN, LR
// scaling and evaluation); `Classification` is the default.
//
// A task of your own is a small struct:
// ```
// struct MeanAbsolute {
//   using task_concept = ddpkit::task_tag;
//   static constexpr std::string_view name = "mae";
//   static constexpr std::array<std::string_view, 1> metrics{"loss"};
//   static constexpr std::size_t num_sums = 2;  // |error| sum, elements
//   static constexpr ddpkit::train::MonitorSpec monitor{"val_loss",
//                                                       ddpkit::train::Goal::min};
//   torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) const {
//     return (out - y).abs().mean();
//   }
//   std::array<double, 2> sums(const torch::Tensor&, const torch::Tensor& y,
//                              double loss) const {
//     const double n = static_cast<double>(y.numel());
//     return {loss * n, n};
//   }
//   std::array<double, 1> finish(const std::array<double, 2>& s) const {
//     return {s[1] > 0 ? s[0] / s[1] : 0.0};
//   }
// };
// ```
// The first metric is the mean loss and is named "loss" (the progress line
// and train/loss_step show it). The files name each metric train_<m> and
// val_<m> (metrics.jsonl, metrics.csv, summary.json; TensorBoard
// train/<m>, val/<m>).
#pragma once

#include <array>
#include <cmath>
#include <concepts>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit {

// Note [The task is a policy; batches stay two tensors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The task is a policy; batches stay two tensors. What is learnt (loss,
// metrics, what "best" means) is the Trainer's seventh parameter, `Task`
// (default `Classification`), checked by `task_policy` piece by piece. A task
// gives the batch's mean loss (what backward runs on), the batch's metrics as
// `num_sums` sums that add across batches and ranks (so sharded evaluation
// counts each sample once and every rank finishes the same numbers), `finish`
// (sums to metrics: sum/count, exp of the mean loss for perplexity), and its
// monitored metric. The Trainer sums `[samples, task sums...]` in float64 and
// all-reduces them in the collective that already ran for the training
// metrics; nothing is added per step. `sums` is given the batch's mean loss
// as a number (the engines already return it) rather than recomputing it; a
// task may give `evaluation_sums` of its own (Classification sums the
// per-sample losses in one reduction, as before tasks existed), so the
// CIFAR-10 and flowers examples write the same metrics files to the last
// digit as before (a recorded comparison, issue 28's note). One metric,
// `monitor` (task default, or `--monitor`/`--mode`), decides early stopping,
// keep-best, `best.pt`, `summary.json`'s `best_<m>` and the `done:` line:
// before, early stopping always watched val_acc while keep-best could rank by
// val_loss. A sample may be any `Example`/pair/tuple of two tensors; a
// dataset is anything with `size()` and `get(i)`; a collate step (`Stack`,
// `PadSequences`, or the user's) makes a `data::Batch`. The image path
// (`get(indices)` + batched transforms) is a separate branch of the loader,
// chosen at compile time, so its code did not change.

/// Opt-in tag of a task: `using task_concept = ddpkit::task_tag;`.
struct task_tag {};

}  // namespace ddpkit

namespace ddpkit::train {

/// Whether a monitored metric is better when lower or higher.
enum class Goal { min, max };

/// A task's default monitored metric: a literal, so it can be a constant.
struct MonitorSpec {
  std::string_view name;  ///< "val_<metric>" or "train_<metric>"
  Goal goal;
};

/// The metric that means "best" for early stopping, keep-best, best.pt,
/// summary.json and the progress line. Empty name: the task's own.
struct Monitor {
  std::string name;
  Goal goal = Goal::max;

  /// Whether `a` is better than `b` (NaN never is).
  bool better(double a, double b) const {
    if (std::isnan(a)) return false;
    if (std::isnan(b)) return true;
    return goal == Goal::max ? a > b : a < b;
  }
  std::string_view goal_name() const {
    return goal == Goal::max ? "max" : "min";
  }
};

/// "min" or "max" (`--mode`); a UsageError naming the value otherwise.
inline Goal parse_goal(std::string_view s) {
  if (s == "min") return Goal::min;
  if (s == "max") return Goal::max;
  throw UsageError(
      ddpkit::detail::cat("monitor mode '", s, "': expected min or max"));
}

}  // namespace ddpkit::train

namespace ddpkit {

// ---- the task concept, piece by piece ---------------------------------------

template <class T>
concept declares_task_tag = std::same_as<typename T::task_concept, task_tag>;

template <class T>
concept task_names_itself = requires {
  { T::name } -> std::convertible_to<std::string_view>;
};

/// `metrics`: the finished metrics' names, the first being "loss".
template <class T>
concept task_names_metrics = requires {
  { T::metrics.size() } -> std::convertible_to<std::size_t>;
  { T::metrics[0] } -> std::convertible_to<std::string_view>;
};

template <class T>
concept task_counts_sums = requires {
  { T::num_sums } -> std::convertible_to<std::size_t>;
};

/// `loss(output, target)`: the batch's mean loss, a scalar tensor that the
/// backward pass runs on.
template <class T>
concept task_computes_loss = requires(const T& t, const torch::Tensor& x) {
  { t.loss(x, x) } -> std::convertible_to<torch::Tensor>;
};

/// `sums(output, target, loss)`: the batch's `num_sums` sums (given its mean
/// loss as a number), which add across batches and ranks.
template <class T>
concept task_sums_batches =
    task_counts_sums<T> && requires(const T& t, const torch::Tensor& x) {
      {
        t.sums(x, x, 1.0)
      } -> std::convertible_to<std::array<double, T::num_sums>>;
    };

/// `finish(sums)`: the metrics, one per name in `metrics`.
template <class T>
concept task_finishes_metrics =
    task_counts_sums<T> && task_names_metrics<T> &&
    requires(const T& t, const std::array<double, T::num_sums>& s) {
      {
        t.finish(s)
      } -> std::convertible_to<std::array<double, T::metrics.size()>>;
    };

template <class T>
concept task_monitors_a_metric = requires {
  { T::monitor } -> std::convertible_to<train::MonitorSpec>;
};

/// What the Trainer's `Task` parameter must be: Classification,
/// Regression, LanguageModel, or your own (see ddpkit/train/task.hpp).
template <class T>
concept task_policy =
    declares_task_tag<T> && task_names_itself<T> && task_names_metrics<T> &&
    task_computes_loss<T> && task_sums_batches<T> && task_finishes_metrics<T> &&
    task_monitors_a_metric<T> && std::default_initializable<T>;

template <class T>
inline constexpr bool is_task_policy_v = task_policy<T>;

/// A task that computes its evaluation sums itself (Classification: the
/// summed loss, as before tasks existed), rather than from `loss`.
template <class T>
concept task_sums_evaluation = requires(const T& t, const torch::Tensor& x) {
  {
    t.evaluation_sums(x, x)
  } -> std::convertible_to<std::array<double, T::num_sums>>;
};

}  // namespace ddpkit

namespace ddpkit::train {

/// `Task::num_sums` doubles from `p` (a reduced tensor's data) as the
/// task's sums.
template <class Task>
std::array<double, Task::num_sums> task_sums_at(const double* p) {
  std::array<double, Task::num_sums> a{};
  for (std::size_t i = 0; i < Task::num_sums; ++i) a[i] = p[i];
  return a;
}

/// The sums of one evaluation batch: the task's own `evaluation_sums`, or
/// `sums` with the batch's mean loss.
template <task_policy Task>
std::array<double, Task::num_sums> evaluation_sums(const Task& task,
                                                   const torch::Tensor& out,
                                                   const torch::Tensor& y) {
  if constexpr (task_sums_evaluation<Task>) {
    return task.evaluation_sums(out, y);
  } else {
    return task.sums(out, y, task.loss(out, y).template item<double>());
  }
}

/// Cross entropy on logits N×C against int64 labels N; metrics loss and
/// accuracy; monitors val_acc (higher is better). The Trainer's default.
struct Classification {
  using task_concept = task_tag;
  static constexpr std::string_view name = "classification";
  static constexpr std::array<std::string_view, 2> metrics{"loss", "acc"};
  /// loss × samples, correct, samples
  static constexpr std::size_t num_sums = 3;
  static constexpr MonitorSpec monitor{"val_acc", Goal::max};
  /// What the progress line counts per second.
  static constexpr std::string_view unit = "img";

  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) const {
    return torch::nn::functional::cross_entropy(out, y);
  }
  std::array<double, 3> sums(const torch::Tensor& out, const torch::Tensor& y,
                             double loss) const {
    const auto n = static_cast<double>(y.size(0));
    return {loss * n, out.argmax(1).eq(y).sum().template item<double>(), n};
  }
  /// Evaluation sums the per-sample losses in one reduction.
  std::array<double, 3> evaluation_sums(const torch::Tensor& out,
                                        const torch::Tensor& y) const {
    namespace F = torch::nn::functional;
    auto s = sums(out, y, 0.0);
    s[0] = F::cross_entropy(out, y,
                            F::CrossEntropyFuncOptions().reduction(torch::kSum))
               .template item<double>();
    return s;
  }
  std::array<double, 2> finish(const std::array<double, 3>& s) const {
    if (s[2] <= 0) return {0.0, 0.0};
    return {s[0] / s[2], s[1] / s[2]};
  }
};

/// Mean squared error between outputs and targets of the same shape;
/// metrics loss (MSE) and mae, both per element; monitors val_loss (lower
/// is better).
struct Regression {
  using task_concept = task_tag;
  static constexpr std::string_view name = "regression";
  static constexpr std::array<std::string_view, 2> metrics{"loss", "mae"};
  /// squared-error sum, absolute-error sum, elements
  static constexpr std::size_t num_sums = 3;
  static constexpr MonitorSpec monitor{"val_loss", Goal::min};

  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) const {
    check(out, y);
    return torch::mse_loss(out, y.to(out.scalar_type()));
  }
  std::array<double, 3> sums(const torch::Tensor& out, const torch::Tensor& y,
                             double loss) const {
    const auto n = static_cast<double>(y.numel());
    return {loss * n, error(out, y).abs().sum().template item<double>(), n};
  }
  /// Evaluation sums the squared errors in float64.
  std::array<double, 3> evaluation_sums(const torch::Tensor& out,
                                        const torch::Tensor& y) const {
    const torch::Tensor d = error(out, y);
    return {d.square().sum().template item<double>(),
            d.abs().sum().template item<double>(),
            static_cast<double>(y.numel())};
  }
  std::array<double, 2> finish(const std::array<double, 3>& s) const {
    if (s[2] <= 0) return {0.0, 0.0};
    return {s[0] / s[2], s[1] / s[2]};
  }

 private:
  static void check(const torch::Tensor& out, const torch::Tensor& y) {
    if (out.sizes() != y.sizes()) {
      throw UsageError(ddpkit::detail::cat(
          "Regression: the model's output has shape ", out.sizes(),
          " but the target has ", y.sizes(), "; they must be equal"));
    }
  }
  /// out - y in float64, detached (shapes checked).
  static torch::Tensor error(const torch::Tensor& out, const torch::Tensor& y) {
    check(out, y);
    return out.detach().to(torch::kFloat64) - y.detach().to(torch::kFloat64);
  }
};

/// Next-token prediction: logits B×T×V against int64 targets B×T (or any
/// N×V against N), cross entropy per token; targets equal to
/// `ignore_index` (padding) count nowhere. Metrics loss (mean per token)
/// and ppl (exp of it) and acc (tokens right); monitors val_loss.
struct LanguageModel {
  using task_concept = task_tag;
  static constexpr std::string_view name = "language-model";
  static constexpr std::array<std::string_view, 3> metrics{"loss", "ppl",
                                                           "acc"};
  /// loss × tokens, correct tokens, tokens
  static constexpr std::size_t num_sums = 3;
  static constexpr MonitorSpec monitor{"val_loss", Goal::min};
  static constexpr std::string_view unit = "seq";
  std::int64_t ignore_index = -100;

  torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) const {
    namespace F = torch::nn::functional;
    return F::cross_entropy(
        flat_logits(out, y), y.reshape({-1}),
        F::CrossEntropyFuncOptions().ignore_index(ignore_index));
  }
  std::array<double, 3> sums(const torch::Tensor& out, const torch::Tensor& y,
                             double loss) const {
    const torch::Tensor t = y.reshape({-1});
    const torch::Tensor keep = t.ne(ignore_index);
    const double tokens = keep.sum().template item<double>();
    const double correct = flat_logits(out, y)
                               .argmax(1)
                               .eq(t)
                               .logical_and(keep)
                               .sum()
                               .template item<double>();
    return {loss * tokens, correct, tokens};
  }
  std::array<double, 3> evaluation_sums(const torch::Tensor& out,
                                        const torch::Tensor& y) const {
    namespace F = torch::nn::functional;
    auto s = sums(out, y, 0.0);
    s[0] = F::cross_entropy(flat_logits(out, y), y.reshape({-1}),
                            F::CrossEntropyFuncOptions()
                                .ignore_index(ignore_index)
                                .reduction(torch::kSum))
               .template item<double>();
    return s;
  }
  std::array<double, 3> finish(const std::array<double, 3>& s) const {
    if (s[2] <= 0) return {0.0, 0.0, 0.0};
    const double loss = s[0] / s[2];
    return {loss, std::exp(loss), s[1] / s[2]};
  }

 private:
  static torch::Tensor flat_logits(const torch::Tensor& out,
                                   const torch::Tensor& y) {
    if (out.dim() != y.dim() + 1 ||
        out.sizes().slice(0, static_cast<std::size_t>(y.dim())) != y.sizes()) {
      throw UsageError(ddpkit::detail::cat(
          "LanguageModel: the model's output has shape ", out.sizes(),
          " and the target ", y.sizes(),
          "; expected logits of the target's shape plus a vocabulary "
          "dimension (B x T x V against B x T)"));
    }
    return out.reshape({-1, out.size(-1)});
  }
};

/// The unit the progress line counts per second: the task's `unit`, or
/// "samples".
template <class Task>
constexpr std::string_view sample_unit() {
  if constexpr (requires { Task::unit; }) {
    return Task::unit;
  } else {
    return "samples";
  }
}

/// A task's finished metrics named `prefix` + its names ("train_loss").
template <task_policy Task>
std::vector<std::pair<std::string, double>> named_metrics(
    const std::array<double, Task::metrics.size()>& values,
    std::string_view prefix) {
  std::vector<std::pair<std::string, double>> out;
  for (std::size_t i = 0; i < values.size(); ++i) {
    out.emplace_back(std::string(prefix) + std::string(Task::metrics[i]),
                     values[i]);
  }
  return out;
}

/// The column names a task's metrics get: train_<m>..., val_<m>...
template <task_policy Task>
std::vector<std::string> metric_columns() {
  std::vector<std::string> names;
  for (std::string_view phase : {"train_", "val_"}) {
    for (std::string_view m : Task::metrics) {
      names.push_back(std::string(phase) + std::string(m));
    }
  }
  return names;
}

}  // namespace ddpkit::train
