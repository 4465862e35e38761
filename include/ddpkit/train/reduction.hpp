// SPDX-License-Identifier: BSD-3-Clause
// Evaluation strategies: who evaluates the validation set and how the
// numbers reach every rank. Both give the same loss and accuracy; every
// sample is counted exactly once.
#pragma once

#include "ddpkit/concepts.hpp"

namespace ddpkit::train {

/// Rank 0 evaluates the whole validation set and broadcasts loss and
/// accuracy (the CIFAR recipe). Simple; the other ranks wait meanwhile.
struct RankZeroEval {
  using reduction_concept = reduction_tag;
  static constexpr bool shards_evaluation = false;
  static constexpr const char* name = "rank0";
};

/// Every rank evaluates its shard (no padding duplicates) and the sums are
/// all-reduced (the flowers recipe, without its padding bias).
struct ShardedEval {
  using reduction_concept = reduction_tag;
  static constexpr bool shards_evaluation = true;
  static constexpr const char* name = "sharded";
};

}  // namespace ddpkit::train
