// SPDX-License-Identifier: BSD-3-Clause
// Run something when a scope ends, however it ends: ddpkit's one scope
// guard (`ScopeExit`), and its variant that runs only when the scope ends by
// an exception (`ScopeFail`).
#pragma once

#include <exception>
#include <utility>

namespace ddpkit::detail {

/// Calls `f()` when destroyed: `ScopeExit cleanup([&] { remove(dir); });`.
template <class F>
class ScopeExit {
 public:
  explicit ScopeExit(F f) : f_(std::move(f)) {}
  ScopeExit(const ScopeExit&) = delete;
  ScopeExit& operator=(const ScopeExit&) = delete;
  ~ScopeExit() {
    f_();
  }

 private:
  F f_;
};

/// Calls `f()` when destroyed by an exception thrown after its
/// construction.
template <class F>
class ScopeFail {
 public:
  explicit ScopeFail(F f) : f_(std::move(f)) {}
  ScopeFail(const ScopeFail&) = delete;
  ScopeFail& operator=(const ScopeFail&) = delete;
  ~ScopeFail() {
    if (std::uncaught_exceptions() > pending_) f_();
  }

 private:
  F f_;
  int pending_ = std::uncaught_exceptions();
};

}  // namespace ddpkit::detail
