// SPDX-License-Identifier: BSD-3-Clause
// The flight recorder: every collective a group starts, in a fixed-size ring
// per process (sequence number, kind, group, dtype, size, what started it,
// start and end times, state), written as OUT/flight/rank-K.json when a
// collective fails and on SIGUSR1, for `ddpkit-doctor` to read. PyTorch
// keeps one for NCCL only; this one sees every backend ddpkit uses (gloo,
// NCCL, shared memory) and the waits through the store.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/json.hpp"
#include "ddpkit/detail/strings.hpp"

namespace ddpkit::dist {

// Note [The flight recorder]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// The flight recorder (`distributed/flight_recorder.hpp`). Every collective a
// group starts goes through `Group::begin_collective` (the four places in
// `collectives.hpp` that start one, and the store wait of
// `broadcast_when_ready` as `store_wait`), which counts it and writes an
// entry in a ring shared by the group's copies and its side group (2048
// entries, `DDPKIT_FLIGHT_RECORDER=N`, 0 turns it off): the collective's
// number in its group, kind, dtype, element count, bytes, a tag, start and
// end wall-clock times (µs) and state. The tag comes from a thread-local
// `CollectiveTag` set where collectives start: the reducer ("bucket 3", "used
// parameters"), SyncBN ("syncbn forward/backward"), the Trainer ("step
// agreement", "epoch end", "evaluation", "rank 0 status", "resume", …). Ends
// are recorded by `detail::wait`, the one place every wait goes through; an
// entry also keeps a weak reference to its c10d work, so a dump shows as
// completed what finished without a wait. A failed wait writes the rank's
// record (`DIR/rank-K.json`, atomically) and names it in the error; SIGUSR1
// writes it from a thread of its own while training goes on (the handler only
// writes a byte to a pipe), and counts a request in the store
// (`ddpkit/flight/dumps`) that every other rank's liveness thread sees within
// a second and answers with its own record (libtorch ≥ 2.5; before, only the
// signalled rank writes). The Trainer points it at `OUT/flight`
// (`DDPKIT_FLIGHT_DIR` chooses another folder for any program) and removes an
// earlier run's records there first. `scripts/ddpkit-doctor` (installed as
// `bin/ddpkit-doctor`, Python standard library) reads the records: ranks
// without one, the first number at which two ranks recorded different
// collectives (a desync, both sides named), ranks behind (fewer collectives
// started), what each rank concluded when it wrote its record (a lost peer, a
// desync), where each rank waited and for how long (a collective in flight
// under 5 s, as in a SIGUSR1 record of a healthy job, is no fault), and the
// rank that started the common collectives last most often (the slowest);
// exit 1 on a fault. A rank that ends on a lost peer, a desync or a failed
// collective runs it too (`distributed/doctor.hpp`): the first to create
// `DIR/verdict.claim` (O_EXCL; on a folder hosts share, once per job,
// otherwise once per host) waits until no new record has come for a second (3
// s at most), runs `python3 ddpkit-doctor DIR`, renames the whole report to
// `DIR/verdict.txt` and prints its first line; the other ranks wait for that
// file (8 s at most) before they exit, because a launcher stops every rank at
// the first exit and would cut the doctor short (CI saw an empty report
// before this rule); the doctor is looked up in `$DDPKIT_DOCTOR`, beside the
// program (CMake copies it into the build's `bin/`), then on `PATH`, and
// nothing is printed without it. Cost: a mutex and a few stores per
// collective (measured in BENCHMARKS.md).

/// Names what starts the collectives on this thread while alive (the
/// reducer's "bucket 3", SyncBN's statistics, the Trainer's agreements), for
/// the flight recorder; the previous tag is restored at destruction.
///
/// Example:
/// ```
/// ddpkit::dist::CollectiveTag tag("metrics");
/// ddpkit::dist::all_reduce(group, sums);  // recorded with tag "metrics"
/// ```
/// See Note [The flight recorder].
class CollectiveTag {
 public:
  explicit CollectiveTag(const char* what, long index = -1) : prev_(current()) {
    current() = {what, index};
  }
  ~CollectiveTag() {
    current() = prev_;
  }
  CollectiveTag(const CollectiveTag&) = delete;
  CollectiveTag& operator=(const CollectiveTag&) = delete;

  struct Value {
    const char* what = nullptr;
    long index = -1;
  };
  /// This thread's tag ({nullptr, -1} when none is set).
  static Value& current() {
    thread_local Value v;
    return v;
  }

