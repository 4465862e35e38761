// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's one JSON writer: escaping, numbers (non-finite as null) and flat
// objects written in order, compact or indented. metrics.jsonl,
// summary.json, class_indices.json and the Chrome trace are written with it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <iomanip>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ddpkit::detail {

/// `s` with `"`, `\` and control characters escaped (no quotes around).
inline std::string json_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += c;
    }
  }
  return out;
}

/// `"s"`, escaped.
inline std::string json_string(std::string_view s) {
  return "\"" + json_escape(s) + "\"";
}

/// `v` with 10 significant digits; NaN and infinities (which JSON lacks) as
/// null.
inline std::string num(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream os;
  os << std::setprecision(10) << v;
  return os.str();
}

/// Key/value pairs of a flat JSON object, written in the order added.
class JsonObject {
 public:
  JsonObject& add(std::string_view k, std::string_view v) {
    return raw(k, json_string(v));
  }
  JsonObject& add(std::string_view k, const char* v) {
    return raw(k, json_string(v));
  }
  JsonObject& add(std::string_view k, double v) {
    return raw(k, num(v));
  }
  JsonObject& add(std::string_view k, int v) {
    return raw(k, std::to_string(v));
  }
  JsonObject& add(std::string_view k, long v) {
    return raw(k, std::to_string(v));
  }
  JsonObject& add(std::string_view k, long long v) {
    return raw(k, std::to_string(v));
  }
  JsonObject& add(std::string_view k, bool v) {
    return raw(k, v ? "true" : "false");
  }
  /// `json` as the value, unchanged (a number already formatted, null, a
  /// nested object).
  JsonObject& raw(std::string_view k, std::string json) {
    items_.emplace_back(json_escape(k), std::move(json));
    return *this;
  }

  /// `{"a":1,"b":"x"}`: one line, no spaces (a JSON Lines record).
  std::string compact() const {
    std::string s = "{";
    for (std::size_t i = 0; i < items_.size(); ++i) {
      s += (i ? ",\"" : "\"") + items_[i].first + "\":" + items_[i].second;
    }
    return s + "}";
  }
  /// One key per line, indented by `indent` spaces, as Python's
  /// `json.dumps(obj, indent=indent)` lays it out (no final newline).
  std::string indented(int indent = 2) const {
    if (items_.empty()) return "{}";
    const std::string pad(static_cast<std::size_t>(indent), ' ');
    std::string s = "{\n";
    for (std::size_t i = 0; i < items_.size(); ++i) {
      s += pad + "\"" + items_[i].first + "\": " + items_[i].second +
           (i + 1 < items_.size() ? ",\n" : "\n");
    }
    return s + "}";
  }
  /// `indented(2)` and a newline: what summary.json holds.
  std::string str() const {
    return indented(2) + "\n";
  }

 private:
  std::vector<std::pair<std::string, std::string>> items_;
};

}  // namespace ddpkit::detail
