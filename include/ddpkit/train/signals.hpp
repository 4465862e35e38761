// SPDX-License-Identifier: BSD-3-Clause
// Stopping on SIGTERM / SIGINT at a step boundary: the signal only raises a
// flag; the training loop sees it, the ranks agree on the step (one small
// all-reduce per step, which also carries whether the step was finite, and
// one at each epoch's end, which also carries a callback's stop), rank 0
// writes a checkpoint, and `Interrupted` ends the run.
#pragma once

#include <signal.h>

#include <csignal>
#include <cstdint>

#include <torch/torch.h>

#include "ddpkit/distributed/collectives.hpp"

namespace ddpkit::train {

// Note [Checkpoint on SIGTERM/SIGINT]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Checkpoint on SIGTERM/SIGINT (`checkpoint_on_signal`, default on). During
// `fit` the two signals only set a flag (one-shot handlers, `SA_RESETHAND`: a
// second signal has its usual effect; the previous handlers come back when
// `fit` returns). A signal may reach one rank only, so after each optimizer
// step the ranks all-reduce the flag (max; 8 bytes, skipped in one process)
// and all stop on the same batch: a mid-epoch checkpoint there (the same one
// `checkpoint_every_n_steps` writes, so the resume is exact), then
// `Interrupted` (`launch`: exit 128 + signal, the message on rank 0). A
// signal during evaluation is seen after the epoch's own checkpoint (a second
// all-reduce per epoch). With `uneven_inputs(join)` only that epoch-end check
// runs. A rank blocked in a collective does not see the flag until the
// collective ends or times out; the self-spawn launcher sends SIGKILL 30 s
// after passing the signal on (`SpawnOptions::interrupt_grace`, torchrun's
// and SLURM's default wait), or at once on a second signal. Tested: SIGTERM
// to rank 0 of 2 after batch 2 of an epoch and after its last batch (both
// ranks stop there, resumed weights equal an uninterrupted run's bit for
// bit); SIGINT in one process (checkpoint at that batch, handler restored;
// off leaves a handler of the user's in place).

namespace detail {
/// The first SIGTERM/SIGINT received while a `SignalFlag` is armed (0: none).
inline volatile std::sig_atomic_t pending_signal = 0;
extern "C" inline void record_signal(int sig) {
  if (pending_signal == 0) pending_signal = sig;
}
}  // namespace detail

/// While alive, SIGTERM and SIGINT set a flag instead of ending the
/// process; the handlers in place before are restored at destruction. Each
/// handler is one-shot (SA_RESETHAND): the same signal a second time ends
/// the process as it would have without us, so a stuck run still stops.
class SignalFlag {
 public:
  explicit SignalFlag(bool arm) : armed_(arm) {
    if (!armed_) return;
    detail::pending_signal = 0;
    struct sigaction sa{};
    sa.sa_handler = &detail::record_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART | SA_RESETHAND;
    ::sigaction(SIGTERM, &sa, &old_term_);
    ::sigaction(SIGINT, &sa, &old_int_);
  }
  ~SignalFlag() {
    if (!armed_) return;
    ::sigaction(SIGTERM, &old_term_, nullptr);
    ::sigaction(SIGINT, &old_int_, nullptr);
    detail::pending_signal = 0;
  }
  SignalFlag(const SignalFlag&) = delete;
  SignalFlag& operator=(const SignalFlag&) = delete;

  bool armed() const {
    return armed_;
  }
  /// The signal received so far (SIGTERM or SIGINT), or 0.
  int pending() const {
    return armed_ ? static_cast<int>(detail::pending_signal) : 0;
  }

 private:
  bool armed_;
  struct sigaction old_term_{};
  struct sigaction old_int_{};
};

/// What the ranks agreed after a step's backward.
struct StepAgreement {
  int signal = 0;                ///< SIGTERM/SIGINT any rank received (0: none)
  int nonfinite_rank = -1;       ///< first rank whose loss was not finite
  bool nonfinite_grads = false;  ///< the averaged gradients were not
};

/// After a step's backward: one all-reduce (max) of [signal, world - first
/// rank whose loss was not finite, gradients not finite] over `group`,
/// where the ranks communicate per step anyway (and a signal or the check
/// asks for it); else the local view of rank `rank` (one process, or
/// `group` null under join, where ranks step unevenly and a signal waits
/// for the epoch's end: `local_signal` false).
inline StepAgreement agree_on_step(const dist::Group* group,
                                   const SignalFlag& signals, bool check,
                                   bool loss_finite, bool grads_finite,
                                   int rank, bool local_signal = true) {
  StepAgreement a;
  if (group && (signals.armed() || check)) {
    const int world = group->size();
    auto t =
        torch::tensor(
            {static_cast<std::int64_t>(signals.pending()),
             static_cast<std::int64_t>(loss_finite ? 0 : world - group->rank()),
             static_cast<std::int64_t>(grads_finite ? 0 : 1)},
            torch::kInt64)
            .to(group->device());
    dist::CollectiveTag tag("step agreement");
    dist::all_reduce(*group, t, dist::Reduce::max);
    t = t.cpu();
    const auto* v = t.data_ptr<std::int64_t>();
    a.signal = static_cast<int>(v[0]);
    a.nonfinite_rank = v[1] > 0 ? world - static_cast<int>(v[1]) : -1;
    a.nonfinite_grads = v[2] != 0;
    return a;
  }
  a.signal = local_signal ? signals.pending() : 0;
  a.nonfinite_rank = loss_finite ? -1 : rank;
  a.nonfinite_grads = !grads_finite;
  return a;
}

/// At an epoch's end every rank agrees on stopping (a callback may have
/// decided on one rank only: `stop` becomes true on every rank if it was on
/// any) and on a signal, which it returns (0: none). `group` null: one
/// process, nothing to agree.
inline int agree_at_epoch_end(const dist::Group* group,
                              const SignalFlag& signals, bool& stop) {
  if (!group) return signals.pending();
  auto t = torch::tensor({static_cast<std::int64_t>(signals.pending()),
                          static_cast<std::int64_t>(stop)},
                         torch::kInt64)
               .to(group->device());
  dist::CollectiveTag tag("stop agreement");
  dist::all_reduce(*group, t, dist::Reduce::max);
  t = t.cpu();
  if (t[1].item<std::int64_t>() != 0) stop = true;
  return static_cast<int>(t[0].item<std::int64_t>());
}

}  // namespace ddpkit::train
