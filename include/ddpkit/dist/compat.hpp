// SPDX-License-Identifier: BSD-3-Clause
// The one place that knows which libtorch it is built against. Every c10d
// difference between libtorch 1.13 (Debian's) and 2.x (PyTorch wheels) is
// resolved here; the rest of ddpkit uses only the names below.
#pragma once

#include <chrono>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include "ddpkit/dist/compat_core.hpp"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#if defined(USE_C10D_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA) && \
    defined(DDPKIT_HAS_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace ddpkit::dist::compat {

#if DDPKIT_TORCH_AT_LEAST(2, 0)
// 2.x split ProcessGroup into a dispatching front and per-device Backends;
// ProcessGroupGloo/NCCL are Backends and keep the collective API we use.
using Backend = c10d::Backend;
#else
using Backend = c10d::ProcessGroup;
#endif
using BackendPtr = c10::intrusive_ptr<Backend>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using StorePtr = c10::intrusive_ptr<c10d::Store>;

inline constexpr bool has_gloo =
#if defined(USE_C10D_GLOO)
    true;
#else
    false;
#endif

inline constexpr bool has_nccl =
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA) && \
    defined(DDPKIT_HAS_NCCL)
    true;
#else
    false;
#endif

inline StorePtr make_tcp_store(const std::string& host, int port,
                               bool is_server, int world_size,
                               std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions opts;
  opts.port = static_cast<std::uint16_t>(port);
  opts.isServer = is_server;
  opts.numWorkers = static_cast<std::size_t>(world_size);
  // ddpkit counts the ranks in itself (Group::wait_for_all, with an error
  // that says how many joined): libtorch 2.x's server throws when
  // waitWorkers is set and a rank is missing, 1.13's returned.
  opts.waitWorkers = false;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

inline StorePtr make_file_store(const std::string& path, int world_size,
                                std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  store->setTimeout(timeout);
  return store;
}

/// Whether this libtorch's TCPStore client can use the store that torchrun's
/// agent hosts (TORCHELASTIC_USE_AGENT_STORE). The store's wire protocol
/// changed in 2.x: a 1.13 client waits forever for a 2.x server's answer.
/// A 1.13 build cannot ask the agent its version; an agent of PyTorch 2.2 or
/// later is told by the variable it sets for every worker,
/// TORCH_NCCL_ASYNC_ERROR_HANDLING (1.13's agent sets
/// NCCL_ASYNC_ERROR_HANDLING).
inline bool can_use_agent_store() {
#if DDPKIT_TORCH_AT_LEAST(2, 0)
  return true;
#else
  return std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr;
#endif
}

inline StorePtr make_prefix_store(const std::string& prefix, StorePtr inner) {
  return c10::make_intrusive<c10d::PrefixStore>(prefix, std::move(inner));
}

#if defined(USE_C10D_GLOO)
/// `address` empty: the default device (host name); otherwise an interface
/// name (GLOO_SOCKET_IFNAME) when `is_interface`, else a host or IP to bind.
inline BackendPtr make_gloo(const StorePtr& store, int rank, int size,
                            std::chrono::milliseconds timeout,
                            const std::string& address, bool is_interface) {
  auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
  if (address.empty()) {
    opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  } else if (is_interface) {
    opts->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForInterface(address));
  } else {
    opts->devices.push_back(
        c10d::ProcessGroupGloo::createDeviceForHostname(address));
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
}
#endif

#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA) && \
    defined(DDPKIT_HAS_NCCL)
/// `blocking_wait`: Work::wait() blocks and throws on a timeout or a failed
/// communicator; otherwise NCCL's watchdog tears the process down
/// (asynchronous error handling). Both are read by ProcessGroupNCCL from the
/// environment when it is constructed (2.x names, and 1.13's without
/// TORCH_); a value the user set there is kept.
inline BackendPtr make_nccl(const StorePtr& store, int rank, int size,
                            std::chrono::milliseconds timeout,
                            bool blocking_wait) {
  auto user_set = [](const char* a, const char* b) {
    return std::getenv(a) != nullptr || std::getenv(b) != nullptr;
  };
  if (!user_set("TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT") &&
      !user_set("TORCH_NCCL_ASYNC_ERROR_HANDLING",
                "NCCL_ASYNC_ERROR_HANDLING")) {
    const char* var = blocking_wait ? "BLOCKING_WAIT" : "ASYNC_ERROR_HANDLING";
    ::setenv((std::string("TORCH_NCCL_") + var).c_str(), "1", 0);
    ::setenv((std::string("NCCL_") + var).c_str(), "1", 0);
  }
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
}
#endif

/// Sum is the only reduction every backend has; mean divides afterwards.
inline c10d::ReduceOp reduce_sum() {
  return c10d::ReduceOp::SUM;
}
inline c10d::ReduceOp reduce_max() {
  return c10d::ReduceOp::MAX;
}
inline c10d::ReduceOp reduce_min() {
  return c10d::ReduceOp::MIN;
}

}  // namespace ddpkit::dist::compat
