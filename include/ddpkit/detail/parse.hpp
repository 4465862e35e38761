// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's one set of parsers for values a user types (environment
// variables, flags, init methods): whole numbers in a range, seconds, and
// a choice from a table. Every error names where the value came from, the
// value, and what was expected, as a UsageError:
//   environment variable WORLD_SIZE='2abc' is not an integer (expected a
//   whole number >= 1)
//   environment variable DDPKIT_ALLREDUCE='ring' must be auto, flat or
//   hierarchical
#pragma once

#include <charconv>
#include <chrono>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit::detail {

/// "environment variable NAME", the `what` of a value read from NAME.
inline std::string env_what(std::string_view name) {
  return cat("environment variable ", name);
}

/// `name`'s value, or nothing when it is unset.
inline std::optional<std::string> env_value(std::string_view name) {
  const char* v = std::getenv(std::string(name).c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

/// `text` as a whole number in [lo, hi]; `what` names its source.
template <class Int = int>
Int parse_int(std::string_view what, std::string_view text,
              Int lo = std::numeric_limits<Int>::min(),
              Int hi = std::numeric_limits<Int>::max()) {
  const auto expected = [&] {
    if (hi == std::numeric_limits<Int>::max()) return cat(">= ", lo);
    return cat("in ", lo, "..", hi);
  };
  Int out{};
  const char* first = text.data();
  const char* last = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(first, last, out);
  if (text.empty() || ptr != last || ec == std::errc::invalid_argument) {
    throw UsageError(cat(what, "='", text,
                         "' is not an integer (expected a whole number ",
                         expected(), ")"));
  }
  if (ec == std::errc::result_out_of_range || out < lo || out > hi) {
    throw UsageError(
        cat(what, "=", text, " is out of range (expected ", expected(), ")"));
  }
  return out;
}

/// `text` as a positive number of seconds ("300", "0.5").
inline std::chrono::milliseconds parse_seconds(std::string_view what,
                                               std::string_view text) {
  double secs = 0;
  const char* first = text.data();
  const char* last = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(first, last, secs);
  if (text.empty() || ptr != last || ec != std::errc() || !(secs > 0) ||
      secs > 1e9) {
    throw UsageError(
        cat(what, "='", text, "' is not a positive number of seconds"));
  }
  return std::chrono::milliseconds(static_cast<long long>(secs * 1000));
}

/// "a, b or c" for an error message.
inline std::string one_of(const std::vector<std::string_view>& names) {
  std::string s;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) s += i + 1 == names.size() ? " or " : ", ";
    s += names[i];
  }
  return s;
}

/// The value `text` names in `table` (exact match).
template <class T>
T parse_choice(std::string_view what, std::string_view text,
               const std::vector<std::pair<std::string_view, T>>& table) {
  std::vector<std::string_view> names;
  for (const auto& [name, value] : table) {
    if (name == text) return value;
    names.push_back(name);
  }
  throw UsageError(cat(what, "='", text, "' must be ", one_of(names)));
}

/// Environment variable `name` as `parse_seconds` reads it, or `dflt`.
inline std::chrono::milliseconds env_seconds(std::string_view name,
                                             std::chrono::milliseconds dflt) {
  const auto v = env_value(name);
  return v ? parse_seconds(env_what(name), *v) : dflt;
}

/// Environment variable `name` as `parse_choice` reads it, or `dflt`.
template <class T>
T env_choice(std::string_view name, T dflt,
             const std::vector<std::pair<std::string_view, T>>& table) {
  const auto v = env_value(name);
  return v ? parse_choice<T>(env_what(name), *v, table) : dflt;
}

/// An on/off environment variable, spelled "0" or "1" as ddpkit's are; `dflt`
/// when unset.
inline bool env_switch(std::string_view name, bool dflt) {
  return env_choice<bool>(name, dflt, {{"0", false}, {"1", true}});
}

}  // namespace ddpkit::detail