 private:
  Value prev_;
};

/// One collective as the recorder holds it.
struct FlightEntry {
  enum class State { started, completed, failed };
  std::uint64_t id = 0;   // position in the process's record (all groups)
  std::uint64_t seq = 0;  // the collective's number in its group
  int group = 0;          // 0: the group, 1: its side group
  const char* kind = "";  // all_reduce, all_gather, broadcast, store_wait
  std::optional<c10::ScalarType> dtype;
  std::int64_t numel = 0;
  std::uint64_t bytes = 0;
  std::array<char, 48> tag{};
  std::int64_t start_us = 0;  // wall clock, microseconds since the epoch
  std::int64_t end_us = 0;    // 0 while not ended
  State state = State::started;
  const void* work_id = nullptr;
  std::optional<c10::weak_intrusive_ptr<c10d::Work>> work;
  std::string error;
};

/// A ring of the last `capacity` collectives of a process's groups, shared
/// by copies of a `Group` (and its side group). Thread-safe: collectives
/// start from the training thread and from autograd's.
class FlightRecorder {
 public:
  /// The ring's default size: DDPKIT_FLIGHT_RECORDER=N sets another, 0 turns
  /// the recorder off.
  static constexpr std::size_t kDefaultCapacity = 2048;

  FlightRecorder(std::size_t capacity, int rank, int world, std::string host)
      : ring_(capacity), rank_(rank), world_(world), host_(std::move(host)) {}

  static std::int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }

  /// Records the start of a collective of `kind` on `group` over `t` (or
  /// none: a wait through the store); returns its id for `attach`/`end`.
  std::uint64_t start(int group, const char* kind, const torch::Tensor* t,
                      std::uint64_t bytes) {
    const auto tag = CollectiveTag::current();
    std::lock_guard<std::mutex> lock(mu_);
    const std::uint64_t id = next_id_++;
    FlightEntry& e = ring_[id % ring_.size()];
    e.id = id;
    e.seq = next_seq_[group == 0 ? 0 : 1]++;
    e.group = group;
    e.kind = kind;
    e.dtype.reset();
    e.numel = 0;
    if (t != nullptr && t->defined()) {
      e.dtype = t->scalar_type();
      e.numel = t->numel();
    }
    e.bytes = bytes;
    e.tag[0] = '\0';
    if (tag.what != nullptr) {
      if (tag.index >= 0) {
        std::snprintf(e.tag.data(), e.tag.size(), "%s %ld", tag.what,
                      tag.index);
      } else {
        std::snprintf(e.tag.data(), e.tag.size(), "%s", tag.what);
      }
    }
    e.start_us = now_us();
    e.end_us = 0;
    e.state = FlightEntry::State::started;
    e.work_id = nullptr;
    e.work.reset();
    e.error.clear();
    return id;
  }

  /// Ties the work handle of collective `id` to its entry, so a later wait
  /// on the handle ends it (and a dump asks the handle whether it is done).
  void attach(std::uint64_t id, const compat::WorkPtr& work) {
    if (!work) return;
    std::lock_guard<std::mutex> lock(mu_);
    FlightEntry* e = find(id);
    if (e == nullptr) return;
    e->work_id = work.get();
    e->work.emplace(work);
  }

  /// Ends collective `id` (completed, or failed with `error`).
  void end(std::uint64_t id, const std::string& error = {}) {
    std::lock_guard<std::mutex> lock(mu_);
    if (FlightEntry* e = find(id)) close(*e, error);
  }

  /// Ends the collective whose work handle is `work`, if the ring still
  /// holds it.
  void end(const compat::WorkPtr& work, const std::string& error = {}) {
    if (!work) return;
    std::lock_guard<std::mutex> lock(mu_);
    const std::uint64_t n = std::min<std::uint64_t>(next_id_, ring_.size());
    for (std::uint64_t k = 1; k <= n; ++k) {
      FlightEntry& e = ring_[(next_id_ - k) % ring_.size()];
      if (e.work_id == work.get() && e.state == FlightEntry::State::started) {
        close(e, error);
        return;
      }
    }
  }

  /// Where `dump` writes (`DIR/rank-K.json`); empty: nowhere.
  void set_dump_dir(std::filesystem::path dir) {
    std::lock_guard<std::mutex> lock(mu_);
    dump_dir_ = std::move(dir);
  }
  std::filesystem::path dump_dir() const {
    std::lock_guard<std::mutex> lock(mu_);
    return dump_dir_;
  }
  /// The file `dump` writes, or empty when no folder is set.
  std::filesystem::path dump_path() const {
    auto dir = dump_dir();
    if (dir.empty()) return {};
    return dir / ddpkit::detail::cat("rank-", rank_, ".json");
  }

  /// Whether SIGUSR1 asked this rank for its record since the last call
  /// (the liveness watch then asks every other rank through the store).
  bool take_dump_request() {
    return dump_requested_.exchange(false);
  }

