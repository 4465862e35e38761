// SPDX-License-Identifier: BSD-3-Clause
// All-reduce through shared memory between ranks on one host: the channel
// (ShmChannel) over the segments of shm_segment.hpp. See Note [The
// shared-memory channel].
#pragma once

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/shm_segment.hpp"
#include "ddpkit/distributed/topology.hpp"

namespace ddpkit::dist {

// Note [Hierarchical all-reduce]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Hierarchical all-reduce (`ShmChannel` with `ShmBetweenHosts`,
// `GroupOptions::all_reduce_algorithm`,
// `DDPKIT_ALLREDUCE=auto|flat|hierarchical`). When ranks span hosts and some
// host has several ranks (the `auto` rule), each host's ranks get a
// shared-memory channel of their own and the hosts' leaders (lowest rank on
// each) a gloo group of their own. A sum or mean then goes: reduce-scatter
// inside the host through shared memory, gathered into the leader only; one
// gloo all-reduce among the leaders, scaled there (a mean's 1/world); the
// leader's result copied to the host's ranks through shared memory (slot by
// slot, or from the leader's region for the reducer's shared buckets). Every
// rank ends with the leaders' bits, so all ranks of all hosts agree exactly.
// Gradients cross the network once per host instead of once per rank. The
// leader publishes the outcome of the between-hosts step in its header line:
// a failure there (a lost host, or a type gloo cannot add) fails that
// operation on every rank of the host with the leader's message, and the
// channel stays usable. The ranks of the host wait for the leader for twice
// the collective timeout plus 10 s, so the leader's own timeout is the error
// reported. Every host must have its channel or none is used (checked through
// the store). Reported as transport `"hierarchical shm+gloo"` in summary.json
// and the examples' first line (`world size 4 on 2 hosts (transport
// hierarchical shm+gloo)`); `flat` keeps the old behaviour (every rank in one
// gloo all-reduce, transport `"gloo"`); forcing `hierarchical` with shared
// memory off, or on NCCL, is a UsageError (NCCL arranges its own
// topology-aware all-reduce). The DDP reducer keeps its buckets *in* shared
// memory (`ShmChannel::shared_buffer`, `ReducerOptions::shared_buckets`, on
// by default): one segment holds every rank's copy of the buckets, so an
// all-reduce of a bucket reads the other ranks' gradients where autograd
// wrote them — each rank sums its slice from the others' regions into its
// own, then copies the others' reduced slices: three barriers per bucket and
// about half the memory traffic of copying through the slots. The segment is
// fully allocated up front (`posix_fallocate`), so a small /dev/shm (Docker's
// 64 MiB default) means ordinary buckets, never a SIGBUS. Rank 0 only sizes
// the file (`ftruncate`); each rank allocates its own region and slots, so on
// a multi-socket host their pages come from its own NUMA node (first touch)
// rather than all from rank 0's (untested: this machine has one NUMA node;
// the small-/dev/shm fallback test covers the allocation). Every operation
// also announces its size, type and kind in the rank's header line and checks
// the others' at the first barrier: ranks that disagree fail with a message
// naming both, instead of hanging or mixing unrelated data.

// Note [The shared-memory channel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// gloo moves CPU tensors over TCP even when every rank is on the same
// machine: on loopback that is two kernel copies per byte per hop plus the
// socket machinery (about 0.6 GB/s here). When all ranks share a host, ddpkit
// instead maps one shared segment and reduces in it: every rank copies its
// chunk in, reduces its 1/N slice of every rank's chunk, and copies the
// reduced slices out. Ranks wait on futexes, not spins, so a machine with
// more ranks than cores does not burn the cores the ranks need.
//
// Each element is summed by exactly one rank, in a fixed order, and copied
// to all: every rank gets the same bits, run after run. A rank that dies is
// noticed within about 10 ms (its pid is watched) and every waiting rank
// fails with `PeerFailure` naming it; a rank that stops arriving fails the
// others after the group's collective timeout.
//
// Across hosts, each host's ranks share such a channel and it becomes the
// inner level of a hierarchical all-reduce (see ShmChannel): sums inside a
// host through shared memory, between hosts one gloo all-reduce among the
// hosts' leaders.

namespace detail {

/// A c10d work handle completed by ddpkit's own channel thread.
class ChannelWork : public c10d::Work {
 public:
  ChannelWork() : c10d::Work(-1, c10d::OpType::ALLREDUCE) {}
  void complete(std::exception_ptr error) {
    finish(std::move(error));
  }
};

}  // namespace detail

/// The all-reduce between hosts failed (on this host's leader): that
/// operation fails on every rank of the host, the channel stays usable.
class BetweenHostsFailed : public PeerFailure {
 public:
  using PeerFailure::PeerFailure;
};

/// The level between hosts of a hierarchical all-reduce (ShmChannel).
struct ShmBetweenHosts {
  /// The channel is one host's part of a hierarchical all-reduce.
  bool enabled = false;
  /// The leaders' group (on the host's leader only; null elsewhere).
  compat::BackendPtr leaders;
};

/// Shared-memory all-reduce (sum) among ranks on one host. Created by
/// `Group::init` for the ranks that share this host's /dev/shm (option
/// `GroupOptions::shared_memory`, environment `DDPKIT_SHM=0` to turn off);
/// `all_reduce_async` routes eligible tensors here.
///
/// When ranks span several hosts, each host's channel is one level of a
/// hierarchical all-reduce: the host's ranks sum into its leader (its
/// lowest rank) through shared memory, the leaders all-reduce over their
/// own gloo group (`between_hosts`), and each leader hands the result to
/// its host's ranks through shared memory. Every rank gets the leaders'
/// bits, so every rank of every host ends with the same result.
class ShmChannel {
 public:
  /// Bytes of one rank's slot; tensors travel in chunks of this size.
  static constexpr int64_t kSlotBytes = 2 << 20;

