// SPDX-License-Identifier: BSD-3-Clause
// Memory measured where tensors get it: a wrapper around libtorch's CPU
// allocator that keeps the bytes handed out and not yet returned, their
// high-water mark, and an optional cap beyond which an allocation fails
// (as a smaller machine's would) with an error naming the sizes. The
// Trainer reads it where installed (train/step_memory.hpp: summary.json's
// step_peak_allocated); testing/memory_cap.hpp names it for tests.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "ddpkit/detail/compat.hpp"

namespace ddpkit::detail {

/// libtorch's CPU allocator, metered: `install()` puts it in place of the
/// allocator set before (which still does the allocating). Every CPU
/// tensor allocated afterwards is counted from its allocation to its
/// release; tensors allocated before are not. Installed once per process
/// and never removed (the tensors it handed out may outlive any scope).
/// Counts storage bytes only: not gloo's, the shared-memory channel's or
/// oneDNN's own buffers, nor what the C library keeps after a release.
class MeteredCpuAllocator final : public c10::Allocator {
 public:
  /// Installs it (the first call) and returns it.
  static MeteredCpuAllocator& install() {
    static MeteredCpuAllocator* self = [] {
      auto* a = new MeteredCpuAllocator(c10::GetCPUAllocator());
      c10::SetCPUAllocator(a, /*priority=*/255);
      installed_.store(a);
      return a;
    }();
    return *self;
  }
  /// The installed one, or null (none installed in this process).
  static MeteredCpuAllocator* installed() {
    return installed_.load();
  }

  /// Allocations that would make more than `bytes` in use fail with a
  /// c10::Error naming the sizes (0: no cap).
  void set_cap(int64_t bytes) {
    cap_.store(bytes);
  }
  int64_t cap() const {
    return cap_.load();
  }
  /// Bytes handed out and not yet released.
  int64_t in_use() const {
    return in_use_.load();
  }
  /// The most bytes in use at once since install or `reset_peak`.
  int64_t peak() const {
    return peak_.load();
  }
  /// Starts the high-water mark afresh at what is in use now.
  void reset_peak() {
    peak_.store(in_use_.load());
  }

  c10::DataPtr allocate(std::size_t n) DDPKIT_ALLOCATOR_CONST override {
    auto* self = const_cast<MeteredCpuAllocator*>(this);
    const auto bytes = static_cast<int64_t>(n);
    const int64_t now = self->in_use_.fetch_add(bytes) + bytes;
    const int64_t cap = cap_.load();
    if (cap > 0 && now > cap) {
      self->in_use_.fetch_sub(bytes);
      TORCH_CHECK(false, "ddpkit: the metered CPU allocator: allocating ", n,
                  " bytes would hold ", now, " bytes, over the cap of ", cap,
                  " bytes (", now - bytes, " in use)");
    }
    int64_t seen = self->peak_.load();
    while (now > seen && !self->peak_.compare_exchange_weak(seen, now)) {
    }
    c10::DataPtr inner;
    try {
      inner = base_->allocate(n);
    } catch (...) {
      self->in_use_.fetch_sub(bytes);
      throw;
    }
    void* data = inner.get();
    if (data == nullptr) {  // nothing allocated (0 bytes)
      self->in_use_.fetch_sub(bytes);
      return inner;
    }
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      self->held_.emplace(data, Held{std::move(inner), bytes});
    }
    // The data is its own context, as libtorch's raw_allocate requires.
    return c10::DataPtr(data, data, &release, device);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

#if DDPKIT_TORCH_AT_LEAST(2, 3)
  void copy_data(void* dest, const void* src,
                 std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }
#endif

 private:
  explicit MeteredCpuAllocator(c10::Allocator* base) : base_(base) {}

  // What a metered allocation holds: the base allocator's DataPtr.
  struct Held {
    c10::DataPtr inner;
    int64_t bytes;
  };
  static void release(void* data) {
    auto* self = installed_.load();
    c10::DataPtr inner;  // released (the base's deleter) after the lock
    {
      std::lock_guard<std::mutex> lock(self->mutex_);
      const auto it = self->held_.find(data);
      if (it == self->held_.end()) return;
      self->in_use_.fetch_sub(it->second.bytes);
      inner = std::move(it->second.inner);
      self->held_.erase(it);
    }
  }

  c10::Allocator* base_;
  static inline std::atomic<MeteredCpuAllocator*> installed_{nullptr};
  std::atomic<int64_t> in_use_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> cap_{0};
  std::mutex mutex_;
  std::unordered_map<void*, Held> held_;
};

}  // namespace ddpkit::detail
