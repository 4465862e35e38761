// SPDX-License-Identifier: BSD-3-Clause
// Rendezvous (c10d TCPStore hosted by rank 0, or FileStore) and the process
// group over it (gloo for CPU tensors, NCCL for CUDA tensors where built).
// `Group` is a cheap handle; a world of one needs no store and no backend.
#pragma once

#include <netdb.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/dist/compat.hpp"
#include "ddpkit/dist/env.hpp"
#include "ddpkit/dist/shm.hpp"
#include "ddpkit/dist/topology.hpp"

namespace ddpkit::dist {

enum class BackendKind { automatic, gloo, nccl };

/// How NCCL reports a collective that fails or does not complete within
/// the collective timeout (a dead peer, a rank that never calls it).
enum class NcclErrorHandling {
  /// `wait()` blocks the calling thread until the collective finishes, and
  /// throws (a DistError naming ddpkit's operation) when it times out or the
  /// communicator failed: every rank stops with an error, none hangs.
  /// PyTorch's TORCH_NCCL_BLOCKING_WAIT=1. The default.
  blocking_wait,
  /// PyTorch's default: `wait()` only orders the CUDA streams; NCCL's
  /// watchdog thread aborts the communicator and ends the process when a
  /// collective times out (TORCH_NCCL_ASYNC_ERROR_HANDLING=1). Fewer host
  /// synchronisations; the error is the watchdog's log line.
  async_teardown,
};

/// How all-reduces of CPU tensors travel when ranks span several hosts.
enum class AllReduceAlgorithm {
  /// Hierarchical when some host has several ranks (and shared memory is
  /// on), flat otherwise.
  automatic,
  /// Every rank in one gloo all-reduce (shared memory only when every rank
  /// is on one host).
  flat,
  /// Sum inside each host through shared memory, all-reduce between one
  /// leader per host over gloo, hand the result back through shared memory.
  hierarchical,
};

/// How to meet the other ranks and talk to them.
struct GroupOptions {
  /// `env://` (MASTER_ADDR/PORT from the DistEnv), `tcp://host:port`, or
  /// `file:///path/to/shared/file`. With `env://`, the environment variable
  /// `DDPKIT_INIT_METHOD` (set by self-spawn) overrides it.
  TORCH_ARG(std::string, init_method) = "env://";
  TORCH_ARG(BackendKind, backend) = BackendKind::automatic;
  /// How long rank 0 waits for every rank to join, and clients to connect.
  TORCH_ARG(std::chrono::milliseconds,
            rendezvous_timeout) = std::chrono::seconds(300);
  /// How long one collective may take before it fails (gloo/NCCL timeout).
  TORCH_ARG(std::chrono::milliseconds,
            collective_timeout) = std::chrono::seconds(300);
  /// Where gloo binds. Empty: `GLOO_SOCKET_IFNAME` if set, loopback when the
  /// master is on loopback, else this host's name.
  TORCH_ARG(std::string, bind_address) = "";
  /// When every rank runs on this host, all-reduce CPU tensors through a
  /// shared-memory segment instead of gloo's loopback TCP (several times
  /// faster; see dist/shm.hpp). The environment variable `DDPKIT_SHM=0`
  /// turns it off, `DDPKIT_SHM=1` on.
  TORCH_ARG(bool, shared_memory) = true;
  /// Flat or hierarchical all-reduce across hosts (see AllReduceAlgorithm).
  /// The environment variable `DDPKIT_ALLREDUCE` (auto, flat or
  /// hierarchical) overrides it.
  TORCH_ARG(AllReduceAlgorithm,
            all_reduce_algorithm) = AllReduceAlgorithm::automatic;
  /// What an NCCL collective that fails or never completes does (see
  /// NcclErrorHandling). A value the user set in the environment
  /// (TORCH_NCCL_BLOCKING_WAIT / TORCH_NCCL_ASYNC_ERROR_HANDLING) wins.
  TORCH_ARG(NcclErrorHandling,
            nccl_error_handling) = NcclErrorHandling::blocking_wait;
};

namespace detail {

inline bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

/// A master address that does not resolve is bad input, not a timeout.
inline void check_resolvable(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &res);
  if (rc != 0) {
    throw UsageError(ddpkit::detail::cat(
        "MASTER_ADDR '", host, "' cannot be resolved (", ::gai_strerror(rc),
        "); expected the host name or IP address of rank 0"));
  }
  ::freeaddrinfo(res);
}

inline std::chrono::milliseconds env_timeout(const char* name,
                                             std::chrono::milliseconds dflt) {
  if (const char* v = std::getenv(name)) {
    double secs = 0;
    try {
      secs = std::stod(v);
    } catch (...) {
      secs = -1;
    }
    if (!(secs > 0)) {
      throw UsageError(
          ddpkit::detail::cat("environment variable ", name, "='", v,
                              "' is not a positive number of seconds"));
    }
    return std::chrono::milliseconds(static_cast<long long>(secs * 1000));
  }
  return dflt;
}

/// Who of `seen`'s ranks did not answer the roll call, for the error:
/// "every rank of host 'b' (ranks 2, 3) and rank 5 on host 'c' did not
/// answer within 3 s", or "" when every rank answered.
inline std::string describe_missing(const std::vector<bool>& seen,
                                    const Topology& topo,
                                    std::chrono::milliseconds wait) {
  using ddpkit::detail::cat;
  const int world = static_cast<int>(seen.size());
  const bool known = topo.world() == world;
  std::string text;
  std::vector<bool> said(seen.size(), false);
  for (int r = 0; r < world; ++r) {
    if (seen[static_cast<std::size_t>(r)] ||
        said[static_cast<std::size_t>(r)]) {
      continue;
    }
    if (!text.empty()) text += " and ";
    if (!known) {
      text += cat("rank ", r);
      continue;
    }
    const int host = topo.host_of[static_cast<std::size_t>(r)];
    const auto on = topo.ranks_on(host);
    bool all = true;
    for (int q : on) all = all && !seen[static_cast<std::size_t>(q)];
    if (all && on.size() > 1) {
      std::string list;
      for (int q : on) {
        list += cat(list.empty() ? "" : ", ", q);
        said[static_cast<std::size_t>(q)] = true;
      }
      text += cat("every rank of host '",
                  topo.host_name[static_cast<std::size_t>(r)], "' (ranks ",
                  list, ")");
    } else {
      text += cat("rank ", r, " on host '",
                  topo.host_name[static_cast<std::size_t>(r)], "'");
    }
  }
  if (text.empty()) return text;
  return cat(text, " did not answer within ", wait.count() / 1000.0,
             " s (lost, or stuck elsewhere)");
}

}  // namespace detail