  /// How many collectives have been recorded (all groups).
  std::uint64_t recorded() const {
    std::lock_guard<std::mutex> lock(mu_);
    return next_id_;
  }

  /// The oldest collective still waiting (started, its work not
  /// completed), if any: what the liveness watch times.
  std::optional<FlightEntry> oldest_pending() {
    std::lock_guard<std::mutex> lock(mu_);
    const std::uint64_t n = std::min<std::uint64_t>(next_id_, ring_.size());
    for (std::uint64_t id = next_id_ - n; id < next_id_; ++id) {
      FlightEntry& e = ring_[id % ring_.size()];
      if (e.state != FlightEntry::State::started) continue;
      if (e.work) {
        auto w = e.work->lock();
        if (!w || w->isCompleted()) {
          // Done, or dropped unwaited (an abandoned step): not a wait.
          close(e, {});
          continue;
        }
      }
      return e;
    }
    return std::nullopt;
  }

  /// `e` in words, as ddpkit-doctor writes it: "all_reduce 4.0 kB Float
  /// (bucket 3)".
  static std::string describe(const FlightEntry& e) {
    std::string text = e.kind;
    if (std::string_view(e.kind) != "store_wait") {
      const double b = static_cast<double>(e.bytes);
      text += b >= 1e9 ? ddpkit::detail::cat(
                             " ", ddpkit::detail::fixed(b / 1e9, 1), " GB")
              : b >= 1e6 ? ddpkit::detail::cat(
                               " ", ddpkit::detail::fixed(b / 1e6, 1), " MB")
              : b >= 1e3 ? ddpkit::detail::cat(
                               " ", ddpkit::detail::fixed(b / 1e3, 1), " kB")
                         : ddpkit::detail::cat(" ", e.bytes, " B");
      if (e.dtype) text += ddpkit::detail::cat(" ", c10::toString(*e.dtype));
    }
    if (e.tag[0] != '\0') text += ddpkit::detail::cat(" (", e.tag.data(), ")");
    return text;
  }

