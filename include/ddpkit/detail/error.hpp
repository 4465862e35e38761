// ddpkit's exception types. `UsageError` marks bad input from a user (a
// variable, a file, a flag): front ends turn it into exit code 2.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

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

/// A distributed failure: rendezvous or collective timeout, rank mismatch.
class DistError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

}  // namespace detail
}  // namespace ddpkit
