// SPDX-License-Identifier: BSD-3-Clause
// The liveness watch: every rank posts a heartbeat in the store each second
// (its own client, so a wait in the group's store never delays it); while
// one of its collectives has waited a few seconds, a rank reads the others'
// heartbeats, and a rank whose heartbeat has not changed for the silence
// limit (15 s by default), or a store that no longer answers, is declared
// lost: the rank writes its flight record, names the lost rank (host, pid)
// and exits, long before the collective timeout. A rank that is merely busy
// (writing a checkpoint, evaluating alone, a slow batch) keeps beating: its
// heartbeat comes from a thread of its own.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/flight_recorder.hpp"
#include "ddpkit/distributed/topology.hpp"

namespace ddpkit::dist {

// Note [The liveness watch]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// The liveness watch (`distributed/liveness.hpp`). A collective that hangs
// because a peer is stopped (SIGSTOP, a debugger), dead on a lost host, or
// unreachable used to be found at the collective timeout (300 s). Each rank
// now posts a heartbeat (`ddpkit/live/R` = count and pid) every second
// through a second client of the store (`compat::clone_store`: a connection
// and lock of its own, so the group's own store waits never delay it) from a
// thread of its own. A second thread judges, never blocking: once one of this
// rank's collectives has waited 5 s (`oldest_pending` in the recorder), the
// first thread also reads the others' heartbeats; a peer whose heartbeat has
// not changed for 15 s (`DDPKIT_LIVENESS_TIMEOUT`), or a store that has not
// answered for as long, is lost: the rank writes its flight record, prints
// `error (rank 0): rank 1 (pid 4242 on host 'h') sent no heartbeat for 15.0
// s: lost (stopped, dead, or its host unreachable) while rank 0 waited 20.3 s
// in collective #4 all_reduce (bucket 0)` and exits 75 three heartbeats later
// (its main thread is blocked in the collective; the wait lets the other
// ranks reach their own judgment from the same heartbeats before this rank's
// exit breaks their waits, which they would otherwise report as a lost
// connection — the first test of a skipped batch inside a DDP fit saw exactly
// that). A busy rank — evaluating alone, writing a large checkpoint, a slow
// batch — keeps beating, because the heartbeat does not come from its
// training thread; only a process whose every thread is stopped, or that is
// gone, falls silent. Desync: while one of its collectives has waited 5 s, a
// rank adds it to its heartbeat (group, number, kind, size, dtype and its
// words, "all_reduce 4.0 kB Float (bucket 3)"); a rank that sees another
// waiting at the same number of the same group in a different collective ends
// with both sides named (`desync at collective #4: rank 1 broadcast 8 B Long
// (stop flag) vs rank 0 all_reduce 4.0 kB Float (bucket 3)`), within about 7
// s. Nothing is exchanged for collectives that complete: a desync whose
// collectives happen to match in kind, size and dtype (the same bucket of two
// different batches) is not seen until the ranks' sequences part. Signals
// during a hang: the Trainer hands the watch its signal flag
// (`Group::watch_interrupt`); a SIGTERM/SIGINT the loop has not acted on ends
// the rank (exit 128 + signal) 10 s after it came when one of its collectives
// has waited 5 s, or after 20 s wherever the rank is stuck, saying that no
// consistent checkpoint was possible and which checkpoint a resume will start
// from; within SLURM's and torchrun's 30 s grace. Off with
// `DDPKIT_LIVENESS=0`, and where the libtorch's stores cannot be cloned
// (before 2.5: Debian's 1.13), where the collective timeout alone finds a
// lost rank.

/// The liveness watch's settings.
struct LivenessSettings {
  /// A peer silent this long while a collective waits is lost
  /// (DDPKIT_LIVENESS_TIMEOUT, seconds).
  std::chrono::milliseconds silence{std::chrono::seconds(15)};
  /// How often a rank posts its heartbeat and looks at the others'.
  std::chrono::milliseconds interval{std::chrono::seconds(1)};
  /// Peers are looked at only once a collective has waited this long.
  std::chrono::milliseconds check_after{std::chrono::seconds(5)};
};

/// Watches the other ranks while this one waits in a collective (see the
/// top of this file). `on_lost` gets the message and is expected not to
/// return (the Group's writes the flight record and exits).
class LivenessWatch {
 public:
  /// Gets the message and the exit code (75 for a lost peer or a desync,
  /// 128 + the signal for an interrupted hang).
  using OnLost = std::function<void(const std::string&, int)>;

