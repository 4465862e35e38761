// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's string helpers, one of each: `cat` (stream anything into one
// string), `join`, `first_line` (the first line of a multi-line message,
// e.g. a c10::Error without its backtrace) and `fixed` (a number with so
// many decimals).
#pragma once

#include <cstdio>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

namespace ddpkit::detail {

/// Every argument streamed into one string: `cat("rank ", 3, ": ", what)`.
template <class... Args>
std::string cat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}

/// The items of `range`, each streamed, with `sep` between them.
template <class Range>
std::string join(const Range& range, std::string_view sep) {
  std::ostringstream os;
  bool first = true;
  for (const auto& item : range) {
    if (!first) os << sep;
    os << item;
    first = false;
  }
  return os.str();
}

/// `text` up to its first newline.
inline std::string first_line(std::string_view text) {
  return std::string(text.substr(0, text.find('\n')));
}

/// `v` with `digits` digits after the point: `fixed(2.04, 1)` is "2.0".
inline std::string fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

}  // namespace ddpkit::detail
