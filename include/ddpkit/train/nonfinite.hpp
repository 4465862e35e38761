// SPDX-License-Identifier: BSD-3-Clause
// The finiteness guard: a step whose loss or averaged gradients are not
// finite is not taken on any rank — skipped while
// TrainerOptions::skip_nonfinite allows, else a NonFiniteError on every
// rank naming the step — so the weights (and checkpoints/last.pt) stay the
// last finite ones. The ranks agree on it in the step's one small
// all-reduce (signals.hpp, agree_on_step).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/train/callbacks.hpp"
#include "ddpkit/train/clip.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/signals.hpp"

namespace ddpkit::train {

// Note [Finite or stop]
// ~~~~~~~~~~~~~~~~~~~~~
// Finite or stop. The per-step agreement (one 3 × int64 max all-reduce:
// pending signal, `world - rank` of the first rank whose loss was not finite,
// whether the averaged gradients are) runs between backward and the optimizer
// step; gradients after DDP's all-reduce are identical on every rank, so
// every rank decides the same. The gradient check (`train::gradients_finite`)
// sums each gradient (NaN and infinities propagate through a sum) and, only
// when the sum of sums is not finite (a NaN, an infinity, or finite values
// overflowing), checks `isfinite().all()` per parameter; one host sync in the
// usual case. The element check alone cost ~100 ms of a 1.7 s ResNet-34 step
// at 128 px (docs/BENCHMARKS.md); the sums ~10 ms.

/// Whether every gradient of `module` is finite (one host sync).
inline bool grads_finite(const torch::nn::Module& module) {
  return gradients_finite(parallel::unique_parameters(module));
}

/// Counts the non-finite steps skipped in this process and decides each.
class NonFiniteGuard {
 public:
  /// A step of `batches` batches whose loss or gradients were not finite
  /// (`a`), not taken (the caller has zeroed the gradients): skipped and
  /// reported (rank 0) while `o.skip_nonfinite()` allows, advancing `s`
  /// past its batches without counting them in the metrics; else throws
  /// NonFiniteError naming the step and what was not finite.
  void skip_or_throw(FitState& s, const StepAgreement& a, std::size_t batches,
                     const TrainerOptions& o, bool multi, bool is_main) {
    using ddpkit::detail::cat;
    const std::string what =
        a.nonfinite_rank >= 0
            ? cat("non-finite loss on rank ", a.nonfinite_rank,
                  multi ? " (the first rank whose loss was not finite)" : "")
            : cat("non-finite gradients",
                  multi ? " (averaged over the ranks; every rank's loss "
                          "was finite)"
                        : " (the loss was finite)");
    const std::string where =
        cat("step ", s.global_step + 1, " (epoch ", s.epoch + 1, ", batch ",
            s.step + 1, " of ", s.steps, ")");
    if (skipped_ < o.skip_nonfinite()) {
      ++skipped_;
      if (is_main) {
        std::fprintf(stderr,
                     "warning: %s at %s: step skipped (%d of %d allowed)\n",
                     what.c_str(), where.c_str(), skipped_, o.skip_nonfinite());
      }
      s.step += batches;  // consumed, not counted in the metrics
      s.global_step += static_cast<std::int64_t>(batches);
      return;
    }
    throw NonFiniteError(cat(
        what, " at ", where, "; the step was not taken, so the weights (and ",
        o.checkpoints() ? "checkpoints/last.pt" : "the model",
        ") are the last finite ones",
        o.skip_nonfinite() > 0
            ? cat(" (", skipped_, " such steps skipped already)")
            : std::string(),
        ". Lower the learning rate, clip the gradients (clip / "
        "--clip-grad-norm), or skip such steps (skip_nonfinite / "
        "--skip-nonfinite N)"));
  }

  /// Steps skipped so far in this process.
  int skipped() const {
    return skipped_;
  }

 private:
  int skipped_ = 0;
};

}  // namespace ddpkit::train
