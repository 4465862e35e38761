// SPDX-License-Identifier: BSD-3-Clause
// The Trainer's checkpoint connector: the one home of a training
// checkpoint's contents and of resuming from one. Every key a Trainer's
// checkpoint holds is written and read here (TrainingState; the container's
// own "format", "format_version", "torch_version" and "optimizer" entries
// are checkpoint.hpp's); `--resume PATH|auto` is resolved here once (rank 0
// reads the file, the other ranks receive its bytes; "auto" falls back from
// a damaged last.pt to last-prev.pt); every compatibility check of a resume
// (world size, seed, data, task, precision, layout) is here; and the
// Trainer's save and resume (mid-epoch state included) are
// `CheckpointConnector`'s. See Note [Checkpoint durability] (checkpoint.hpp).
//
// Reading a checkpoint from C++ (a run's `checkpoints/last.pt` or
// `best.pt`):
//
//   auto archive = ddpkit::train::open_checkpoint(path);  // checked
//   ddpkit::train::load_module_checked(*model, archive, "model", path);
//   auto state = ddpkit::train::TrainingState::load(
//       archive, path, ddpkit::train::metric_columns<Task>(),
//       Task::num_sums);  // epochs_done, best, history, ...
//
// (and `load_optimizer_checked(optimizer, archive, path)` for the
// optimizer). Python reads the same file with `torch.load(path)`.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/files.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/nn/state_dict.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/train/callbacks.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/checkpoint_queue.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/optimizer_snapshot.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/resume_source.hpp"
#include "ddpkit/train/run_folder.hpp"
#include "ddpkit/train/run_summary.hpp"
#include "ddpkit/train/sharded_state.hpp"

namespace ddpkit::train {

// Note [Resume is bit-identical]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Resume is bit-identical because all randomness is a function of (seed,
// epoch, rank, batch): the sampler permutation (`seed + epoch`, equal to
// Python's `torch.randperm` with a seeded generator), the augmentation
// generator per batch, and the global RNG reseeded per epoch for dropout.

// Note [Mid-epoch checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Mid-epoch checkpoints (`checkpoint_every_n_steps`, counted in batches over
// the run). Resuming inside an epoch needs what an epoch-end checkpoint does
// not: the batch reached (`epoch_batches_done`; the sampler's order and every
// batch's augmentation seed are functions of (seed, epoch, rank, batch), so
// `Loader::epoch(indices, epoch, first)` rebuilds the rest exactly), the
// training metrics so far over all ranks (`epoch_sums`, one all-reduce; on
// resume rank 0 starts from them, the others from zero), and every rank's CPU
// generator (`rng_cpu_ranks`, one all-gather: dropout draws differ per rank,
// and rank 0 writes for all). Every rank decides to checkpoint at the same
// batch (same counts; refused with `uneven_inputs(join)`); resuming one needs
// the same world size. The TensorBoard events so far are flushed after it, so
// a resume from it logs each step once. The resumed epoch's images/s count
// only the images trained after the checkpoint (tested: 32 of 64).

/// Every key of a Trainer's checkpoint, written and read here alone: the
/// format, the model, the optimizer, where the run stands, the history, the
/// CPU generators, and (from the Trainer) each stateful callback's state
/// under "callbacks/<name>".
///
/// Keys: format, format_version, torch_version, model, optimizer,
/// epochs_done, best, best_epoch, bad_epochs, monitor, monitor_mode,
/// world_size, seed, data_size, data_fingerprint, precision, memory_format,
/// loss_scale, global_step, history, history_columns,
/// rng_cpu, epoch_batches_done, and in mid-epoch checkpoints epoch_sums
/// ([loss sum, samples, task sums...] over all ranks) and rng_cpu_ranks.
/// Format 3 checkpoints (before tasks) have best_val_acc for best, no
/// monitor (val_acc) and no history_columns (Classification's), and
/// epoch_sums [loss sum, correct, samples]; they still load.
struct TrainingState {
  int epochs_done = 0;
  double best = std::numeric_limits<double>::quiet_NaN();  ///< NaN: none
  int best_epoch = 0;
  int bad_epochs = 0;
  std::string monitor = "val_acc";  ///< the metric `best` is of
  std::string monitor_mode = "max";
  /// The writer's world size and seed (none in checkpoints before them).
  std::optional<std::int64_t> world_size;
  std::optional<std::int64_t> seed;
  /// The training set's size and fingerprint (its `fingerprint()`, "" for a
  /// dataset without one) when written; none in checkpoints before them.
  std::optional<std::int64_t> data_size;
  std::string data_fingerprint;
  /// The writer's precision ("32", "bf16-mixed", "16-mixed") and memory
  /// format ("contiguous", "channels-last"); "" in checkpoints before them.
  std::string precision, memory_format;
  double loss_scale = 1;
  /// Batches trained so far (TensorBoard's step axis); 0 when the
  /// checkpoint predates it (format 2).
  std::int64_t global_step = 0;
  std::vector<EpochMetrics> history;
  /// The task's history columns (train_<m>..., val_<m>...).
  std::vector<std::string> columns;
  torch::Tensor rng_cpu;  ///< the writer's CPU generator (written only)
  /// Batches done in the unfinished epoch `epochs_done` (0: at an epoch's
  /// end), and what resuming there needs.
  std::int64_t epoch_batches_done = 0;
  torch::Tensor epoch_sums;  ///< [loss sum, samples, task sums...]
  torch::Tensor rng_ranks;   ///< [world, state]: every rank's generator

