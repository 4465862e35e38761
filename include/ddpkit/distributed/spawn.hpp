// SPDX-License-Identifier: BSD-3-Clause
// Self-spawn: the same binary re-executes itself as N ranks on loopback,
// watches them, and on the first failure stops the rest and reports which
// rank died and how. Ranks die with the launcher (PR_SET_PDEATHSIG).
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <torch/arg.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/scope_guard.hpp"

extern char** environ;

namespace ddpkit::dist {

// Note [Self-spawn meets through a FileStore]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Self-spawn meets through a FileStore in a fresh private folder: nothing of
// the rendezvous listens on the network, and there is no port to collide.
// torchrun/SLURM/MPI jobs use the TCPStore on `MASTER_ADDR:MASTER_PORT`
// (c10d's store listens on every interface: keep it on trusted networks).

/// Extra environment variables, name and value.
using EnvVars = std::vector<std::pair<std::string, std::string>>;

/// How to start the ranks of a self-spawned job.
struct SpawnOptions {
  explicit SpawnOptions(int world_size) : world_size_(world_size) {}
  TORCH_ARG(int, world_size);
  /// The program to run; empty means this very binary (/proc/self/exe).
  TORCH_ARG(std::string, executable) = "";
  /// argv[1..] for every rank (argv[0] is the executable).
  TORCH_ARG(std::vector<std::string>, args) = {};
  /// Extra environment for every rank, on top of the launcher's.
  TORCH_ARG(EnvVars, env) = {};
  /// Ranks other than 0 send stdout to /dev/null; stderr always shows.
  TORCH_ARG(bool, quiet_workers) = true;
  /// After the first failure, how long the others get after SIGTERM before
  /// SIGKILL.
  TORCH_ARG(std::chrono::milliseconds, grace) = std::chrono::seconds(3);
  /// After SIGINT/SIGTERM to the launcher, how long the ranks get after the
  /// SIGTERM passed on before SIGKILL: time to finish the step and write a
  /// checkpoint (torchrun and SLURM give 30 s). A second SIGINT/SIGTERM to
  /// the launcher kills them at once.
  TORCH_ARG(std::chrono::milliseconds,
            interrupt_grace) = std::chrono::seconds(30);
  /// Rendezvous port; 0 picks a free loopback port.
  TORCH_ARG(int, master_port) = 0;
  /// Print the launcher's own failure message on stderr.
  TORCH_ARG(bool, report) = true;
  /// Meet through a file in a fresh private folder (`file://`), so nothing
  /// of the rendezvous listens on the network; false: a TCPStore on the
  /// loopback port (it listens on every interface, as c10d's store does).
  TORCH_ARG(bool, file_rendezvous) = true;
};

/// How one rank ended.
struct RankExit {
  int rank = -1;
  pid_t pid = -1;
  int exit_code = 0;  ///< valid when `signal == 0`
  int signal = 0;     ///< the signal that killed it, or 0
  bool stopped_by_launcher = false;

  bool ok() const {
    return signal == 0 && exit_code == 0;
  }
  std::string describe() const {
    if (signal != 0) {
      // strsignal is POSIX (sigdescr_np needs glibc 2.32, newer than the
      // RHEL 8 / Rocky 8 clusters run); its text is only read here.
      const char* name = ::strsignal(signal);
      return ddpkit::detail::cat("rank ", rank, " (pid ", pid,
                                 ") was killed by signal ", signal, " (",
                                 name ? name : "?", ")");
    }
    return ddpkit::detail::cat("rank ", rank, " (pid ", pid,
                               ") exited with status ", exit_code);
  }
};

/// How the job ended: the first failure (if any) and every rank's end.
struct SpawnResult {
  int exit_code = 0;
  std::optional<RankExit> first_failure;
  std::vector<RankExit> ranks;
  int master_port = 0;
  double seconds_to_stop_after_failure = 0;
  std::string message;
  bool ok() const {
    return exit_code == 0;
  }
};

/// A free TCP port on loopback (bound once, then released).
inline int free_loopback_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw Error("free_loopback_port: socket() failed");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    throw Error("free_loopback_port: bind() failed");
  }
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

/// Whether this process was started by `spawn` (it must not spawn again).
inline bool is_spawned_rank() {
  return std::getenv("DDPKIT_SPAWNED") != nullptr;
}

