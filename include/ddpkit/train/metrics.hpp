// SPDX-License-Identifier: BSD-3-Clause
// Per-epoch metrics, their files (metrics.jsonl, metrics.csv, summary.json,
// rewritten whole and atomically so a resumed run never duplicates rows),
// and rank 0's progress display.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/json.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit::train {

/// The value named `name` among named metrics, or null.
inline const double* find_metric(
    const std::vector<std::pair<std::string, double>>& metrics,
    std::string_view name) {
  for (const auto& [k, v] : metrics) {
    if (k == name) return &v;
  }
  return nullptr;
}

/// One epoch's numbers, identical on every rank (times are rank 0's).
///
/// `task` holds the task's metrics in column order, train_<m>... then
/// val_<m>... (Classification: train_loss, train_acc, val_loss, val_acc).
/// `train_seconds` runs from the epoch's start to the end of its last
/// optimizer step (training metrics reduced across ranks), `val_seconds`
/// covers the validation pass, `seconds` the whole epoch (both, plus
/// checkpoints and files). `train_images_per_second` is training samples
/// (all ranks) per training second: the figure other tools call training
/// throughput; `epoch_images_per_second` divides by the whole epoch. An
/// epoch resumed from a mid-epoch checkpoint counts only the samples
/// trained after it.
/// Rows read from checkpoints written before these were split have NaN
/// (`null` in JSON) for the train/val split.
struct EpochMetrics {
  int epoch = 0;  ///< 1-based, as printed
  std::vector<std::pair<std::string, double>> task;
  double lr = 0, seconds = 0, train_seconds = 0, val_seconds = 0,
         train_images_per_second = 0, epoch_images_per_second = 0;
  /// Seconds each rank waited for the others in this epoch's steps (the
  /// gradient all-reduce after its backward and the step agreement), by
  /// rank; empty with one process. The rank that waits least is the one
  /// the others wait for: `slowest_rank()`. In metrics.jsonl and
  /// TensorBoard, not in the CSV nor in checkpoints' history.
  std::vector<double> rank_wait_seconds;

  /// The rank the others waited for most (the least waiting), or -1.
  int slowest_rank() const {
    return least_waiting(rank_wait_seconds);
  }
  /// The index of the smallest wait, or -1 for none.
  static int least_waiting(const std::vector<double>& waits) {
    if (waits.empty()) return -1;
    return static_cast<int>(std::min_element(waits.begin(), waits.end()) -
                            waits.begin());
  }

  /// The columns after the task's, in order.
  static constexpr std::array<std::string_view, 6> kTimingNames{
      "lr",
      "seconds",
      "train_seconds",
      "val_seconds",
      "train_images_per_second",
      "epoch_images_per_second"};
  static constexpr int kTimingFields = kTimingNames.size();
  /// The history table's timing columns in checkpoints of format version 2
  /// (lr, seconds, images_per_second over the whole epoch); still read.
  static constexpr int kTimingFieldsV2 = 3;
  /// The values of the columns after the task's, in `kTimingNames`' order.
  std::array<double, 6> timings() const {
    return {lr,
            seconds,
            train_seconds,
            val_seconds,
            train_images_per_second,
            epoch_images_per_second};
  }

  /// A task metric ("val_acc"), or one of the columns after them ("lr",
  /// "seconds", ...); a UsageError naming the columns if there is none.
  double value(std::string_view name) const {
    if (const double* v = find_metric(task, name)) return *v;
    const auto t = timings();
    for (std::size_t i = 0; i < t.size(); ++i) {
      if (kTimingNames[i] == name) return t[i];
    }
    std::vector<std::string> names;
    for (const auto& kv : task) names.push_back(kv.first);
    throw UsageError(ddpkit::detail::cat("no metric '", name,
                                         "' in an epoch's row; it has ",
                                         ddpkit::detail::join(names, ", ")));
  }
  double train_loss() const {
    return value("train_loss");
  }
  double val_loss() const {
    return value("val_loss");
  }