  /// `optimizer_later`: the optimizer's state copied now and serialised
  /// when the archive is (optimizer_snapshot), for an asynchronous write.
  /// `shards`: a sharded checkpoint's manifest, which names the model's
  /// and optimizer's state in shard files instead of holding it.
  void save(Checkpoint& archive, const torch::nn::Module& model,
            const torch::optim::Optimizer& optimizer,
            bool optimizer_later = false,
            const ShardSet* shards = nullptr) const {
    archive.stamp();
    if (shards) {
      archive.write(kShardsEntry, shard_set_value(*shards));
      archive.write(kOptimizerGroupsEntry, shards->groups);
    } else {
      archive.write("model", c10::IValue(nn::state_dict(model)));
    }
    if (shards) {
      // (in the shards)
    } else if (optimizer_later) {
      archive.write_later("optimizer", [make = optimizer_snapshot(optimizer)] {
        return c10::IValue(make());
      });
    } else {
      archive.write_optimizer(optimizer);
    }
    archive.write("epochs_done", static_cast<std::int64_t>(epochs_done));
    archive.write("best", best);
    archive.write("best_epoch", static_cast<std::int64_t>(best_epoch));
    archive.write("bad_epochs", static_cast<std::int64_t>(bad_epochs));
    archive.write("monitor", monitor);
    archive.write("monitor_mode", monitor_mode);
    archive.write("world_size", world_size.value_or(1));
    archive.write("seed", seed.value_or(0));
    if (data_size) {
      archive.write("data_size", *data_size);
      archive.write("data_fingerprint", data_fingerprint);
    }
    if (!precision.empty()) archive.write("precision", precision);
    if (!memory_format.empty()) archive.write("memory_format", memory_format);
    archive.write("loss_scale", loss_scale);
    archive.write("global_step", global_step);
    archive.write("epoch_batches_done", epoch_batches_done);
    if (epoch_batches_done > 0) {
      archive.write("epoch_sums", epoch_sums);
      archive.write("rng_cpu_ranks", rng_ranks);
    }
    const auto width = static_cast<std::int64_t>(1 + columns.size()) +
                       EpochMetrics::kTimingFields;
    auto hist = torch::zeros({static_cast<std::int64_t>(history.size()), width},
                             torch::kFloat64);
    for (std::size_t i = 0; i < history.size(); ++i) {
      hist[static_cast<std::int64_t>(i)] = history[i].to_tensor();
    }
    archive.write("history", hist);
    archive.write("history_columns", ddpkit::detail::join(columns, ","));
    archive.write("rng_cpu", rng_cpu);
  }

  /// The precision and memory format `archive` records ("" for each it
  /// does not: checkpoints before them, or a value that is not text).
  static std::pair<std::string, std::string> recorded_settings(
      const Checkpoint& archive) {
    std::pair<std::string, std::string> r;
    c10::IValue v;
    if (archive.try_read("precision", v) && v.isString()) {
      r.first = v.toStringRef();
    }
    if (archive.try_read("memory_format", v) && v.isString()) {
      r.second = v.toStringRef();
    }
    return r;
  }

