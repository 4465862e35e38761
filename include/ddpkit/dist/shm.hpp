// All-reduce through shared memory between ranks on one host.
//
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
#pragma once

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
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

#include "ddpkit/detail/error.hpp"
#include "ddpkit/dist/compat.hpp"

namespace ddpkit::dist {

namespace detail {

/// A c10d work handle completed by ddpkit's own channel thread.
class ChannelWork : public c10d::Work {
 public:
  ChannelWork() : c10d::Work(-1, c10d::OpType::ALLREDUCE) {}
  void complete(std::exception_ptr error) {
    finish(std::move(error));
  }
};

inline std::string host_identity() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::getline(in, boot);
  return std::string(host) + "/" + boot;
}

inline std::vector<uint8_t> to_bytes(const std::string& s) {
  return {s.begin(), s.end()};
}

inline std::string from_bytes(const std::vector<uint8_t>& b) {
  return {b.begin(), b.end()};
}

}  // namespace detail

/// Shared-memory all-reduce (sum) among ranks on one host. Created by
/// `Group::init` when every rank is on this host (option
/// `GroupOptions::shared_memory`, environment `DDPKIT_SHM=0` to turn off);
/// `all_reduce_async` routes eligible tensors here.
class ShmChannel {
 public:
  /// Bytes of one rank's slot; tensors travel in chunks of this size.
  static constexpr int64_t kSlotBytes = 2 << 20;