  /// The ring's entries, oldest first.
  std::vector<FlightEntry> entries() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<FlightEntry> out;
    const std::uint64_t n = std::min<std::uint64_t>(next_id_, ring_.size());
    out.reserve(n);
    for (std::uint64_t id = next_id_ - n; id < next_id_; ++id) {
      out.push_back(ring_[id % ring_.size()]);
    }
    return out;
  }

  /// The record as JSON: who wrote it, why, and every entry (oldest first);
  /// entries still started whose work has completed are shown completed.
  std::string to_json(const std::string& reason) const {
    using ddpkit::detail::JsonObject;
    auto list = entries();
    std::string items = "[";
    bool first = true;
    for (const FlightEntry& e : list) {
      std::string state = state_name(e.state);
      if (e.state == FlightEntry::State::started && e.work) {
        auto w = e.work->lock();
        if (w && w->isCompleted()) state = "completed";
      }
      JsonObject o;
      o.add("seq", static_cast<long long>(e.seq))
          .add("group", e.group == 0 ? "default" : "side")
          .add("kind", e.kind)
          .add("dtype",
               e.dtype ? std::string(c10::toString(*e.dtype)) : std::string())
          .add("numel", static_cast<long long>(e.numel))
          .add("bytes", static_cast<long long>(e.bytes))
          .add("tag", e.tag.data())
          .add("start_us", static_cast<long long>(e.start_us))
          .add("end_us", static_cast<long long>(e.end_us))
          .add("state", state);
      if (!e.error.empty()) o.add("error", e.error);
      items += first ? "\n    " : ",\n    ";
      items += o.compact();
      first = false;
    }
    items += "\n  ]";
    JsonObject top;
    top.add("format", "ddpkit-flight-1")
        .add("rank", rank_)
        .add("world", world_)
        .add("host", host_)
        .add("pid", static_cast<long>(::getpid()))
        .add("reason", reason)
        .add("time_us", static_cast<long long>(now_us()))
        .add("capacity", static_cast<long long>(ring_.size()))
        .add("recorded", static_cast<long long>(recorded()))
        .raw("entries", std::move(items));
    return top.str();
  }

  /// Writes the record to `dump_path()` (atomically; a failure is said on
  /// stderr, never thrown: a dump happens while something else is already
  /// going wrong). Returns the path written, or empty.
  std::filesystem::path dump(const std::string& reason) const noexcept {
    // A fault this rank judged (dump_verdict) keeps its record: what
    // follows (the collectives its peers' exits break) is a consequence.
    if (verdict_written_) return dump_path();
    return write_record(reason);
  }

  /// `dump` for a fault this rank judged itself (a lost peer, a desync):
  /// later dumps leave this record in place.
  std::filesystem::path dump_verdict(const std::string& reason) noexcept {
    auto path = write_record(reason);
    verdict_written_ = true;
    return path;
  }

 private:
  std::filesystem::path write_record(const std::string& reason) const noexcept {
    try {
      const auto path = dump_path();
      if (path.empty()) return {};
      std::filesystem::create_directories(path.parent_path());
      ddpkit::detail::write_atomically(path, to_json(reason));
      return path;
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "ddpkit: rank %d: could not write the flight record: %s\n",
                   rank_, e.what());
      return {};
    }
  }

 public:
  /// Ends collective `id` (or the one of `work`) as failed with `error` and
  /// writes the record: " (flight record: PATH)" for the error message, or
  /// "" when nothing was written.
  std::string fail(std::uint64_t id, const std::string& error,
                   const std::string& reason) {
    end(id, error);
    return where(dump(reason));
  }
  std::string fail(const compat::WorkPtr& work, const std::string& error,
                   const std::string& reason) {
    end(work, error);
    return where(dump(reason));
  }

  /// Writes the record asked for from outside (SIGUSR1) and says where on
  /// stderr.
  void dump_on_request(const std::string& reason) const {
    const auto path = dump(reason);
    if (!path.empty()) {
      std::fprintf(stderr, "ddpkit: rank %d: flight record written to %s\n",
                   rank_, path.c_str());
    }
  }

  /// Dumps every live recorder of this process on SIGUSR1 (from a thread
  /// of its own; training goes on). Installed once per process, the first
  /// time a recorder is given a dump folder.
  static void dump_on_sigusr1(const std::shared_ptr<FlightRecorder>& r) {
    auto& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mu);
    bool known = false;
    for (const auto& w : reg.live) known = known || w.lock() == r;
    if (!known) reg.live.push_back(r);
    if (reg.installed) return;
    int fds[2];
    if (::pipe(fds) != 0) return;
    reg.write_fd = fds[1];
    std::thread([read_fd = fds[0]] {
      for (;;) {
        char c = 0;
        const auto n = ::read(read_fd, &c, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        std::vector<std::shared_ptr<FlightRecorder>> live;
        {
          auto& reg = registry();
          std::lock_guard<std::mutex> lock(reg.mu);
          for (auto& w : reg.live) {
            if (auto p = w.lock()) live.push_back(std::move(p));
          }
        }
        for (const auto& p : live) {
          p->dump_requested_.store(true);  // the other ranks: liveness.hpp
          p->dump_on_request("SIGUSR1");
        }
      }
    }).detach();
    struct sigaction sa{};
    sa.sa_handler = &on_sigusr1;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    ::sigaction(SIGUSR1, &sa, nullptr);
    reg.installed = true;
  }

 private:
  struct Registry {
    std::mutex mu;
    std::vector<std::weak_ptr<FlightRecorder>> live;
    bool installed = false;
    volatile int write_fd = -1;
  };
  static Registry& registry() {
    static Registry* r = new Registry();  // never destroyed: the thread uses it
    return *r;
  }
  static void on_sigusr1(int) {
    const int saved = errno;
    const int fd = registry().write_fd;
    if (fd >= 0) {
      char c = 1;
      [[maybe_unused]] auto n = ::write(fd, &c, 1);
    }
    errno = saved;
  }

  static std::string where(const std::filesystem::path& path) {
    return path.empty()
               ? std::string()
               : ddpkit::detail::cat(" (flight record: ", path.string(), ")");
  }

  static const char* state_name(FlightEntry::State s) {
    switch (s) {
      case FlightEntry::State::completed: return "completed";
      case FlightEntry::State::failed: return "failed";
      default: return "started";
    }
  }

  FlightEntry* find(std::uint64_t id) {
    FlightEntry& e = ring_[id % ring_.size()];
    return e.id == id && id < next_id_ ? &e : nullptr;
  }
  static void close(FlightEntry& e, const std::string& error) {
    if (e.state != FlightEntry::State::started) return;
    e.end_us = now_us();
    e.state = error.empty() ? FlightEntry::State::completed
                            : FlightEntry::State::failed;
    e.error = error;
    e.work.reset();
  }

  mutable std::mutex mu_;
  std::atomic<bool> dump_requested_{false};
  std::vector<FlightEntry> ring_;
  std::uint64_t next_id_ = 0;
  std::array<std::uint64_t, 2> next_seq_{};
  int rank_;
  int world_;
  std::string host_;
  std::filesystem::path dump_dir_;
  std::atomic<bool> verdict_written_{false};
};

}  // namespace ddpkit::dist
