// SPDX-License-Identifier: BSD-3-Clause
// Callbacks: what happens at the training loop's boundaries. `Trainer::fit`
// is a short loop that hands events (FitBegin, EpochBegin, BatchEnd,
// StepEnd, EpochEnd, FitEnd) to a compile-time pack of callbacks:
// EarlyStopping, the user's (in the order given), then ModelCheckpoint,
// MetricsFiles, TensorBoardLog and ProgressDisplay -- so the checkpoint
// written at a StepEnd or EpochEnd holds every callback's state after it.
//
// A callback is a class with `on(const Event&)` for the events it wants:
// ```
// struct PrintLoss {
//   void on(const ddpkit::train::EpochEnd& e) {
//     std::printf("epoch %d: %.4f\n", e.metrics.epoch, e.metrics.train_loss());
//   }
// };
// trainer.fit(train, val, train_tf, eval_tf, loader_opts, PrintLoss{});
// ```
// The event is named by its type, so a misspelt event is a compile error,
// and a class with no `on(...)` for any event fails the `callback` concept
// where `fit` is called. A callback with state gives it a `name` and
// `state()` / `load_state(v)`: it is saved in every checkpoint (under
// "callbacks/<name>") and restored on resume. Only rank 0 writes
// checkpoints, so only rank 0's `state()` is called (it must not start a
// collective) and every rank loads rank 0's state. Setting `stop` at an
// EpochEnd on any rank stops every rank after that epoch.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <concepts>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/nn/state_dict.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/step_times.hpp"
#include "ddpkit/train/task.hpp"
#include "ddpkit/train/tensorboard.hpp"

namespace ddpkit::train {

// Note [The loop and its callbacks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The loop and its callbacks. `Trainer::fit` is a loop over events (FitBegin,
// EpochBegin, BatchEnd per batch, StepEnd per optimizer step, EpochEnd,
// FitEnd) that hands each to a compile-time pack: the ready-made callbacks in
// `train/callbacks.hpp` and the user's in this order — `EarlyStopping`
// (patience), the user's (in the order given), `ModelCheckpoint` (last.pt at
// epoch ends and every N batches, the k best, weights by pattern),
// `MetricsFiles`, `TensorBoardLog`, `ProgressDisplay` — so a checkpoint
// written at a `StepEnd` or `EpochEnd` holds every callback's state, and the
// generator, after that event (tested: a callback counting epochs resumes at
// 4 after 2 + 2; with the user's callbacks after the checkpoint it was 3). A
// mid-epoch resume restores the generator after `EpochBegin`, as the
// uninterrupted run had it. `stop` set by a callback on any rank is
// all-reduced at the epoch's end (with the signal flag, one 16-byte
// all-reduce), so every rank stops after the same epoch (tested with rank 1
// alone asking). Only rank 0's `state()` is saved; every rank loads it. What
// stays in the Trainer is what every rank must do alike: the step
// (accumulation, AMP, clipping), the epoch's reduction and evaluation,
// best/bad-epoch bookkeeping in `FitState`, the signal stop, and the
// checkpoint itself: `save_checkpoint` is the one place the versioned
// dictionary is written (model, optimizer, loop state, loss scale, RNG,
// mid-epoch position, then each stateful callback's `state()` under
// `callbacks/<name>`) and `try_resume` the one place it is read. Callbacks
// reach it through `CheckpointWriter` (`write` on rank 0 at an epoch's end;
// `write_mid_epoch` on every rank at a `StepEnd`, since the metrics and every
// rank's generator are gathered). An event is a type and a callback
// implements `on(const Event&)`: a misspelt event does not compile, and a
// class whose hooks carry other names (e.g. the earlier
// `on_epoch_end(EpochMetrics)`) fails the `callbacks` concept where `fit` is
// called (compile-fail test `misspelt_callback`: "required for the
// satisfaction of 'callbacks<Callbacks ...>' [with Callbacks =
// {OldStyleHooks}]"). Not caught: a class with one correct `on` and a second
// hook under a wrong name (that hook is never called). A `state()` without
// `name` and `load_state` is refused (`state_complete`), so state is never
// silently dropped; two stateful callbacks with one name are a `UsageError`.
// A checkpoint without a callback's key (an older run) leaves that callback
// as constructed. Member functions are defined in the class (no macro
// repeating the `requires` clause).

// Note [Best checkpoints are ranked from the history]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Best checkpoints are ranked from the history. `keep_best(k)` ranks the
// epochs of the run's history (which the checkpoint carries) by the monitored
// metric, ties to the earlier epoch, so a resumed run keeps exactly the set
// an uninterrupted one would (tested). With k > 1 each kept epoch is
// `best-epoch-E.pt`, written atomically before any file that left the k best
// is removed; `best.pt` is a hard link to the first, made beside it and
// renamed over it. With k = 1 only `best.pt` is written, as before, and
// earlier runs' `best-epoch-*` files are left alone.

/// Writes checkpoints for callbacks (the Trainer is one): the whole
/// training state as one versioned dictionary, atomically.
class CheckpointWriter {
 public:
  /// Rank 0 only, at an epoch's end (after `EpochEnd`'s bookkeeping).
  virtual void write(const std::filesystem::path& path) = 0;
  /// Every rank, at the same `StepEnd`: the state after `FitState::step`
  /// batches of the running epoch (each rank's generator and the metrics
  /// so far are gathered); rank 0 writes it.
  virtual void write_mid_epoch(const std::filesystem::path& path) = 0;
  /// Rank 0: runs `fn`, a file operation on checkpoints written before it
  /// (a link, a removal), after them: at once, or with asynchronous
  /// checkpoints in their background job. `write` may return before its
  /// file exists; what needs the file goes here.
  virtual void then(std::function<void()> fn) = 0;