  /// The level between hosts of a hierarchical all-reduce.
  using BetweenHosts = ShmBetweenHosts;

  /// Collective over `store` among the `world` ranks that share this host's
  /// /dev/shm (`rank` is this rank's index among them): null on every one of
  /// them unless each could map the segment. `timeout`: how long one
  /// collective through the channel waits for the others (the group's
  /// collective timeout).
  static std::shared_ptr<ShmChannel> connect(const compat::StorePtr& store,
                                             int rank, int world,
                                             std::chrono::milliseconds timeout,
                                             BetweenHosts between = {}) {
    const std::string k = "ddpkit/shm/";
    const std::size_t total =
        header_bytes(world) + 2 * static_cast<std::size_t>(world) * kSlotBytes;
    // Rank 0 allocates the header; each rank its two slots.
    ShmSegment::Ranges mine;
    if (rank == 0) mine.emplace_back(0, header_bytes(world));
    for (int b = 0; b < 2; ++b) {
      mine.emplace_back(
          header_bytes(world) + static_cast<std::size_t>(b * world + rank) *
                                    static_cast<std::size_t>(kSlotBytes),
          static_cast<std::size_t>(kSlotBytes));
    }
    auto seg = ShmSegment::create(store, k, rank, world, total, mine);
    if (!seg) return nullptr;
    std::shared_ptr<ShmChannel> ch(new ShmChannel(
        std::move(seg), store, rank, world, timeout, std::move(between)));
    ch->start();
    return ch;
  }

  /// Whether this channel is one host's part of a hierarchical all-reduce.
  bool hierarchical() const {
    return between_.enabled;
  }

  /// Collective: a zeroed buffer of `numel` elements of `dtype` in shared
  /// memory, whose all-reduces skip the copies through the channel's slots
  /// (the DDP reducer keeps its gradient buckets here). Every rank must ask
  /// for the same size; undefined on every rank when the segment cannot be
  /// made (e.g. /dev/shm too small), so callers fall back to ordinary
  /// memory.
  torch::Tensor shared_buffer(int64_t numel, torch::ScalarType dtype) {
    using ddpkit::detail::cat;
    const std::string k = cat("ddpkit/shm/arena/", arenas_made_++, "/");
    const std::size_t bytes =
        (static_cast<std::size_t>(numel) * c10::elementSize(dtype) + 4095) /
        4096 * 4096;
    // Every rank must agree on the size, or nobody uses the segment.
    if (!detail::all_ranks_say(store_, k + "bytes/", rank_, world_,
                               std::to_string(bytes)) ||
        numel <= 0) {
      return {};
    }
    // Each rank allocates its own region (first touch on its NUMA node).
    auto seg = ShmSegment::create(
        store_, k, rank_, world_, bytes * static_cast<std::size_t>(world_),
        {{bytes * static_cast<std::size_t>(rank_), bytes}});
    if (!seg) return {};
    auto arena = std::make_shared<ShmArena>(std::move(seg), bytes, rank_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      arenas_.push_back(arena);
    }
    char* mine = arena->region(rank_);
    return torch::from_blob(
        mine, {numel}, [arena](void*) {}, torch::TensorOptions().dtype(dtype));
  }

