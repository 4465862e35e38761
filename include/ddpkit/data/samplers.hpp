// SPDX-License-Identifier: BSD-3-Clause
// Index samplers: sequential, seeded random, and distributed (PyTorch's
// DistributedSampler semantics, plus an evaluation mode that counts every
// sample once). They satisfy libtorch's sampler interface, so they plug into
// `torch::data::make_data_loader` as well as ddpkit's loader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <optional>
#include <vector>

#include <torch/torch.h>
#include <range/v3/algorithm/copy.hpp>
#include <range/v3/range/conversion.hpp>
#include <range/v3/view/concat.hpp>
#include <range/v3/view/cycle.hpp>
#include <range/v3/view/drop.hpp>
#include <range/v3/view/slice.hpp>
#include <range/v3/view/stride.hpp>
#include <range/v3/view/take.hpp>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/permutation.hpp"
#include "ddpkit/detail/error.hpp"

namespace ddpkit::data {

/// What a sampler needs to know about its place in the job. Every sampler is
/// constructible from `(dataset_size, ShardSpec)` so the Trainer can make any
/// of them.
struct ShardSpec {
  int rank = 0;
  int world_size = 1;
  std::uint64_t seed = 0;
  /// Distributed training: drop the tail so every rank has the same number
  /// of samples (true), or pad by repeating the head (false, PyTorch's
  /// default).
  bool drop_last = false;
};

namespace detail {

/// 0, 1, ..., n-1. (std::iota: `views::iota | to<vector>` trips a false
/// -Waggressive-loop-optimizations warning in GCC 12.)
inline std::vector<std::size_t> identity_permutation(std::size_t n) {
  std::vector<std::size_t> v(n);
  std::iota(v.begin(), v.end(), std::size_t{0});
  return v;
}

/// Shared cursor logic: hands out `indices_` in chunks of at most n, and
/// saves/loads the position. `Derived::reset()` rebuilds an epoch's indices.
template <class Derived>
class IndexCursor {
 public:
  using BatchRequestType = std::vector<std::size_t>;

  c10::optional<std::vector<std::size_t>> next(std::size_t batch_size) {
    if (position_ >= indices_.size()) return c10::nullopt;
    auto end = std::min(indices_.size(), position_ + batch_size);
    std::vector<std::size_t> out(indices_.begin() + position_,
                                 indices_.begin() + end);
    position_ = end;
    return out;
  }

  /// Every index this sampler hands out in the current epoch, in order.
  const std::vector<std::size_t>& indices() const {
    return indices_;
  }
  /// How many indices one epoch yields on this rank.
  std::size_t size() const {
    return indices_.size();
  }
  std::size_t position() const {
    return position_;
  }

  void save(torch::serialize::OutputArchive& archive) const {
    archive.write("position",
                  torch::tensor(static_cast<int64_t>(position_), torch::kInt64),
                  /*is_buffer=*/true);
    archive.write("epoch",
                  torch::tensor(static_cast<int64_t>(epoch_), torch::kInt64),
                  true);
  }

  /// Restores the epoch and the position within it.
  void load(torch::serialize::InputArchive& archive) {
    torch::Tensor pos, ep;
    archive.read("position", pos, true);
    archive.read("epoch", ep, true);
    epoch_ = static_cast<std::size_t>(ep.item<int64_t>());
    static_cast<Derived&>(*this).reset();
    position_ = std::min(static_cast<std::size_t>(pos.item<int64_t>()),
                         indices_.size());
  }

 protected:
  std::vector<std::size_t> indices_;
  std::size_t position_ = 0;
  std::size_t epoch_ = 0;
};

}  // namespace detail

/// Indices 0..n-1 in order. Not shardable: one process sees everything.
class SequentialSampling : public detail::IndexCursor<SequentialSampling> {
 public:
  using sampler_concept = sampler_tag;
  static constexpr bool is_distributed = false;

  explicit SequentialSampling(std::size_t size, ShardSpec = {}) : n_(size) {
    reset();
  }
  void reset(c10::optional<std::size_t> new_size = c10::nullopt) {
    if (new_size) n_ = *new_size;
    indices_ = detail::identity_permutation(n_);
    position_ = 0;
  }
  void set_epoch(std::size_t epoch) {
    epoch_ = epoch;
  }