  torch::Tensor to_tensor() const {
    std::vector<double> row{static_cast<double>(epoch)};
    for (const auto& kv : task) row.push_back(kv.second);
    const auto t = timings();
    row.insert(row.end(), t.begin(), t.end());
    return torch::tensor(row, torch::kFloat64);
  }
  /// A row of 1 + names + `kTimingFields` numbers (or, from checkpoints of
  /// format version 2, 1 + names + `kTimingFieldsV2`), the task's columns
  /// named by `names`.
  static EpochMetrics from_tensor(const torch::Tensor& t,
                                  const std::vector<std::string>& names) {
    auto a = t.accessor<double, 1>();
    EpochMetrics m;
    m.epoch = static_cast<int>(a[0]);
    std::int64_t i = 1;
    for (const auto& n : names) m.task.emplace_back(n, a[i++]);
    m.lr = a[i++];
    m.seconds = a[i++];
    if (t.size(0) ==
        1 + static_cast<std::int64_t>(names.size()) + kTimingFieldsV2) {
      const double nan = std::numeric_limits<double>::quiet_NaN();
      m.train_seconds = m.val_seconds = m.train_images_per_second = nan;
      m.epoch_images_per_second = a[i];
    } else {
      m.train_seconds = a[i++];
      m.val_seconds = a[i++];
      m.train_images_per_second = a[i++];
      m.epoch_images_per_second = a[i];
    }
    return m;
  }
};

namespace detail {
using ddpkit::detail::num;
}  // namespace detail

/// The metrics files' columns for a row, in order: epoch, the task's, then
/// the timings.
inline std::vector<std::string> metrics_columns(const EpochMetrics& m) {
  std::vector<std::string> c{"epoch"};
  for (const auto& kv : m.task) c.push_back(kv.first);
  for (std::string_view n : EpochMetrics::kTimingNames) c.emplace_back(n);
  return c;
}

namespace detail {
inline std::vector<std::string> metric_values(const EpochMetrics& m) {
  std::vector<std::string> v{std::to_string(m.epoch)};
  for (const auto& kv : m.task) v.push_back(num(kv.second));
  for (double t : m.timings()) v.push_back(num(t));
  return v;
}

/// `[a,b,...]`: numbers as a JSON array.
inline std::string json_array(const std::vector<double>& xs) {
  std::vector<std::string> parts;
  for (double x : xs) parts.push_back(num(x));
  return "[" + ddpkit::detail::join(parts, ",") + "]";
}
}  // namespace detail

inline std::string to_json(const EpochMetrics& m) {
  const auto v = detail::metric_values(m);
  const auto c = metrics_columns(m);
  ddpkit::detail::JsonObject j;
  for (std::size_t i = 0; i < v.size(); ++i) j.raw(c[i], v[i]);
  if (!m.rank_wait_seconds.empty()) {
    j.raw("wait_seconds", detail::json_array(m.rank_wait_seconds))
        .add("slowest_rank", m.slowest_rank());
  }
  return j.compact();
}

/// Rewrites OUT/metrics.jsonl and OUT/metrics.csv from the whole history.
inline void write_metrics_files(const std::filesystem::path& out,
                                const std::vector<EpochMetrics>& history) {
  std::string jsonl, csv;
  if (!history.empty())
    csv = ddpkit::detail::join(metrics_columns(history[0]), ",");
  csv += "\n";
  for (const auto& m : history) {
    jsonl += to_json(m) + "\n";
    const auto v = detail::metric_values(m);
    for (std::size_t i = 0; i < v.size(); ++i) csv += (i ? "," : "") + v[i];
    csv += "\n";
  }
  ddpkit::detail::write_atomically(out / "metrics.jsonl", jsonl);
  ddpkit::detail::write_atomically(out / "metrics.csv", csv);
}

/// The flat JSON object summary.json is written with.
using ddpkit::detail::JsonObject;

/// Rank 0's display: a progress bar redrawn in place on a terminal, one
/// plain line per epoch otherwise.
/// When the Progress display prints a plain line where stdout is not a
/// terminal (a pipe, a file, SLURM's or torchrun's log): every
/// `every_n_steps` batches, and at least every `every_seconds` seconds
/// (0 turns either off). A terminal gets the redrawn bar instead.
struct ProgressOptions {
  TORCH_ARG(std::int64_t, every_n_steps) = 0;
  TORCH_ARG(double, every_seconds) = 30;
};