  LivenessWatch(compat::StorePtr store,
                std::shared_ptr<FlightRecorder> recorder, Topology topology,
                int rank, int world, LivenessSettings settings, OnLost on_lost)
      : state_(std::make_shared<State>()) {
    auto& s = *state_;
    s.store = std::move(store);
    s.recorder = std::move(recorder);
    s.topology = std::move(topology);
    s.rank = rank;
    s.world = world;
    s.settings = settings;
    s.on_lost = std::move(on_lost);
    s.peers.resize(static_cast<std::size_t>(world));
    s.last_store_ok = Clock::now();
    // Two threads: one talks to the store (and may block there when the
    // store's host is gone), the other judges from what the first saw, and
    // never blocks.
    beat_ = std::thread([st = state_] {
      beat(st);
      std::lock_guard<std::mutex> lock(st->mu);
      st->beat_done = true;
      st->cv.notify_all();
    });
    judge_ = std::thread([st = state_] { judge(st); });
  }
  /// Stops both threads: the judge at once, the heartbeat within a few
  /// seconds, else (blocked in a store that is gone) it is left to end
  /// with the process.
  ~LivenessWatch() {
    std::unique_lock<std::mutex> lock(state_->mu);
    state_->stop = true;
    state_->cv.notify_all();
    const bool done = state_->cv.wait_for(lock, std::chrono::seconds(3),
                                          [&] { return state_->beat_done; });
    lock.unlock();
    if (done) {
      beat_.join();
    } else {
      beat_.detach();
    }
    judge_.join();
  }
  LivenessWatch(const LivenessWatch&) = delete;
  LivenessWatch& operator=(const LivenessWatch&) = delete;

  /// While set, a SIGTERM/SIGINT that `pending` reports and that the
  /// training loop has not acted on ends the rank: after 10 s when one of
  /// its collectives has waited 5 s (a hang: the ranks cannot meet to agree
  /// on a checkpoint), after 20 s wherever it is stuck; `resume_note` says
  /// which checkpoint a resume will use. Empty functions stop it.
  void watch_interrupt(std::function<int()> pending,
                       std::function<std::string()> resume_note) {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->interrupt = std::move(pending);
    state_->resume_note = std::move(resume_note);
    state_->signal_seen.reset();
  }