  /// Reads what `save` wrote (and format 2/3 checkpoints), for a task whose
  /// history columns are `columns` and which keeps `num_sums` sums; a
  /// UsageError naming the file and key for anything missing, malformed or
  /// written by another task. The model and optimizer are loaded by
  /// `load_module_checked` and `load_optimizer_checked`.
  static TrainingState load(const Checkpoint& archive,
                            const std::filesystem::path& file,
                            const std::vector<std::string>& columns,
                            std::size_t num_sums) {
    using ddpkit::detail::cat;
    constexpr int kMax = std::numeric_limits<int>::max();
    TrainingState r;
    r.columns = columns;
    r.epochs_done = read_checkpoint_int(archive, "epochs_done", file, 0, kMax);
    c10::IValue v;
    const bool tasks = archive.try_read("best", v);  // format 4 on
    r.best =
        read_checkpoint_scalar(archive, tasks ? "best" : "best_val_acc", file);
    r.best_epoch = read_checkpoint_int(archive, "best_epoch", file, -1, kMax);
    r.bad_epochs = read_checkpoint_int(archive, "bad_epochs", file, 0, kMax);
    if (tasks) {
      r.monitor = read_checkpoint_string(archive, "monitor", file);
      r.monitor_mode = read_checkpoint_string(archive, "monitor_mode", file);
    } else if (r.best_epoch == 0) {
      r.best = std::numeric_limits<double>::quiet_NaN();  // was -1: none
    }
    r.loss_scale = read_checkpoint_scalar(archive, "loss_scale", file);
    if (archive.try_read("world_size", v) && v.isInt()) {
      r.world_size = v.toInt();
    }
    if (archive.try_read("seed", v) && v.isInt()) r.seed = v.toInt();
    if (archive.try_read("data_size", v)) {
      r.data_size = read_checkpoint_int(archive, "data_size", file, 0, kMax);
      r.data_fingerprint =
          read_checkpoint_string(archive, "data_fingerprint", file);
    }
    if (archive.try_read("precision", v)) {
      r.precision = read_checkpoint_string(archive, "precision", file);
    }
    if (archive.try_read("memory_format", v)) {
      r.memory_format = read_checkpoint_string(archive, "memory_format", file);
    }
    if (archive.try_read("global_step", v)) {
      r.global_step =
          read_checkpoint_int(archive, "global_step", file, 0, kMax);
    }
    // The history's task columns: this task's, or the checkpoint was
    // written for another task.
    const std::string want = ddpkit::detail::join(columns, ",");
    const std::string had =
        archive.try_read("history_columns", v)
            ? read_checkpoint_string(archive, "history_columns", file)
            : std::string("train_loss,train_acc,val_loss,val_acc");
    if (had != want) {
      throw UsageError(cat("checkpoint ", file.string(),
                           " was written for a task whose metrics are ", had,
                           "; this run's task has ", want));
    }
    if (archive.try_read("history", v)) {
      const auto n = static_cast<std::int64_t>(1 + columns.size());
      const bool ok =
          v.isTensor() && v.toTensor().dim() == 2 &&
          (v.toTensor().size(1) == n + EpochMetrics::kTimingFields ||
           v.toTensor().size(1) == n + EpochMetrics::kTimingFieldsV2) &&
          v.toTensor().is_floating_point();
      if (!ok) {
        throw UsageError(
            cat("checkpoint ", file.string(), ": 'history' is not an N x ",
                n + EpochMetrics::kTimingFields,
                " (or, from format version 2, N x ",
                n + EpochMetrics::kTimingFieldsV2, ") table of numbers"));
      }
      auto h = v.toTensor().to(torch::kFloat64).contiguous();
      for (std::int64_t i = 0; i < h.size(0); ++i) {
        const double epoch = h[i][0].item<double>();
        if (!(epoch >= 0 && epoch <= kMax)) {
          throw UsageError(cat("checkpoint ", file.string(), ": 'history' row ",
                               i, " has epoch ", epoch));
        }
        r.history.push_back(EpochMetrics::from_tensor(h[i], columns));
      }
    }
    if (!archive.try_read("epoch_batches_done", v)) return r;  // format 2
    r.epoch_batches_done =
        read_checkpoint_int(archive, "epoch_batches_done", file, 0, kMax);
    if (r.epoch_batches_done == 0) return r;
    c10::IValue sums, rng;
    const bool ok = archive.try_read("epoch_sums", sums) && sums.isTensor() &&
                    archive.try_read("rng_cpu_ranks", rng) && rng.isTensor() &&
                    rng.toTensor().dim() == 2 &&
                    rng.toTensor().scalar_type() == torch::kUInt8;
    const auto width = static_cast<std::int64_t>(2 + num_sums);
    torch::Tensor t =
        ok ? sums.toTensor().to(torch::kFloat64).cpu().reshape({-1})
           : torch::Tensor();
    if (ok && !tasks && t.numel() == 3 && num_sums == 3) {
      // Format 3: [loss sum, correct, samples] of Classification.
      t = torch::stack({t[0], t[2], t[0], t[1], t[2]});
    }
    if (!ok || t.numel() != width) {
      throw UsageError(cat("checkpoint ", file.string(), " stops after batch ",
                           r.epoch_batches_done,
                           " of an epoch but lacks 'epoch_sums' of ", width,
                           " numbers or 'rng_cpu_ranks' (a damaged file?)"));
    }
    r.epoch_sums = t;
    r.rng_ranks = rng.toTensor().cpu();
    return r;
  }
};

/// A stateful callback as the checkpoint sees it.
struct CallbackState {
  std::string key;  ///< "callbacks/<name>"
  std::function<c10::IValue()> save;
  std::function<void(const c10::IValue&)> load;
};

/// Adds callback `c` to `states` if it keeps state (stateful_callback), under
/// "callbacks/<its name>"; a UsageError when another has the same name.
template <class C>
void add_callback_state(std::vector<CallbackState>& states, C& c) {
  if constexpr (stateful_callback<std::remove_cvref_t<C>>) {
    std::string key = "callbacks/" + std::string(std::remove_cvref_t<C>::name);
    for (const auto& other : states) {
      if (other.key == key) {
        throw UsageError(ddpkit::detail::cat(
            "two callbacks of one fit have the name '",
            std::remove_cvref_t<C>::name,
            "'; their states would overwrite each other in checkpoints"));
      }
    }
    states.push_back({std::move(key), [&c] { return c10::IValue(c.state()); },
                      [&c](const c10::IValue& v) { c.load_state(v); }});
  }
}

/// This rank's epoch so far: [loss sum, samples, task sums...].
inline torch::Tensor epoch_sums(const FitState& s) {
  std::vector<double> v{s.loss_sum, s.count};
  v.insert(v.end(), s.sums.begin(), s.sums.end());
  return torch::tensor(v, torch::kFloat64);
}

/// What a Trainer's checkpoints need to know of it.
struct CheckpointTarget {
  torch::nn::Module* module = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  parallel::LossScaler* scaler = nullptr;
};

/// The Trainer's checkpoints: writes them (at an epoch's end or mid-epoch)
/// and resumes from them. Every rank holds one; rank 0 writes.
class CheckpointConnector {
 public:
  /// `rank`/`world`: the ranks training together (1 for one process);
  /// `columns`/`num_sums`: the task's history columns and sums.
  CheckpointConnector(dist::Group group, TrainerOptions options, int rank,
                      int world, std::vector<std::string> columns,
                      std::size_t num_sums)
      : group_(std::move(group)),
        options_(std::move(options)),
        rank_(rank),
        world_(world),
        columns_(std::move(columns)),
        num_sums_(num_sums) {}

