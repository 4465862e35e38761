// Where a step's time goes at the level PyTorch's own profiler sees: wall
// time inside outermost ATen operators on one thread, by operator name.
// ddpkit_ddp_bench's precision section uses it in C++ (--op-profile=N),
// and scripts/bench_pytorch_precision.py loads the same code into PyTorch's
// process (libddpkit_op_profile, op_profile_lib.cpp), so both sides are
// measured by one mechanism with the same overhead.
#pragma once

#include <ATen/record_function.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>

namespace ddpkit_bench {

/// While alive, times every outermost `aten::` operator that the thread
/// which made it runs. A RecordFunction callback (the hook PyTorch's
/// profiler uses) keeps a per-thread depth of `aten::` spans, so conv2d ->
/// convolution -> mkldnn_convolution counts once, under conv2d, and an
/// operator inside an autograd node's backward counts under its own name.
/// What lies outside every operator is the framework around the kernels:
/// autograd's engine, DDP's hooks and bucket bookkeeping, waits for
/// communication, and on PyTorch's side the interpreter. Work on other
/// threads (gloo's, ddpkit's shared-memory channel) is not seen. One at a
/// time (a second throws std::logic_error).
class OpProfile {
 public:
  OpProfile() {
    OpProfile* none = nullptr;
    if (!self_.compare_exchange_strong(none, this)) {
      throw std::logic_error(
          "OpProfile: another one is active (one at a time)");
    }
    depth_ = 0;
    thread_.store(std::this_thread::get_id());
    handle_ =
        at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end)
                                  .scopes({at::RecordScope::FUNCTION}));
  }
  ~OpProfile() {
    at::removeCallback(handle_);
    self_.store(nullptr);
  }
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  /// Seconds inside each outermost operator, and its number of calls. Read
  /// it on the profiled thread (the callback writes it there).
  const std::map<std::string, std::pair<double, int64_t>>& ops() const {
    return ops_;
  }

 private:
  using clock = std::chrono::steady_clock;

  /// ATen operators on the profiled thread only: the same scope also holds
  /// autograd's "evaluate_function: <node>" spans, which include hooks.
  static bool counted(const at::RecordFunction& fn) {
    return self_.load() != nullptr &&
           std::this_thread::get_id() == thread_.load() &&
           std::strncmp(fn.name(), "aten::", 6) == 0;
  }
  static std::unique_ptr<at::ObserverContext> on_start(
      const at::RecordFunction& fn) {
    if (counted(fn) && depth_++ == 0) start_ = clock::now();
    return nullptr;
  }
  static void on_end(const at::RecordFunction& fn, at::ObserverContext*) {
    if (!counted(fn) || depth_ == 0 || --depth_ != 0) return;
    const double elapsed =
        std::chrono::duration<double>(clock::now() - start_).count();
    auto& [seconds, calls] = self_.load()->ops_[fn.name()];
    seconds += elapsed;
    ++calls;
  }

  static inline std::atomic<OpProfile*> self_{nullptr};
  static inline std::atomic<std::thread::id> thread_{};
  static inline thread_local int depth_ = 0;
  static inline thread_local clock::time_point start_{};
  at::CallbackHandle handle_ = 0;
  std::map<std::string, std::pair<double, int64_t>> ops_;
};

}  // namespace ddpkit_bench
