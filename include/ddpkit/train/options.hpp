// SPDX-License-Identifier: BSD-3-Clause
// What the Trainer does: its options, their validation (every bad value a
// UsageError naming the option), and the monitored metric they choose.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <torch/torch.h>

#include "ddpkit/data/samplers.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/train/clip.hpp"
#include "ddpkit/train/lr.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/task.hpp"

namespace ddpkit::train {

/// What the Trainer does; each field says whether changing it after
/// construction has effect (all are read at `fit`).
/// What DDP training does when ranks have different numbers of batches in
/// an epoch.
enum class UnevenInputs {
  /// Fail before the epoch, on every rank, naming the counts (default).
  refuse,
  /// PyTorch's Join: ranks that run out keep taking part in the others'
  /// gradient all-reduces with zeros until every rank is done; the last
  /// rank to finish broadcasts its model (see BasicDDP::engine::join_round).
  join,
};

/// The numbers training computes with, named as Lightning names them.
enum class Precision {
  /// "32": float32 throughout (default).
  fp32,
  /// "bf16-mixed": forward (and evaluation) under autocast to bfloat16, on
  /// CPU and CUDA; parameters, gradients and optimizer state stay float32,
  /// and no loss scaling is needed (bfloat16 has float32's range).
  bf16_mixed,
  /// "16-mixed": CUDA only: autocast to float16 with a dynamic loss scale
  /// whose overflow check is reduced across ranks (`--amp`).
  fp16_mixed,
  /// "auto": one of the above, chosen by the Trainer when it is built (rank
  /// 0 for all): what the checkpoint a resume starts from recorded, else
  /// the hardware's rule (train/auto_settings.hpp, Note [auto settings]).
  automatic,
};

/// "32", "bf16-mixed", "16-mixed", "auto".
inline const char* precision_name(Precision p) {
  switch (p) {
    case Precision::bf16_mixed: return "bf16-mixed";
    case Precision::fp16_mixed: return "16-mixed";
    case Precision::automatic: return "auto";
    default: return "32";
  }
}

/// The precision a name ("32", "bf16-mixed", "16-mixed", "auto") means;
/// nullopt for any other string.
inline std::optional<Precision> precision_from_name(const std::string& s) {
  if (s == "32") return Precision::fp32;
  if (s == "bf16-mixed") return Precision::bf16_mixed;
  if (s == "16-mixed") return Precision::fp16_mixed;
  if (s == "auto") return Precision::automatic;
  return std::nullopt;
}

/// The memory layout of a model's 4-D parameters, buffers and inputs.
enum class MemoryFormat {
  /// "contiguous": NCHW (default).
  contiguous,
  /// "channels-last": NHWC, which oneDNN's bfloat16 convolutions on CPUs
  /// with AMX and cuDNN's tensor cores prefer.
  channels_last,
  /// "auto": one of the above, chosen by the Trainer when it is built:
  /// what the checkpoint a resume starts from recorded, else timed on
  /// TrainerOptions::layout_sample (train/memory_format.hpp).
  automatic,
};

/// "contiguous", "channels-last", "auto".
inline const char* memory_format_name(MemoryFormat f) {
  switch (f) {
    case MemoryFormat::channels_last: return "channels-last";
    case MemoryFormat::automatic: return "auto";
    default: return "contiguous";
  }
}

/// The layout a name ("contiguous", "channels-last", "auto") means; nullopt
/// for any other string.
inline std::optional<MemoryFormat> memory_format_from_name(
    const std::string& s) {
  if (s == "contiguous") return MemoryFormat::contiguous;
  if (s == "channels-last") return MemoryFormat::channels_last;
  if (s == "auto") return MemoryFormat::automatic;
  return std::nullopt;
}

/// libtorch's memory format for a chosen layout (`automatic` must have been
/// resolved: std::logic_error otherwise).
inline torch::MemoryFormat torch_memory_format(MemoryFormat f) {
  if (f == MemoryFormat::automatic) {
    throw std::logic_error("memory format auto used before it was resolved");
  }
  return f == MemoryFormat::channels_last ? torch::MemoryFormat::ChannelsLast
                                          : torch::MemoryFormat::Contiguous;
}

/// The layout libtorch's `Contiguous` or `ChannelsLast` names; a UsageError
/// for any other (4-D models only).
inline MemoryFormat memory_format_of(torch::MemoryFormat f) {
  if (f == torch::MemoryFormat::ChannelsLast) {
    return MemoryFormat::channels_last;
  }
  if (f != torch::MemoryFormat::Contiguous) {
    throw UsageError(
        "memory_format must be Contiguous or ChannelsLast (4-D models)");
  }
  return MemoryFormat::contiguous;
}

/// The autocast dtype of a mixed precision (float32 for "32").
inline torch::ScalarType autocast_dtype(Precision p) {
  switch (p) {
    case Precision::bf16_mixed: return torch::kBFloat16;
    case Precision::fp16_mixed: return torch::kHalf;
    default: return torch::kFloat32;
  }
}

struct TrainerOptions {
  TORCH_ARG(int, epochs) = 30;
  /// Base learning rate, before the LR-scaling policy and the schedule.
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(ScheduleOptions, schedule) = {};
  /// Early stopping: stop after this many epochs without a better
  /// monitored metric (0: never).
  TORCH_ARG(int, patience) = 0;
  /// Where rank 0 writes metrics, checkpoints and the summary.
  TORCH_ARG(std::string, out_dir) = "runs/ddpkit";
  /// "" (fresh), a checkpoint path, or "auto": OUT/checkpoints/last.pt if
  /// it exists (OUT/checkpoints/last-prev.pt, the one before, when last.pt
  /// is damaged or missing, with a warning); a fresh start when OUT holds
  /// no earlier run, else an error (see `overwrite`).
  TORCH_ARG(std::string, resume) = "";
  /// A run that does not resume into an OUT holding an earlier run's
  /// checkpoints or metrics is refused (its outputs would be overwritten
  /// one by one, and a `resume("auto")` could mix the two runs); true
  /// starts fresh there, removing the earlier checkpoints/last*.pt and
  /// best*.pt first. Whatever this says, one run at a time holds OUT (a
  /// lock, OUT/.lock): a second is refused, naming the first's process.
  TORCH_ARG(bool, overwrite) = false;
  /// After each optimizer step's backward the ranks agree whether every
  /// rank's loss and the averaged gradients are finite (folded into the
  /// per-step agreement on signals, no extra collective when that runs).
  /// A non-finite step is not taken; with `skip_nonfinite` 0 (default)
  /// training stops with a NonFiniteError naming the step, the epoch and
  /// the first rank whose loss was non-finite, and the checkpoints keep the
  /// last good weights. false: no check. Mixed precision keeps its loss
  /// scaler's rule instead.
  TORCH_ARG(bool, check_finite) = true;
  /// Skip (do not take, do not count in the metrics) up to this many
  /// non-finite steps over the run, each reported, before stopping.
  TORCH_ARG(int, skip_nonfinite) = 0;
  /// Resuming from a checkpoint written with another world size or seed,
  /// or with another training set (its size, or the `fingerprint()` of
  /// ImageFiles / ImageTensors: file names, labels and sizes; shape,
  /// labels and the images' first and last 64 KiB) is refused (the
  /// sampler's order and each rank's share would change), and so is one
  /// written with another precision or memory format (the continuation
  /// would round differently); true resumes anyway and says what changed.
  TORCH_ARG(bool, resume_allow_changes) = false;
  /// Cap on steps per epoch (0: no cap), for smoke runs and benchmarks.
  TORCH_ARG(int64_t, max_steps) = 0;
  /// Seeds sampling, augmentation (with the rank) and dropout.
  TORCH_ARG(std::uint64_t, seed) = 42;
  /// Write checkpoints/last.pt every epoch and best.pt on improvement.
  TORCH_ARG(bool, checkpoints) = true;
  /// Keep the best this many epochs' checkpoints by the monitored metric:
  /// checkpoints/best.pt is always the best one; with k > 1 the k best are
  /// also kept as checkpoints/best-epoch-<E>.pt (best.pt a hard link to the
  /// first), files that drop out of the k best removed. Ties go to the
  /// earlier epoch. 0: no best checkpoints.
  TORCH_ARG(int, keep_best) = 1;
  /// Also write checkpoints/last.pt within epochs, every this many batches
  /// (counted over the run; 0: at epoch ends only). It holds the batch, the
  /// metrics so far and every rank's CPU generator, so `resume("auto")`
  /// continues at that batch with the weights an uninterrupted run has (CPU:
  /// bit for bit). Needs the same world size to resume; not with
  /// `uneven_inputs(join)`.
  TORCH_ARG(std::int64_t, checkpoint_every_n_steps) = 0;
  /// SIGTERM or SIGINT during `fit` (what torchrun, SLURM and Ctrl-C send
  /// before killing) stops training at the next batch boundary instead of
  /// at once: the ranks agree on the batch (in the per-step all-reduce of
  /// `check_finite`, after each step's backward; a signal that arrives
  /// after it is acted on at the next step), rank 0 writes checkpoints/last.pt there (as
  /// `checkpoint_every_n_steps` does, resumable with `resume("auto")`), and
  /// `fit` throws `Interrupted` (`launch` exits 128 + the signal). A signal
  /// during evaluation stops after the epoch's checkpoint. A second signal
  /// ends the process at once. With `uneven_inputs(join)` the ranks stop
  /// at the epoch's end. false: the signals keep their usual effect.
  TORCH_ARG(bool, checkpoint_on_signal) = true;
  /// The metric that means "best" for early stopping, keep_best, best.pt
  /// and summary.json: "val_<m>" or "train_<m>" for a metric m of the task
  /// (metrics.jsonl's columns). "" : the task's own (Classification:
  /// val_acc, Regression and LanguageModel: val_loss).
  TORCH_ARG(std::string, monitor) = "";
  /// "min" or "max"; "" : the task's when it is the task's metric, min for
  /// a name ending in "_loss", else an error asking for it.
  TORCH_ARG(std::string, monitor_mode) = "";
  /// Also write the model's state dict (Python-loadable) each epoch to this
  /// pattern under OUT, `{epoch}` replaced (flowers:
  /// "weights/model-{epoch}.pt").
  TORCH_ARG(std::string, weights_pattern) = "";
  /// With rank-0 evaluation (RankZeroEval), how long the other ranks wait
  /// for rank 0 to evaluate the validation set, in seconds. They wait
  /// through the store, so a validation set that takes longer than the
  /// collective timeout does not fail them.
  TORCH_ARG(double, eval_timeout) = 3600;
  /// Rank 0 prints progress and one line per epoch.
  TORCH_ARG(bool, verbose) = true;
  /// Where stdout is not a terminal (SLURM, torchrun, a pipe), how often
  /// rank 0 prints a progress line (step, loss, throughput, time left):
  /// every N batches and/or every S seconds (default 30 s).
  TORCH_ARG(ProgressOptions, progress) = {};
  /// Names the run in summary.json ("cifar10", "flowers-resnet34").
  TORCH_ARG(std::string, run_name) = "ddpkit";
  /// Drop the tail of the training set so every rank has equal batches.
  TORCH_ARG(bool, drop_last) = false;
  /// DistributedSampling's own options for the training set (e.g.
  /// `.shuffle(false)`: every epoch in the dataset's order, sharded);
  /// other samplers ignore them. `evaluation` must stay false (the Trainer
  /// shards evaluation itself).
  TORCH_ARG(data::DistributedSamplingOptions, sampling) = {};
  /// Ranks with different batch counts: refuse (default) or join.
  TORCH_ARG(UnevenInputs, uneven_inputs) = UnevenInputs::refuse;
  /// 32 (default), bf16-mixed (CPU and CUDA), 16-mixed (CUDA) or
  /// automatic (resolved when the Trainer is built; `Trainer::options()`
  /// holds the choice); see `Precision`. Checkpoints hold float32 weights
  /// whichever is chosen.
  TORCH_ARG(Precision, precision) = Precision::fp32;

