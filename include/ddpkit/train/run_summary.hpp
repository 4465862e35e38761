// SPDX-License-Identifier: BSD-3-Clause
// What a run was and what it gave: `RunInfo` (the composition and the
// settings, built once by the Trainer), `FitResult` and `EvalResult`, and
// the two places they are written: OUT/summary.json and the TensorBoard
// hparams table.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/json.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/step_times.hpp"
#include "ddpkit/train/task.hpp"
#include "ddpkit/version.hpp"

namespace ddpkit::train {

/// The result of `fit`.
struct FitResult {
  std::vector<EpochMetrics> history;
  Monitor monitor;        ///< what "best" means
  double best_value = 0;  ///< the monitored metric's best value
  int best_epoch = 0;     ///< its epoch (1-based; 0: none)
  int epochs_run = 0;
  bool stopped_early = false;
  double total_seconds = 0;
  StepTimes step_times;  ///< where this rank's step time went
  /// Seconds each rank waited for the others over the fit's epochs (their
  /// `EpochMetrics::rank_wait_seconds` added; empty with one process), and
  /// the rank that waited least: the one the others waited for.
  std::vector<double> rank_wait_seconds;
  int slowest_rank = -1;
  /// Per rank, in bytes. Counted by ddpkit from the tensors held, at the
  /// fit's end: the optimizer state the rank keeps (ZeRO: its shard), the
  /// most gradient bytes it held at once (the DDP reducer's buckets;
  /// ZeRO-2: its own shard plus the others' buckets in flight), and the
  /// largest buffer the parameters were gathered through (ZeRO; 0
  /// otherwise). Measured outside ddpkit (Note [Measured memory]): the
  /// most the process had resident during a training step (the kernel's
  /// high-water mark, reset per step; shared pages in full), the same with
  /// shared memory counted by the rank's share, and on a CUDA device the
  /// caching allocator's peak of allocated bytes during a step (0 on CPU).
  /// Where the CPU allocator is metered (`metered`, meter_cpu_memory): the
  /// most bytes of CPU tensors allocated at once during a step, and
  /// `peak_step`: that plus the rank's share of the shared-memory segments
  /// (Pss_Shmem at the fit's end: buckets and gather buffers, made before
  /// the steps and kept).
  struct Memory {
    std::vector<double> parameters, optimizer_state, gradients_peak,
        parameter_gather;
    std::vector<double> peak_resident, peak_proportional, device_peak;
    std::vector<double> peak_allocated, peak_step;
    bool metered = false;
    /// false: the kernel would not reset the high-water mark, so the
    /// resident peaks run from each process's start.
    bool peaks_per_step = true;
  } memory;
  /// What checkpoints cost rank 0 over the fit: milliseconds the training
  /// thread spent on them while training (the whole write; with
  /// asynchronous checkpoints the snapshot and any wait for the previous
  /// write), milliseconds of background writing, milliseconds the fit's end
  /// waited for the last background write (asynchronous only), and the
  /// files written.
  struct Checkpoints {
    bool asynchronous = false;
    double blocking_ms = 0, background_ms = 0, drain_ms = 0;
    std::int64_t written = 0;
  } checkpoints;
};

/// The task's metrics over a dataset, the same on every rank.
struct EvalResult {
  /// The task's metrics by name ("loss", "acc", ...), in its order.
  std::vector<std::pair<std::string, double>> metrics;
  double loss = 0;          ///< the first metric, the mean loss
  int64_t count = 0;        ///< samples evaluated, all ranks together
  int64_t local_count = 0;  ///< of those, the samples this rank evaluated