 protected:
  ~CheckpointWriter() = default;
};

/// Where a `fit` stands. Callbacks read it; `stop` and `stop_reason` are
/// theirs to set.
struct FitState {
  std::filesystem::path out;     ///< the output folder
  bool is_main = true;           ///< rank 0, the one that writes files
  int world = 1;                 ///< ranks training together
  int epochs = 0;                ///< epochs asked for
  int epoch = 0;                 ///< the epoch running (0-based)
  std::size_t step = 0;          ///< batches done in it, on this rank
  std::size_t steps = 0;         ///< batches in it, on this rank
  std::int64_t global_step = 0;  ///< batches over the run, resumes included
  std::int64_t last_checkpoint_step = 0;  ///< `global_step` at the last one
  double lr = 0;                          ///< this epoch's learning rate
  /// This epoch so far, this rank (rank 0 also holds the other ranks'
  /// batches from before a mid-epoch resume).
  double loss_sum = 0, count = 0;
  /// This epoch's task sums so far (`Task::sums`), like `loss_sum`.
  std::vector<double> sums;
  double resumed_images = 0;  ///< of `count`, trained before the resume
  std::chrono::steady_clock::time_point epoch_start;
  std::vector<EpochMetrics> history;  ///< the finished epochs
  Monitor monitor;                    ///< what "best" means in this fit
  double best = std::numeric_limits<double>::quiet_NaN();  ///< NaN: none
  int best_epoch = 0;       ///< its epoch (1-based; 0: none)
  int bad_epochs = 0;       ///< epochs since it
  bool stop = false;        ///< no further epoch (set at `EpochEnd`)
  std::string stop_reason;  ///< said at `FitEnd` (early stop, signal)
  int signal = 0;           ///< the signal that stopped the run, or 0
  torch::nn::Module* module = nullptr;      ///< the model being trained
  CheckpointWriter* checkpoints = nullptr;  ///< for checkpoint callbacks
  StepTimes times;  ///< where this rank's step time went, this fit
  /// `times.waited()` when the epoch began (the epoch's wait is the rest).
  double wait_at_epoch_start = 0;
};

/// Counts epoch `m` towards the best (a better monitored value, the first
/// that is not NaN) or the bad epochs since.
inline void rank_epoch(FitState& s, const EpochMetrics& m) {
  const double v = m.value(s.monitor.name);
  if (s.best_epoch == 0 ? !std::isnan(v) : s.monitor.better(v, s.best)) {
    s.best = v;
    s.best_epoch = m.epoch;
    s.bad_epochs = 0;
  } else {
    ++s.bad_epochs;
  }
}

/// Best value, its epoch and the epochs since, from the history alone.
inline void rank_history(FitState& s) {
  s.best = std::numeric_limits<double>::quiet_NaN();
  s.best_epoch = s.bad_epochs = 0;
  for (const auto& m : s.history) rank_epoch(s, m);
}

/// After resuming, before the first epoch.
struct FitBegin {
  FitState& state;
};
/// The epoch's lr, sampler and batches are set (`state.steps`).
struct EpochBegin {
  FitState& state;
};
/// After each batch (its optimizer step taken): `loss` is this rank's
/// batch mean.
struct BatchEnd {
  FitState& state;
  double loss;
};
/// After each optimizer step and its batches' `BatchEnd`: every rank is at
/// the same point (collectives allowed; with `uneven_inputs(join)` they are
/// not, since ranks take different numbers of steps).
struct StepEnd {
  FitState& state;
};
/// After evaluation, `metrics` appended to `state.history`, best and
/// bad epochs updated.
struct EpochEnd {
  FitState& state;
  const EpochMetrics& metrics;
};
/// The last event: after the last epoch, early stopping, or a signal
/// (`state.signal`; `fit` then throws `Interrupted`).
struct FitEnd {
  FitState& state;
};

template <class C, class Event>
concept handles_event = requires(C& c, const Event& e) { c.on(e); };

/// A class that handles at least one event. One that handles none (a
/// misspelt `on`, or hooks under other names) is refused.
template <class C>
concept handles_some_event =
    std::is_class_v<C> &&
    (handles_event<C, FitBegin> || handles_event<C, EpochBegin> ||
     handles_event<C, BatchEnd> || handles_event<C, StepEnd> ||
     handles_event<C, EpochEnd> || handles_event<C, FitEnd>);

/// What `fit` takes as a callback (by value or reference; a const one
/// needs const `on` members).
template <class C>
concept callback = handles_some_event<std::remove_reference_t<C>>;

/// Every one of `Cs` is a `callback`.
template <class... Cs>
concept callbacks = (callback<Cs> && ...);

/// A callback whose state goes into checkpoints: `name` (unique among the
/// callbacks of a fit), `state()` and `load_state(v)`.
template <class C>
concept stateful_callback =
    callback<C> && requires(C& c, const C& cc, const c10::IValue& v) {
      { C::name } -> std::convertible_to<std::string_view>;
      { cc.state() } -> std::convertible_to<c10::IValue>;
      c.load_state(v);
    };

/// Declaring `state()` without the rest of `stateful_callback` is an
/// error, not a callback whose state is silently dropped.
template <class C>
concept state_complete =
    !requires(const C& c) { c.state(); } || stateful_callback<C>;

/// Hands `event` to every callback that handles it, in order.
template <class Event, class... Cs>
void emit(const Event& event, Cs&... cs) {
  (
      [&] {
        if constexpr (handles_event<Cs, Event>) cs.on(event);
      }(),
      ...);
}

// --- Ready-made callbacks -------------------------------------------------

/// Stops after `patience` epochs without a better monitored metric
/// (`FitState::monitor`; 0: never).
class EarlyStopping {
 public:
  explicit EarlyStopping(int patience) : patience_(patience) {}
  void on(const EpochEnd& e) {
    if (patience_ > 0 && e.state.bad_epochs >= patience_) {
      e.state.stop = true;
      e.state.stop_reason = ddpkit::detail::cat(
          "early stopping after epoch ", e.metrics.epoch, ": no better ",
          e.state.monitor.name, " for ", patience_, " epochs");
    }
  }