 public:
  /// The memory layout of 4-D parameters, buffers and inputs (see
  /// `MemoryFormat`; libtorch's `Contiguous` and `ChannelsLast` are taken
  /// too): contiguous (default), channels-last or automatic (resolved when
  /// the Trainer is built, timed on `layout_sample` unless a resume's
  /// checkpoint recorded one). The model is converted at construction,
  /// before DDP lays out its gradient buckets (each gradient keeps its
  /// parameter's strides), and each batch's input at its copy to the device.
  TrainerOptions& memory_format(MemoryFormat f) {
    memory_format_ = f;
    return *this;
  }
  TrainerOptions& memory_format(torch::MemoryFormat f) {
    memory_format_ = memory_format_of(f);
    return *this;
  }
  MemoryFormat memory_format() const noexcept {
    return memory_format_;
  }

  /// A batch of the training input's shape (values do not matter): what
  /// MemoryFormat::automatic times both layouts on. Needed only then.
  TORCH_ARG(torch::Tensor, layout_sample) = {};
  /// The earlier name of `precision(Precision::fp16_mixed)` (true) and
  /// `precision(Precision::fp32)` (false).
  TrainerOptions& mixed_precision(bool on) {
    precision_ = on ? Precision::fp16_mixed : Precision::fp32;
    return *this;
  }
  bool mixed_precision() const {
    return precision_ == Precision::fp16_mixed;
  }
  /// Gradient accumulation: this many batches per optimizer step (1: none).
  /// The gradients of the first k-1 are kept locally (the engine's
  /// `no_sync`: DDP communicates once per step, on the last batch), and
  /// each batch's loss is weighted by its share of the step's samples, so
  /// k batches of b equal one batch of k*b (a short last step at the end
  /// of an epoch included). `max_steps` still counts batches. Not with
  /// `uneven_inputs(join)`.
  TORCH_ARG(int, accumulate) = 1;
  /// Gradient clipping (off by default), applied to the averaged gradients
  /// before each optimizer step; with mixed precision after unscaling, and
  /// only on steps that are taken.
  TORCH_ARG(ClipOptions, clip) = {};
  /// Rank 0 writes TensorBoard event files to OUT/tb: per epoch (step =
  /// epoch, 1-based) the recipe's tags train/loss, train/acc, val/loss,
  /// val/acc, lr, plus train/images_per_second, time/train_seconds and
  /// time/val_seconds; per batch train/loss_step (below); the run's
  /// settings as text (tag "hparams"). Flushed at each epoch's end.
  TORCH_ARG(bool, tensorboard) = true;
  /// Every this many batches (counted over the whole run, resumes
  /// included) rank 0 logs its batch loss as train/loss_step (0: never).
  TORCH_ARG(int, log_every_n_steps) = 50;
  /// Rank 0 writes checkpoints in the background: the step blocks only
  /// while the state is copied to host memory (a second copy of the model
  /// and optimizer state while a write runs); one write at a time, each
  /// atomic as before. See Note [Asynchronous checkpoints].
  TORCH_ARG(bool, async_checkpoints) = false;
  /// Every rank writes its own part of the model and optimizer state to
  /// OUT/checkpoints/shards/<state>/rank-R-of-W.pt (ZeRO-1/2: the
  /// parameters it owns; ZeRO-3: its shards; other engines: rank 0
  /// everything), no rank gathering the whole state; `last.pt` becomes the
  /// manifest naming them, written once every rank's file is durable.
  /// Resumes at any world size and under any engine; the out folder must
  /// be shared by every host. See Note [Sharded training checkpoints].
  TORCH_ARG(bool, sharded_checkpoints) = false;

