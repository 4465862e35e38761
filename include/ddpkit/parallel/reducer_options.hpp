// SPDX-License-Identifier: BSD-3-Clause
// The reducer's settings (ReducerOptions): bucket caps, unused parameters,
// the bucket rebuild, shared-memory buckets, ZeRO-2's gradient owners.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include <torch/torch.h>

namespace ddpkit::parallel {

/// Reducer settings.
struct ReducerOptions {
  /// DDP's bucket size cap when none is set (PyTorch: bucket_cap_mb = 25).
  static constexpr int64_t kDefaultBucketCapBytes = 25 * 1024 * 1024;
  /// Bucket size cap: kDefaultBucketCapBytes unless set (ZeRO2 uses its own
  /// smaller default when none is set, and honours any that is).
  ReducerOptions& bucket_cap_bytes(int64_t bytes) {
    bucket_cap_bytes_ = bytes;
    return *this;
  }
  int64_t bucket_cap_bytes() const {
    return bucket_cap_bytes_.value_or(kDefaultBucketCapBytes);
  }
  /// Whether a bucket cap was set (even one equal to the default).
  bool bucket_cap_set() const {
    return bucket_cap_bytes_.has_value();
  }

 private:
  std::optional<int64_t> bucket_cap_bytes_;

 public:
  /// The first bucket (the last layers' gradients, ready first) is smaller,
  /// so communication starts early.
  TORCH_ARG(int64_t, first_bucket_cap_bytes) = 1024 * 1024;
  /// The last bucket holds the first layers' gradients, which are ready only
  /// when backward ends: everything in it is communication nobody overlaps.
  /// Capping it keeps that tail short (0: no separate cap).
  TORCH_ARG(int64_t, last_bucket_cap_bytes) = 1024 * 1024;
  /// PyTorch's find_unused_parameters. true: the DDP engine walks the
  /// autograd graph from forward's output to find the parameters this rank
  /// does not use, and marks them ready when backward starts (their buckets
  /// still overlap with backward); they contribute what `.grad` holds (zero
  /// after zero_grad). After the step a parameter unused on every rank
  /// keeps its gradient as it was (undefined stays undefined, so the
  /// optimizer skips it); one used on some ranks gets the average over all
  /// ranks. Costs one small all-reduce (a used-flag per parameter) per step.
  /// false: a parameter that got no gradient is an error naming it.
  /// Either way a parameter used only in earlier no_sync micro-steps is
  /// used: its accumulated gradient is averaged.
  /// See Note [Unused parameters follow PyTorch] (ddp.hpp).
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// When the group reduces through shared memory (every rank on one
  /// host), keep the gradient buckets in a shared segment, so each
  /// all-reduce reads the other ranks' gradients where they lie instead of
  /// copying them through the channel (about half the memory traffic).
  /// Falls back to ordinary memory when the segment cannot be made.
  TORCH_ARG(bool, shared_buckets) = true;
  /// After the first synchronised step, rebuild the buckets in the order
  /// the gradients arrived on rank 0 (broadcast, so every rank agrees), as
  /// PyTorch does once: a model whose modules are registered in another
  /// order than they run still overlaps communication with backward.
  TORCH_ARG(bool, rebuild_buckets) = true;
  /// PyTorch's static_graph: the graph is the same in every step, so the
  /// first synchronised step records how many times each parameter's
  /// gradient is accumulated in one backward (0: unused; 2 or more: used
  /// in several reentrant backwards, e.g. a module run twice under
  /// activation checkpointing) and reduces every bucket once backward has
  /// ended; from the second step a parameter is ready when its count is
  /// reached, so the buckets overlap with backward again, and the unused
  /// ones are known without find_unused_parameters' graph walk and
  /// used-flag all-reduce. The counts must agree across ranks; a later step
  /// whose graph differs is an error naming the parameter. Whoever drives
  /// the reducer calls `finish_backward()` after each backward (the DDP
  /// engine does). DDP only (not with gradient_owners).
  /// See Note [Static graphs] (reducer.hpp).
  TORCH_ARG(bool, static_graph) = false;
  /// ZeRO-2: the rank that owns each parameter's averaged gradient (indexed
  /// like the parameters given to the reducer; every rank the same). Buckets
  /// never span two owners; each is reduced to its owner
  /// (dist::reduce_mean_async) instead of all-reduced, and the other ranks
  /// free it once the reduce has completed: their `.grad` of a parameter
  /// they do not own is undefined after the step. A rank keeps its own
  /// buckets (about 1/world of the gradients) between steps, and a few
  /// others while backward runs (see unowned_buckets_in_flight). Empty
  /// (the default): every rank keeps every averaged gradient (DDP). Only
  /// with the plain mean (AllReduceMean); shared_buckets does not apply.
  TORCH_ARG(std::vector<int>, gradient_owners) = {};
  /// ZeRO-2: how many buckets owned by other ranks are held at once during
  /// backward when gradients arrive in bucket order. When a new one is
  /// needed and this many are held, backward first waits for the oldest
  /// launched one's reduce and frees it (bounded memory, less overlap).
  /// See Note [ZeRO-2's buckets in flight] for when more are held.
  TORCH_ARG(int, unowned_buckets_in_flight) = 2;
};

}  // namespace ddpkit::parallel