  void set_target(CheckpointTarget t) {
    target_ = t;
  }
  /// The fit's stateful callbacks (saved and restored by key).
  void set_callbacks(std::vector<CallbackState> states) {
    callbacks_ = std::move(states);
  }

  /// A fit begins over a training set of `size` samples whose fingerprint
  /// is `fingerprint` (recorded; compared on resume).
  void begin(std::size_t size, std::string fingerprint) {
    mid_ = {};
    data_size_ = static_cast<std::int64_t>(size);
    data_fingerprint_ = std::move(fingerprint);
    if (options_.sharded_checkpoints()) {
      // The fit's shard folders differ from every earlier fit's (a resumed
      // run reaching a step again never rewrites a folder a manifest names).
      std::int64_t nonce =
          static_cast<std::int64_t>(std::random_device{}() & 0xffffffffu);
      if (world_ > 1) {
        dist::CollectiveTag tag("sharded checkpoint folder");
        nonce = dist::broadcast_value(group_, nonce, 0);
      }
      nonce_ = nonce;
      shards_state_ = {-1, -1, -1};
    }
  }

  /// Every rank, before a sharded checkpoint of the state after
  /// `global_step` batches (`epochs_done` epochs and `batches_done` of the
  /// next) is written: each writes its part (Note [Sharded training
  /// checkpoints]), and all agree that every part is durable; a failure on
  /// any rank throws on every rank, the previous checkpoint untouched. Once
  /// per state; nothing without TrainerOptions::sharded_checkpoints.
  void write_shards(std::int64_t global_step, int epochs_done,
                    std::int64_t batches_done) {
    if (!options_.sharded_checkpoints()) return;
    const std::array<std::int64_t, 3> state{global_step, epochs_done,
                                            batches_done};
    if (state == shards_state_) return;
    const auto t0 = std::chrono::steady_clock::now();
    char name[128];
    std::snprintf(name, sizeof name, "shards/step-%lld-e%d-b%lld-%08llx",
                  static_cast<long long>(global_step), epochs_done,
                  static_cast<long long>(batches_done),
                  static_cast<unsigned long long>(nonce_));
    const std::filesystem::path dir =
        std::filesystem::path(options_.out_dir()) / "checkpoints";
    if (queue_.asynchronous()) {
      // Each rank blocks only while its part is copied; its file is
      // written in the background, and rank 0's manifest waits there for
      // every rank's file (see save).
      auto shard = std::make_shared<RankShard>(collect_training_shard(
          dir, name, *target_.module, *target_.optimizer, rank_, world_,
          /*copy=*/true));
      shards_ = shard->set;
      queue_.then([shard] { write_rank_shard(*shard); });
      blocking_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
      shards_state_ = state;
      return;
    }
    std::exception_ptr error;
    try {
      shards_ = write_training_shards(dir, name, *target_.module,
                                      *target_.optimizer, rank_, world_);
    } catch (...) {
      error = std::current_exception();
    }
    std::int64_t failed = error ? 1 : 0;
    if (world_ > 1) {
      dist::CollectiveTag tag("sharded checkpoint");
      failed = dist::all_reduce_value(group_, failed);
    }
    blocking_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    if (error) std::rethrow_exception(error);
    if (failed > 0) {
      throw IoError(ddpkit::detail::cat(
          "sharded checkpoint ", (dir / name).string(), ": ", failed,
          " rank(s) could not write their part (their own error says why); "
          "the previous checkpoint is kept"));
    }
    shards_state_ = state;
  }