 private:
  std::size_t n_;
};

/// A permutation seeded by `seed + epoch`, new each `set_epoch`.
class RandomSampling : public detail::IndexCursor<RandomSampling> {
 public:
  using sampler_concept = sampler_tag;
  static constexpr bool is_distributed = false;

  explicit RandomSampling(std::size_t size, ShardSpec spec = {})
      : n_(size), seed_(spec.seed) {
    reset();
  }
  void reset(c10::optional<std::size_t> new_size = c10::nullopt) {
    if (new_size) n_ = *new_size;
    indices_ = detail::seeded_permutation(n_, seed_ + epoch_);
    position_ = 0;
  }
  void set_epoch(std::size_t epoch) {
    epoch_ = epoch;
    reset();
  }

 private:
  std::size_t n_;
  std::uint64_t seed_;
};

/// Options of `DistributedSampling` beyond the ShardSpec.
struct DistributedSamplingOptions {
  TORCH_ARG(bool, shuffle) = true;
  /// Evaluation: shard `[rank::world_size]` without padding or dropping, so
  /// ranks may differ by one sample and a sum over ranks counts every sample
  /// exactly once.
  TORCH_ARG(bool, evaluation) = false;
};

/// PyTorch's `DistributedSampler`: a permutation seeded by `seed + epoch`,
/// identical on every rank; padded by repeating its head (or truncated with
/// `drop_last`) to a multiple of the world size; this rank takes
/// `indices[rank::world_size]`. Call `set_epoch` before each epoch.
///
/// Example:
/// ```
/// ddpkit::data::DistributedSampling s(10, {.rank = 1, .world_size = 4});
/// s.set_epoch(3);
/// auto batch = s.next(2);  // two of this rank's 3 indices
/// ```
class DistributedSampling : public detail::IndexCursor<DistributedSampling> {
 public:
  using sampler_concept = sampler_tag;
  static constexpr bool is_distributed = true;

  explicit DistributedSampling(std::size_t size, ShardSpec spec = {},
                               DistributedSamplingOptions opts = {})
      : n_(size), spec_(spec), opts_(opts) {
    if (spec.world_size < 1 || spec.rank < 0 || spec.rank >= spec.world_size) {
      throw UsageError(
          ddpkit::detail::cat("DistributedSampling: rank ", spec.rank,
                              " is invalid for world size ", spec.world_size,
                              " (expected 0 <= rank < world_size)"));
    }
    reset();
  }

  /// Samples per rank in one epoch (the last rank may have one fewer in
  /// evaluation mode).
  std::size_t num_samples() const {
    return indices_.size();
  }
  /// Samples over all ranks in one epoch, padding included.
  std::size_t total_size() const {
    if (opts_.evaluation()) return n_;
    auto w = static_cast<std::size_t>(spec_.world_size);
    return spec_.drop_last ? (n_ / w) * w : ((n_ + w - 1) / w) * w;
  }

  void reset(c10::optional<std::size_t> new_size = c10::nullopt) {
    namespace rv = ranges::views;
    if (new_size) n_ = *new_size;
    std::vector<std::size_t> all =
        opts_.shuffle() ? detail::seeded_permutation(n_, spec_.seed + epoch_)
                        : detail::identity_permutation(n_);
    const auto total = total_size();
    std::vector<std::size_t> sized;
    if (total <= all.size()) {
      sized = all | rv::take(total) | ranges::to<std::vector>();
    } else if (!all.empty()) {
      // Pad by repeating the head, cycling when the pad exceeds n.
      sized = rv::concat(all, all | rv::cycle | rv::take(total - all.size())) |
              ranges::to<std::vector>();
    }
    indices_ = sized | rv::drop(static_cast<std::size_t>(spec_.rank)) |
               rv::stride(spec_.world_size) | ranges::to<std::vector>();
    position_ = 0;
  }
  void set_epoch(std::size_t epoch) {
    epoch_ = epoch;
    reset();
  }
  std::size_t epoch() const {
    return epoch_;
  }

 private:
  std::size_t n_;
  ShardSpec spec_;
  DistributedSamplingOptions opts_;
};

}  // namespace ddpkit::data
