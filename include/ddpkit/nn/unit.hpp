// SPDX-License-Identifier: BSD-3-Clause
// Units of a fully sharded model: `nn::Unit<Holder>` marks a submodule whose
// parameters a sharding engine (ZeRO3) gathers just before its call and
// frees after it. Outside such an engine it is the holder itself.
#pragma once

#include <algorithm>
#include <memory>
#include <mutex>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

namespace ddpkit::nn {

// Note [Units are marked at the call site]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Units are marked at the call site. PyTorch's FSDP gathers a unit's
// parameters in a forward pre-hook; libtorch's modules have no hooks (a
// submodule's `forward` is an ordinary member function its parent calls),
// so something on the call path has to do it. Three ways were weighed:
// (1) a wrapper *module* registered in the parent around the submodule
// changes every parameter's name ("layer1.inner.weight"), so checkpoints
// would no longer match DDP's or Python's; (2) an autograd function at the
// unit boundary runs in backward, not before forward; (3) a wrapper of the
// *holder* that the parent keeps instead of the holder, registered as usual:
//
//   nn::Unit<torch::nn::Linear> fc{nullptr};
//   fc = register_module("fc", torch::nn::Linear(8, 8));   // names unchanged
//   x = fc(x);          // gathered before, freed after (under ZeRO3 only)
//
// ddpkit takes (3). Converting a holder to a `Unit` marks its module (a
// process-wide list of weak pointers, so the engine finds the units when it
// is built, before any forward: a model whose whole state does not fit one
// rank must never be whole on it). Under a ZeRO3 engine's forward the call
// gathers the unit's parameters, runs the module, frees them and hooks the
// output's gradient so backward gathers them again before the unit's own
// backward; elsewhere (DDP, one process, evaluation outside an engine) it
// only calls the module. A unit's output must be one tensor for it to be
// freed after forward; other outputs keep it gathered until the end of
// backward (correct, without the saving). `operator->` reaches the module
// itself (its options, its tensors) without gathering. Sequential's
// children cannot be marked this way (Sequential calls them itself): put a
// `Unit` around each block the model calls. The examples' models keep the
// blocks in a Sequential or ModuleList (their names: `layer1.0.conv1`) and
// beside it a list of `Unit`s over the same modules that forward calls;
// their `clone` lists the clone's own blocks again (Cloneable copies the
// list, which would still point at the original's).

namespace detail {

/// What a sharding engine does around a unit's call (the engine whose
/// forward is running on this thread: `active_unit_calls`).
class UnitCalls {
 public:
  virtual ~UnitCalls() = default;
  /// Before the call: the unit's parameters are whole.
  virtual void before_unit(const torch::nn::Module& unit) = 0;
  /// After a call that returned one tensor: may free the parameters, and
  /// returns `out` (with a gradient hook that gathers them in backward).
  virtual torch::Tensor after_unit(const torch::nn::Module& unit,
                                   torch::Tensor out) = 0;
  /// After a call that returned something else: the parameters stay
  /// whole until the end of backward.
  virtual void keep_unit(const torch::nn::Module& unit) = 0;
};

/// The engine whose forward runs on this thread (null outside one).
inline UnitCalls*& active_unit_calls() {
  thread_local UnitCalls* calls = nullptr;
  return calls;
}

/// Sets `active_unit_calls` for a scope.
class ActiveUnitCalls {
 public:
  explicit ActiveUnitCalls(UnitCalls* calls)
      : previous_(std::exchange(active_unit_calls(), calls)) {}
  ActiveUnitCalls(const ActiveUnitCalls&) = delete;
  ActiveUnitCalls& operator=(const ActiveUnitCalls&) = delete;
  ~ActiveUnitCalls() {
    active_unit_calls() = previous_;
  }

 private:
  UnitCalls* previous_;
};

/// The modules marked as units (weak: a dropped model leaves nothing).
class UnitMarks {
 public:
  void mark(const std::shared_ptr<torch::nn::Module>& m) {
    if (!m) return;
    std::lock_guard<std::mutex> lock(mutex_);
    marks_.erase(std::remove_if(marks_.begin(), marks_.end(),
                                [](const auto& w) { return w.expired(); }),
                 marks_.end());
    for (const auto& w : marks_) {
      if (w.lock() == m) return;
    }
    marks_.push_back(m);
  }
  bool marked(const torch::nn::Module& m) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& w : marks_) {
      if (auto p = w.lock(); p.get() == &m) return true;
    }
    return false;
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::weak_ptr<torch::nn::Module>> marks_;
};

inline UnitMarks& unit_marks() {
  static UnitMarks marks;
  return marks;
}

}  // namespace detail

/// Whether `m` was marked as a unit (held by an `nn::Unit`).
inline bool is_unit(const torch::nn::Module& m) {
  return detail::unit_marks().marked(m);
}

/// A module holder (`torch::nn::Linear`, a TORCH_MODULE of one's own)
/// marked as a unit of a fully sharded model: see Note [Units are marked
/// at the call site]. Keep it where the holder was, assign it the holder
/// `register_module` returns, and call it as the holder.
template <class Holder>
class Unit {
 public:
  /// An empty unit (as `Holder{nullptr}`), assigned later.
  Unit(std::nullptr_t) : holder_(nullptr) {}  // NOLINT
  /// Marks `holder`'s module as a unit.
  Unit(Holder holder) : holder_(std::move(holder)) {  // NOLINT
    if (!holder_.is_empty()) detail::unit_marks().mark(holder_.ptr());
  }
  /// The same from the module (what `register_module` returns).
  Unit(std::shared_ptr<typename Holder::ContainedType> module)  // NOLINT
      : Unit(Holder(std::move(module))) {}

  /// Calls the module's `forward` (Sequential's: returning a tensor):
  /// under a ZeRO3 engine's forward, its parameters are gathered for the
  /// call.
  template <class... Args>
  decltype(auto) operator()(Args&&... args) {
    auto* calls = detail::active_unit_calls();
    if (!calls) return holder_->forward(std::forward<Args>(args)...);
    const torch::nn::Module& m = *holder_.ptr();
    calls->before_unit(m);
    using R = decltype(holder_->forward(std::forward<Args>(args)...));
    if constexpr (std::is_same_v<std::decay_t<R>, torch::Tensor>) {
      return calls->after_unit(m,
                               holder_->forward(std::forward<Args>(args)...));
    } else {
      decltype(auto) out = holder_->forward(std::forward<Args>(args)...);
      calls->keep_unit(m);
      return out;
    }
  }
  /// The same as calling it.
  template <class... Args>
  decltype(auto) forward(Args&&... args) {
    return (*this)(std::forward<Args>(args)...);
  }

  /// The module itself (no gathering).
  auto* operator->() {
    return holder_.get();
  }
  const auto* operator->() const {
    return holder_.get();
  }
  auto& operator*() {
    return *holder_;
  }
  /// The holder (as registered in the parent).
  Holder& holder() {
    return holder_;
  }
  const Holder& holder() const {
    return holder_;
  }
  auto ptr() const {
    return holder_.ptr();
  }
  bool is_empty() const {
    return holder_.is_empty();
  }

 private:
  Holder holder_;
};

}  // namespace ddpkit::nn