/// A process group: this rank, the world, and the c10d backend between them.
///
/// Example:
/// ```
/// auto group = ddpkit::dist::Group::init(ddpkit::dist::read_env());
/// auto t = torch::ones({3});
/// ddpkit::dist::all_reduce(group, t);  // t == world_size everywhere
/// ```
class Group {
 public:
  /// A world of one: every collective is the identity.
  Group() = default;

  static Group init(const DistEnv& env, GroupOptions opts = {}) {
    Group g;
    g.env_ = env;
    if (env.world_size == 1) return g;
    auto rdv_timeout = detail::env_timeout("DDPKIT_RENDEZVOUS_TIMEOUT",
                                           opts.rendezvous_timeout());
    auto coll_timeout = detail::env_timeout("DDPKIT_COLLECTIVE_TIMEOUT",
                                            opts.collective_timeout());
    std::string method = opts.init_method();
    if (method == "env://") {
      if (const char* m = std::getenv("DDPKIT_INIT_METHOD")) method = m;
    }
    g.store_ = rendezvous(env, method, rdv_timeout);
    wait_for_all(g.store_, env, method, rdv_timeout);
    g.backend_ = make_backend(g.store_, env, opts, coll_timeout);
    g.timeout_ = coll_timeout;
    g.opts_ = opts;
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA) && \
    defined(DDPKIT_HAS_NCCL)
    if (dynamic_cast<c10d::ProcessGroupNCCL*>(g.backend_.get()) != nullptr) {
      g.device_ = torch::Device(torch::kCUDA, env.local_rank);
    }
#endif
    // The shared-memory channel carries CPU tensors only: an NCCL group
    // (CUDA tensors) never sets it up.
    bool shm = opts.shared_memory();
    if (const char* v = std::getenv("DDPKIT_SHM")) {
      std::string s = v;
      if (s != "0" && s != "1") {
        throw UsageError(ddpkit::detail::cat(
            "environment variable DDPKIT_SHM='", s, "' must be 0 or 1"));
      }
      shm = s == "1";
    }
    const auto algorithm = all_reduce_algorithm(opts);
    if (algorithm == AllReduceAlgorithm::hierarchical &&
        !(shm && g.device_.is_cpu())) {
      throw UsageError(
          g.device_.is_cpu()
              ? "all-reduce 'hierarchical' needs the shared-memory channel, "
                "which is turned off (DDPKIT_SHM=0 or "
                "GroupOptions::shared_memory(false))"
              : "all-reduce 'hierarchical' is for CPU tensors over gloo; "
                "NCCL arranges CUDA all-reduces across hosts itself "
                "(use 'auto' or 'flat')");
    }
    g.topology_ = Topology::discover(g.store_, env.rank, env.world_size);
    if (env.rank == 0 && !g.topology_.consistent) {
      std::fprintf(stderr,
                   "ddpkit: the ranks disagree on which of them share "
                   "/dev/shm; shared memory is not used\n");
    }
    g.hierarchical_ = g.topology_.hosts() > 1 &&
                      (algorithm == AllReduceAlgorithm::hierarchical ||
                       (algorithm == AllReduceAlgorithm::automatic &&
                        g.topology_.max_per_host() > 1));
    if (shm && g.device_.is_cpu()) {
      // A collective through the channel waits as long as one over gloo
      // (the collective timeout, not the rendezvous one).
      g.shm_ = g.connect_channel("ddpkit/default_pg/shm");
    }
    return g;
  }

  int rank() const {
    return env_.rank;
  }
  int size() const {
    return env_.world_size;
  }
  int local_rank() const {
    return env_.local_rank;
  }
  bool is_main() const {
    return env_.rank == 0;
  }
  const DistEnv& env() const {
    return env_;
  }
  std::chrono::milliseconds timeout() const {
    return timeout_;
  }
  /// Where this group's tensors live: CPU for gloo, this rank's GPU for NCCL.
  torch::Device device() const {
    return device_;
  }

  /// The c10d backend; null in a world of one.
  const compat::BackendPtr& backend() const {
    return backend_;
  }
  /// The shared-memory channel when every rank is on this host (and it is
  /// not turned off); null otherwise.
  const std::shared_ptr<ShmChannel>& shm() const {
    return shm_;
  }
  /// How this group's collectives travel: "none" (a world of one),
  /// "shm+gloo" (every rank on this host: sums through shared memory, the
  /// rest over gloo), "hierarchical shm+gloo" (ranks on several hosts: sums
  /// through shared memory inside each host and gloo between the hosts'
  /// leaders, the rest over gloo), "gloo" or "nccl".
  std::string transport() const {
    if (env_.world_size == 1 || !backend_) return "none";
    if (shm_)
      return shm_->hierarchical() ? "hierarchical shm+gloo" : "shm+gloo";
    return device_.is_cuda() ? "nccl" : "gloo";
  }
  /// Which ranks share a host (as shared memory sees it); empty in a world
  /// of one.
  const Topology& topology() const {
    return topology_;
  }
  /// How many hosts the ranks run on.
  int hosts() const {
    return topology_.hosts();
  }
  /// The rendezvous store; null in a world of one.
  const compat::StorePtr& store() const {
    return store_;
  }

  /// A second group over the same ranks with a backend and shared-memory
  /// channel of its own, so its collectives are ordered among themselves
  /// only. SyncBatchNorm's collectives go there: they run inside forward and
  /// backward, where the DDP reducer's gradient buckets may launch at
  /// rank-dependent moments (find_unused_parameters with rank-dependent
  /// usage); on one channel the two streams would meet in different orders
  /// on different ranks. Made the first time it is asked for, which is a
  /// collective (every rank must ask at the same point: SyncBN asks in its
  /// first training forward); copies of this group share it, and its
  /// collectives count in this group's collectives_started(). A world of one
  /// returns itself.
  Group side_group() const {
    if (env_.world_size == 1 || !backend_) return *this;
    std::lock_guard<std::mutex> lock(side_->mu);
    if (!side_->group) {
      auto g = std::make_shared<Group>();
      g->env_ = env_;
      g->store_ = store_;
      g->timeout_ = timeout_;
      g->device_ = device_;
      g->opts_ = opts_;
      g->opts_.backend(device_.is_cuda() ? BackendKind::nccl
                                         : BackendKind::gloo);
      g->collectives_ = collectives_;
      g->bytes_ = bytes_;
      g->ready_keys_ = ready_keys_;
      auto side_store = compat::make_prefix_store("ddpkit/side", store_);
      g->backend_ = make_backend(side_store, env_, g->opts_, timeout_);
      g->topology_ = topology_;
      g->hierarchical_ = hierarchical_;
      if (shm_) g->shm_ = g->connect_channel("ddpkit/side/shm");
      side_->group = std::move(g);
    }
    return *side_->group;
  }

  /// After a failed collective: which ranks no longer answer. Every rank
  /// still running that gets here posts a key in the store; those whose key
  /// does not appear within `wait` are named, by host ("every rank of host
  /// 'b' (ranks 2, 3)"). Empty when every rank answered, in a world of one,
  /// or when the store does not answer either (its host may be the one
  /// lost): the call never takes much longer than `wait`.
  std::string unanswered(std::chrono::milliseconds wait) const {
    if (env_.world_size == 1 || !store_) return "";
    struct Shared {
      std::mutex mu;
      std::condition_variable cv;
      bool done = false;
      std::string text;
    };
    auto shared = std::make_shared<Shared>();
    std::thread([shared, store = store_, topo = topology_, rank = env_.rank,
                 world = env_.world_size, wait] {
      std::string text;
      try {
        using ddpkit::detail::cat;
        store->set(cat("ddpkit/alive/", rank), std::vector<uint8_t>{1});
        const auto deadline = std::chrono::steady_clock::now() + wait;
        std::vector<bool> seen(static_cast<std::size_t>(world), false);
        int missing = world;
        while (missing > 0) {
          missing = 0;
          for (int r = 0; r < world; ++r) {
            const auto i = static_cast<std::size_t>(r);
            if (!seen[i]) seen[i] = store->check({cat("ddpkit/alive/", r)});
            missing += seen[i] ? 0 : 1;
          }
          if (missing == 0 || std::chrono::steady_clock::now() > deadline) {
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(50));
        }
        text = detail::describe_missing(seen, topo, wait);
      } catch (...) {
        text.clear();  // the store is gone too: nothing to add
      }
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->text = std::move(text);
      shared->done = true;
      shared->cv.notify_all();
    }).detach();
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait_for(lock, wait + std::chrono::seconds(1),
                        [&] { return shared->done; });
    return shared->text;
  }

  /// How many collectives this group (and its copies) has started: every
  /// all-reduce, all-gather and broadcast of `dist/collectives.hpp`, the
  /// reducer's bucket all-reduces among them. A world of one starts none.
  /// Tests use it to prove that nothing was sent (e.g. under `no_sync`).
  std::uint64_t collectives_started() const {
    return collectives_->load(std::memory_order_relaxed);
  }
  /// Bytes of the tensors those collectives carried (each tensor's size
  /// once, whatever the algorithm sends on the wire): what a gradient
  /// compression saves shows here.
  std::uint64_t bytes_started() const {
    return bytes_->load(std::memory_order_relaxed);
  }
  /// A number for a store key of `broadcast_when_ready`: the same sequence
  /// on every rank (each call is collective), shared by copies of this
  /// group.
  std::uint64_t next_ready_key() const {
    return ready_keys_->fetch_add(1, std::memory_order_relaxed);
  }
  /// Counts one collective of `bytes` (called by the functions that start
  /// them).
  void count_collective(std::uint64_t bytes = 0) const {
    collectives_->fetch_add(1, std::memory_order_relaxed);
    bytes_->fetch_add(bytes, std::memory_order_relaxed);
  }

 private:
  static compat::StorePtr rendezvous(const DistEnv& env,
                                     const std::string& init_method,
                                     std::chrono::milliseconds timeout) {
    using ddpkit::detail::cat;
    std::string host = env.master_addr;
    int port = env.master_port;
    try {
      if (init_method.rfind("file://", 0) == 0) {
        std::string path = init_method.substr(7);
        if (path.empty()) {
          throw UsageError("init method 'file://' names no file");
        }
        return compat::make_file_store(path, env.world_size, timeout);
      }
      if (init_method.rfind("tcp://", 0) == 0) {
        std::string hp = init_method.substr(6);
        auto colon = hp.rfind(':');
        if (colon == std::string::npos) {
          throw UsageError(cat("init method '", init_method,
                               "' lacks a port (expected tcp://host:port)"));
        }
        host = hp.substr(0, colon);
        port = std::stoi(hp.substr(colon + 1));
      } else if (init_method != "env://") {
        throw UsageError(cat("init method '", init_method,
                             "' is unknown (expected env://, tcp://host:port "
                             "or file:///path)"));
      }
      detail::check_resolvable(host);
      // torchrun (2.x) hosts the store in its agent and says so with
      // TORCHELASTIC_USE_AGENT_STORE: every rank is a client, and each
      // restart of the workers gets keys of its own, or a restarted job
      // would meet the previous attempt's rendezvous counters and gloo
      // addresses.
      if (init_method == "env://" && agent_store()) {
        if (!compat::can_use_agent_store()) {
          throw UsageError(cat(
              "rank ", env.rank,
              ": torchrun hosts the rendezvous store in its agent "
              "(TORCHELASTIC_USE_AGENT_STORE=True), and the agent is PyTorch "
              ">= 2.2 (it set TORCH_NCCL_ASYNC_ERROR_HANDLING): this ddpkit "
              "build's libtorch ",
              ddpkit::compat::torch_version(),
              " cannot talk to that store and would wait forever. Launch "
              "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun ..., or use "
              "torchrun from the PyTorch this build uses"));
        }
        auto client = compat::make_tcp_store(host, port, /*is_server=*/false,
                                             env.world_size, timeout);
        // The agents' store outlives the rounds, so each round needs keys
        // of its own, the same on every node. TORCHELASTIC_RESTART_COUNT
        // is not that: only a node whose own workers failed counts the
        // restart; a node restarted for the membership change does not
        // (seen: 1 on one host, 0 on the other, and the new round hung).
        // Every round starts every rank once, so how often this rank has
        // started is the same number on every rank.
        const auto starts =
            client->add(cat("ddpkit/agent_starts/rank", env.rank), 1);
        return compat::make_prefix_store(cat("/ddpkit/round_", starts), client);
      }
      return compat::make_tcp_store(host, port, env.rank == 0, env.world_size,
                                    timeout);
    } catch (const c10::Error& e) {
      rendezvous_failed(env, host, port, timeout, e.what_without_backtrace());
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      rendezvous_failed(env, host, port, timeout, e.what());
    }
  }

  static bool agent_store() {
    const char* v = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    return v && (std::string(v) == "True" || std::string(v) == "true" ||
                 std::string(v) == "1");
  }

  [[noreturn]] static void rendezvous_failed(const DistEnv& env,
                                             const std::string& host, int port,
                                             std::chrono::milliseconds timeout,
                                             const std::string& what) {
    using ddpkit::detail::cat;
    if (what.find("ddress already in use") != std::string::npos) {
      throw UsageError(cat("rank ", env.rank,
                           ": cannot host the rendezvous "
                           "store on port ",
                           port,
                           ": the port is already in use (choose another "
                           "MASTER_PORT)"));
    }
    throw DistError(cat("rank ", env.rank, ": rendezvous at ", host, ":", port,
                        " failed within ", timeout.count() / 1000.0,
                        " s waiting for ", env.world_size,
                        " ranks (is every rank started, with the same "
                        "MASTER_ADDR/MASTER_PORT?): ",
                        what.substr(0, what.find('\n'))));
  }

  static void wait_for_all(const compat::StorePtr& store, const DistEnv& env,
                           const std::string& method,
                           std::chrono::milliseconds timeout) {
    using ddpkit::detail::cat;
    const std::string joined = "ddpkit/rendezvous/joined";
    const std::string done = "ddpkit/rendezvous/complete";
    // Ranks told different world sizes would wait for each other forever:
    // compare with rank 0's before waiting.
    const std::string ws_key = "ddpkit/rendezvous/world_size";
    int64_t rank0_world = -1;
    try {
      auto bytes = std::to_string(env.world_size);
      if (env.rank == 0) {
        store->set(ws_key, std::vector<uint8_t>(bytes.begin(), bytes.end()));
      }
      auto got = store->get(ws_key);
      rank0_world = std::stoll(std::string(got.begin(), got.end()));
    } catch (const c10::Error&) {
      // rank 0 never arrived: reported below as a timeout
    }
    if (rank0_world > 0 && rank0_world != env.world_size) {
      throw UsageError(cat("rank ", env.rank, " was started with world size ",
                           env.world_size, " but rank 0 with ", rank0_world,
                           "; every rank must get the same WORLD_SIZE"));
    }
    try {
      auto n = store->add(joined, 1);
      if (n == env.world_size) store->set(done, std::vector<uint8_t>{1});
      store->wait({done}, timeout);
    } catch (const c10::Error& e) {
      int64_t n = -1;
      try {
        n = store->add(joined, 0);
      } catch (...) {
      }
      std::string where = method.rfind("file://", 0) == 0
                              ? method
                              : cat(env.master_addr, ":", env.master_port);
      throw DistError(cat("rank ", env.rank, ": rendezvous at ", where,
                          " timed out after ", timeout.count() / 1000.0,
                          " s waiting for ", env.world_size, " ranks (", n,
                          " joined; is every rank started, with the same "
                          "MASTER_ADDR/MASTER_PORT and WORLD_SIZE?)"));
    }
  }

  static AllReduceAlgorithm all_reduce_algorithm(const GroupOptions& opts) {
    const char* v = std::getenv("DDPKIT_ALLREDUCE");
    if (v == nullptr) return opts.all_reduce_algorithm();
    const std::string s = v;
    if (s == "auto") return AllReduceAlgorithm::automatic;
    if (s == "flat") return AllReduceAlgorithm::flat;
    if (s == "hierarchical") return AllReduceAlgorithm::hierarchical;
    throw UsageError(
        ddpkit::detail::cat("environment variable DDPKIT_ALLREDUCE='", s,
                            "' must be auto, flat or hierarchical"));
  }

  // The shared-memory channel under `prefix` of the store, or null on every
  // rank: over all ranks when they share one host; else, for a hierarchical
  // all-reduce, over this host's ranks, with the leaders' gloo group
  // between hosts. A failure to set it up is a DistError.
  std::shared_ptr<ShmChannel> connect_channel(const std::string& prefix) const {
    using ddpkit::detail::cat;
    try {
      if (topology_.hosts() == 1) {
        return ShmChannel::connect(compat::make_prefix_store(prefix, store_),
                                   env_.rank, env_.world_size, timeout_);
      }
      if (!hierarchical_) return nullptr;
      const int host = topology_.host_of[static_cast<std::size_t>(env_.rank)];
      const int local = topology_.local_index(env_.rank);
      ShmChannel::BetweenHosts between;
      between.enabled = true;
      if (local == 0) {
        between.leaders =
            make_gloo(compat::make_prefix_store(prefix + "/leaders", store_),
                      env_, host, topology_.hosts(), opts_, timeout_);
      }
      auto ch = ShmChannel::connect(
          compat::make_prefix_store(cat(prefix, "/host", host), store_), local,
          static_cast<int>(topology_.ranks_on(host).size()), timeout_,
          std::move(between));
      // Every host has its channel, or none is used: a host without one
      // would send its sums over the flat group while the others wait for
      // its leader.
      if (!detail::all_ranks_say(store_, prefix + "/ok/", env_.rank,
                                 env_.world_size, ch ? "1" : "0")) {
        return nullptr;
      }
      return ch;
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      throw DistError(cat("rank ", env_.rank,
                          ": setting up shared memory failed: ",
                          what.substr(0, what.find('\n'))));
    }
  }

  // A gloo backend of `size` ranks over `store`, bound where the options
  // and environment say (see GroupOptions::bind_address).
  static compat::BackendPtr make_gloo(const compat::StorePtr& store,
                                      const DistEnv& env, int rank, int size,
                                      const GroupOptions& opts,
                                      std::chrono::milliseconds timeout) {
#if defined(USE_C10D_GLOO)
    std::string addr = opts.bind_address();
    bool is_iface = false;
    if (addr.empty()) {
      if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
        addr = ifname;
        is_iface = true;
      } else if (detail::is_loopback(env.master_addr)) {
        addr = "127.0.0.1";
      }
    }
    return compat::make_gloo(store, rank, size, timeout, addr, is_iface);