 private:
  int patience_;
};

/// The epochs (1-based) of the `k` best rows of `history` by `monitor`,
/// best first; ties go to the earlier epoch, NaN ranks last.
inline std::vector<int> best_epochs(const std::vector<EpochMetrics>& history,
                                    const Monitor& monitor, int k) {
  std::vector<const EpochMetrics*> rows;
  for (const auto& m : history) rows.push_back(&m);
  std::stable_sort(rows.begin(), rows.end(), [&](auto* a, auto* b) {
    return monitor.better(a->value(monitor.name), b->value(monitor.name));
  });
  std::vector<int> epochs;
  for (int i = 0; i < k && i < static_cast<int>(rows.size()); ++i) {
    epochs.push_back(rows[i]->epoch);
  }
  return epochs;
}

/// What `ModelCheckpoint` writes.
struct ModelCheckpointOptions {
  /// checkpoints/last.pt at every epoch's end, and the best ones.
  TORCH_ARG(bool, enabled) = true;
  /// See `TrainerOptions::keep_best`.
  TORCH_ARG(int, keep_best) = 1;
  /// See `TrainerOptions::checkpoint_every_n_steps`.
  TORCH_ARG(std::int64_t, every_n_steps) = 0;
  /// See `TrainerOptions::weights_pattern`.
  TORCH_ARG(std::string, weights_pattern) = "";
};

/// Rank 0 writes OUT/checkpoints/last.pt at each epoch's end (and within
/// epochs every N batches), keeps the best k, and the model's weights by a
/// pattern.
class ModelCheckpoint {
 public:
  explicit ModelCheckpoint(ModelCheckpointOptions o) : o_(std::move(o)) {}