  /// The store key of rank `r`'s heartbeat.
  static std::string key(int r) {
    return ddpkit::detail::cat("ddpkit/live/", r);
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Peer {
    // Its last heartbeat: "COUNT PID", then, while one of its collectives
    // waits, "|G SEQ KIND NUMEL DTYPE|description" of the oldest.
    std::string beat;
    Clock::time_point changed{};
  };
  struct State {
    std::mutex mu;
    std::condition_variable cv;
    bool stop = false;
    bool beat_done = false;
    bool checking = false;  // a collective has waited check_after
    std::string pending;    // "G SEQ KIND NUMEL DTYPE|description" while so
    compat::StorePtr store;
    std::shared_ptr<FlightRecorder> recorder;
    Topology topology;
    int rank = 0;
    int world = 1;
    LivenessSettings settings;
    OnLost on_lost;
    std::vector<Peer> peers;
    Clock::time_point last_store_ok;
    std::function<int()> interrupt;
    std::function<std::string()> resume_note;
    std::optional<Clock::time_point> signal_seen;
  };

  // Sleeps one interval; false when the watch is stopped.
  static bool tick(State& s) {
    std::unique_lock<std::mutex> lock(s.mu);
    return !s.cv.wait_for(lock, s.settings.interval, [&] { return s.stop; });
  }

  static void beat(const std::shared_ptr<State>& st) {
    State& s = *st;
    std::uint64_t count = 0;
    const std::string pid = std::to_string(::getpid());
    // SIGUSR1 to one rank: it counts a request here, every rank writes its
    // record when it sees the count grow.
    const std::string dumps = "ddpkit/flight/dumps";
    std::optional<std::int64_t> dumps_seen;
    do {
      try {
        if (s.recorder->take_dump_request()) {
          dumps_seen = s.store->add(dumps, 1);
        } else {
          const auto n = s.store->add(dumps, 0);
          if (dumps_seen && n > *dumps_seen) {
            s.recorder->dump_on_request("SIGUSR1 to another rank");
          }
          dumps_seen = n;
        }
        std::string mine = ddpkit::detail::cat(++count, " ", pid);
        bool checking = false;
        {
          std::lock_guard<std::mutex> lock(s.mu);
          checking = s.checking;
          if (checking && !s.pending.empty()) mine += "|" + s.pending;
        }
        s.store->set(key(s.rank),
                     std::vector<uint8_t>(mine.begin(), mine.end()));
        {
          std::lock_guard<std::mutex> lock(s.mu);
          s.last_store_ok = Clock::now();
        }
        if (!checking) continue;
        for (int r = 0; r < s.world; ++r) {
          if (r == s.rank) continue;
          std::string beat;
          if (s.store->check({key(r)})) {
            const auto v = s.store->get(key(r));
            beat.assign(v.begin(), v.end());
          }
          std::lock_guard<std::mutex> lock(s.mu);
          auto& p = s.peers[static_cast<std::size_t>(r)];
          if (!beat.empty() && beat != p.beat) {
            p.beat = beat;
            p.changed = Clock::now();
          }
          s.last_store_ok = Clock::now();
        }
      } catch (...) {
        // The store did not answer: the judge sees last_store_ok age.
      }
    } while (tick(s));
  }

  static void judge(const std::shared_ptr<State>& st) {
    State& s = *st;
    while (tick(s)) {
      const auto pending = s.recorder->oldest_pending();
      const auto now = Clock::now();
      const auto waited_us =
          pending ? FlightRecorder::now_us() - pending->start_us : 0;
      std::string what;  // why this rank ends; "" while all is well
      int code = kPeerFailureExitCode;
      std::string note;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        const bool wait_long =
            pending && waited_us >= s.settings.check_after.count() * 1000;
        if (auto stuck = interrupted(s, now, wait_long); !stuck.empty()) {
          what = stuck;
          code = 128 + s.interrupt();
          note = s.resume_note ? s.resume_note() : std::string();
        } else if (!wait_long) {
          s.checking = false;
          s.pending.clear();
          continue;
        } else {
          s.pending = ddpkit::detail::cat(
              pending->group, " ", pending->seq, " ", pending->kind, " ",
              pending->numel, " ",
              pending->dtype ? c10::toString(*pending->dtype) : "-", "|",
              FlightRecorder::describe(*pending));
          if (!s.checking) {
            // Silence is counted from here: a peer's heartbeat before the
            // wait says nothing about now.
            s.checking = true;
            for (auto& p : s.peers) p.changed = now;
            s.last_store_ok = now;
            continue;
          }
          what = describe_lost(s, now);
          if (what.empty()) what = describe_desync(s);
          if (what.empty()) continue;
        }
      }
      if (pending) {
        what += ddpkit::detail::cat(
            " while rank ", s.rank, " waited ",
            ddpkit::detail::fixed(static_cast<double>(waited_us) / 1e6, 1),
            " s in collective #", pending->seq, " ",
            FlightRecorder::describe(*pending));
      }
      if (code != kPeerFailureExitCode) {
        what +=
            ": the ranks cannot meet to agree on a step, so no "
            "consistent checkpoint is possible";
        if (!note.empty()) what += "; " + note;
      }
      s.on_lost(what, code);
      return;
    }
  }

