// SPDX-License-Identifier: BSD-3-Clause
// One entry point for every launch style: self-spawn (`--world-size N`),
// torchrun / srun / mpirun (environment), or a single process. After the
// rendezvous every style runs the same code with the same `Group`.
#pragma once

#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/parse.hpp"
#include "ddpkit/distributed/env.hpp"
#include "ddpkit/distributed/process_group.hpp"
#include "ddpkit/distributed/spawn.hpp"

namespace ddpkit::dist {

/// Returns N from `--world-size N` or `--world-size=N` in argv, or 0.
inline int world_size_from_args(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    std::string v;
    if (a == "--world-size" && i + 1 < argc) {
      v = argv[i + 1];
    } else if (a.rfind("--world-size=", 0) == 0) {
      v = a.substr(13);
    } else {
      continue;
    }
    return ddpkit::detail::parse_int<int>("--world-size", v, 1);
  }
  return 0;
}

/// Runs `fn(group)` on every rank and returns the process's exit code.
///
/// - `world_size > 1` in a process not started by a launcher: re-executes
///   this binary as that many ranks (same `argv`) and waits for them.
/// - otherwise: reads the environment (torchrun / SLURM / Open MPI or none),
///   meets the other ranks, and calls `fn`.
/// Ranks other than 0 print nothing on stdout unless `DDPKIT_ALL_RANKS_PRINT`
/// is set; errors go to stderr from any rank. A `UsageError` exits 2,
/// `Interrupted` (training stopped on a signal after a checkpoint) 128 + the
/// signal, an `IoError` (a write the system refused: disk full, I/O error)
/// `kIoErrorExitCode` (74), any other exception 1.
///
/// Example:
/// ```
/// int main(int argc, char** argv) {
///   return ddpkit::dist::launch(argc, argv, /*world_size=*/2,
///                               [](ddpkit::dist::Group& g) { return 0; });
/// }
/// ```
template <class Fn>
int launch(int argc, char** argv, int world_size, Fn&& fn,
           GroupOptions opts = {}) {
  int rank = -1;
  Group group;
  try {
    if (world_size > 1 && !is_spawned_rank() && !std::getenv("RANK")) {
      std::vector<std::string> args(argv + 1, argv + argc);
      return spawn(SpawnOptions(world_size).args(args)).exit_code;
    }
    DistEnv env = read_env();
    if (world_size > 1 && env.world_size != world_size) {
      throw UsageError(ddpkit::detail::cat(
          "--world-size ", world_size,
          " disagrees with the launcher's world "
          "size ",
          env.world_size, " (", to_string(env.source), ")"));
    }
    rank = env.rank;
    if (env.rank != 0 && !std::getenv("DDPKIT_ALL_RANKS_PRINT")) {
      std::fflush(stdout);
      if (std::freopen("/dev/null", "w", stdout) == nullptr) {
        std::fprintf(stderr, "ddpkit: rank %d: cannot silence stdout\n",
                     env.rank);
      }
    }
    group = Group::init(env, opts);
    return fn(group);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const Interrupted& e) {
    if (rank <= 0) std::fprintf(stderr, "%s\n", e.what());
    return 128 + e.signal();
  } catch (const IoError& e) {
    std::fprintf(stderr, "error (rank %d): %s\n", std::max(rank, 0), e.what());
    return kIoErrorExitCode;
  } catch (const PeerFailure& e) {
    // Name the ranks (and hosts) that are gone, when some are.
    const std::string lost = group.unanswered(std::chrono::seconds(3));
    std::fprintf(stderr, "error (rank %d): %s%s%s\n", rank, e.what(),
                 lost.empty() ? "" : "; ", lost.c_str());
    const auto& recorder = group.flight_recorder();
    if (rank == 0 && recorder && !recorder->dump_dir().empty()) {
      std::fprintf(stderr,
                   "ddpkit: every rank that could wrote its flight record "
                   "to %s; `ddpkit-doctor %s` says who and where\n",
                   recorder->dump_dir().c_str(), recorder->dump_dir().c_str());
    }
    if (recorder) print_doctor_verdict(recorder->dump_dir());
    return kPeerFailureExitCode;
  } catch (const std::exception& e) {
    if (rank >= 0) {
      std::fprintf(stderr, "error (rank %d): %s\n", rank, e.what());
    } else {
      std::fprintf(stderr, "error: %s\n", e.what());
    }
    return 1;
  }
}

/// `launch` with the world size taken from `--world-size N` in argv.
template <class Fn>
int launch(int argc, char** argv, Fn&& fn, GroupOptions opts = {}) {
  int n = 0;
  try {
    n = world_size_from_args(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  return launch(argc, argv, n, std::forward<Fn>(fn), std::move(opts));
}

}  // namespace ddpkit::dist