  void on(const StepEnd& e) {
    FitState& s = e.state;
    const auto every = o_.every_n_steps();
    // Every rank decides alike (same counts); the epoch's last batch is
    // followed by the epoch-end checkpoint anyway.
    if (o_.enabled() && every > 0 && s.step < s.steps &&
        s.global_step / every > s.last_checkpoint_step / every) {
      s.checkpoints->write_mid_epoch(dir(s) / "last.pt");
      s.last_checkpoint_step = s.global_step;
    }
  }

  void on(const EpochEnd& e) {
    FitState& s = e.state;
    if (o_.enabled() && s.is_main) {
      s.checkpoints->write(dir(s) / "last.pt");
      keep_best(s);
    }
    if (s.is_main && !o_.weights_pattern().empty()) {
      std::string rel = o_.weights_pattern();
      auto at = rel.find("{epoch}");
      if (at != std::string::npos) rel.replace(at, 7, std::to_string(s.epoch));
      auto path = s.out / rel;
      std::filesystem::create_directories(path.parent_path());
      nn::save_state_dict(*s.module, path);
    }
  }

 private:
  static std::filesystem::path dir(const FitState& s) {
    return s.out / "checkpoints";
  }

  void keep_best(FitState& s) {
    namespace fs = std::filesystem;
    const int k = o_.keep_best();
    if (k == 0 || s.history.empty()) return;
    const fs::path d = dir(s);
    // Ranked from the history alone, so a resumed run keeps the same set.
    const auto top = best_epochs(s.history, s.monitor, k);
    const int epoch = s.history.back().epoch;
    auto epoch_file = [&](int e) {
      return d / ("best-epoch-" + std::to_string(e) + ".pt");
    };
    if (std::find(top.begin(), top.end(), epoch) != top.end()) {
      if (k == 1) {
        s.checkpoints->write(d / "best.pt");
      } else {
        s.checkpoints->write(epoch_file(epoch));
        if (top.front() == epoch) {
          // best.pt names the same file: a hard link made beside it and
          // renamed over it (a copy where hard links are refused), so
          // best.pt is always whole; once the file is written.
          s.checkpoints->then([from = epoch_file(epoch), to = d / "best.pt"] {
            ddpkit::detail::link_or_copy_atomically(from, to);
          });
        }
      }
    }
    // Files of epochs no longer among the best (only after the new one is
    // in place: a crash in between leaves one file too many, removed next
    // time). With k = 1 there are none to remove (an earlier run's are left
    // alone).
    s.checkpoints->then([d, k, top] {
      std::error_code ec;
      for (const auto& entry : fs::directory_iterator(d, ec)) {
        const std::string name = entry.path().filename().string();
        int e = 0;
        char tail = 0;
        if (std::sscanf(name.c_str(), "best-epoch-%d.p%c", &e, &tail) == 2 &&
            name == "best-epoch-" + std::to_string(e) + ".pt" && k > 1 &&
            std::find(top.begin(), top.end(), e) == top.end()) {
          fs::remove(entry.path(), ec);
        }
      }
    });
  }

