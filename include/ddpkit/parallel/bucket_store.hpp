// SPDX-License-Identifier: BSD-3-Clause
// The reducer's buckets: how the parameters' gradients are grouped into
// flat buffers (in the order their gradients are expected, capped, never
// across two dtypes, devices or ZeRO-2 owners), where the buffers live
// (shared memory when the group reduces through it, else ordinary
// tensors), which a rank keeps (ZeRO-2: its own), and the gradient bytes
// held, counted from the tensors. The step protocol that fills and
// communicates them is the Reducer's (reducer.hpp, Note [The reducer's step
// protocol]).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/parallel/grad_comm.hpp"
#include "ddpkit/parallel/reducer_options.hpp"
#include "ddpkit/parallel/trace.hpp"

namespace ddpkit::parallel {

// Note [The reducer]
// ~~~~~~~~~~~~~~~~~~
// The reducer makes each parameter's `.grad` a view of its bucket (PyTorch's
// `gradient_as_bucket_view`): AccumulateGrad adds straight into the buffer
// that is all-reduced, and the average lands in `.grad` in place. The first
// version copied each gradient into its bucket from a tensor hook and wrote
// the averages back after backward: two extra passes over 45 MB per step for
// ResNet-18, about 7 % of the step. The hook now is a *post* hook on each
// parameter's grad accumulator (it runs after accumulation); if `.grad` was
// set to None or replaced, it is copied into the bucket once and rebound.
// Buckets launch strictly in index order, so every rank issues the same
// collective sequence even when gradients arrive in another order or some
// parameters are unused; a callback queued on the autograd engine waits for
// the buckets at the end of `backward()`, so plain `loss.backward()` works as
// in PyTorch. A tensor registered under several names (tied weights) has one
// grad accumulator, so it gets one slot and one hook, its name listing the
// others (PyTorch de-duplicates the same way; test "DDP: tied weights get one
// slot and equal one process"). Every collective started through
// `distributed/collectives.hpp` is counted (`Group::collectives_started()`);
// the no_sync test asserts none run under `no_sync` and one per bucket in the
// synced backward. The bucket holding the first layers (ready last) is capped
// at 1 MiB (`last_bucket_cap_bytes`): nothing overlaps it, so it should be
// small.

// Note [Buckets are rebuilt once, in arrival order]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Buckets are rebuilt once, in arrival order (`rebuild_buckets`, on by
// default, as PyTorch): during the first synchronised step the reducer
// records the order in which gradients became ready; at its end rank 0's
// order is broadcast (one collective, at the same point on every rank) and
// the buckets are rebuilt in it, each gradient moved into its new view. A
// model registered in another order than it runs (head before trunk) then
// launches its first bucket as soon as the head's gradients exist (test "DDP:
// buckets are rebuilt in the order gradients arrive…": bucket 0 goes from
// trunk2.bias to head.bias, results equal one process). No `static_graph`
// mode: the per-step checks stay on.

// Note [ZeRO-2's buckets in flight]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Buckets launch strictly in index order (every rank must start the
// same collectives in the same order), and only a launched bucket can be
// waited for: one that has not launched is waiting for gradients that
// this same backward produces later, so waiting for it here, inside an
// autograd hook, would deadlock. When `limit` others' buckets are held
// and none has launched, another is allocated. So the bound
// unowned_buckets_in_flight holds while gradients arrive in bucket
// order: a bucket is then complete, and launched, before the next
// one's first gradient arrives. The buckets are built in reverse
// registration order and, after the first synchronised step, rebuilt
// once in the order rank 0's gradients arrived (rebuild_buckets), so a
// model whose backward visits its parameters in the same order every
// step holds at most `limit` from its second step on. More are held in
// the first step (when that order is not reverse registration order:
// branches, tied weights, modules registered in another order than they
// run), with rebuild_buckets(false), and in steps whose arrival order
// differs from the first (data-dependent branches): up to every other
// rank's bucket that received a gradient while a bucket below it was
// incomplete. last_step_unowned_buckets_held() reports the count; the
// test "ZeRO-2 holds at most unowned_buckets_in_flight ..." measures
// both cases on a model with branches and a tied weight.

/// One bucket: a flat buffer over some parameters' gradients.
struct Bucket {
  std::vector<std::size_t> params;  // indices into the reducer's parameters
  std::vector<int64_t> offsets;
  torch::Tensor flat;
  std::vector<torch::Tensor> views;  // per parameter, shaped like it
  int owner = -1;  // ZeRO-2: the rank that keeps it (-1: every rank)
  std::size_t pending = 0;
  bool launched = false;
  CommFuture future;  // the communication hook's, while launched
  Trace::clock::time_point launch_time;
};

/// A reducer's buckets over its parameters, and the bytes they hold.
class BucketStore {
 public:
  const std::vector<Bucket>& buckets() const {
    return buckets_;
  }
  /// ZeRO-2 (gradient_owners given): buckets are reduced to their owner and
  /// freed on the other ranks.
  bool sharded() const {
    return !owner_.empty() && owner_.front() >= 0;
  }
  /// Bytes of gradient buffers this rank holds now: the buckets allocated
  /// (all of them in DDP; in ZeRO-2 its own, between steps).
  uint64_t gradient_bytes() const {
    return bucket_bytes_;
  }
  /// The most gradient bytes this rank has held at once since the reducer
  /// was made: bucket buffers, plus gradients outside the buckets (those a
  /// ZeRO-2 rank accumulates under no_sync for parameters it does not own)
  /// as counted when a step starts. Measured from the tensors held, not
  /// computed. Not counted: a ZeRO-2 bucket's first gradient, which
  /// autograd makes before the bucket exists and which is copied into it
  /// at once (one parameter's gradient for a moment).
  uint64_t peak_gradient_bytes() const {
    return peak_bytes_;
  }
  /// ZeRO-2: the most buckets of other ranks held at once during the last
  /// completed step (see unowned_buckets_in_flight for the bound). 0 in
  /// DDP.
  std::size_t last_step_unowned_buckets_held() const {
    return last_step_unowned_held_;
  }