  // "SIGTERM received 10.3 s ago and not acted on" when the rank must end
  // (see watch_interrupt), else "". Under s.mu.
  static std::string interrupted(State& s, Clock::time_point now,
                                 bool wait_long) {
    const int sig = s.interrupt ? s.interrupt() : 0;
    if (sig == 0) {
      s.signal_seen.reset();
      return {};
    }
    if (!s.signal_seen) s.signal_seen = now;
    const auto since = now - *s.signal_seen;
    if (since <
        (wait_long ? std::chrono::seconds(10) : std::chrono::seconds(20))) {
      return {};
    }
    return ddpkit::detail::cat(
        sig == SIGINT    ? "SIGINT"
        : sig == SIGTERM ? "SIGTERM"
                         : ddpkit::detail::cat("signal ", sig),
        " received ",
        ddpkit::detail::fixed(std::chrono::duration<double>(since).count(), 1),
        " s ago and not acted on");
  }

  // Two ranks waiting at the same collective number of a group with
  // different collectives (kind, size, dtype): both sides in words, as
  // "desync at collective #4 (group 0): rank 1 broadcast 8 B Long (stop
  // flag) vs rank 0 all_reduce 4.0 kB Float (bucket 3)"; "" when none.
  // Under s.mu.
  static std::string describe_desync(State& s) {
    const auto split = [](const std::string& p) {
      const auto bar = p.find('|');
      return std::pair{p.substr(0, bar), bar == std::string::npos
                                             ? std::string()
                                             : p.substr(bar + 1)};
    };
    const auto [mine, my_words] = split(s.pending);
    // "G SEQ": the collective's place; the rest: what it is.
    const auto place = [](const std::string& sig) {
      auto sp = sig.find(' ');
      sp = sp == std::string::npos ? sp : sig.find(' ', sp + 1);
      return sig.substr(0, sp);
    };
    for (int r = 0; r < s.world; ++r) {
      if (r == s.rank) continue;
      const auto& beat = s.peers[static_cast<std::size_t>(r)].beat;
      const auto bar = beat.find('|');
      if (bar == std::string::npos) continue;
      const auto [theirs, their_words] = split(beat.substr(bar + 1));
      if (place(theirs) != place(mine) || theirs == mine) continue;
      const auto sp = mine.find(' ');
      return ddpkit::detail::cat(
          "desync at collective #", place(mine).substr(sp + 1),
          mine[0] == '0' ? "" : " (side group)", ": rank ", r, " ", their_words,
          " vs rank ", s.rank, " ", my_words,
          ": the ranks called different collectives");
    }
    return {};
  }

  // The lost peers (or the store), in words; "" when none. Under s.mu.
  static std::string describe_lost(State& s, Clock::time_point now) {
    using ddpkit::detail::cat;
    const auto secs = [](auto d) {
      return ddpkit::detail::fixed(std::chrono::duration<double>(d).count(), 1);
    };
    if (now - s.last_store_ok >= s.settings.silence) {
      return cat("the rendezvous store has not answered for ",
                 secs(now - s.last_store_ok),
                 " s (its host, rank 0's or the launcher's, is stopped, "
                 "gone or unreachable)");
    }
    // The peers' heartbeats come through the store: while it is slow to
    // answer, their silence says nothing (a cut link silences them all).
    if (now - s.last_store_ok > 3 * s.settings.interval) return {};
    std::string text;
    for (int r = 0; r < s.world; ++r) {
      const auto& p = s.peers[static_cast<std::size_t>(r)];
      if (r == s.rank || now - p.changed < s.settings.silence) continue;
      if (!text.empty()) text += " and ";
      const auto space = p.beat.find(' ');
      const std::string pid =
          space == std::string::npos ? "?" : p.beat.substr(space + 1);
      const bool known = s.topology.world() == s.world;
      text += cat(
          "rank ", r, " (pid ", pid,
          known ? cat(" on host '",
                      s.topology.host_name[static_cast<std::size_t>(r)], "'")
                : std::string(),
          ")");
    }
    if (text.empty()) return text;
    return cat(text, " sent no heartbeat for ", secs(s.settings.silence),
               " s: lost (stopped, dead, or its host unreachable)");
  }

  std::shared_ptr<State> state_;
  std::thread beat_;
  std::thread judge_;
};

}  // namespace ddpkit::dist
