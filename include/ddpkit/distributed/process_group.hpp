// SPDX-License-Identifier: BSD-3-Clause
// The process group over the rendezvous store (distributed/rendezvous.hpp):
// gloo for CPU tensors, NCCL for CUDA tensors where built, and shared memory
// between ranks of one host.
// `Group` is a cheap handle; a world of one needs no store and no backend.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/parse.hpp"
#include "ddpkit/distributed/doctor.hpp"
#include "ddpkit/distributed/env.hpp"
#include "ddpkit/distributed/failure_report.hpp"
#include "ddpkit/distributed/flight_recorder.hpp"
#include "ddpkit/distributed/group_options.hpp"
#include "ddpkit/distributed/liveness.hpp"
#include "ddpkit/distributed/rendezvous.hpp"
#include "ddpkit/distributed/shm.hpp"
#include "ddpkit/distributed/topology.hpp"

namespace ddpkit::dist {

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
    auto rdv_timeout = ddpkit::detail::env_seconds("DDPKIT_RENDEZVOUS_TIMEOUT",
                                                   opts.rendezvous_timeout());
    auto coll_timeout = ddpkit::detail::env_seconds("DDPKIT_COLLECTIVE_TIMEOUT",
                                                    opts.collective_timeout());
    std::string method = opts.init_method();
    if (method == "env://") {
      if (const char* m = std::getenv("DDPKIT_INIT_METHOD")) method = m;
    }
    // A rank without a GPU of its own fails here, before waiting for the
    // others at the rendezvous.
    const BackendKind kind = resolve_backend(opts);
    check_local_device(env, kind);
    g.store_ = detail::rendezvous(env, method, rdv_timeout);
    detail::wait_for_all(g.store_, env, method, rdv_timeout);
    g.backend_ = make_backend(g.store_, env, kind, opts, coll_timeout);
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
    const bool shm =
        ddpkit::detail::env_switch("DDPKIT_SHM", opts.shared_memory());
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
    // Before the channel: its set-up is not a collective of ours, but the
    // recorder must exist before the first one.
    const auto capacity = ddpkit::detail::env_value("DDPKIT_FLIGHT_RECORDER");
    const std::size_t ring =
        capacity ? ddpkit::detail::parse_int<std::size_t>(
                       ddpkit::detail::env_what("DDPKIT_FLIGHT_RECORDER"),
                       *capacity, 0, std::size_t{1} << 24)
                 : FlightRecorder::kDefaultCapacity;
    if (ring > 0) {
      g.recorder_ = std::make_shared<FlightRecorder>(
          ring, env.rank, env.world_size,
          g.topology_.world() == env.world_size
              ? g.topology_.host_name[static_cast<std::size_t>(env.rank)]
              : std::string());
      if (const auto dir = ddpkit::detail::env_value("DDPKIT_FLIGHT_DIR")) {
        g.set_flight_dir(*dir);
      }
    }
    // See Note [The liveness watch] (liveness.hpp).
    g.start_liveness_watch();
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
      g->recorder_ = recorder_;
      g->group_index_ = 1;
      auto side_store = compat::make_prefix_store("ddpkit/side", store_);
      g->backend_ = make_backend(side_store, env_, g->opts_.backend(), g->opts_,
                                 timeout_);
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
    return detail::roll_call(store_, topology_, env_.rank, env_.world_size,
                             wait);
  }

  /// How many collectives this group (and its copies) has started: every
  /// all-reduce, all-gather and broadcast of `distributed/collectives.hpp`, the
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
  /// Counts one collective of `kind` over `t` (null: a wait through the
  /// store) carrying `bytes`, and records it in the flight recorder; the
  /// functions that start collectives call it first, then `started` with
  /// the work handle. Returns the recorder's id for the collective.
  std::uint64_t begin_collective(const char* kind, const torch::Tensor* t,
                                 std::uint64_t bytes) const {
    if (t != nullptr) {
      collectives_->fetch_add(1, std::memory_order_relaxed);
      bytes_->fetch_add(bytes, std::memory_order_relaxed);
    }
    return recorder_ ? recorder_->start(group_index_, kind, t, bytes) : 0;
  }
  /// Ties collective `id` (from `begin_collective`) to its work handle;
  /// returns the handle.
  compat::WorkPtr started(std::uint64_t id, compat::WorkPtr work) const {
    if (recorder_) recorder_->attach(id, work);
    return work;
  }
  /// While set, a SIGTERM/SIGINT that `pending` reports and the training
  /// loop does not act on ends this rank (exit 128 + the signal) when a
  /// collective hangs: see LivenessWatch::watch_interrupt. The Trainer sets
  /// it for a fit. Without the liveness watch it does nothing.
  void watch_interrupt(std::function<int()> pending,
                       std::function<std::string()> resume_note) const {
    if (liveness_) {
      liveness_->watch_interrupt(std::move(pending), std::move(resume_note));
    }
  }
  /// The flight recorder this group and its copies share (null in a world
  /// of one, or with DDPKIT_FLIGHT_RECORDER=0).
  const std::shared_ptr<FlightRecorder>& flight_recorder() const {
    return recorder_;
  }
  /// Where this rank writes its flight record (`DIR/rank-K.json`) when a
  /// collective fails or on SIGUSR1 (the Trainer sets OUT/flight;
  /// DDPKIT_FLIGHT_DIR sets it for any program). Installs the SIGUSR1
  /// handler the first time.
  void set_flight_dir(const std::filesystem::path& dir) const {
    if (!recorder_) return;
    recorder_->set_dump_dir(dir);
    FlightRecorder::dump_on_sigusr1(recorder_);
  }

 private:
  // The liveness watch (distributed/liveness.hpp) over a second client of
  // the store, unless DDPKIT_LIVENESS=0, the recorder is off, or this
  // libtorch's stores cannot be cloned (then the collective timeout alone
  // finds a lost rank). A lost rank or a desync: this rank writes its
  // flight record, says what it found, waits three heartbeats (so the other
  // ranks reach their own judgment before this one's exit breaks their
  // waits), prints ddpkit-doctor's verdict when it is the first to claim
  // the records, and exits kPeerFailureExitCode (its main thread is
  // blocked in the collective).
  void start_liveness_watch() {
    if (!recorder_ || !ddpkit::detail::env_switch("DDPKIT_LIVENESS", true)) {
      return;
    }
    auto own = compat::clone_store(store_);
    if (!own) return;
    LivenessSettings settings;
    settings.silence = ddpkit::detail::env_seconds("DDPKIT_LIVENESS_TIMEOUT",
                                                   settings.silence);
    settings.check_after = std::min(settings.check_after, settings.silence / 3);
    settings.interval = std::min(settings.interval, settings.silence / 5);
    own->setTimeout(
        std::max(settings.silence, std::chrono::milliseconds(1000)));
    const int rank = env_.rank;
    auto recorder = recorder_;
    liveness_ = std::make_shared<LivenessWatch>(
        own, recorder_, topology_, rank, env_.world_size, settings,
        [rank, recorder, interval = settings.interval](const std::string& what,
                                                       int code) {
          const auto path = recorder->dump_verdict(what);
          std::fprintf(stderr, "error (rank %d): %s%s%s\n", rank, what.c_str(),
                       path.empty() ? "" : "; flight record: ", path.c_str());
          std::fflush(stderr);
          if (code == kPeerFailureExitCode) {
            // The other ranks judge from the same heartbeats up to three
            // ticks later: ending now would break their waits first, and they
            // would report a lost connection instead of the lost rank or
            // the desync.
            std::this_thread::sleep_for(3 * interval);
          }
          if (!path.empty()) print_doctor_verdict(path.parent_path());
          std::_Exit(code);
        });
  }

  static AllReduceAlgorithm all_reduce_algorithm(const GroupOptions& opts) {
    return ddpkit::detail::env_choice<AllReduceAlgorithm>(
        "DDPKIT_ALLREDUCE", opts.all_reduce_algorithm(),
        {{"auto", AllReduceAlgorithm::automatic},
         {"flat", AllReduceAlgorithm::flat},
         {"hierarchical", AllReduceAlgorithm::hierarchical}});
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
                          ddpkit::detail::first_line(what)));
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

  /// The backend `opts` asks for, `automatic` resolved: NCCL where this
  /// build has it and a CUDA device is visible, else gloo.
  static BackendKind resolve_backend(const GroupOptions& opts) {
    const BackendKind kind = opts.backend();
    if (kind != BackendKind::automatic) return kind;
    return (compat::has_nccl && torch::cuda::is_available())
               ? BackendKind::nccl
               : BackendKind::gloo;
  }

  /// An NCCL rank works on GPU LOCAL_RANK of its host: refuses a rank
  /// whose LOCAL_RANK is past the host's device count, or any NCCL rank in
  /// a build without NCCL.
  /// Both before the rendezvous: a rank that cannot run fails at once.
  static void check_local_device(const DistEnv& env, BackendKind kind) {
    if (kind != BackendKind::nccl) return;
    if constexpr (!compat::has_nccl) {
      throw UsageError(
          "backend nccl requested, but this build of ddpkit "
          "has no NCCL (libtorch without CUDA)");
    }
    const auto gpus = torch::cuda::device_count();
    if (env.local_rank >= static_cast<int>(gpus)) {
      throw UsageError(ddpkit::detail::cat(
          "rank ", env.rank, " has LOCAL_RANK ", env.local_rank,
          " but this host has ", gpus, " CUDA device", gpus == 1 ? "" : "s",
          "; start at most that many ranks per host"));
    }
  }

  /// The backend of `kind` (resolved: nccl or gloo); `opts` for gloo's
  /// devices and NCCL's error handling.
  static compat::BackendPtr make_backend(const compat::StorePtr& store,
                                         const DistEnv& env, BackendKind kind,
                                         const GroupOptions& opts,
                                         std::chrono::milliseconds timeout) {
    using ddpkit::detail::cat;
    // Each group gets its own key space so several can share one store.
    auto prefixed = compat::make_prefix_store("ddpkit/default_pg", store);
    try {
      if (kind == BackendKind::nccl) {
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA) && \
    defined(DDPKIT_HAS_NCCL)
        // Each rank's CUDA work on its own GPU (PyTorch's recipes call
        // torch.cuda.set_device(local_rank) first): otherwise every rank
        // makes a context on GPU 0 and NCCL may pick the wrong device.
        // (check_local_device made sure it exists.)
        ddpkit::compat::set_cuda_device(env.local_rank);
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
                          ddpkit::detail::first_line(what)));
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
  std::shared_ptr<FlightRecorder> recorder_;
  std::shared_ptr<LivenessWatch> liveness_;
  int group_index_ = 0;  // in the recorder: 0 this group, 1 its side group
};

}  // namespace ddpkit::dist