  /// Rank 0 writes the state after `epochs_done` epochs (and, mid-epoch,
  /// after `mid_` batches) to `path`; `last.pt`'s predecessor is kept.
  void save(const std::filesystem::path& path, const FitState& s,
            int epochs_done) {
    TrainingState t;
    t.epochs_done = epochs_done;
    t.best = s.best;
    t.best_epoch = s.best_epoch;
    t.bad_epochs = s.bad_epochs;
    t.monitor = s.monitor.name;
    t.monitor_mode = std::string(s.monitor.goal_name());
    t.world_size = world_;
    t.seed = static_cast<int64_t>(options_.seed());
    t.data_size = data_size_;
    t.data_fingerprint = data_fingerprint_;
    t.precision = precision_name(options_.precision());
    t.memory_format = memory_format_name(options_.memory_format());
    t.loss_scale = target_.scaler->scale();
    t.global_step = s.global_step;
    t.history = s.history;
    t.columns = columns_;
    t.rng_cpu = at::detail::getDefaultCPUGenerator().get_state();
    t.epoch_batches_done = mid_.batches_done;
    t.epoch_sums = mid_.sums;
    t.rng_ranks = mid_.rng;
    const auto t0 = std::chrono::steady_clock::now();
    const std::filesystem::path out(options_.out_dir());
    const std::filesystem::path keep = path == last_checkpoint(out)
                                           ? previous_checkpoint(out)
                                           : std::filesystem::path();
    // The same state written to a second file in one event (last.pt, then
    // best.pt): one snapshot, serialised once.
    const std::array<std::int64_t, 3> state{s.global_step, epochs_done,
                                            mid_.batches_done};
    std::shared_ptr<const Checkpoint> archive;
    if (state == queued_state_) archive = queue_.latest_archive();
    const bool sharded = options_.sharded_checkpoints();
    if (sharded && state != shards_state_) {
      throw std::logic_error(ddpkit::detail::cat(
          "sharded checkpoint ", path.string(),
          ": the ranks' parts of this state were not written first "
          "(CheckpointConnector::write_shards on every rank)"));
    }
    if (sharded && !sharded_saved_ && queue_.asynchronous()) {
      // The manifest only once every rank's part is on disk.
      queue_.then([files = shard_files(shards_, path), cancelled = cancelled_] {
        wait_for_files(files, std::chrono::seconds(600),
                       [cancelled] { return cancelled->load(); });
      });
    }
    if (sharded) sharded_saved_ = true;
    if (!archive) {
      const bool async = queue_.asynchronous();
      if (!async && !sharded) require_finite_weights(*target_.module, path);
      auto a = std::make_shared<Checkpoint>();
      t.save(*a, *target_.module, *target_.optimizer, async,
             sharded ? &shards_ : nullptr);
      for (const auto& c : callbacks_) a->write(c.key, c.save());
      if (async) {
        // Note [Asynchronous checkpoints]: a copy, never a view, checked
        // in the background before it is written.
        auto snap = checkpoint_snapshot(*a);
        std::set<std::string> buffers;
        for (const auto& kv : target_.module->named_buffers()) {
          buffers.insert(kv.key());
        }
        queue_.then([snap, path, buffers] {
          require_finite_snapshot(*snap, path, buffers);
        });
        archive = std::move(snap);
      } else {
        archive = std::move(a);
      }
      queued_state_ = state;
    }
    queue_.write(std::move(archive), path, keep);
    ++checkpoints_written_;
    blocking_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
  }

  /// Runs `fn`, a file operation on checkpoints written before it: now, or
  /// (asynchronous checkpoints) after them, in the same background job.
  void then(std::function<void()> fn) {
    queue_.then(std::move(fn));
  }

  /// At the end of an event: the checkpoints it queued start being written
  /// in the background (after the previous ones; asynchronous only).
  void launch() {
    if (sharded_saved_) {
      // After the event's manifests: folders none names any more go.
      queue_.then([dir = std::filesystem::path(options_.out_dir()) /
                         "checkpoints"] { remove_unnamed_shards(dir); });
      sharded_saved_ = false;
    }
    blocking_seconds_ += queue_.launch();
    queued_state_ = {-1, -1, -1};
  }

  /// At a fit's end: every checkpoint written; a background error rethrown.
  /// The wait for the last background write is the fit's drain, not a
  /// training stall: summary.json reports it apart (checkpoint_ms.drain).
  void finish() {
    launch();
    drain_seconds_ += queue_.wait();
  }

  /// Leaving a fit by an exception: the checkpoints queued and running are
  /// written whole (their errors on stderr).
  void finish_quietly() noexcept {
    cancelled_->store(true);  // a manifest's wait for the parts ends
    queue_.wait_quietly();
    queued_state_ = {-1, -1, -1};
  }

  /// What checkpoints cost this Trainer so far (summary.json's
  /// checkpoint_ms): the training thread's time on them while training
  /// (writing them, or with asynchronous checkpoints snapshotting them and
  /// waiting for the previous), the background's, the wait at a fit's end
  /// for the last background write, and how many files.
  FitResult::Checkpoints summary() const {
    return {queue_.asynchronous(), blocking_seconds_ * 1e3,
            queue_.background_seconds() * 1e3, drain_seconds_ * 1e3,
            checkpoints_written_};
  }

