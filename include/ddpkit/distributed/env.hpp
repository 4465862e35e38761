// SPDX-License-Identifier: BSD-3-Clause
// Where am I: rank, local rank, world size and master address, read from the
// environment of torchrun, SLURM or Open MPI, or given explicitly. Malformed
// or inconsistent values are a `UsageError` naming the variable.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/parse.hpp"

namespace ddpkit::dist {

/// Which launcher described this process.
enum class LaunchSource { explicit_args, torchrun, slurm, openmpi, single };

inline const char* to_string(LaunchSource s) {
  switch (s) {
    case LaunchSource::explicit_args: return "explicit";
    case LaunchSource::torchrun: return "torchrun";
    case LaunchSource::slurm: return "slurm";
    case LaunchSource::openmpi: return "openmpi";
    case LaunchSource::single: return "single";
  }
  return "?";
}

/// This process's place in the job.
struct DistEnv {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  LaunchSource source = LaunchSource::single;

  bool is_distributed() const {
    return world_size > 1;
  }
  bool is_main() const {
    return rank == 0;
  }
};

/// Looks a variable up; tests pass a table instead of the real environment.
using EnvLookup = std::function<std::optional<std::string>(std::string_view)>;

inline EnvLookup process_environment() {
  return [](std::string_view name) { return ddpkit::detail::env_value(name); };
}

namespace detail {

/// Launcher variable `name` as a whole number >= `min_value`.
inline int parse_int(std::string_view name, const std::string& value,
                     int min_value) {
  return ddpkit::detail::parse_int<int>(ddpkit::detail::env_what(name), value,
                                        min_value);
}

struct VarNames {
  const char* rank;
  const char* local_rank;
  const char* world_size;
  const char* local_world_size;
};

inline void check_consistent(const DistEnv& e, const VarNames& n) {
  using ddpkit::detail::cat;
  if (e.rank >= e.world_size) {
    throw UsageError(cat(n.rank, "=", e.rank, " must be less than ",
                         n.world_size, "=", e.world_size));
  }
  if (e.local_world_size > e.world_size) {
    throw UsageError(cat(n.local_world_size, "=", e.local_world_size,
                         " must not exceed ", n.world_size, "=", e.world_size));
  }
  if (e.local_rank >= e.local_world_size) {
    throw UsageError(cat(n.local_rank, "=", e.local_rank, " must be less than ",
                         n.local_world_size, "=", e.local_world_size));
  }
  if (e.master_port < 1 || e.master_port > 65535) {
    throw UsageError(cat("MASTER_PORT=", e.master_port,
                         " is not a TCP port (expected 1..65535)"));
  }
}

}  // namespace detail

/// Reads the job description from `env`. Precedence: torchrun's variables
/// (`RANK`/`WORLD_SIZE`), then SLURM's (`SLURM_PROCID`/`SLURM_NTASKS`), then
/// Open MPI's (`OMPI_COMM_WORLD_*`); none of them means a single process.
/// `MASTER_ADDR` is required once the world has more than one process;
/// `MASTER_PORT` defaults to 29500.
///
/// Example:
/// ```
/// auto env = ddpkit::dist::read_env();  // under torchrun --nproc_per_node=2
/// // env.rank in {0, 1}, env.world_size == 2
/// ```
inline DistEnv read_env(const EnvLookup& env = process_environment()) {
  using detail::parse_int;
  DistEnv e;
  detail::VarNames names{};
  auto get = [&](const char* n) { return env(n); };
  auto need = [&](const char* n, const char* launcher) -> std::string {
    auto v = get(n);
    if (!v) {
      throw UsageError(ddpkit::detail::cat(
          "environment variable ", n, " is missing (", launcher,
          " launch detected; expected it to be set)"));
    }
    return *v;
  };
  if (get("RANK") || get("WORLD_SIZE")) {
    e.source = LaunchSource::torchrun;
    names = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"};
    e.rank = parse_int("RANK", need("RANK", "torchrun"), 0);
    e.world_size = parse_int("WORLD_SIZE", need("WORLD_SIZE", "torchrun"), 1);
    auto lr = get("LOCAL_RANK");
    e.local_rank = lr ? parse_int("LOCAL_RANK", *lr, 0) : e.rank;
    auto lws = get("LOCAL_WORLD_SIZE");
    e.local_world_size =
        lws ? parse_int("LOCAL_WORLD_SIZE", *lws, 1) : e.world_size;
  } else if (get("SLURM_PROCID") && get("SLURM_NTASKS")) {
    e.source = LaunchSource::slurm;
    names = {"SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS",
             "SLURM_NTASKS_PER_NODE"};
    e.rank = parse_int("SLURM_PROCID", *get("SLURM_PROCID"), 0);
    e.world_size = parse_int("SLURM_NTASKS", *get("SLURM_NTASKS"), 1);
    auto lr = get("SLURM_LOCALID");
    e.local_rank = lr ? parse_int("SLURM_LOCALID", *lr, 0) : 0;
    // SLURM_NTASKS_PER_NODE may read "2(x3)" on heterogeneous jobs: take the
    // count before any parenthesis.
    if (auto lws = get("SLURM_NTASKS_PER_NODE")) {
      std::string v = lws->substr(0, lws->find('('));
      e.local_world_size = parse_int("SLURM_NTASKS_PER_NODE", v, 1);
    } else {
      // Without it, this node holds at least the ranks up to ours; checked
      // first so that local_rank + 1 cannot overflow.
      if (e.local_rank >= e.world_size) {
        throw UsageError(ddpkit::detail::cat(
            "SLURM_LOCALID=", e.local_rank,
            " must be less than SLURM_NTASKS=", e.world_size));
      }
      e.local_world_size = e.local_rank + 1;
    }
  } else if (get("OMPI_COMM_WORLD_RANK") || get("OMPI_COMM_WORLD_SIZE")) {
    e.source = LaunchSource::openmpi;
    names = {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"};
    e.rank = parse_int("OMPI_COMM_WORLD_RANK",
                       need("OMPI_COMM_WORLD_RANK", "Open MPI"), 0);
    e.world_size = parse_int("OMPI_COMM_WORLD_SIZE",
                             need("OMPI_COMM_WORLD_SIZE", "Open MPI"), 1);
    auto lr = get("OMPI_COMM_WORLD_LOCAL_RANK");
    e.local_rank = lr ? parse_int("OMPI_COMM_WORLD_LOCAL_RANK", *lr, 0) : 0;
    auto lws = get("OMPI_COMM_WORLD_LOCAL_SIZE");
    e.local_world_size =
        lws ? parse_int("OMPI_COMM_WORLD_LOCAL_SIZE", *lws, 1) : e.world_size;
  } else {
    e.source = LaunchSource::single;
    return e;
  }
  if (auto addr = get("MASTER_ADDR")) {
    if (addr->empty()) {
      throw UsageError(
          "environment variable MASTER_ADDR is empty (expected a "
          "host name or IP address of rank 0)");
    }
    e.master_addr = *addr;
  } else if (auto node = get("SLURM_LAUNCH_NODE_IPADDR");
             node && e.source == LaunchSource::slurm) {
    // SLURM names no master; the launching node is the usual choice.
    if (node->empty()) {
      throw UsageError(
          "environment variable SLURM_LAUNCH_NODE_IPADDR is empty (expected "
          "the launching node's address; or set MASTER_ADDR to rank 0's "
          "host)");
    }
    e.master_addr = *node;
  } else if (e.world_size > 1) {
    throw UsageError(ddpkit::detail::cat(
        "environment variable MASTER_ADDR is missing (required when ",
        names.world_size, "=", e.world_size, " > 1)"));
  }
  if (auto port = get("MASTER_PORT")) {
    e.master_port = detail::parse_int("MASTER_PORT", *port, 1);
  }
  detail::check_consistent(e, names);
  return e;
}

/// A job described by the caller rather than the environment.
inline DistEnv explicit_env(int rank, int world_size, std::string master_addr,
                            int master_port, int local_rank = -1,
                            int local_world_size = -1) {
  DistEnv e;
  e.source = LaunchSource::explicit_args;
  e.rank = rank;
  e.world_size = world_size;
  e.local_rank = local_rank < 0 ? rank : local_rank;
  e.local_world_size = local_world_size < 0 ? world_size : local_world_size;
  e.master_addr = std::move(master_addr);
  e.master_port = master_port;
  if (world_size < 1) {
    throw UsageError(ddpkit::detail::cat("world size ", world_size,
                                         " is invalid (expected >= 1)"));
  }
  if (rank < 0) {
    throw UsageError(
        ddpkit::detail::cat("rank ", rank, " is invalid (expected >= 0)"));
  }
  detail::check_consistent(
      e, {"rank", "local rank", "world size", "local world size"});
  return e;
}

}  // namespace ddpkit::dist
