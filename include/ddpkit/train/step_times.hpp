// SPDX-License-Identifier: BSD-3-Clause
// Where a training step's time goes on one rank, summed over a fit: waiting
// for the loader, forward (with the loss), backward (with the gradient
// all-reduces it overlaps and the wait for the last ones), the ranks'
// per-step agreement, the optimizer step, and the rest (batches to the
// device, metric sums, callbacks). Steady-clock readings on the thread
// that trains: on a CPU they are the work itself; CUDA kernels run
// asynchronously, so there a phase's time is when the host got past it.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include "ddpkit/detail/json.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit::train {

// Note [Stragglers]
// ~~~~~~~~~~~~~~~~~
// Stragglers. Each rank times what its steps wait for the others
// (`StepTimes::waited()`: the DDP reducer's wait after backward plus the step
// agreement's collective, the finiteness check excluded). At an epoch's end
// the rank puts its epoch's wait in its own slot of `world` doubles appended
// to the epoch-end all-reduce that already sums the training metrics (no
// collective added), so every rank holds every rank's wait:
// `EpochMetrics::rank_wait_seconds` (metrics.jsonl `wait_seconds` and
// `slowest_rank`, TensorBoard `wait/rank_K`), and `FitResult` adds them over
// the fit (summary.json `wait_seconds_per_rank`, `slowest_rank`). The slowest
// rank is the one that waited least. Not in checkpoints' history (its width
// would depend on the world size, which a resume may change): rows from
// before a resume have none. Test: rank 1 of 2 reading its data 0.1 s a step
// late is named, and rank 0's wait exceeds 0.3 s an epoch (task_test.cpp).

// Note [Step times by phase]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Step times by phase (`train/step_times.hpp`). Every step the Trainer reads
// the steady clock at phase boundaries on the training thread: waiting for
// the step's batches, forward (up to the loss call; under DataParallel
// replica 0's), backward (with the overlapped gradient all-reduces; the
// engine's `last_wait_seconds` is the part spent waiting for them after
// backward; an engine that gathers parameters, ZeRO3, reports what its
// forward and backward waited for them, `last_gather_seconds`), the per-step agreement, the optimizer step (unscale, clip, step)
// and the rest (batches to the device, metric sums, callbacks). The sums are
// `FitResult::step_times`; rank 0's are `step_ms` in `summary.json` (ms per
// step) and the progress display's last line ("time per step … ms"). On CUDA
// the phases are host times (kernels run asynchronously; no synchronisation
// is added): untested. Tested: the DDP trainer test checks the step count and
// that the phases add up to the whole.

/// Seconds per phase, summed over `steps` optimizer steps.
struct StepTimes {
  std::int64_t steps = 0;
  double total = 0;      ///< from asking for the batches to the step's end
  double data = 0;       ///< waiting for the step's batches
  double forward = 0;    ///< forward and loss (DataParallel: replica 0's)
  double backward = 0;   ///< backward, including `grad_wait`
  double grad_wait = 0;  ///< of `backward`: waiting for gradient all-reduces
  /// Of `forward` and `backward`: waiting for parameters to be gathered
  /// (an engine that shards them: ZeRO3; 0 otherwise).
  double gather_wait = 0;
  double agree = 0;  ///< the ranks' agreement (signals, finiteness)
  /// Of `agree`: its collective (the rest is the finiteness check).
  double agree_collective = 0;
  double optimizer = 0;  ///< unscale, clip and the optimizer's step

  /// Waiting for the other ranks: the gradient all-reduce's wait and the
  /// agreement's collective (a straggler's is the smallest).
  double waited() const {
    return grad_wait + gather_wait + agree_collective;
  }

  /// What no phase above counts (batches to the device, metric sums,
  /// callbacks such as checkpoints).
  double other() const {
    return total - data - forward - backward - agree - optimizer;
  }

  /// Milliseconds per step, phase by phase, as a JSON object.
  std::string json() const {
    ddpkit::detail::JsonObject j;
    j.add("steps", static_cast<long long>(steps))
        .add("total", ms(total))
        .add("data_wait", ms(data))
        .add("forward", ms(forward))
        .add("backward", ms(backward))
        .add("grad_wait", ms(grad_wait))
        .add("gather_wait", ms(gather_wait))
        .add("agreement", ms(agree))
        .add("optimizer", ms(optimizer))
        .add("other", ms(other()));
    return j.compact();
  }

  /// "time per step 812.4 ms: data wait 1.2, forward 240.0, …" (ms).
  std::string line() const {
    using ddpkit::detail::cat;
    auto f = [](double v) {
      char b[32];
      std::snprintf(b, sizeof b, "%.1f", v);
      return std::string(b);
    };
    return cat("time per step ", f(ms(total)), " ms (mean of ", steps,
               " steps, this rank): data wait ", f(ms(data)), ", forward ",
               f(ms(forward)), ", backward ", f(ms(backward)),
               " (of which waiting for gradients ", f(ms(grad_wait)), ")",
               gather_wait > 0 ? cat(", of forward and backward waiting for "
                                     "parameters ",
                                     f(ms(gather_wait)))
                               : std::string(),
               ", agreement ", f(ms(agree)), ", optimizer ", f(ms(optimizer)),
               ", other ", f(ms(other())));
  }

 private:
  double ms(double seconds) const {
    return steps > 0 ? 1000.0 * seconds / static_cast<double>(steps) : 0.0;
  }
};

/// Seconds between two readings of the steady clock.
inline double seconds_between(std::chrono::steady_clock::time_point a,
                              std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace ddpkit::train