  /// Every rank, at the same step: the epoch's metrics so far over all
  /// ranks and every rank's generator are gathered; rank 0 writes them
  /// with the state after `s.step` batches of epoch `s.epoch`.
  void save_mid_epoch(const std::filesystem::path& path, const FitState& s) {
    dist::CollectiveTag tag("mid-epoch checkpoint");
    torch::Tensor all = epoch_sums(s).to(group_.device());
    if (world_ > 1) dist::all_reduce(group_, all);
    auto rng = at::detail::getDefaultCPUGenerator().get_state();
    torch::Tensor states = rng.unsqueeze(0);
    if (world_ > 1) {
      states =
          torch::stack(dist::all_gather(group_, rng.to(group_.device()))).cpu();
    }
    write_shards(s.global_step, s.epoch, static_cast<std::int64_t>(s.step));
    if (rank_ != 0) return;
    mid_ = {static_cast<std::int64_t>(s.step), all.cpu(), states};
    save(path, s, s.epoch);
    mid_ = {};
  }

  /// Rank 0, before the engine exists: reads the checkpoint the next
  /// resume starts from (that resume then uses this read: the file is
  /// opened and parsed once) and returns the precision and memory format it
  /// records; nullopt when not resuming, starting fresh, or the file cannot
  /// be used (the resume says why). Never throws.
  std::optional<RecordedSettings> read_ahead() {
    if (options_.resume().empty()) return std::nullopt;
    ahead_ = read_now();
    if (ahead_->status != ResumeRead::Status::read || !ahead_->parsed) {
      return std::nullopt;
    }
    const auto found = TrainingState::recorded_settings(*ahead_->parsed);
    return RecordedSettings{ahead_->path, found.first, found.second};
  }

  /// The precision and memory format the Trainer resolved (automatic
  /// settings), recorded in its checkpoints and checked on resume.
  void set_settings(Precision p, MemoryFormat f) {
    options_.precision(p).memory_format(f);
  }

  /// Resumes as TrainerOptions::resume says (every rank): the model, the
  /// optimizer, the loss scale, `s`'s history, best and step, the
  /// callbacks' states, and where an unfinished epoch stands. Returns the
  /// epochs done (0: a fresh start).
  int resume(FitState& s) {
    namespace fs = std::filesystem;
    const std::string& what = options_.resume();
    if (what.empty()) return 0;
    // Rank 0 reads (Note [Checkpoint durability]), or has read ahead
    // (read_ahead). Status: 0 fresh, 1 bytes follow, 2 rank 0's error
    // message follows.
    std::int64_t status = 0;
    std::string bytes;
    std::optional<Checkpoint> parsed;  // rank 0's, from checking the file
    fs::path path =
        what == "auto" ? last_checkpoint(options_.out_dir()) : fs::path(what);
    if (rank_ == 0) {
      ResumeRead r = ahead_ ? std::move(*ahead_) : read_now();
      ahead_.reset();
      if (r.status == ResumeRead::Status::failed && world_ == 1) {
        std::rethrow_exception(r.error);
      }
      status = static_cast<std::int64_t>(r.status);
      path = r.path;
      bytes = std::move(r.bytes);
      parsed = std::move(r.parsed);
    }
    if (world_ > 1) {
      dist::CollectiveTag tag("resume");
      status = dist::broadcast_value(group_, status, 0);
      if (status != 0) {
        bytes = dist::broadcast_string(group_, bytes, 0);
        path = dist::broadcast_string(group_, path.string(), 0);
      }
    }
    if (status == 2) throw UsageError(bytes);
    if (status == 0) {
      if (rank_ == 0 && options_.verbose()) {
        std::printf("resume auto: no checkpoint at %s, starting fresh\n",
                    path.c_str());
      }
      return 0;
    }
    auto archive = parsed ? std::move(*parsed) : parse_checkpoint(bytes, path);
    if (is_shard_manifest(archive)) {
      // Every rank reads the shards (Note [Sharded training checkpoints]).
      archive = assemble_training_checkpoint(archive, path, *target_.module,
                                             *target_.optimizer);
    }
    const auto state = TrainingState::load(archive, path, columns_, num_sums_);
    check_settings(state, path);
    load_module_checked(*target_.module, archive, "model", path);
    load_optimizer_checked(*target_.optimizer, archive, path);
    const int done = state.epochs_done;
    s.history = state.history;
    if (state.monitor == s.monitor.name &&
        state.monitor_mode == s.monitor.goal_name()) {
      s.best = state.best;
      s.best_epoch = state.best_epoch;
      s.bad_epochs = state.bad_epochs;
    } else {
      // Another monitor than the checkpoint's: its best, from the history.
      rank_history(s);
      if (rank_ == 0 && options_.verbose()) {
        std::printf(
            "resume: the checkpoint monitored %s (%s), this run %s (%s); "
            "best epoch recomputed from the history: %d\n",
            state.monitor.c_str(), state.monitor_mode.c_str(),
            s.monitor.name.c_str(), std::string(s.monitor.goal_name()).c_str(),
            s.best_epoch);
      }
    }
    target_.scaler->set_scale(state.loss_scale);
    s.global_step = state.global_step;
    read_mid_epoch(state, path);
    for (auto& c : callbacks_) {
      c10::IValue v;
      if (archive.try_read(c.key, v)) c.load(v);
    }
    if (rank_ == 0 && options_.verbose()) {
      std::printf("resumed from %s after epoch %d (best %s %.4f)\n",
                  path.c_str(), done, s.monitor.name.c_str(),
                  s.best_epoch > 0 ? s.best : 0.0);
    }
    return done;
  }