/// Starts `world_size` ranks and waits for all of them. On the first rank to
/// fail (non-zero exit or a signal) the others get SIGTERM, then SIGKILL
/// after `grace`; SIGINT/SIGTERM to the launcher are passed on as SIGTERM,
/// with SIGKILL after `interrupt_grace` or at a second signal.
/// The result names the first failed rank and how it ended.
inline SpawnResult spawn(const SpawnOptions& opts) {
  using ddpkit::detail::cat;
  using clock = std::chrono::steady_clock;
  const int n = opts.world_size();
  if (n < 1) {
    throw UsageError(cat("world size ", n, " is invalid (expected >= 1)"));
  }
  SpawnResult result;
  result.master_port =
      opts.master_port() > 0 ? opts.master_port() : free_loopback_port();
  std::string exe =
      opts.executable().empty() ? "/proc/self/exe" : opts.executable();
  bool caller_sets_init = false;
  for (auto& kv : opts.env())
    caller_sets_init |= kv.first == "DDPKIT_INIT_METHOD";
  std::string rdv_dir;
  if (opts.file_rendezvous() && !caller_sets_init) {
    std::string tmpl =
        (std::filesystem::temp_directory_path() / "ddpkit-rdv-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) {
      throw Error(cat("spawn: cannot create a rendezvous folder in ",
                      std::filesystem::temp_directory_path().string(), ": ",
                      std::strerror(errno)));
    }
    rdv_dir = tmpl;
  }
  ddpkit::detail::ScopeExit remove_rdv_dir([&rdv_dir] {
    std::error_code ec;
    if (!rdv_dir.empty()) std::filesystem::remove_all(rdv_dir, ec);
  });

  // Signals arrive through sigtimedwait, not handlers: block them here and
  // unblock them in each child before exec.
  sigset_t watched, old_mask;
  sigemptyset(&watched);
  sigaddset(&watched, SIGCHLD);
  sigaddset(&watched, SIGINT);
  sigaddset(&watched, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &watched, &old_mask);

  std::vector<pid_t> pids(n, -1);
  const pid_t launcher = ::getpid();
  for (int r = 0; r < n; ++r) {
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      std::string kv = *e;
      auto key = kv.substr(0, kv.find('='));
      if (key == "RANK" || key == "LOCAL_RANK" || key == "WORLD_SIZE" ||
          key == "LOCAL_WORLD_SIZE" || key == "MASTER_ADDR" ||
          key == "MASTER_PORT" || key == "DDPKIT_SPAWNED" ||
          key == "DDPKIT_INIT_METHOD") {
        continue;
      }
      env_strings.push_back(std::move(kv));
    }
    env_strings.push_back(cat("RANK=", r));
    env_strings.push_back(cat("LOCAL_RANK=", r));
    env_strings.push_back(cat("WORLD_SIZE=", n));
    env_strings.push_back(cat("LOCAL_WORLD_SIZE=", n));
    env_strings.push_back("MASTER_ADDR=127.0.0.1");
    env_strings.push_back(cat("MASTER_PORT=", result.master_port));
    env_strings.push_back("DDPKIT_SPAWNED=1");
    if (!rdv_dir.empty()) {
      env_strings.push_back("DDPKIT_INIT_METHOD=file://" + rdv_dir + "/store");
    }
    for (auto& [k, v] : opts.env()) env_strings.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (auto& s : env_strings) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> argv_strings{exe};
    for (auto& a : opts.args()) argv_strings.push_back(a);
    std::vector<char*> argv;
    for (auto& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);

    pid_t pid = ::fork();
    if (pid < 0) {
      for (int k = 0; k < r; ++k) ::kill(pids[k], SIGKILL);
      pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);
      throw Error(cat("spawn: fork() failed: ", std::strerror(errno)));
    }
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(127);
      sigset_t none;
      sigemptyset(&none);
      pthread_sigmask(SIG_SETMASK, &none, nullptr);
      if (r != 0 && opts.quiet_workers()) {
        int devnull = ::open("/dev/null", O_WRONLY);
        if (devnull >= 0) ::dup2(devnull, STDOUT_FILENO);
      }
      ::execve(exe.c_str(), argv.data(), envp.data());
      std::fprintf(stderr, "ddpkit: rank %d: cannot execute %s: %s\n", r,
                   exe.c_str(), std::strerror(errno));
      ::_exit(127);
    }
    pids[r] = pid;
  }

  result.ranks.resize(n);
  int alive = n;
  bool stopping = false;
  clock::time_point stop_started{};
  bool killed = false;
  bool interrupted = false;
  bool sigterm_pending = false;
  auto stop_all = [&](int sig) {
    for (int r = 0; r < n; ++r) {
      if (pids[r] > 0) {
        ::kill(pids[r], sig);
        result.ranks[r].stopped_by_launcher = true;
      }
    }
  };
  while (alive > 0) {
    // Reap everything that has ended.
    for (;;) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) break;
      int r = -1;
      for (int k = 0; k < n; ++k) {
        if (pids[k] == pid) r = k;
      }
      if (r < 0) continue;  // not one of ours
      RankExit ex;
      ex.rank = r;
      ex.pid = pid;
      ex.stopped_by_launcher = result.ranks[r].stopped_by_launcher;
      if (WIFSIGNALED(status)) {
        ex.signal = WTERMSIG(status);
      } else {
        ex.exit_code = WEXITSTATUS(status);
      }
      result.ranks[r] = ex;
      pids[r] = -1;
      --alive;
      if (!ex.ok() && !interrupted) {
        // The cause is the first failure that is not a casualty: a rank
        // stopped by us, or one that only saw a peer go away, is named
        // only when nothing else failed.
        auto casualty = [](const RankExit& e) {
          return e.stopped_by_launcher ||
                 (e.signal == 0 && e.exit_code == kPeerFailureExitCode);
        };
        if (!result.first_failure ||
            (casualty(*result.first_failure) && !casualty(ex))) {
          result.first_failure = ex;
        }
        if (!stopping) {
          stopping = true;
          stop_started = clock::now();
          if (casualty(ex)) {
            // Give the rank that caused it a moment to exit on its own, so
            // it is reported rather than killed.
            sigterm_pending = true;
          } else {
            stop_all(SIGTERM);
          }
        } else if (sigterm_pending && !casualty(ex)) {
          sigterm_pending = false;
          stop_started = clock::now();
          stop_all(SIGTERM);
        }
      }
    }
    if (alive == 0) break;
    if (sigterm_pending &&
        clock::now() - stop_started > std::chrono::milliseconds(1000)) {
      sigterm_pending = false;
      stop_started = clock::now();
      stop_all(SIGTERM);
    }
    if (stopping && !sigterm_pending && !killed &&
        clock::now() - stop_started >
            (interrupted ? opts.interrupt_grace() : opts.grace())) {
      stop_all(SIGKILL);
      killed = true;
    }
    timespec ts{0, 50'000'000};
    int sig = ::sigtimedwait(&watched, nullptr, &ts);
    if ((sig == SIGINT || sig == SIGTERM) && !stopping) {
      if (opts.report()) {
        std::fprintf(stderr, "ddpkit: launcher got %s; stopping %d rank(s)\n",
                     sig == SIGINT ? "SIGINT" : "SIGTERM", alive);
      }
      stopping = true;
      interrupted = true;
      stop_started = clock::now();
      stop_all(SIGTERM);
      result.exit_code = 128 + sig;
    } else if ((sig == SIGINT || sig == SIGTERM) && interrupted && !killed) {
      if (opts.report()) {
        std::fprintf(stderr,
                     "ddpkit: launcher got a second signal; killing "
                     "%d rank(s)\n",
                     alive);
      }
      stop_all(SIGKILL);
      killed = true;
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_mask, nullptr);

  if (result.first_failure) {
    const auto& f = *result.first_failure;
    result.seconds_to_stop_after_failure =
        std::chrono::duration<double>(clock::now() - stop_started).count();
    result.message =
        cat("ddpkit: ", f.describe(), "; stopped the other ", "ranks");
    result.exit_code = f.signal != 0 ? 128 + f.signal : f.exit_code;
    if (opts.report()) std::fprintf(stderr, "%s\n", result.message.c_str());
  }
  return result;
}

}  // namespace ddpkit::dist