  ModelCheckpointOptions o_;
};

/// Rank 0's display: a bar redrawn in place on a terminal (elsewhere a
/// plain line as ProgressOptions says), a line per epoch, and why the run
/// stopped.
class ProgressDisplay {
 public:
  explicit ProgressDisplay(bool enabled, ProgressOptions options = {},
                           std::string unit = "img")
      : progress_(enabled, options, std::move(unit)) {}
  void on(const EpochBegin& e) {
    progress_.begin_epoch(e.state.epoch + 1, e.state.epochs, e.state.steps);
  }
  void on(const BatchEnd& e) {
    const FitState& s = e.state;
    const double secs = std::chrono::duration<double>(
                            std::chrono::steady_clock::now() - s.epoch_start)
                            .count();
    progress_.step(s.step, s.loss_sum / s.count,
                   secs > 0 ? s.count * s.world / secs : 0);
  }
  void on(const EpochEnd& e) {
    progress_.end_epoch(e.metrics);
  }
  void on(const FitEnd& e) {
    if (e.state.times.steps > 0) progress_.line(e.state.times.line());
    if (!e.state.stop_reason.empty()) progress_.line(e.state.stop_reason);
  }

 private:
  Progress progress_;
};

/// Rank 0 rewrites OUT/metrics.jsonl, metrics.csv and report.svg from the
/// history at each epoch's end.
struct MetricsFiles {
  void on(const EpochEnd& e) {
    if (e.state.is_main) write_metrics_files(e.state.out, e.state.history);
  }
};

/// Rank 0 writes TensorBoard event files to OUT/tb (see
/// `TrainerOptions::tensorboard`). Events are flushed at each epoch's end
/// and after each mid-epoch checkpoint, so a resumed run logs each step
/// once.
class TensorBoardLog {
 public:
  /// `hparams`: the run's settings as a markdown table (tag "hparams").
  TensorBoardLog(bool enabled, std::int64_t log_every_n_steps,
                 std::string hparams)
      : enabled_(enabled),
        every_(log_every_n_steps),
        hparams_(std::move(hparams)) {}

  void on(const FitBegin& e) {
    if (!enabled_ || !e.state.is_main) return;
    tb_ = std::make_unique<TensorBoardWriter>(e.state.out / "tb");
    tb_->add_text("hparams", hparams_, e.state.epoch);
    tb_->flush();
  }
  void on(const BatchEnd& e) {
    if (tb_ && every_ > 0 && e.state.global_step % every_ == 0) {
      tb_->add_scalar("train/loss_step", e.loss, e.state.global_step);
    }
  }
  void on(const StepEnd& e) {
    // Right after a mid-epoch checkpoint (ModelCheckpoint comes first).
    if (tb_ && e.state.last_checkpoint_step == e.state.global_step) {
      tb_->flush();
    }
  }
  void on(const EpochEnd& e) {
    if (!tb_) return;
    // After the checkpoint: a run killed in between lacks this epoch here
    // rather than logging it twice once resumed.
    const EpochMetrics& m = e.metrics;
    // Task metrics as train/<m> and val/<m> (train_loss: train/loss).
    for (const auto& [name, value] : m.task) {
      std::string tag = name;
      if (auto at = tag.find('_'); at != std::string::npos) tag[at] = '/';
      tb_->add_scalar(tag, value, m.epoch);
    }
    const std::pair<const char*, double> scalars[] = {
        {"lr", m.lr},
        {"train/images_per_second", m.train_images_per_second},
        {"time/train_seconds", m.train_seconds},
        {"time/val_seconds", m.val_seconds}};
    for (const auto& [tag, value] : scalars) {
      tb_->add_scalar(tag, value, m.epoch);
    }
    // Each rank's wait for the others (several processes): a straggler is
    // the line near zero while the others rise.
    for (std::size_t r = 0; r < m.rank_wait_seconds.size(); ++r) {
      tb_->add_scalar("wait/rank_" + std::to_string(r), m.rank_wait_seconds[r],
                      m.epoch);
    }
    tb_->flush();
  }
  void on(const FitEnd&) {
    if (tb_) tb_->flush();
  }

 private:
  bool enabled_;
  std::int64_t every_;
  std::string hparams_;
  std::unique_ptr<TensorBoardWriter> tb_;  // movable, unlike the writer
};

}  // namespace ddpkit::train