  /// Batches of the epoch about to start that a mid-epoch checkpoint had
  /// done (0: none, or not resuming).
  std::size_t batches_done() const {
    return static_cast<std::size_t>(mid_.batches_done);
  }

  /// The epoch resumed mid-way starts: this rank's generator as it was
  /// there (applied by restore_generator) and the metrics so far (all
  /// ranks' sums, counted once: on rank 0) into `s`.
  void continue_epoch(FitState& s) {
    if (mid_.batches_done == 0) return;
    resume_rng_ = mid_.rng[rank_].contiguous().clone();
    const torch::Tensor m = mid_.sums.contiguous();
    const double* v = m.data_ptr<double>();
    if (rank_ == 0) {
      s.loss_sum = v[0];
      s.count = v[1];
      s.sums.assign(v + 2, v + 2 + num_sums_);
    }
    s.step = static_cast<std::size_t>(mid_.batches_done);
    s.resumed_images = v[1];
    mid_ = {};
  }

  /// Sets the CPU generator to the state a mid-epoch checkpoint saved for
  /// this rank (after EpochBegin, as in the uninterrupted run).
  void restore_generator() {
    if (!resume_rng_.defined()) return;
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(resume_rng_);
    }
    resume_rng_ = torch::Tensor();
  }

  /// `d.fingerprint()` where the dataset has one (ImageFiles,
  /// ImageTensors), else "": recorded in checkpoints, compared at resume.
  template <class Dataset>
  static std::string data_fingerprint(const Dataset& d) {
    if constexpr (requires {
                    { d.fingerprint() } -> std::convertible_to<std::string>;
                  }) {
      return d.fingerprint();
    } else {
      return "";
    }
  }

 private:
  /// A checkpoint never holds non-finite weights: refuses naming the first
  /// parameter or buffer that has one.
  static void require_finite_weights(const torch::nn::Module& module,
                                     const std::filesystem::path& path) {
    for (const auto& kv : module.named_parameters()) {
      if (!torch::isfinite(kv.value()).all().template item<bool>()) {
        throw NonFiniteError(ddpkit::detail::cat(
            "refusing to write checkpoint ", path.string(), ": parameter '",
            kv.key(), "' holds non-finite values"));
      }
    }
    for (const auto& kv : module.named_buffers()) {
      if (kv.value().is_floating_point() &&
          !torch::isfinite(kv.value()).all().template item<bool>()) {
        throw NonFiniteError(ddpkit::detail::cat(
            "refusing to write checkpoint ", path.string(), ": buffer '",
            kv.key(), "' holds non-finite values"));
      }
    }
  }

  /// require_finite_weights on a snapshot's "model" (`buffers`: the names
  /// of the model's buffers).
  static void require_finite_snapshot(const Checkpoint& snap,
                                      const std::filesystem::path& path,
                                      const std::set<std::string>& buffers) {
    c10::IValue model;
    if (!snap.try_read("model", model) || !model.isGenericDict()) return;
    for (const auto& kv : model.toGenericDict()) {
      if (!kv.value().isTensor()) continue;
      const torch::Tensor& t = kv.value().toTensor();
      if (!t.is_floating_point() || torch::isfinite(t).all().item<bool>()) {
        continue;
      }
      const std::string& name = kv.key().toStringRef();
      throw NonFiniteError(ddpkit::detail::cat(
          "refusing to write checkpoint ", path.string(), ": ",
          buffers.count(name) ? "buffer" : "parameter", " '", name,
          "' holds non-finite values"));
    }
  }

  void read_mid_epoch(const TrainingState& state,
                      const std::filesystem::path& path) {
    using ddpkit::detail::cat;
    mid_ = {};
    if (state.epoch_batches_done == 0) return;
    if (state.rng_ranks.size(0) != world_) {
      throw UsageError(cat(
          "checkpoint ", path.string(),
          " was written in the middle of an epoch by ", state.rng_ranks.size(0),
          " ranks; it can only be resumed by as many (this run has ", world_,
          "), since each rank's share of the epoch depends on it. Resume "
          "from an epoch's end, or with ",
          state.rng_ranks.size(0), " ranks"));
    }
    mid_ = {state.epoch_batches_done, state.epoch_sums, state.rng_ranks};
    if (rank_ == 0 && options_.verbose()) {
      std::printf("continuing epoch %d at batch %lld\n", state.epochs_done + 1,
                  static_cast<long long>(state.epoch_batches_done + 1));
    }
  }

