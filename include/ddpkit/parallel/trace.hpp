// SPDX-License-Identifier: BSD-3-Clause
// Per-step timings written as a Chrome trace (chrome://tracing, Perfetto):
// forward, backward, each bucket's all-reduce and the wait after backward.
#pragma once

#include <chrono>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/json.hpp"

namespace ddpkit::parallel {

/// Collects complete events ("ph":"X") and writes them as JSON on `flush`.
/// Disabled (every call a no-op) when constructed with an empty path.
class Trace {
 public:
  using clock = std::chrono::steady_clock;

  Trace() = default;
  Trace(std::string path, int rank) : path_(std::move(path)), rank_(rank) {}

  bool enabled() const {
    return !path_.empty();
  }

  /// Records [start, end) under `name` on track `track`.
  void record(const std::string& name, clock::time_point start,
              clock::time_point end, int track = 0) {
    if (!enabled()) return;
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back({name, us(start), us(end) - us(start), track});
  }

  /// A scope that records itself on destruction.
  class Span {
   public:
    Span(Trace& t, std::string name, int track = 0)
        : t_(t), name_(std::move(name)), track_(track), start_(clock::now()) {}
    ~Span() {
      t_.record(name_, start_, clock::now(), track_);
    }

   private:
    Trace& t_;
    std::string name_;
    int track_;
    clock::time_point start_;
  };

  /// Writes every event so far (rewrites the whole file: it stays valid JSON
  /// whenever the process stops).
  void flush() const {
    if (!enabled()) return;
    std::lock_guard<std::mutex> lock(mu_);
    std::ostringstream out;
    out << "{\"traceEvents\":[\n";
    for (std::size_t i = 0; i < events_.size(); ++i) {
      const auto& e = events_[i];
      out << ddpkit::detail::JsonObject()
                 .add("name", e.name)
                 .add("ph", "X")
                 .add("ts", e.ts)
                 .add("dur", e.dur)
                 .add("pid", rank_)
                 .add("tid", e.track)
                 .compact()
          << (i + 1 < events_.size() ? ",\n" : "\n");
    }
    out << "],\"displayTimeUnit\":\"ms\"}\n";
    ddpkit::detail::write_atomically(path_, out.str());
  }

  std::size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return events_.size();
  }

 private:
  struct Event {
    std::string name;
    long long ts;
    long long dur;
    int track;
  };
  static long long us(clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               t.time_since_epoch())
        .count();
  }

  std::string path_;
  int rank_ = 0;
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

}  // namespace ddpkit::parallel
