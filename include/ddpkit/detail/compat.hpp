// SPDX-License-Identifier: BSD-3-Clause
// The one place that knows which libtorch ddpkit is built against. Every API
// difference between libtorch 1.13 (Debian's) and 2.x (PyTorch wheels) is
// resolved here: autograd, autocast, serialization and warnings in
// `ddpkit::compat`, c10d (stores, process groups, backends) in
// `ddpkit::dist::compat`. The rest of ddpkit uses only the names below.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
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
#if defined(USE_C10D_NCCL) && defined(DDPKIT_HAS_CUDA) && \
    defined(DDPKIT_HAS_NCCL)
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#if defined(DDPKIT_HAS_CUDA)
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

#define DDPKIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// c10::Allocator::allocate is const before libtorch 2.3 (and has no
// copy_data to override); written `allocate(n) DDPKIT_ALLOCATOR_CONST
// override`. Checked against 1.13 and 2.11.
#if DDPKIT_TORCH_AT_LEAST(2, 3)
#define DDPKIT_ALLOCATOR_CONST
#else
#define DDPKIT_ALLOCATOR_CONST const
#endif

namespace ddpkit::compat {

// Note [Two libtorch versions, one place for the difference]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Two libtorch versions, one place for the difference. The default build uses
// the libtorch inside PyTorch 2.11's wheel (CUDA 13.0) from the project's
// `.venv`; `-DDDPKIT_TORCH=system` uses Debian's 1.13 (CPU), and
// `CMAKE_PREFIX_PATH`/`Torch_DIR` any other (`cmake/ddpkitTorch.cmake`).
// `detail/compat.hpp` (autograd, autocast, warnings, serialization in
// `ddpkit::compat`; `Backend` vs `ProcessGroup`, stores, NCCL options in
// `ddpkit::dist::compat`) is the only file that tests
// `DDPKIT_TORCH_AT_LEAST`. What the 2.x build taught us: the wheel's
// `libtorch.so` exports libstdc++ symbols of a newer GCC, so
// `std::filesystem` calls bound to them crashed until ddpkit's link line put
// `-lstdc++` first (`cmake/ddpkitDependencies.cmake`); CMake must see the
// wheel's prefix before `/usr` or Debian's `libc10` gets mixed in
// (`cmake/ddpkitCuda.cmake` refuses such a mix); `nccl.h` is not in the
// wheel's torch but in its `nvidia-nccl` package, whose version must match
// (`ncclConfig_t` is embedded in `ProcessGroupNCCL::Options`); 2.x `TCPStore`
// with `waitWorkers=true` throws where 1.13 returned, so ddpkit checks in
// through the store itself; torchrun 2.x hosts the store in its agent
// (`TORCHELASTIC_USE_AGENT_STORE`): every rank is then a client, and each
// restart attempt uses its own key prefix.

/// Makes CUDA device `index` this thread's current device (where ddpkit is
/// built with CUDA; elsewhere nothing to do).
inline void set_cuda_device(int index) {
#if defined(DDPKIT_HAS_CUDA)
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(index));
#else
  (void)index;
#endif
}

/// Resets the CUDA caching allocator's peak statistics of device `index`
/// (nothing in a build without CUDA).
inline void reset_cuda_peak_memory(int index) {
#if defined(DDPKIT_HAS_CUDA)
  c10::cuda::CUDACachingAllocator::resetPeakStats(
      static_cast<c10::DeviceIndex>(index));
#else
  (void)index;
#endif
}

/// The most bytes the CUDA caching allocator has had allocated at once on
/// device `index` since its last reset (0 in a build without CUDA).
inline uint64_t cuda_peak_allocated_bytes(int index) {
#if defined(DDPKIT_HAS_CUDA)
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(
      static_cast<c10::DeviceIndex>(index));
  return static_cast<uint64_t>(stats.allocated_bytes[0].peak);
#else
  (void)index;
  return 0;
#endif
}

/// This thread's current CUDA device, or -1 (a build without CUDA, or no
/// device).
inline int current_cuda_device() {
#if defined(DDPKIT_HAS_CUDA)
  if (c10::cuda::device_count() == 0) return -1;
  return static_cast<int>(c10::cuda::current_device());
#else
  return -1;
#endif
}

/// Makes CUDA device `index` current for a scope and restores the previous
/// one after; nothing for `index` < 0 or without CUDA. A new thread starts
/// on device 0, so a thread that launches CUDA work for a rank's device
/// (DataParallel's replicas, loader workers pinning memory) sets it first:
/// otherwise it makes a context on GPU 0 (PyTorch's pin-memory thread and
/// parallel_apply do the same).
class CudaDeviceScope {
 public:
  explicit CudaDeviceScope(int index) {
    const int current = index < 0 ? -1 : current_cuda_device();
    if (current < 0) return;
    previous_ = current;
    if (previous_ != index) set_cuda_device(index);
  }
  explicit CudaDeviceScope(const torch::Device& device)
      : CudaDeviceScope(device.is_cuda() ? std::max<int>(device.index(), 0)
                                         : -1) {}
  ~CudaDeviceScope() {
    if (previous_ >= 0) set_cuda_device(previous_);
  }
  CudaDeviceScope(const CudaDeviceScope&) = delete;
  CudaDeviceScope& operator=(const CudaDeviceScope&) = delete;