/// Rank 0's display: on a terminal a bar redrawn at most every 0.1 s;
/// elsewhere a plain line as ProgressOptions says:
/// `epoch 1/3 step 40/400 loss 1.2345 830 img/s ETA 42s`. Then one line
/// per epoch.
class Progress {
 public:
  /// `unit`: what the throughput counts ("img/s"; the task's unit).
  explicit Progress(bool enabled, ProgressOptions options = {},
                    std::string unit = "img")
      : enabled_(enabled),
        tty_(enabled && ::isatty(STDOUT_FILENO)),
        options_(options),
        unit_(std::move(unit)) {}

  void begin_epoch(int epoch, int epochs, std::size_t steps) {
    epoch_ = epoch;
    epochs_ = epochs;
    steps_ = steps;
    start_ = std::chrono::steady_clock::now();
    last_line_ = start_;
  }

  void step(std::size_t done, double loss, double images_per_second) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (!due(done, now)) return;
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    const double eta = done ? elapsed / done * (steps_ - done) : 0;
    if (tty_) {
      drawn_ = true;
      const int width = 24;
      int filled = steps_ ? static_cast<int>(width * done / steps_) : width;
      std::printf("\repoch %d/%d [%s%s] %zu/%zu loss %.4f %.0f %s/s ETA %.0fs ",
                  epoch_, epochs_, std::string(filled, '#').c_str(),
                  std::string(width - filled, '.').c_str(), done, steps_, loss,
                  images_per_second, unit_.c_str(), eta);
    } else {
      std::printf("epoch %d/%d step %zu/%zu loss %.4f %.0f %s/s ETA %.0fs\n",
                  epoch_, epochs_, done, steps_, loss, images_per_second,
                  unit_.c_str(), eta);
    }
    std::fflush(stdout);
  }

  void end_epoch(const EpochMetrics& m) {
    if (!enabled_) return;
    if (tty_) std::printf("\r\033[K");
    drawn_ = false;
    std::string line = ddpkit::detail::cat("epoch ", m.epoch, "/", epochs_);
    char buf[64];
    for (const auto& [name, v] : m.task) {
      std::snprintf(buf, sizeof buf, "  %s %.4f", name.c_str(), v);
      line += buf;
    }
    std::printf(
        "%s  lr %.3g  %.1fs (train %.1fs, val %.1fs)  %.0f train %s/s\n",
        line.c_str(), m.lr, m.seconds, m.train_seconds, m.val_seconds,
        m.train_images_per_second, unit_.c_str());
    std::fflush(stdout);
  }

  /// A line of its own (a bar drawn mid-epoch is kept, and ended first).
  void line(const std::string& s) {
    if (!enabled_) return;
    if (drawn_) std::printf("\n");
    drawn_ = false;
    std::printf("%s\n", s.c_str());
    std::fflush(stdout);
  }

 private:
  /// Whether batch `done` is shown: on a terminal at most every 0.1 s (and
  /// the epoch's last batch always), elsewhere as ProgressOptions says.
  bool due(std::size_t done, std::chrono::steady_clock::time_point now) {
    if (tty_) {
      if (done < steps_ && now - last_draw_ < std::chrono::milliseconds(100))
        return false;
      last_draw_ = now;
      return true;
    }
    const auto n = options_.every_n_steps();
    const double secs = options_.every_seconds();
    const bool by_steps = n > 0 && done % static_cast<std::size_t>(n) == 0;
    const bool by_time =
        secs > 0 &&
        std::chrono::duration<double>(now - last_line_).count() >= secs;
    if (!by_steps && !by_time) return false;
    last_line_ = now;
    return true;
  }

  bool enabled_, tty_;
  ProgressOptions options_;
  std::string unit_;
  bool drawn_ = false;  ///< a bar is on the current line
  int epoch_ = 0, epochs_ = 0;
  std::size_t steps_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_, last_line_;
};

}  // namespace ddpkit::train