  /// The resume's settings against the checkpoint's: a UsageError naming
  /// every change unless TrainerOptions::resume_allow_changes.
  void check_settings(const TrainingState& state,
                      const std::filesystem::path& path) const {
    using ddpkit::detail::cat;
    const std::int64_t world = world_;
    const auto seed = static_cast<std::int64_t>(options_.seed());
    std::string changes;
    if (state.world_size && *state.world_size != world) {
      changes += cat("world size ", *state.world_size, " -> ", world,
                     " (each rank's share of the data and the effective batch "
                     "change)");
    }
    if (state.seed && *state.seed != seed) {
      changes +=
          cat(changes.empty() ? "" : "; ", "seed ", *state.seed, " -> ", seed,
              " (the sampler's order, augmentation and dropout draw "
              "differently from the original run)");
    }
    const auto per_class =
        fingerprint_difference(state.data_fingerprint, data_fingerprint_);
    if (state.data_size && *state.data_size != data_size_) {
      changes += cat(changes.empty() ? "" : "; ", "the training set had ",
                     *state.data_size, " samples, now ", data_size_, " (",
                     per_class.empty() ? "files added or removed?" : per_class,
                     "; the sampler's order and a mid-epoch position "
                     "change)");
    } else if (state.data_size && !state.data_fingerprint.empty() &&
               !data_fingerprint_.empty() &&
               fingerprint_identity(state.data_fingerprint) !=
                   fingerprint_identity(data_fingerprint_)) {
      changes += cat(changes.empty() ? "" : "; ", "the training set has ",
                     data_size_, " samples as before but other contents (",
                     fingerprint_identity(state.data_fingerprint), " -> ",
                     fingerprint_identity(data_fingerprint_), ": ",
                     per_class.empty() ? "files renamed, replaced or relabelled"
                                       : per_class,
                     ")");
    }
    const std::string precision = precision_name(options_.precision());
    if (!state.precision.empty() && state.precision != precision) {
      changes += cat(changes.empty() ? "" : "; ", "precision ", state.precision,
                     " -> ", precision,
                     " (the continuation rounds "
                     "differently from the original run)");
    }
    // A layout changes nothing for a model without 4-D tensors.
    const bool four_d = parallel::has_4d_tensors(*target_.module);
    const std::string layout = memory_format_name(options_.memory_format());
    if (four_d && !state.memory_format.empty() &&
        state.memory_format != layout) {
      changes += cat(changes.empty() ? "" : "; ", "memory format ",
                     state.memory_format, " -> ", layout,
                     " (other kernels: the continuation rounds differently)");
    }
    if (changes.empty()) return;
    if (!options_.resume_allow_changes()) {
      throw UsageError(
          cat("checkpoint ", path.string(),
              " was written by a run with other settings: ", changes,
              ". Resume with the original settings, or allow the "
              "change (resume_allow_changes, "
              "--resume-allow-changes)"));
    }
    if (rank_ == 0 && options_.verbose()) {
      std::printf("resuming %s with changed settings: %s\n", path.c_str(),
                  changes.c_str());
    }
  }

  /// Rank 0: the resume's checkpoint, read (and checked) whole.
  ResumeRead read_now() const {
    return read_for_resume(
        options_.resume(), options_.out_dir(),
        [&](const std::string& b, const std::filesystem::path& p) {
          Checkpoint parsed = parse_checkpoint(b, p);
          TrainingState::load(parsed, p, columns_, num_sums_);
          return parsed;
        });
  }

  dist::Group group_;
  TrainerOptions options_;
  std::optional<ResumeRead> ahead_;  ///< rank 0: read_ahead's, until resume
  CheckpointQueue queue_{options_.async_checkpoints()};
  /// (global step, epochs done, batches done) of the archive written or
  /// queued last in the current event.
  std::array<std::int64_t, 3> queued_state_{-1, -1, -1};
  double blocking_seconds_ = 0;
  double drain_seconds_ = 0;
  std::int64_t checkpoints_written_ = 0;
  int rank_ = 0, world_ = 1;
  std::vector<std::string> columns_;
  std::size_t num_sums_ = 0;
  CheckpointTarget target_;
  std::vector<CallbackState> callbacks_;  ///< the fit's, by key
  std::int64_t data_size_ = 0;            ///< the training set's
  std::string data_fingerprint_;          ///< its `fingerprint()`, or ""
  torch::Tensor resume_rng_;  ///< set by a mid-epoch resume until applied
  /// Sharded checkpoints: this fit's folder number, the state whose parts
  /// were written last and what rank 0's manifest says of them, and
  /// whether this event wrote a manifest (its cleanup follows).
  std::uint64_t nonce_ = 0;
  std::array<std::int64_t, 3> shards_state_{-1, -1, -1};
  ShardSet shards_;
  bool sharded_saved_ = false;
  /// Set when the fit ends by an error: a background wait for the other
  /// ranks' parts gives up.
  std::shared_ptr<std::atomic<bool>> cancelled_ =
      std::make_shared<std::atomic<bool>>(false);
  /// Where an unfinished epoch stands: saved in mid-epoch checkpoints, and
  /// read from one until the resumed epoch starts.
  struct MidEpoch {
    std::int64_t batches_done = 0;  ///< 0: at an epoch's end
    torch::Tensor sums;  ///< [loss sum, samples, task sums...], all ranks
    torch::Tensor rng;   ///< [world, state]: each rank's generator
  } mid_;
};

}  // namespace ddpkit::train