#else
    (void)store, (void)env, (void)rank, (void)size, (void)opts, (void)timeout;
    throw UsageError(
        "backend gloo requested, but libtorch was built "
        "without it");
#endif
  }

  static compat::BackendPtr make_backend(const compat::StorePtr& store,
                                         const DistEnv& env,
                                         const GroupOptions& opts,
                                         std::chrono::milliseconds timeout) {
    using ddpkit::detail::cat;
    BackendKind kind = opts.backend();
    if (kind == BackendKind::automatic) {
      kind = (compat::has_nccl && torch::cuda::is_available())
                 ? BackendKind::nccl
                 : BackendKind::gloo;
    }
    // Each group gets its own key space so several can share one store.
    auto prefixed = compat::make_prefix_store("ddpkit/default_pg", store);
    try {
      if (kind == BackendKind::nccl) {
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA) && \
    defined(DDPKIT_HAS_NCCL)
        return compat::make_nccl(
            prefixed, env.rank, env.world_size, timeout,
            opts.nccl_error_handling() == NcclErrorHandling::blocking_wait);
#else
        throw UsageError(
            "backend nccl requested, but this build of ddpkit "
            "has no NCCL (libtorch without CUDA)");
#endif
      }
      return make_gloo(prefixed, env, env.rank, env.world_size, opts, timeout);
    } catch (const c10::Error& e) {
      std::string what = e.what_without_backtrace();
      throw DistError(cat("rank ", env.rank,
                          ": creating the process group "
                          "failed: ",
                          what.substr(0, what.find('\n'))));
    }
  }

  struct Side {
    std::mutex mu;
    std::shared_ptr<Group> group;
  };

  DistEnv env_{};
  GroupOptions opts_{};
  compat::StorePtr store_;
  compat::BackendPtr backend_;
  std::shared_ptr<ShmChannel> shm_;
  Topology topology_;
  bool hierarchical_ = false;  // ranks span hosts and sums go hierarchically
  std::shared_ptr<Side> side_ = std::make_shared<Side>();
  std::chrono::milliseconds timeout_{std::chrono::seconds(300)};
  torch::Device device_{torch::kCPU};
  std::shared_ptr<std::atomic<std::uint64_t>> collectives_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);
  std::shared_ptr<std::atomic<std::uint64_t>> bytes_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);
  std::shared_ptr<std::atomic<std::uint64_t>> ready_keys_ =
      std::make_shared<std::atomic<std::uint64_t>>(0);
};

}  // namespace ddpkit::dist