 protected:
  BucketStore(dist::Group group, ReducerOptions opts)
      : group_(std::move(group)), opts_(std::move(opts)) {}

  // Groups the parameters into buckets in `order`, the order their gradients
  // are expected to be ready. The last ones (ready last) get a bucket of
  // their own, capped by last_bucket_cap_bytes, so the communication left
  // after backward is small.
  void layout_buckets(const std::vector<std::size_t>& order) {
    const std::size_t n = params_.size();
    buckets_.clear();
    auto bytes_of = [&](std::size_t k) {
      return params_[k].numel() *
             static_cast<int64_t>(params_[k].element_size());
    };
    std::size_t tail = 0;  // order[n - tail, n) form the last bucket
    if (opts_.last_bucket_cap_bytes() > 0) {
      const int64_t tail_cap =
          std::min(opts_.last_bucket_cap_bytes(), opts_.bucket_cap_bytes());
      int64_t sum = 0;
      while (tail < n &&
             (tail == 0 || sum + bytes_of(order[n - 1 - tail]) <= tail_cap)) {
        sum += bytes_of(order[n - 1 - tail++]);
      }
    }
    Bucket current;
    int64_t bytes = 0;
    int64_t cap = opts_.first_bucket_cap_bytes();
    auto close = [&] {
      if (current.params.empty()) return;
      buckets_.push_back(std::move(current));
      current = Bucket{};
      bytes = 0;
      cap = opts_.bucket_cap_bytes();
    };
    for (std::size_t pos = 0; pos < n; ++pos) {
      const std::size_t k = order[pos];
      const auto& p = params_[k];
      int64_t pbytes = bytes_of(k);
      bool other_kind =
          !current.params.empty() &&
          (params_[current.params.front()].dtype() != p.dtype() ||
           params_[current.params.front()].device() != p.device() ||
           owner_[current.params.front()] != owner_[k]);
      bool enters_tail = pos + tail == n && pos > 0;
      if (other_kind || enters_tail ||
          (!current.params.empty() && bytes + pbytes > cap)) {
        close();
      }
      int64_t offset =
          current.params.empty()
              ? 0
              : current.offsets.back() + params_[current.params.back()].numel();
      current.params.push_back(k);
      current.offsets.push_back(offset);
      current.owner = owner_[k];
      bytes += pbytes;
    }
    close();
    allocate_buckets();
    slot_bucket_.assign(n, 0);
    slot_index_.assign(n, 0);
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      for (std::size_t j = 0; j < buckets_[b].params.size(); ++j) {
        slot_bucket_[buckets_[b].params[j]] = b;
        slot_index_[buckets_[b].params[j]] = j;
      }
    }
  }

