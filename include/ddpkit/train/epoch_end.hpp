// SPDX-License-Identifier: BSD-3-Clause
// The ends of an epoch and of a fit, as every rank computes them: the
// epoch's training metrics over every rank's samples with each rank's wait
// for the others (one all-reduce), the evaluation, the times by rank 0's
// clock (so every rank holds identical numbers and decides alike), the new
// history row ranked for "best"; and the fit's result from its state.
#pragma once

#include <chrono>
#include <cstdint>
#include <utility>

#include <torch/torch.h>

#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/train/callbacks.hpp"
#include "ddpkit/train/checkpoint_connector.hpp"
#include "ddpkit/train/evaluation.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/run_summary.hpp"
#include "ddpkit/train/task.hpp"

namespace ddpkit::train {

// Note [Decisions use shared values]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Decisions use shared values. Validation numbers are broadcast (rank-0
// evaluation) or all-reduced (sharded evaluation); the epoch time is rank 0's
// broadcast; best/early-stop are therefore identical everywhere.

// Note [Epoch times are split]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Epoch times are split. `train_seconds` (epoch start to the end of the last
// optimizer step, metrics reduced), `val_seconds`, and `seconds` (the whole
// epoch); `train_images_per_second` divides the epoch's training images by
// `train_seconds` (what other tools call throughput),
// `epoch_images_per_second` by `seconds` (the figure that used to be called
// `images_per_second`).

/// Every rank at the end of epoch `s.epoch`: reduces the training metrics
/// over `group` (null: one process), runs `evaluate()` (an EvalResult,
/// identical on every rank), times the epoch, appends the row to
/// `s.history` and ranks it (rank_epoch). Returns the row.
template <class Task, class Evaluate>
EpochMetrics end_epoch(FitState& s, const Task& task, const dist::Group* group,
                       int rank, Evaluate&& evaluate) {
  using clock = std::chrono::steady_clock;
  // Training metrics over every rank's samples, and (several processes)
  // each rank's wait for the others in its own slot: one all-reduce.
  auto t = epoch_sums(s);
  const int64_t waits_at = t.size(0);
  const int world = group ? group->size() : 1;
  if (group) {
    auto waits = torch::zeros({world}, torch::kFloat64);
    waits[rank] = s.times.waited() - s.wait_at_epoch_start;
    t = torch::cat({t, waits}).to(group->device());
    dist::CollectiveTag tag("epoch end");
    dist::all_reduce(*group, t);
  }
  t = t.cpu().contiguous();
  const auto t_train = clock::now();
  const EvalResult ev = evaluate();
  const auto t_val = clock::now();
  EpochMetrics m;
  m.epoch = s.epoch + 1;
  const double total = t[1].template item<double>();
  m.task = named_metrics<Task>(
      task.finish(task_sums_at<Task>(t.data_ptr<double>() + 2)), "train_");
  for (const auto& [name, value] : ev.metrics) {
    m.task.emplace_back("val_" + name, value);
  }
  if (group) {
    const double* w = t.data_ptr<double>() + waits_at;
    m.rank_wait_seconds.assign(w, w + world);
  }
  m.lr = s.lr;
  const auto since = [](auto a, auto b) {
    return std::chrono::duration<double>(b - a).count();
  };
  m.seconds = since(s.epoch_start, clock::now());
  m.train_seconds = since(s.epoch_start, t_train);
  m.val_seconds = since(t_train, t_val);
  if (group) {
    // Every rank records rank 0's clock, so all hold identical numbers.
    auto times = torch::tensor({m.seconds, m.train_seconds, m.val_seconds},
                               torch::kFloat64)
                     .to(group->device());
    dist::CollectiveTag tag("epoch end");
    dist::broadcast(*group, times, 0);
    times = times.cpu();
    m.seconds = times[0].template item<double>();
    m.train_seconds = times[1].template item<double>();
    m.val_seconds = times[2].template item<double>();
  }
  // Images trained in this process's time (an epoch resumed mid-way
  // counts only those after its checkpoint).
  const double trained = total - s.resumed_images;
  m.train_images_per_second =
      m.train_seconds > 0 ? trained / m.train_seconds : 0;
  m.epoch_images_per_second = m.seconds > 0 ? trained / m.seconds : 0;
  s.history.push_back(m);
  // Decisions use only values every rank holds, so every rank decides the
  // same.
  rank_epoch(s, m);
  return m;
}

/// The fit's result from its final state (`s.history` is moved out), and
/// the ranks' summed waits; the caller adds the memory figures.
inline FitResult fit_result(FitState& s, double total_seconds) {
  FitResult result;
  result.monitor = s.monitor;
  result.best_value = s.best_epoch > 0 ? s.best : 0.0;
  result.best_epoch = s.best_epoch;
  result.stopped_early = s.stop;
  result.epochs_run = static_cast<int>(s.history.size());
  result.history = std::move(s.history);
  result.total_seconds = total_seconds;
  result.step_times = s.times;
  for (const EpochMetrics& m : result.history) {
    const auto& w = m.rank_wait_seconds;
    if (w.empty()) continue;
    if (result.rank_wait_seconds.empty()) {
      result.rank_wait_seconds.assign(w.size(), 0.0);
    }
    if (w.size() != result.rank_wait_seconds.size()) continue;
    for (std::size_t r = 0; r < w.size(); ++r) {
      result.rank_wait_seconds[r] += w[r];
    }
  }
  result.slowest_rank = EpochMetrics::least_waiting(result.rank_wait_seconds);
  return result;
}

}  // namespace ddpkit::train
