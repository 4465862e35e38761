// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's exception types. `UsageError` marks bad input from a user (a
// variable, a file, a flag): front ends turn it into exit code 2; `IoError`
// (the system refused a write: disk full, I/O error, quota) into 74.
#pragma once

#include <stdexcept>
#include <string>

#include "ddpkit/detail/strings.hpp"

namespace ddpkit {

/// Base of every error ddpkit throws on purpose.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Bad input from the user: an environment variable, a file, a flag, a
/// value. The message names what was wrong and what was expected.
class UsageError : public Error {
 public:
  using Error::Error;
};

/// The system refused to read or write a file (ENOSPC, EIO, EDQUOT, ...):
/// not the user's input but the machine's state. The message names the
/// file and the system's error text; `launch` exits `kIoErrorExitCode`.
class IoError : public Error {
 public:
  using Error::Error;
};

/// Training produced a non-finite loss or gradient and stopped (see
/// `TrainerOptions::skip_nonfinite`); the message names the step, the
/// epoch and the first rank that saw it.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

/// A distributed failure: rendezvous or collective timeout, rank mismatch.
class DistError : public Error {
 public:
  using Error::Error;
};

/// A collective failed because a peer went away (died, was killed, or
/// timed out). The rank that sees it is a casualty, not the cause: `launch`
/// exits with `kPeerFailureExitCode`, and the self-spawn launcher names
/// another rank as the cause when there is one.
class PeerFailure : public DistError {
 public:
  using DistError::DistError;
};

/// Training stopped on SIGTERM or SIGINT after writing a checkpoint (see
/// `TrainerOptions::checkpoint_on_signal`). `launch` prints the message on
/// rank 0 and exits 128 + the signal, as a process killed by it would.
class Interrupted : public Error {
 public:
  Interrupted(const std::string& what, int signal)
      : Error(what), signal_(signal) {}
  int signal() const {
    return signal_;
  }

 private:
  int signal_;
};

/// Exit code of a rank that stopped because a peer failed (EX_TEMPFAIL).
inline constexpr int kPeerFailureExitCode = 75;

/// Exit code of a run stopped by an `IoError` (EX_IOERR).
inline constexpr int kIoErrorExitCode = 74;

}  // namespace ddpkit