 private:
  int previous_ = -1;
};

/// "2.11.0" / "1.13.1": the libtorch ddpkit was compiled against.
inline std::string torch_version() {
  return TORCH_VERSION;
}

// ---- autograd --------------------------------------------------------------

/// What `torch::autograd::impl::grad_accumulator` returns: a shared_ptr<Node>
/// up to 2.11, an intrusive pointer in later releases.
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const torch::autograd::Variable&>()));

// ---- optimizers ------------------------------------------------------------

/// The key of parameter `p`'s entry in `torch::optim::Optimizer::state()`:
/// its TensorImpl's address, as a `void*` (libtorch 2.x) or printed as a
/// string (1.13, `c10::guts::to_string` of the pointer). A template so
/// that only the branch of this libtorch's key type is compiled.
template <class State = std::decay_t<
              decltype(std::declval<torch::optim::Optimizer&>().state())>>
inline auto optimizer_state_key(const torch::Tensor& p) {
  using Key = typename State::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;
    out << p.unsafeGetTensorImpl();
    return out.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// ---- autocast --------------------------------------------------------------

/// Autocast's thread-local state for one device type (CUDA or CPU): what a
/// worker thread must copy from the thread that launched it (autocast is
/// per thread).
struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kHalf;
  at::DeviceType device = at::kCUDA;
};

inline AutocastState autocast_state(at::DeviceType device = at::kCUDA) {
#if DDPKIT_TORCH_AT_LEAST(2, 4)
  return {at::autocast::is_autocast_enabled(device),
          at::autocast::get_autocast_dtype(device), device};
#else
  if (device == at::kCPU) {
    return {at::autocast::is_cpu_enabled(),
            at::autocast::get_autocast_cpu_dtype(), device};
  }
  return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype(),
          device};
#endif
}

inline void set_autocast_state(const AutocastState& s) {
#if DDPKIT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(s.device, s.enabled);
  at::autocast::set_autocast_dtype(s.device, s.dtype);
#else
  if (s.device == at::kCPU) {
    at::autocast::set_cpu_enabled(s.enabled);
    at::autocast::set_autocast_cpu_dtype(s.dtype);
    return;
  }
  at::autocast::set_enabled(s.enabled);
  at::autocast::set_autocast_gpu_dtype(s.dtype);
#endif
}

/// Autocast for a scope (PyTorch's `torch.autocast(device, dtype)`; CUDA
/// unless the state names CPU): sets the state, restores the previous one
/// on exit, and drops autocast's cast cache when the outermost autocast
/// scope ends.
class AutocastGuard {
 public:
  explicit AutocastGuard(AutocastState s) : prev_(autocast_state(s.device)) {
    set_autocast_state(s);
    at::autocast::increment_nesting();
  }
  AutocastGuard(bool enabled, at::ScalarType dtype = at::kHalf)
      : AutocastGuard(AutocastState{enabled, dtype}) {}
  ~AutocastGuard() {
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    set_autocast_state(prev_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState prev_;
};

// ---- warnings --------------------------------------------------------------

/// A warning handler that drops every warning (the fuzz targets use it).
struct QuietWarnings : c10::WarningHandler {
#if DDPKIT_TORCH_AT_LEAST(2, 1)
  void process(const c10::Warning&) override {}
#else
  void process(const c10::SourceLocation&, const std::string&,
               const bool) override {}
#endif
};

inline void set_warning_handler(c10::WarningHandler* handler) {
#if DDPKIT_TORCH_AT_LEAST(2, 1)
  c10::WarningUtils::set_warning_handler(handler);
#else
  c10::Warning::set_warning_handler(handler);
#endif
}

// ---- serialization ---------------------------------------------------------

/// `value` in torch.save's zip format, pickled the way Python pickles it:
/// plain dicts and lists without TorchScript's type tags
/// (`torch.jit._pickle.restore_type_tag`), which Python's `torch.load`
/// refuses under its default `weights_only=True` since 2.6. Tensors are
/// written from the CPU.
inline std::string save_for_python(const c10::IValue& value) {
  std::vector<char> pickle;
  torch::jit::Pickler pickler(
      [&](const char* buf, std::size_t n) {
        pickle.insert(pickle.end(), buf, buf + n);
      },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr,
      /*memoized_class_types=*/nullptr, /*get_tensor_id=*/nullptr,
      /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::string out;
  caffe2::serialize::PyTorchStreamWriter writer(
      [&](const void* buf, std::size_t n) -> std::size_t {
        out.append(static_cast<const char*>(buf), n);
        return n;
      });
  torch::jit::writeArchiveAndTensors("data", pickle.data(), pickle.size(),
                                     pickler.tensorData(), writer);
  writer.writeEndOfFile();
  return out;
}

}  // namespace ddpkit::compat

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

/// Whether `clone_store` can make a second client (libtorch >= 2.5).
inline constexpr bool can_clone_store = DDPKIT_TORCH_AT_LEAST(2, 5);

/// A second client of `store` with a connection (and lock) of its own, so a
/// thread can use it while another waits in the first; null where this
/// libtorch's stores cannot be cloned (before 2.5).
inline StorePtr clone_store(const StorePtr& store) {
#if DDPKIT_TORCH_AT_LEAST(2, 5)
  return store ? store->clone() : StorePtr();
#else
  (void)store;
  return StorePtr();
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
