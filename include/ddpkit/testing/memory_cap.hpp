// SPDX-License-Identifier: BSD-3-Clause
// Memory measured where tensors get it: a wrapper around libtorch's CPU
// allocator that keeps the bytes handed out and not yet returned, their
// high-water mark, and an optional cap beyond which an allocation fails
// (as a smaller machine's would) with an error naming the sizes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include "ddpkit/detail/compat.hpp"

namespace ddpkit::testing {

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
      return a;
    }();
    return *self;
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
      TORCH_CHECK(false, "ddpkit::testing::MeteredCpuAllocator: allocating ", n,
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
    const c10::Device device = inner.device();
    auto* held = new Held{std::move(inner), bytes, self};
    return c10::DataPtr(data, held, &release, device);
  }

#if DDPKIT_TORCH_AT_LEAST(2, 3)
  void copy_data(void* dest, const void* src,
                 std::size_t count) const override {
    if (count > 0) std::memcpy(dest, src, count);
  }
#endif

 private:
  explicit MeteredCpuAllocator(c10::Allocator* base) : base_(base) {}

  // What a metered allocation's DataPtr owns: the base allocator's.
  struct Held {
    c10::DataPtr inner;
    int64_t bytes;
    MeteredCpuAllocator* owner;
  };
  static void release(void* ctx) {
    auto* held = static_cast<Held*>(ctx);
    held->owner->in_use_.fetch_sub(held->bytes);
    delete held;  // the base allocator's deleter runs here
  }

  c10::Allocator* base_;
  std::atomic<int64_t> in_use_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<int64_t> cap_{0};
};

}  // namespace ddpkit::testing
