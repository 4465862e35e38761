// SPDX-License-Identifier: BSD-3-Clause
// A rank's peak memory during its training steps, measured outside the code
// it describes: by the kernel for the process (see Note [Measured memory]
// in detail/process_memory.hpp), by libtorch's CPU allocator where it is
// metered (meter_cpu_memory) and, on a CUDA device, by libtorch's caching
// allocator.
#pragma once

#include <algorithm>
#include <cstdint>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/metered_allocator.hpp"
#include "ddpkit/detail/process_memory.hpp"

namespace ddpkit::train {

/// Meters libtorch's CPU allocator from now on, for the whole process (see
/// detail/metered_allocator.hpp): every fit's summary.json then has each
/// rank's `step_peak_allocated` (the most bytes of CPU tensors allocated
/// at once during a training step, counted where they are allocated) and
/// `peak_step` (that plus the rank's share of the shared-memory segments).
/// Call it before making the model, so its parameters count; tensors made
/// before are not counted. Cost: one small heap object per CPU allocation.
/// The examples' `--meter-memory` calls it.
inline void meter_cpu_memory() {
  ddpkit::detail::MeteredCpuAllocator::install();
}

/// The peaks of one rank's training steps. The Trainer calls `begin` as a
/// step starts and `end` when its optimizer step is done.
class StepMemory {
 public:
  explicit StepMemory(torch::Device device) : device_(device) {}

  /// Resets the peaks (the process's resident high-water mark; the CUDA
  /// allocator's peak on a CUDA device).
  void begin() {
    if (auto* m = ddpkit::detail::MeteredCpuAllocator::installed()) {
      m->reset_peak();
    }
    resettable_ = ddpkit::detail::ProcessMemory::reset_peak() && resettable_;
    if (device_.is_cuda()) compat::reset_cuda_peak_memory(device_.index());
  }
  /// Keeps the step's peaks where they are the largest so far.
  void end() {
    if (const auto* m = ddpkit::detail::MeteredCpuAllocator::installed()) {
      allocated_ = std::max(allocated_, static_cast<uint64_t>(m->peak()));
    }
    resident_ =
        std::max(resident_, ddpkit::detail::ProcessMemory::peak_resident());
    if (device_.is_cuda()) {
      device_peak_ = std::max(
          device_peak_, compat::cuda_peak_allocated_bytes(device_.index()));
    }
  }

  /// The most bytes resident at once during a step (every page the
  /// process touched; shared pages in full). 0 before a step.
  uint64_t peak_resident() const {
    return resident_;
  }
  /// peak_resident with the shared-memory pages resident now counted by
  /// this process's share of them instead of in full.
  uint64_t peak_proportional() const {
    if (resident_ == 0) return 0;
    const uint64_t shared = ddpkit::detail::ProcessMemory::shared_resident();
    const uint64_t mine = ddpkit::detail::ProcessMemory::shared_proportional();
    return resident_ - std::min(resident_, shared) + mine;
  }
  /// Where the CPU allocator is metered (meter_cpu_memory): the most bytes
  /// of CPU tensors allocated at once during a step, every thread's (an
  /// asynchronous checkpoint's snapshot too); 0 when not metered.
  uint64_t peak_allocated() const {
    return allocated_;
  }
  /// Whether the CPU allocator is metered in this process.
  static bool metered() {
    return ddpkit::detail::MeteredCpuAllocator::installed() != nullptr;
  }
  /// On a CUDA device: the most bytes the caching allocator had allocated
  /// at once during a step (0 elsewhere).
  uint64_t peak_device() const {
    return device_peak_;
  }
  /// False where the kernel would not reset the high-water mark: the peak
  /// then runs from the process's start (set-up and evaluation included).
  bool per_step() const {
    return resettable_;
  }

 private:
  torch::Device device_;
  uint64_t resident_ = 0, device_peak_ = 0, allocated_ = 0;
  bool resettable_ = true;
};

}  // namespace ddpkit::train