  int64_t numel_of(const Bucket& b) const {
    return b.offsets.back() + params_[b.params.back()].numel();
  }

  // Buffers for the buckets: in shared memory when the group reduces
  // through it (one segment per floating type, each bucket on its own cache
  // lines), otherwise ordinary zeroed tensors. Every rank has the same
  // layout, so every rank makes the same collective calls here.
  void allocate_buckets() {
    bucket_bytes_ = 0;
    const auto& shm = group_.shm();
    if (shm && opts_.shared_buckets() && !sharded()) {
      std::vector<torch::ScalarType> types;
      for (auto& b : buckets_) {
        const auto& p = params_[b.params.front()];
        const auto t = p.scalar_type();
        if (p.device().is_cpu() &&
            (t == torch::kFloat || t == torch::kDouble) &&
            std::find(types.begin(), types.end(), t) == types.end()) {
          types.push_back(t);
        }
      }
      for (auto type : types) {
        const int64_t align = 64 / static_cast<int64_t>(c10::elementSize(type));
        std::vector<std::pair<std::size_t, int64_t>> starts;
        int64_t total = 0;
        for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
          const auto& p = params_[buckets_[bi].params.front()];
          if (!p.device().is_cpu() || p.scalar_type() != type) continue;
          starts.emplace_back(bi, total);
          total += (numel_of(buckets_[bi]) + align - 1) / align * align;
        }
        auto buffer = shm->shared_buffer(total, type);
        if (!buffer.defined()) break;  // the same answer on every rank
        for (auto [bi, start] : starts) {
          buckets_[bi].flat = buffer.narrow(0, start, numel_of(buckets_[bi]));
        }
      }
    }
    for (auto& b : buckets_) {
      if (keeps(b)) allocate(b);
    }
  }

  // Whether this rank keeps bucket `b` between steps.
  bool keeps(const Bucket& b) const {
    return b.owner < 0 || b.owner == group_.rank();
  }

  // Gives bucket `b` its buffer (unless it has one, e.g. in shared
  // memory) and the parameters' views into it.
  void allocate(Bucket& b) {
    if (!b.flat.defined()) {
      b.flat = torch::zeros({numel_of(b)}, params_[b.params.front()].options());
    }
    bucket_bytes_ += static_cast<uint64_t>(b.flat.nbytes());
    peak_bytes_ = std::max(peak_bytes_, bucket_bytes_ + loose_bytes_);
    b.views.clear();
    for (std::size_t j = 0; j < b.params.size(); ++j) {
      const auto& p = params_[b.params[j]];
      // detach(): a plain alias of the bucket, not an autograd view, so
      // optimizers may detach_() it in place like any gradient. The view
      // has the parameter's strides (e.g. channels_last), as autograd
      // would give its gradient; a parameter with gaps or overlaps gets
      // a contiguous one.
      auto slice = b.flat.narrow(0, b.offsets[j], p.numel());
      b.views.push_back((p.is_non_overlapping_and_dense()
                             ? slice.as_strided(p.sizes(), p.strides())
                             : slice.view(p.sizes()))
                            .detach());
    }
  }

  // ZeRO-2: frees bucket `bi`, which another rank owns; its parameters'
  // gradients become undefined.
  void release(std::size_t bi) {
    auto& b = buckets_[bi];
    if (!b.flat.defined()) return;
    for (auto k : b.params) params_[k].mutable_grad() = torch::Tensor();
    bucket_bytes_ -= static_cast<uint64_t>(b.flat.nbytes());
    b.flat = torch::Tensor();
    b.views.clear();
  }

  // ZeRO-2: frees every bucket another rank owns (after their reduces).
  void release_unowned() {
    if (!sharded()) return;
    for (std::size_t bi = 0; bi < buckets_.size(); ++bi) {
      if (!keeps(buckets_[bi])) release(bi);
    }
  }

  // Others' buckets allocated now, into the step's maximum (reported by
  // last_step_unowned_buckets_held). Counted at a step's start too: the
  // first step finds every bucket allocated at construction.
  void note_unowned_held() {
    std::size_t held = 0;
    for (const auto& o : buckets_) held += !keeps(o) && o.flat.defined();
    step_unowned_held_ = std::max(step_unowned_held_, held);
  }

  // At a step's start (the first gradient hook, of parameter `first`):
  // bytes of gradients held outside the buckets (a ZeRO-2 rank's gradients
  // of others' parameters accumulated under no_sync), for
  // peak_gradient_bytes. Not `first`'s: the gradient autograd has just
  // made, about to be copied into its bucket.
  void count_loose_gradients(std::size_t first) {
    loose_bytes_ = 0;
    loose_.assign(params_.size(), 0);
    for (std::size_t i = 0; i < params_.size(); ++i) {
      const auto& g = params_[i].grad();
      if (!g.defined() || i == first) continue;
      const auto& b = buckets_[slot_bucket_[i]];
      if (!b.flat.defined() || !is_view_of(g, b.views[slot_index_[i]])) {
        loose_bytes_ += static_cast<uint64_t>(g.nbytes());
        loose_[i] = 1;
      }
    }
    peak_bytes_ = std::max(peak_bytes_, bucket_bytes_ + loose_bytes_);
  }

  void check_owners(std::size_t n) const {
    const auto& owners = opts_.gradient_owners();
    if (owners.empty()) return;
    if (owners.size() != n) {
      throw UsageError(ddpkit::detail::cat("Reducer: gradient_owners has ",
                                           owners.size(), " entries for ", n,
                                           " parameters"));
    }
    for (std::size_t i = 0; i < n; ++i) {
      if (owners[i] < 0 || owners[i] >= group_.size()) {
        throw UsageError(ddpkit::detail::cat(
            "Reducer: gradient_owners[", i, "] is ", owners[i],
            "; expected a rank in [0, ", group_.size(), ")"));
      }
    }
  }

  static bool is_view_of(const torch::Tensor& g, const torch::Tensor& view) {
    return g.data_ptr() == view.data_ptr() && g.sizes() == view.sizes() &&
           g.strides() == view.strides() && g.dtype() == view.dtype();
  }

  dist::Group group_;
  ReducerOptions opts_;
  std::vector<torch::Tensor> params_;  // each tensor once
  std::vector<Bucket> buckets_;
  std::vector<int> owner_;                // per parameter (ZeRO-2), else -1
  std::vector<std::size_t> slot_bucket_;  // per parameter: its bucket
  std::vector<std::size_t> slot_index_;   // and its place in it
  uint64_t bucket_bytes_ = 0, peak_bytes_ = 0, loose_bytes_ = 0;
  std::size_t step_unowned_held_ = 0, last_step_unowned_held_ = 0;
  std::vector<uint8_t> loose_;  // counted in loose_bytes_, not yet adopted
};

}  // namespace ddpkit::parallel