  /// A metric by its task name ("acc"); a UsageError if the task has none.
  double value(std::string_view name) const {
    if (const double* v = find_metric(metrics, name)) return *v;
    throw UsageError(ddpkit::detail::cat("no metric '", name,
                                         "' in this task's evaluation"));
  }
};

/// What a run is: its policies' names, where it runs, and its options —
/// everything summary.json and the hparams table say besides the results.
struct RunInfo {
  std::string mode;     ///< the parallel policy's name
  std::string sampler;  ///< "distributed" or "local"
  std::string bn, lr_scaling, evaluation, task;
  int world_size = 1;
  std::string transport = "none";  ///< the group's, for several processes
  int hosts = 1;
  std::string comm;  ///< the gradient communication (DDP), else ""
  Monitor monitor;
  TrainerOptions options;
};

/// OUT/summary.json's text: the run, its results, the test set's metrics
/// (`test`, optional) and the bytes of gradients sent per step (where the
/// engine reports them).
inline std::string summary_json(const RunInfo& info, const FitResult& r,
                                const EvalResult* test,
                                std::optional<double> gradient_bytes) {
  const TrainerOptions& o = info.options;
  JsonObject j;
  j.add("run_name", o.run_name());
  // "example": the run's name where one was given (the examples name
  // theirs); a program that keeps the default has no such key.
  if (o.run_name() != TrainerOptions().run_name()) {
    j.add("example", o.run_name());
  }
  j.add("ddpkit_version", std::string(ddpkit::version))
      .add("libtorch_version", ddpkit::compat::torch_version())
      .add("mode", info.mode)
      .add("world_size", info.world_size)
      .add("transport", info.transport)
      .add("hosts", info.hosts)
      .add("sampler", info.sampler)
      .add("bn", info.bn)
      .add("lr_scaling", info.lr_scaling)
      .add("evaluation", info.evaluation)
      .add("task", info.task)
      .add("precision", precision_name(o.precision()))
      .add("memory_format", memory_format_name(o.memory_format()))
      .add("epochs_run", r.epochs_run)
      .add("stopped_early", r.stopped_early)
      .add("monitor", r.monitor.name)
      .add("monitor_mode", std::string(r.monitor.goal_name()))
      .add("best_epoch", r.best_epoch)
      .add("best_" + r.monitor.name, r.best_value)
      .add("final_" + r.monitor.name,
           r.history.empty() ? 0.0 : r.history.back().value(r.monitor.name));
  if (test) {
    for (const auto& [name, value] : test->metrics) {
      j.add("test_" + name, value);
    }
  }
  if (!info.comm.empty()) {
    j.add("comm", info.comm)
        .add("gradient_bytes_per_step", gradient_bytes.value_or(0.0));
  }
  // Over the epochs with a train/val split (older checkpoints' rows have
  // none: NaN).
  double images = 0, seconds = 0, train_seconds = 0;
  for (const auto& m : r.history) {
    if (!std::isfinite(m.train_seconds)) continue;
    images += m.epoch_images_per_second * m.seconds;
    seconds += m.seconds;
    train_seconds += m.train_seconds;
  }
  j.add("total_seconds", r.total_seconds)
      .add("train_images_per_second",
           train_seconds > 0 ? images / train_seconds : 0.0)
      .add("epoch_images_per_second", seconds > 0 ? images / seconds : 0.0);
  if (!r.rank_wait_seconds.empty()) {
    j.raw("wait_seconds_per_rank", detail::json_array(r.rank_wait_seconds))
        .add("slowest_rank", r.slowest_rank);
  }
  if (!r.memory.optimizer_state.empty()) {
    ddpkit::detail::JsonObject mem;
    mem.raw("parameters", detail::json_array(r.memory.parameters))
        .raw("optimizer_state", detail::json_array(r.memory.optimizer_state))
        .raw("gradients_peak", detail::json_array(r.memory.gradients_peak))
        .raw("parameter_gather", detail::json_array(r.memory.parameter_gather))
        .raw("step_peak_resident", detail::json_array(r.memory.peak_resident))
        .raw("step_peak_proportional",
             detail::json_array(r.memory.peak_proportional))
        .add("step_peaks_per_step", r.memory.peaks_per_step);
    if (r.memory.metered) {
      mem.raw("step_peak_allocated",
              detail::json_array(r.memory.peak_allocated))
          .raw("peak_step", detail::json_array(r.memory.peak_step));
    }
    if (std::any_of(r.memory.device_peak.begin(), r.memory.device_peak.end(),
                    [](double b) { return b > 0; })) {
      mem.raw("step_peak_device_allocated",
              detail::json_array(r.memory.device_peak));
    }
    j.raw("memory_bytes_per_rank", mem.compact());
  }
  if (r.checkpoints.written > 0) {
    ddpkit::detail::JsonObject ck;
    ck.add("blocking", r.checkpoints.blocking_ms)
        .add("background", r.checkpoints.background_ms);
    if (r.checkpoints.asynchronous) ck.add("drain", r.checkpoints.drain_ms);
    j.raw("checkpoint_ms", ck.compact())
        .add("checkpoints_written", static_cast<long>(r.checkpoints.written))
        .add("async_checkpoints", r.checkpoints.asynchronous);
  }
  // Rank 0's step time by phase, ms per step (StepTimes).
  if (r.step_times.steps > 0) j.raw("step_ms", r.step_times.json());
  if (o.accumulate() > 1) j.add("accumulate", o.accumulate());
  if (o.keep_best() != 1) j.add("keep_best", o.keep_best());
  if (o.clip().max_norm() > 0) {
    j.add("clip_grad_norm", o.clip().max_norm())
        .add("clip_norm_type", o.clip().norm_type());
  }
  if (o.clip().max_value() > 0) j.add("clip_grad_value", o.clip().max_value());
  return j.str();
}

/// Writes `summary_json` to OUT/summary.json (atomically).
inline void write_summary(const RunInfo& info, const FitResult& r,
                          const EvalResult* test,
                          std::optional<double> gradient_bytes) {
  ddpkit::detail::write_atomically(
      std::filesystem::path(info.options.out_dir()) / "summary.json",
      summary_json(info, r, test, gradient_bytes));
}

/// The TensorBoard hparams table (markdown) of a run whose loader has
/// `batch_size` per rank.
inline std::string hparams_markdown(const RunInfo& info,
                                    std::size_t batch_size) {
  const TrainerOptions& o = info.options;
  std::string md = "| setting | value |\n|---|---|\n";
  auto row = [&](const std::string& k, const std::string& v) {
    md += "| " + k + " | " + v + " |\n";
  };
  using ddpkit::detail::num;
  row("run", o.run_name());
  row("mode", info.mode);
  row("world_size", std::to_string(info.world_size));
  row("bn", info.bn);
  row("lr_scaling", info.lr_scaling);
  row("evaluation", info.evaluation);
  row("task", info.task);
  row("monitor",
      info.monitor.name + " (" + std::string(info.monitor.goal_name()) + ")");
  row("epochs", std::to_string(o.epochs()));
  row("lr", num(o.lr()));
  row("batch_size_per_rank", std::to_string(batch_size));
  row("accumulate", std::to_string(o.accumulate()));
  row("clip_grad_norm", num(o.clip().max_norm()));
  row("clip_grad_value", num(o.clip().max_value()));
  row("seed", std::to_string(o.seed()));
  row("max_steps", std::to_string(o.max_steps()));
  row("precision", precision_name(o.precision()));
  row("memory_format", memory_format_name(o.memory_format()));
  if (!info.comm.empty()) row("comm", info.comm);
  row("torch", ddpkit::compat::torch_version());
  return md;
}

}  // namespace ddpkit::train