  /// Operations (all-reduces and all-gathers) started through the channel
  /// (tests use it to see which path a collective took).
  std::uint64_t operations_started() const {
    return operations_.load(std::memory_order_relaxed);
  }

  /// Whether `t` lies in a buffer from `shared_buffer` (and is reduced in
  /// place).
  bool in_shared_buffer(const torch::Tensor& t) {
    std::size_t off = 0;
    return find_arena(t, &off) != nullptr;
  }

  ShmChannel(const ShmChannel&) = delete;
  ShmChannel& operator=(const ShmChannel&) = delete;

  ~ShmChannel() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  /// Whether `t` can go through the channel: a contiguous CPU tensor of a
  /// type ATen adds natively (fp16 and bf16 are summed in their own type,
  /// as gloo and NCCL do).
  static bool eligible(const torch::Tensor& t) {
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) {
      return false;
    }
    switch (t.scalar_type()) {
      case torch::kFloat:
      case torch::kDouble:
      case torch::kHalf:
      case torch::kBFloat16:
      case torch::kInt:
      case torch::kLong: return true;
      default: return false;
    }
  }

  /// Sums `t` in place over every rank, on the channel's thread, and
  /// multiplies the sum by `scale` (e.g. 1/world for a mean: done on each
  /// rank's slice while it is in cache, instead of another pass over `t`).
  /// Calls must come in the same order on every rank (like any collective);
  /// ranks that disagree on the tensor's size or type, or on whether it is a
  /// shared buffer, all fail with an error saying so.
  /// `caller_waits`: the caller will wait for this work at once (a blocking
  /// all-reduce); then a small tensor (at most kInlineBytes, e.g. SyncBN's
  /// statistics) found with nothing queued or running is reduced on the
  /// calling thread: no hand-over to the channel's thread and back. Never
  /// for work the caller does not wait for at once (the reducer's buckets):
  /// blocking its thread there could deadlock against a collective on
  /// another channel that the other ranks reach first.
  compat::WorkPtr all_reduce_sum_async(torch::Tensor t, double scale = 1.0,
                                       bool caller_waits = false) {
    operations_.fetch_add(1, std::memory_order_relaxed);
    auto work = c10::make_intrusive<detail::ChannelWork>();
    std::size_t offset = 0;
    auto arena = find_arena(t, &offset);
    const bool small = static_cast<int64_t>(t.nbytes()) <= kInlineBytes;
    submit(Op{std::move(t), scale, std::move(arena), offset, work, {}},
           caller_waits && small);
    return work;
  }

  /// An all-gather in place in a buffer from `shared_buffer` (not between
  /// hosts: `hierarchical()` false): rank q has written elements
  /// [parts[q], parts[q + 1]) of `t` (`parts`: world + 1 ascending offsets
  /// from 0 to t.numel(), the same on every rank); afterwards every rank's
  /// `t` holds every part, each copied once from its writer's region. On
  /// the channel's thread, in order with its all-reduces. (ZeRO's
  /// parameters after a step: a sum of zero-filled buffers moved about
  /// four times the bytes.)
  /// `caller_waits`: the caller waits for it at once; then, found with
  /// nothing queued or running, it runs on the calling thread (whatever
  /// its size: it only copies).
  compat::WorkPtr all_gather_shared_async(torch::Tensor t,
                                          std::vector<int64_t> parts,
                                          bool caller_waits = false) {
    std::size_t offset = 0;
    auto arena = find_arena(t, &offset);
    if (!arena || between_.enabled ||
        parts.size() != static_cast<std::size_t>(world_) + 1 ||
        parts.front() != 0 || parts.back() != t.numel() ||
        !std::is_sorted(parts.begin(), parts.end())) {
      throw UsageError(ddpkit::detail::cat(
          "ShmChannel::all_gather_shared_async: needs a tensor in a shared "
          "buffer, a channel on one host and ",
          world_ + 1, " ascending offsets from 0 to ", t.numel(), " (got ",
          parts.size(), arena ? "" : "; not a shared buffer",
          between_.enabled ? "; hierarchical channel" : "", ")"));
    }
    operations_.fetch_add(1, std::memory_order_relaxed);
    auto work = c10::make_intrusive<detail::ChannelWork>();
    submit(
        Op{std::move(t), 1.0, std::move(arena), offset, work, std::move(parts)},
        caller_waits);
    return work;
  }