 private:
  MemoryFormat memory_format_ = MemoryFormat::contiguous;
};

/// The training set's sampler for rank `rank` of `world` over `n` samples
/// as `o` describes it (seed, drop_last, and for DistributedSampling its
/// options, TrainerOptions::sampling).
template <class Sampler>
Sampler training_sampler(const TrainerOptions& o, std::size_t n, int rank,
                         int world) {
  const data::ShardSpec spec{.rank = rank,
                             .world_size = world,
                             .seed = o.seed(),
                             .drop_last = o.drop_last()};
  if constexpr (std::is_constructible_v<Sampler, std::size_t, data::ShardSpec,
                                        data::DistributedSamplingOptions>) {
    return Sampler(n, spec, o.sampling());
  } else {
    return Sampler(n, spec);
  }
}

/// Throws a UsageError naming the first option with a bad value (or two
/// that cannot be combined).
inline void check_options(const TrainerOptions& o) {
  using ddpkit::detail::cat;
  if (o.epochs() < 1) {
    throw UsageError(cat("epochs ", o.epochs(), " must be >= 1"));
  }
  if (!(o.lr() > 0)) {
    throw UsageError(cat("lr ", o.lr(), " must be > 0"));
  }
  if (o.sampling().evaluation()) {
    throw UsageError(
        "sampling().evaluation() is true: the training sampler cannot be in "
        "evaluation mode (ranks would differ by a sample and DDP would hang); "
        "the Trainer shards evaluation itself");
  }
  if (o.max_steps() < 0) {
    throw UsageError(cat("max_steps ", o.max_steps(), " must be >= 0"));
  }
  if (o.checkpoint_every_n_steps() < 0) {
    throw UsageError(cat("checkpoint_every_n_steps ",
                         o.checkpoint_every_n_steps(),
                         " must be >= 0 (0: at epoch ends only)"));
  }
  if (o.checkpoint_every_n_steps() > 0 &&
      o.uneven_inputs() == UnevenInputs::join) {
    throw UsageError(
        "checkpoint_every_n_steps cannot be combined with "
        "uneven_inputs(join): ranks with different batch counts cannot agree "
        "on a step to checkpoint at");
  }
  if (o.keep_best() < 0) {
    throw UsageError(cat("keep_best ", o.keep_best(),
                         " must be >= 0 (0: no best checkpoints)"));
  }
  if (o.progress().every_n_steps() < 0 ||
      !(o.progress().every_seconds() >= 0)) {
    throw UsageError(cat("progress every ", o.progress().every_n_steps(),
                         " steps / ", o.progress().every_seconds(),
                         " s: both must be >= 0 (0: off)"));
  }
  if (o.log_every_n_steps() < 0) {
    throw UsageError(cat("log_every_n_steps ", o.log_every_n_steps(),
                         " must be >= 0 (0: never)"));
  }
  if (o.accumulate() < 1) {
    throw UsageError(cat("accumulate ", o.accumulate(),
                         " must be >= 1 (batches per optimizer step)"));
  }
  if (o.accumulate() > 1 && o.uneven_inputs() == UnevenInputs::join) {
    throw UsageError(cat("accumulate ", o.accumulate(),
                         " cannot be combined with uneven_inputs(join): a "
                         "rank that has run out cannot tell which of the "
                         "others' batches communicate"));
  }
  if (o.skip_nonfinite() < 0) {
    throw UsageError(cat("skip_nonfinite ", o.skip_nonfinite(),
                         " must be >= 0 (0: stop at the first non-finite "
                         "step)"));
  }
  o.clip().check();
}

/// The monitored metric: the options' (checked against the task's
/// columns) or the task's own.
template <task_policy Task>
Monitor resolve_monitor(const TrainerOptions& o) {
  using ddpkit::detail::cat;
  const auto columns = metric_columns<Task>();
  Monitor m{std::string(Task::monitor.name), Task::monitor.goal};
  if (!o.monitor().empty()) {
    if (std::find(columns.begin(), columns.end(), o.monitor()) ==
        columns.end()) {
      throw UsageError(cat("monitor '", o.monitor(), "': the task ", Task::name,
                           " has ", ddpkit::detail::join(columns, ", ")));
    }
    if (o.monitor_mode().empty() && o.monitor() != m.name) {
      const std::string& n = o.monitor();
      if (n.size() < 5 || n.compare(n.size() - 5, 5, "_loss") != 0) {
        throw UsageError(cat("monitor '", n,
                             "': say whether lower or higher is better "
                             "(monitor_mode / --mode min or max)"));
      }
      m.goal = Goal::min;
    }
    m.name = o.monitor();
  }
  if (!o.monitor_mode().empty()) m.goal = parse_goal(o.monitor_mode());
  return m;
}

}  // namespace ddpkit::train