  /// Collective over `store`: returns null on every rank unless every rank
  /// is on this host and could map the segment.
  static std::shared_ptr<ShmChannel> connect(
      const compat::StorePtr& store, int rank, int world,
      std::chrono::milliseconds timeout) {
    using ddpkit::detail::cat;
    const std::string k = "ddpkit/shm/";
    store->set(cat(k, "host/", rank),
               detail::to_bytes(detail::host_identity()));
    bool same_host = true;
    const auto mine = detail::host_identity();
    for (int r = 0; r < world; ++r) {
      same_host &= detail::from_bytes(store->get(cat(k, "host/", r))) == mine;
    }
    if (!same_host) return nullptr;  // the same answer on every rank

    const std::size_t header = header_bytes(world);
    const std::size_t total =
        header + 2 * static_cast<std::size_t>(world) * kSlotBytes;
    std::string path;
    if (rank == 0) {
      std::random_device rd;
      path = cat("/dev/shm/ddpkit-", ::getpid(), "-", rd());
      int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(total)) != 0) {
        if (fd >= 0) ::close(fd);
        ::unlink(path.c_str());
        path.clear();  // tells the others: no segment
      } else {
        ::close(fd);
      }
      store->set(k + "path", detail::to_bytes(path.empty() ? "-" : path));
    } else {
      path = detail::from_bytes(store->get(k + "path"));
      if (path == "-") path.clear();
    }
    std::unique_ptr<ShmChannel> ch;
    if (!path.empty()) {
      int fd = ::open(path.c_str(), O_RDWR);
      if (fd >= 0) {
        void* base =
            ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        ::close(fd);
        if (base != MAP_FAILED) {
          ch.reset(new ShmChannel(static_cast<char*>(base), total, rank, world,
                                  timeout));
        }
      }
    }
    // Everyone reports; the channel is used only if every rank mapped it.
    store->set(cat(k, "ok/", rank), detail::to_bytes(ch ? "1" : "0"));
    bool all_ok = true;
    for (int r = 0; r < world; ++r) {
      all_ok &= detail::from_bytes(store->get(cat(k, "ok/", r))) == "1";
    }
    // Every rank has opened the file (or given up): its name can go, so a
    // crash leaves nothing behind in /dev/shm.
    auto left = store->add(k + "attached", 1);
    if (rank == 0 && !path.empty()) {
      while (left < world) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        left = store->add(k + "attached", 0);
      }
      ::unlink(path.c_str());
    }
    if (!all_ok) return nullptr;
    ch->start();
    return std::shared_ptr<ShmChannel>(ch.release());
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
    ::munmap(base_, bytes_);
  }

  /// Whether `t` can go through the channel: a contiguous CPU tensor of a
  /// type ATen adds natively.
  static bool eligible(const torch::Tensor& t) {
    if (!t.defined() || !t.device().is_cpu() || !t.is_contiguous()) {
      return false;
    }
    switch (t.scalar_type()) {
      case torch::kFloat:
      case torch::kDouble:
      case torch::kInt:
      case torch::kLong: return true;
      default: return false;
    }
  }

  /// Sums `t` in place over every rank, on the channel's thread, and
  /// multiplies the sum by `scale` (e.g. 1/world for a mean: done on each
  /// rank's slice while it is in cache, instead of another pass over `t`).
  /// Calls must come in the same order on every rank (like any collective).
  compat::WorkPtr all_reduce_sum_async(torch::Tensor t, double scale = 1.0) {
    auto work = c10::make_intrusive<detail::ChannelWork>();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back({std::move(t), scale, work});
    }
    cv_.notify_one();
    return work;
  }

 private:
  // One cache line per rank: its sequence word (futex) and its pid.
  struct alignas(64) RankLine {
    std::atomic<uint32_t> seq;
    int32_t pid;
  };
  static std::size_t header_bytes(int world) {
    std::size_t b = sizeof(RankLine) * static_cast<std::size_t>(world);
    return (b + 4095) / 4096 * 4096;
  }

  ShmChannel(char* base, std::size_t bytes, int rank, int world,
             std::chrono::milliseconds timeout)
      : base_(base),
        bytes_(bytes),
        rank_(rank),
        world_(world),
        timeout_(timeout) {
    lines_ = reinterpret_cast<RankLine*>(base_);
    data_ = base_ + header_bytes(world);
    lines_[rank_].pid = static_cast<int32_t>(::getpid());
    lines_[rank_].seq.store(0, std::memory_order_release);
  }

  void start() {
    thread_ = std::thread([this] { loop(); });
  }

  struct Op {
    torch::Tensor tensor;
    double scale;
    c10::intrusive_ptr<detail::ChannelWork> work;
  };

  void loop() {
    for (;;) {
      Op op;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stopping
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      std::exception_ptr error = broken_;
      if (!error) {
        try {
          reduce(op.tensor, op.scale);
        } catch (...) {
          error = broken_ = std::current_exception();
        }
      }
      op.work->complete(error);
    }
  }

  char* slot(int buffer, int r) const {
    return data_ + (static_cast<std::size_t>(buffer) * world_ + r) * kSlotBytes;
  }

  static void futex_wake(std::atomic<uint32_t>* w) {
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(w), FUTEX_WAKE, INT32_MAX,
              nullptr, nullptr, 0);
  }

  void publish(uint32_t value) {
    lines_[rank_].seq.store(value, std::memory_order_release);
    futex_wake(&lines_[rank_].seq);
  }

  // Waits until every rank's sequence word has reached `target`.
  void wait_all(uint32_t target) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + timeout_;
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
              " did not arrive within ", timeout_.count() / 1000.0, " s"));
        }
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

  void reduce(torch::Tensor& t, double scale) {
    const int64_t es = static_cast<int64_t>(t.element_size());
    const int64_t per_chunk = kSlotBytes / es;
    const int64_t n = t.numel();
    char* user = static_cast<char*>(t.data_ptr());
    const auto opts = t.options();
    if (n == 0) return;  // the same on every rank: nothing to exchange
    for (int64_t done = 0; done < n;) {
      const int64_t len = std::min(per_chunk, n - done);
      const int b = static_cast<int>(chunk_ & 1);
      const uint32_t base = static_cast<uint32_t>(chunk_) * 2;
      char* src = user + done * es;
      // 1. my chunk into my slot
      std::memcpy(slot(b, rank_), src, static_cast<std::size_t>(len * es));
      publish(base + 1);
      wait_all(base + 1);
      // 2. reduce my slice of every rank's chunk, in my slot
      auto seg = [&](int q) {
        return std::pair<int64_t, int64_t>{len * q / world_,
                                           len * (q + 1) / world_};
      };
      auto [lo, hi] = seg(rank_);
      if (hi > lo) {
        auto acc = torch::from_blob(slot(b, rank_) + lo * es, {hi - lo}, opts);
        for (int q = 0; q < world_; ++q) {
          if (q == rank_) continue;
          acc.add_(torch::from_blob(slot(b, q) + lo * es, {hi - lo}, opts));
        }
        if (scale != 1.0) acc.mul_(scale);
      }
      publish(base + 2);
      wait_all(base + 2);
      // 3. every rank's reduced slice out
      for (int q = 0; q < world_; ++q) {
        auto [qlo, qhi] = seg(q);
        std::memcpy(src + qlo * es, slot(b, q) + qlo * es,
                    static_cast<std::size_t>((qhi - qlo) * es));
      }
      ++chunk_;
      done += len;
    }
  }

  char* base_;
  std::size_t bytes_;
  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  RankLine* lines_ = nullptr;
  char* data_ = nullptr;
  uint64_t chunk_ = 0;  // chunks done: the same count on every rank

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Op> queue_;
  bool stop_ = false;
  std::exception_ptr broken_;
  std::thread thread_;
};

}  // namespace ddpkit::dist