  /// Largest tensor reduced on the calling thread (see all_reduce_sum_async).
  static constexpr int64_t kInlineBytes = 64 << 10;

 private:
  // One cache line per rank: its sequence word (futex), its pid, and what
  // its current operation is (checked against the others').
  struct OpDesc {
    int64_t numel;
    int64_t dtype;
    int64_t offset;  // in the shared buffer; -1: through the slots
    int64_t gather;  // 1: an all-gather in place, 0: an all-reduce
    bool operator==(const OpDesc& o) const {
      return numel == o.numel && dtype == o.dtype && offset == o.offset &&
             gather == o.gather;
    }
  };
  struct alignas(64) RankLine {
    std::atomic<uint32_t> seq;
    int32_t pid;
    // By operation parity: a rank that has passed an operation's first
    // barrier may announce the next one while others still read this one
    // (an empty tensor has no second barrier), but it cannot get further.
    OpDesc desc[2];
    // The leader's outcome of the all-reduce between hosts (hierarchical).
    int32_t failed;
    char what[200];
  };
  static std::size_t header_bytes(int world) {
    std::size_t b = sizeof(RankLine) * static_cast<std::size_t>(world);
    return (b + 4095) / 4096 * 4096;
  }

  ShmChannel(std::shared_ptr<ShmSegment> seg, compat::StorePtr store, int rank,
             int world, std::chrono::milliseconds timeout, BetweenHosts between)
      : seg_(std::move(seg)),
        store_(std::move(store)),
        rank_(rank),
        world_(world),
        timeout_(timeout),
        between_(std::move(between)) {
    lines_ = reinterpret_cast<RankLine*>(seg_->data());
    data_ = seg_->data() + header_bytes(world);
    lines_[rank_].pid = static_cast<int32_t>(::getpid());
    lines_[rank_].seq.store(0, std::memory_order_release);
  }

  void start() {
    thread_ = std::thread([this] {
      // The channel's reductions are ATen operations (add_ over a slot):
      // give this thread the process's intra-op thread count now, as the
      // threads ATen starts itself do, rather than at its first parallel
      // region.
      at::init_num_threads();
      loop();
    });
  }

  struct Op {
    torch::Tensor tensor;
    double scale;
    std::shared_ptr<ShmArena> arena;  // null: through the slots
    std::size_t offset;               // of the tensor in the arena region
    c10::intrusive_ptr<detail::ChannelWork> work;
    std::vector<int64_t> parts = {};  // an all-gather's; empty: all-reduce
  };

