// The one place that knows which libtorch it is built against. Every c10d
// difference between libtorch 1.13 (Debian's) and 2.x (PyTorch wheels) is
// resolved here; the rest of ddpkit uses only the names below.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#if defined(USE_C10D_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#define DDPKIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

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
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA)
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
  opts.waitWorkers = true;
  opts.timeout = timeout;
  return c10::make_intrusive<c10d::TCPStore>(host, opts);
}

inline StorePtr make_file_store(const std::string& path, int world_size,
                                std::chrono::milliseconds timeout) {
  auto store = c10::make_intrusive<c10d::FileStore>(path, world_size);
  store->setTimeout(timeout);
  return store;
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

#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA)
inline BackendPtr make_nccl(const StorePtr& store, int rank, int size,
                            std::chrono::milliseconds timeout) {
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
