// SPDX-License-Identifier: BSD-3-Clause
// Stopping on SIGTERM / SIGINT at a step boundary: the signal only raises a
// flag; the training loop sees it, the ranks agree on the step, rank 0
// writes a checkpoint, and `Interrupted` ends the run.
#pragma once

#include <signal.h>

#include <csignal>

namespace ddpkit::train {

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

}  // namespace ddpkit::train
