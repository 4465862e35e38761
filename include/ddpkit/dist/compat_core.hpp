// SPDX-License-Identifier: BSD-3-Clause
// The autograd, autocast, serialization and warning half of ddpkit's
// libtorch-version knowledge (`dist/compat.hpp` has the c10d half and
// includes this file). Every API difference between libtorch 1.13 (Debian's)
// and 2.x (PyTorch wheels) outside c10d is resolved here; the rest of ddpkit
// uses only the names below.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/autocast_mode.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>
#include <torch/version.h>

#define DDPKIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace ddpkit::compat {

/// "2.11.0" / "1.13.1": the libtorch ddpkit was compiled against.
inline std::string torch_version() {
  return TORCH_VERSION;
}

// ---- autograd --------------------------------------------------------------

/// What `torch::autograd::impl::grad_accumulator` returns: a shared_ptr<Node>
/// up to 2.11, an intrusive pointer in later releases.
using GradAccumulatorPtr = decltype(torch::autograd::impl::grad_accumulator(
    std::declval<const torch::autograd::Variable&>()));

// ---- autocast --------------------------------------------------------------

/// CUDA autocast's thread-local state: what a worker thread must copy from
/// the thread that launched it (autocast is per thread).
struct AutocastState {
  bool enabled = false;
  at::ScalarType dtype = at::kHalf;
};

inline AutocastState autocast_state() {
#if DDPKIT_TORCH_AT_LEAST(2, 4)
  return {at::autocast::is_autocast_enabled(at::kCUDA),
          at::autocast::get_autocast_dtype(at::kCUDA)};
#else
  return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
#endif
}

inline void set_autocast_state(const AutocastState& s) {
#if DDPKIT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(at::kCUDA, s.enabled);
  at::autocast::set_autocast_dtype(at::kCUDA, s.dtype);
#else
  at::autocast::set_enabled(s.enabled);
  at::autocast::set_autocast_gpu_dtype(s.dtype);
#endif
}

/// CUDA autocast for a scope (PyTorch's `torch.autocast("cuda", dtype)`):
/// sets the state, restores the previous one on exit, and drops autocast's
/// cast cache when the outermost autocast scope ends.
class AutocastGuard {
 public:
  explicit AutocastGuard(AutocastState s) : prev_(autocast_state()) {
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
