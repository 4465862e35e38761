// SPDX-License-Identifier: BSD-3-Clause
// How a process group meets its peers and talks to them: the options of
// `Group::init` and their enums.
#pragma once

#include <chrono>
#include <string>

#include <torch/torch.h>

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
  /// faster; see distributed/shm.hpp). The environment variable `DDPKIT_SHM=0`
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

}  // namespace ddpkit::dist
