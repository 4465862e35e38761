// SPDX-License-Identifier: BSD-3-Clause
// Checkpoint files written in order, now or in the background: the
// checkpoint connector's writer. See Note [Asynchronous checkpoints].
#pragma once

#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/train/checkpoint.hpp"

namespace ddpkit::train {

// Note [Asynchronous checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With `TrainerOptions::async_checkpoints`, rank 0 blocks only while the
// state is copied: the model's tensors and every other tensor of the
// checkpoint are cloned into a private archive (the snapshot), and so are
// the optimizer's state tensors, into a fresh optimizer of the same type
// over the same parameters (optimizer_snapshot: libtorch's optimizers show
// their state only through serialisation, which took 215-228 ms of
// ResNet-34's 456 ms blocking; the copy takes what a copy takes). Types
// other than libtorch's SGD, Adam, AdamW, RMSprop and Adagrad (and what
// derives from them) are serialised while training waits, as before. The
// check that no weight is non-finite runs in the background too, on the
// snapshot, before anything is written: it refuses the write, and the
// error reaches the training thread at the next checkpoint or the fit's
// end (synchronous checkpoints refuse at once). Serialising, zipping,
// writing, fsync and rename run on one background thread while training
// goes on. The snapshot is a copy, never a view, so an update right after
// it cannot reach the file
// (the failure of pytorch#144657, where asynchronous saves of CPU tensors
// wrote values from after the update; tested). Every write stays atomic
// (Note [Checkpoint durability]): a crash or `kill -9` during the
// background write leaves the previous file whole (tested). One job runs at
// a time: the files and file operations queued during one event (last.pt,
// best.pt, the best-k links and removals) form one job, launched when the
// event's callbacks are done, written in order from one snapshot serialised
// once; the next job waits for the previous (that wait counts as blocking;
// the fit's end waiting for the last job is reported apart as the drain).
// An error in the background (a full disk) is rethrown on the training
// thread at the next launch or at the fit's end, naming the file; the
// previous files are intact. Cost: a second copy of the model and optimizer
// state in host memory while a job runs. Without the option every write
// and operation happens at once, as before. Either way the same state
// written to two files in one event is serialised once.

/// A snapshot of `archive` for a background write: every entry copied by
/// host_snapshot (nothing shared with training); the entries written later
/// (`Checkpoint::write_later`, made from copies of their own) kept.
inline std::shared_ptr<const Checkpoint> checkpoint_snapshot(
    const Checkpoint& archive) {
  auto snap = std::make_shared<Checkpoint>();
  for (const auto& kv : archive.dict()) {
    snap->write(kv.key().toStringRef(), host_snapshot(kv.value()));
  }
  for (const auto& [key, make] : archive.later()) snap->write_later(key, make);
  return snap;
}

/// Checkpoint files and operations on them, run in the order queued:
/// at once, or (asynchronous) as one background job per `launch`.
class CheckpointQueue {
 public:
  explicit CheckpointQueue(bool asynchronous = false) : async_(asynchronous) {}
  CheckpointQueue(const CheckpointQueue&) = delete;
  CheckpointQueue& operator=(const CheckpointQueue&) = delete;
  ~CheckpointQueue() {
    wait_quietly();
  }

  bool asynchronous() const {
    return async_;
  }

  /// Writes `archive` to `path` atomically (the old file kept as
  /// `keep_previous` when given): now, or queued. Queued archives must be
  /// snapshots (no tensor shared with training).
  void write(std::shared_ptr<const Checkpoint> archive,
             std::filesystem::path path, std::filesystem::path keep_previous) {
    latest_ = archive;
    Step s{std::move(archive), std::move(path), std::move(keep_previous), {}};
    if (!async_) {
      run(s, serialised_, bytes_);
      return;
    }
    queued_.push_back(std::move(s));
  }

  /// Runs `fn` (a file operation that needs the files written before it):
  /// now, or queued after them.
  void then(std::function<void()> fn) {
    if (!async_) {
      fn();
      return;
    }
    queued_.push_back(Step{nullptr, {}, {}, std::move(fn)});
  }

  /// The archive written (or queued) last since the last `launch`, to write
  /// the same state to a second file (serialised once), or null.
  std::shared_ptr<const Checkpoint> latest_archive() const {
    return latest_;
  }

  /// At the end of an event: starts what was queued as one background job,
  /// after the previous job ends (its error rethrown here), and forgets the
  /// event's archive. Returns the seconds it waited.
  double launch() {
    latest_.reset();
    serialised_.reset();
    bytes_ = std::string();
    if (queued_.empty()) return 0;
    const double waited = wait();
    auto steps = std::make_shared<std::vector<Step>>(std::move(queued_));
    queued_.clear();
    thread_ = std::thread([this, steps] {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        std::shared_ptr<const Checkpoint> last;
        std::string bytes;
        for (auto& s : *steps) run(s, last, bytes);
      } catch (...) {
        error_ = std::current_exception();
      }
      background_seconds_ +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
              .count();
    });
    return waited;
  }

  /// Waits for the running job; rethrows its error. Returns the seconds
  /// waited.
  double wait() {
    const auto t0 = std::chrono::steady_clock::now();
    if (thread_.joinable()) thread_.join();
    const double waited =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
            .count();
    if (error_) {
      auto e = std::exchange(error_, nullptr);
      std::rethrow_exception(e);
    }
    return waited;
  }

  /// `wait` for paths that are already failing (an exception unwinding):
  /// the job finishes so its files are whole; its error goes to stderr.
  void wait_quietly() noexcept {
    try {
      launch();
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: background checkpoint: %s\n", e.what());
    } catch (...) {
      std::fprintf(stderr, "error: background checkpoint failed\n");
    }
  }

  /// Seconds the background jobs took, in all.
  double background_seconds() const {
    return background_seconds_;
  }

 private:
  struct Step {
    std::shared_ptr<const Checkpoint> archive;  ///< a write, or
    std::filesystem::path path, keep_previous;
    std::function<void()> fn;  ///< an operation
  };

  /// One step; `last`/`bytes`: the archive serialised last, reused when
  /// the next write is of the same snapshot.
  static void run(const Step& s, std::shared_ptr<const Checkpoint>& last,
                  std::string& bytes) {
    if (!s.archive) {
      s.fn();
      return;
    }
    if (s.archive != last) {
      bytes = checkpoint_bytes(*s.archive, s.path);
      last = s.archive;
    }
    write_checkpoint_bytes(bytes, s.path, s.keep_previous);
  }

  bool async_;
  std::shared_ptr<const Checkpoint> latest_;  ///< since the last launch
  /// Synchronous writes: the archive serialised last and its bytes, until
  /// the next launch.
  std::shared_ptr<const Checkpoint> serialised_;
  std::string bytes_;
  std::vector<Step> queued_;
  std::thread thread_;
  std::exception_ptr error_;  ///< the running job's, read after join
  double background_seconds_ = 0;
};

}  // namespace ddpkit::train