  // Queues `op` for the channel's thread; with `inline_ok`, runs it on the
  // calling thread instead when nothing is queued or running (saves two
  // thread hand-overs for work the caller waits for at once).
  void submit(Op op, bool inline_ok) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!inline_ok || busy_ || !queue_.empty()) {
        queue_.push_back(std::move(op));
        cv_.notify_one();
        return;
      }
      busy_ = true;  // the channel's thread waits until this one is done
    }
    run(op);
    {
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
    }
    cv_.notify_one();
  }

  std::shared_ptr<ShmArena> find_arena(const torch::Tensor& t,
                                       std::size_t* offset) {
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) {
      return nullptr;
    }
    const std::size_t n =
        static_cast<std::size_t>(t.numel()) * t.element_size();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = arenas_.begin(); it != arenas_.end();) {
      auto a = it->lock();
      if (!a) {
        it = arenas_.erase(it);  // its buffers are gone
        continue;
      }
      if (a->holds(t.data_ptr(), n, offset)) return a;
      ++it;
    }
    return nullptr;
  }

  void loop() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || (!queue_.empty() && !busy_); });
        if (queue_.empty()) return;  // stopping
        op = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      run(op);
      {
        std::lock_guard<std::mutex> lock(mu_);
        busy_ = false;
      }
    }
  }

  // Runs one operation (one at a time: busy_) and completes its work.
  void run(Op& op) {
    std::exception_ptr error = broken_;
    if (!error) {
      try {
        if (between_.enabled) {
          if (op.arena) {
            hierarchical_in_place(op);
          } else {
            hierarchical_reduce(op.tensor, op.scale);
          }
        } else if (!op.parts.empty()) {
          gather_in_place(op);
        } else if (op.arena) {
          reduce_in_place(op);
        } else {
          reduce(op.tensor, op.scale);
        }
      } catch (const BetweenHostsFailed&) {
        // This operation only: every rank of the host met the leader's
        // outcome at the same barrier, so the channel is still in step.
        error = std::current_exception();
      } catch (...) {
        error = broken_ = std::current_exception();
      }
    }
    op.work->complete(error);
  }

  char* slot(int buffer, int r) const {
    return data_ + (static_cast<std::size_t>(buffer) * world_ + r) * kSlotBytes;
  }

  static void futex_wake(std::atomic<uint32_t>* w) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE, INT32_MAX,
              nullptr, nullptr, 0);
  }

  // Every rank arrives at the next barrier: publishes its sequence number
  // and waits until every other rank has published it too.
  // `timeout`: how long to wait (default: the collective timeout).
  void barrier(std::chrono::milliseconds timeout = {}) {
    const uint32_t target = ++seq_;
    lines_[rank_].seq.store(target, std::memory_order_release);
    futex_wake(&lines_[rank_].seq);
    wait_all(target, timeout.count() > 0 ? timeout : timeout_);
  }

  // Waits until every rank's sequence word has reached `target`.
  void wait_all(uint32_t target, std::chrono::milliseconds timeout) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout;
    for (int q = 0; q < world_; ++q) {
      if (q == rank_) continue;
      auto& seq = lines_[q].seq;
      int spins = 0;
      for (;;) {
        uint32_t now = seq.load(std::memory_order_acquire);
        if (static_cast<int32_t>(now - target) >= 0) break;
        if (++spins < 64) continue;
        // Sleep on the word; wake every 10 ms to watch the peer and clock.
        timespec ts{0, 10'000'000};
        ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&seq), FUTEX_WAIT, now,
                  &ts, nullptr, 0);
        if (static_cast<int32_t>(seq.load(std::memory_order_acquire) -
                                 target) >= 0) {
          break;
        }
        const int pid = lines_[q].pid;
        if (pid > 0 && !alive(pid)) {
          throw PeerFailure(ddpkit::detail::cat(
              "rank ", rank_, ": shared-memory all-reduce: rank ", q, " (pid ",
              pid, ") is gone"));
        }
        if (clock::now() > deadline) {
          throw PeerFailure(ddpkit::detail::cat(
              "rank ", rank_, ": shared-memory all-reduce: rank ", q,
              " did not arrive within ", timeout.count() / 1000.0, " s"));
        }
      }
    }
  }

  // Announces this rank's operation, meets the others, and checks that they
  // all started the same one: a mismatch (different sizes, types, or one
  // rank in a shared buffer and another not) would otherwise mix unrelated
  // data or hang.
  void start_op(const OpDesc& mine) {
    const int k = static_cast<int>(ops_++ & 1);
    lines_[rank_].desc[k] = mine;
    barrier();
    for (int q = 0; q < world_; ++q) {
      const OpDesc theirs = lines_[q].desc[k];
      if (!(theirs == mine)) {
        auto say = [](const OpDesc& d) {
          return ddpkit::detail::cat(
              d.numel, " elements of ",
              c10::toString(static_cast<c10::ScalarType>(d.dtype)),
              d.offset >= 0 ? " in a shared buffer" : "",
              d.gather ? " (an all-gather)" : "");
        };
        throw DistError(ddpkit::detail::cat(
            "rank ", rank_, ": all-reduce mismatch: this rank reduces ",
            say(mine), ", rank ", q, " reduces ", say(theirs),
            " (every rank must call the same collectives with tensors of the "
            "same size and type, in the same order)"));
      }
    }
  }

  // Whether `pid` still runs (a zombie, dead but not yet reaped, does not).
  static bool alive(int pid) {
    if (::kill(pid, 0) != 0 && errno == ESRCH) return false;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string line;
    if (!std::getline(stat, line)) return true;  // no /proc: trust kill()
    auto paren = line.rfind(')');
    if (paren == std::string::npos || paren + 2 >= line.size()) return true;
    const char state = line[paren + 2];
    return state != 'Z' && state != 'X';
  }

  std::pair<int64_t, int64_t> slice(int64_t len, int q) const {
    return {len * q / world_, len * (q + 1) / world_};
  }

  // Sums this rank's slice [lo, hi) of `len` elements over every rank into
  // this rank's copy (at(q, i): where rank q holds element i), in rank
  // order, then scales it: each element summed by one rank only.
  template <class At>
  void sum_my_slice(At at, int64_t len, const torch::TensorOptions& opts,
                    double scale) {
    auto [lo, hi] = slice(len, rank_);
    if (hi <= lo) return;
    auto acc = torch::from_blob(at(rank_, lo), {hi - lo}, opts);
    for (int q = 0; q < world_; ++q) {
      if (q == rank_) continue;
      acc.add_(torch::from_blob(at(q, lo), {hi - lo}, opts));
    }
    if (scale != 1.0) acc.mul_(scale);
  }

  // Through the slots, in chunks: copy in, reduce my slice of every rank's
  // chunk, copy every reduced slice out (to every rank, or with
  // `leader_only` to rank 0 alone).
  void reduce(torch::Tensor& t, double scale, bool leader_only = false) {
    const int64_t es = static_cast<int64_t>(t.element_size());
    const int64_t per_chunk = kSlotBytes / es;
    const int64_t n = t.numel();
    char* user = static_cast<char*>(t.data_ptr());
    const auto opts = t.options();
    const OpDesc desc{n, static_cast<int64_t>(t.scalar_type()), -1, 0};
    if (n == 0) {  // nothing to exchange, once all agree on that
      start_op(desc);
      return;
    }
    for (int64_t done = 0; done < n;) {
      const int64_t len = std::min(per_chunk, n - done);
      const int b = static_cast<int>(chunk_++ & 1);
      char* src = user + done * es;
      // 1. my chunk into my slot
      std::memcpy(slot(b, rank_), src, static_cast<std::size_t>(len * es));
      if (done == 0) {
        start_op(desc);
      } else {
        barrier();
      }
      // 2. reduce my slice of every rank's chunk, in my slot
      sum_my_slice([&](int q, int64_t i) { return slot(b, q) + i * es; }, len,
                   opts, scale);
      barrier();
      // 3. every rank's reduced slice out
      for (int q = 0; q < world_ && !(leader_only && rank_ != 0); ++q) {
        auto [qlo, qhi] = slice(len, q);
        std::memcpy(src + qlo * es, slot(b, q) + qlo * es,
                    static_cast<std::size_t>((qhi - qlo) * es));
      }
      done += len;
    }
  }

  // In a shared buffer: every rank reduces its slice straight from the
  // others' regions into its own, then copies the others' reduced slices.
  // The last barrier keeps a rank from writing its buffer again (the next
  // backward) while another still reads it.
  void reduce_in_place(Op& op) {
    auto& t = op.tensor;
    const int64_t es = static_cast<int64_t>(t.element_size());
    const int64_t n = t.numel();
    const auto opts = t.options();
    start_op({n, static_cast<int64_t>(t.scalar_type()),
              static_cast<int64_t>(op.offset), 0});
    if (n == 0) return;
    auto at = [&](int q, int64_t element) {
      return op.arena->region(q) + op.offset + element * es;
    };
    sum_my_slice(at, n, opts, op.scale);
    barrier();
    for (int q = 0; q < world_; ++q) {
      if (q == rank_) continue;
      auto [qlo, qhi] = slice(n, q);
      std::memcpy(at(rank_, qlo), at(q, qlo),
                  static_cast<std::size_t>((qhi - qlo) * es));
    }
    barrier();
  }

  // An all-gather in a shared buffer: once every rank has arrived (each
  // has written its part), copies the others' parts from their regions;
  // the last barrier keeps a rank from writing its buffer again while
  // another still reads it.
  void gather_in_place(Op& op) {
    auto& t = op.tensor;
    const int64_t es = static_cast<int64_t>(t.element_size());
    start_op({t.numel(), static_cast<int64_t>(t.scalar_type()),
              static_cast<int64_t>(op.offset), 1});
    if (t.numel() == 0) return;
    for (int q = 0; q < world_; ++q) {
      const int64_t lo = op.parts[static_cast<std::size_t>(q)];
      const int64_t hi = op.parts[static_cast<std::size_t>(q) + 1];
      if (q == rank_ || hi <= lo) continue;
      std::memcpy(op.arena->region(rank_) + op.offset + lo * es,
                  op.arena->region(q) + op.offset + lo * es,
                  static_cast<std::size_t>((hi - lo) * es));
    }
    barrier();
  }

  // Hierarchical, between the two halves on this host: the leader (rank 0
  // here) all-reduces the host's sum in `t` over the leaders' group and
  // scales it, then every rank of the host meets it at a barrier and learns
  // the outcome from the leader's line. A failure there fails the operation
  // on every rank of the host; the channel itself stays usable (its
  // barriers stayed in step), so a type gloo cannot add fails only that
  // all-reduce.
  void leaders_all_reduce(torch::Tensor& t, double scale) {
    auto& line = lines_[rank_];
    if (rank_ == 0) {
      line.failed = 0;
      try {
        std::vector<torch::Tensor> ts{t};
        c10d::AllreduceOptions o;
        o.reduceOp = compat::reduce_sum();
        between_.leaders->allreduce(ts, o)->wait();
        if (scale != 1.0) t.mul_(scale);
      } catch (const std::exception& e) {
        std::string what = e.what();
        std::snprintf(line.what, sizeof line.what, "%s",
                      ddpkit::detail::first_line(what).c_str());
        line.failed = 1;
      }
    }
    // The leader may wait a whole collective timeout between hosts: the
    // others wait longer, so the leader's error is the one reported.
    barrier(timeout_ * 2 + std::chrono::seconds(10));
    if (lines_[0].failed != 0) {
      throw BetweenHostsFailed(ddpkit::detail::cat(
          "the all-reduce between hosts failed on this host's leader: ",
          lines_[0].what));
    }
  }

  // Through the slots: the host's sum into the leader, between the
  // leaders, then from the leader's slot to every rank, in chunks.
  void hierarchical_reduce(torch::Tensor& t, double scale) {
    reduce(t, 1.0, /*leader_only=*/true);
    const int64_t n = t.numel();
    if (n == 0) return;  // the same on every rank of every host
    leaders_all_reduce(t, scale);
    const int64_t es = static_cast<int64_t>(t.element_size());
    const int64_t per_chunk = kSlotBytes / es;
    char* user = static_cast<char*>(t.data_ptr());
    for (int64_t done = 0; done < n;) {
      const int64_t len = std::min(per_chunk, n - done);
      const int b = static_cast<int>(chunk_++ & 1);
      const auto bytes = static_cast<std::size_t>(len * es);
      if (rank_ == 0) std::memcpy(slot(b, 0), user + done * es, bytes);
      barrier();
      if (rank_ != 0) std::memcpy(user + done * es, slot(b, 0), bytes);
      done += len;
    }
  }

  // In a shared buffer: the host's sum into the leader's region, between
  // the leaders, then every rank copies the leader's region. The last
  // barrier keeps the leader from writing its buffer again while another
  // rank still reads it.
  void hierarchical_in_place(Op& op) {
    auto& t = op.tensor;
    const int64_t es = static_cast<int64_t>(t.element_size());
    const int64_t n = t.numel();
    start_op({n, static_cast<int64_t>(t.scalar_type()),
              static_cast<int64_t>(op.offset), 0});
    if (n == 0) return;
    auto at = [&](int q, int64_t element) {
      return op.arena->region(q) + op.offset + element * es;
    };
    sum_my_slice(at, n, t.options(), 1.0);
    barrier();
    if (rank_ == 0) {
      for (int q = 1; q < world_; ++q) {
        auto [qlo, qhi] = slice(n, q);
        std::memcpy(at(0, qlo), at(q, qlo),
                    static_cast<std::size_t>((qhi - qlo) * es));
      }
    }
    leaders_all_reduce(t, op.scale);
    if (rank_ != 0) {
      std::memcpy(at(rank_, 0), at(0, 0), static_cast<std::size_t>(n * es));
    }
    barrier();
  }

  std::shared_ptr<ShmSegment> seg_;
  compat::StorePtr store_;
  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  BetweenHosts between_;
  RankLine* lines_ = nullptr;
  char* data_ = nullptr;
  uint64_t chunk_ = 0;  // chunks done: the same count on every rank
  uint32_t seq_ = 0;    // barriers passed: the same count on every rank
  uint64_t ops_ = 0;    // operations started: the same count on every rank
  int arenas_made_ = 0;
  std::atomic<std::uint64_t> operations_{0};

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool busy_ = false;  // an operation is running (on either thread)
  std::vector<std::weak_ptr<ShmArena>> arenas_;
  bool stop_ = false;
  std::exception_ptr broken_;
  std::thread thread_;
};

}  // namespace ddpkit::dist
