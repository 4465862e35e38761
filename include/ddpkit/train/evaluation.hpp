// SPDX-License-Identifier: BSD-3-Clause
// Evaluation: the task's sums over some of a dataset's samples
// (`evaluation_sums_over`), and how the ranks share the work
// (`evaluate_across`: each rank its shard and one all-reduce, or rank 0
// everything while the others wait for its broadcast through the store),
// finished into the task's metrics, identical on every rank.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/loader.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/train/run_summary.hpp"
#include "ddpkit/train/task.hpp"

namespace ddpkit::train {

// Note [Rank-0 evaluation is not bounded by the collective timeout]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Rank-0 evaluation is not bounded by the collective timeout. With
// `RankZeroEval` the other ranks used to wait in the broadcast of rank 0's
// numbers, so a validation pass longer than the collective timeout failed
// them. `dist::broadcast_when_ready` makes them wait for a store key rank 0
// sets when its numbers are ready (up to `TrainerOptions::eval_timeout`,
// default 3600 s, `--eval-timeout`), and only then broadcast. Keys come from
// a per-group counter shared with the side group, the same sequence on every
// rank. Test: 3 s of evaluation on rank 0 against a 1 s collective timeout
// passes (red with the plain broadcast: rank 1 times out); a 1 s eval timeout
// fails rank 1 naming the wait.

/// [samples, task sums...] (float64, so sums are exact enough to be
/// identical whichever rank computed them) over `indices` of `set`, batched
/// by a Loader with `transform` and `lo`, in eval mode without gradients.
/// `forward(batch)` returns the model's output and the target on the
/// device, the output in float32.
template <class Task, class Dataset, class Transform, class Forward>
torch::Tensor evaluation_sums_over(const Task& task, torch::nn::Module& module,
                                   const Dataset& set, Transform& transform,
                                   const data::LoaderOptions& lo,
                                   const std::vector<std::size_t>& indices,
                                   Forward&& forward) {
  constexpr std::size_t k = Task::num_sums;
  auto sums = torch::zeros({1 + static_cast<int64_t>(k)}, torch::kFloat64);
  if (indices.empty()) return sums;
  torch::NoGradGuard no_grad;
  const bool was_training = module.is_training();
  module.eval();
  data::Loader loader(set, transform, lo);
  auto epoch = loader.epoch(indices, 0);
  std::array<double, 1 + k> acc{};
  while (auto batch = epoch.next()) {
    const auto [out, y] = forward(*batch);
    const auto b = train::evaluation_sums(task, out, y);
    acc[0] += static_cast<double>(y.size(0));
    for (std::size_t i = 0; i < k; ++i) acc[1 + i] += b[i];
  }
  module.train(was_training);
  return torch::tensor(std::vector<double>(acc.begin(), acc.end()),
                       torch::kFloat64);
}

/// The task's metrics over `n` samples, the same on every rank of `group`
/// (null: one process). `sums_of(indices)` gives `evaluation_sums_over`'s
/// tensor for some of the samples. `sharded`: each rank sums its shard
/// (DistributedSampling in evaluation mode: every sample counted once) and
/// one all-reduce adds them; else rank 0 sums them all and broadcasts,
/// the others waiting through the store at most `timeout` (rather than the
/// collective timeout).
template <class Task, class SumsOf>
EvalResult evaluate_across(const Task& task, const dist::Group* group,
                           bool sharded, std::chrono::milliseconds timeout,
                           std::size_t n, SumsOf&& sums_of) {
  constexpr std::size_t k = Task::num_sums;
  dist::CollectiveTag tag("evaluation");
  torch::Tensor sums;
  if (group && sharded) {
    data::DistributedSampling shard(
        n, {.rank = group->rank(), .world_size = group->size()},
        data::DistributedSamplingOptions().shuffle(false).evaluation(true));
    sums = sums_of(shard.indices());
  } else if (!group || group->rank() == 0) {
    sums = sums_of(data::SequentialSampling(n).indices());
  } else {
    sums = torch::zeros({1 + static_cast<int64_t>(k)}, torch::kFloat64);
  }
  EvalResult r;
  r.local_count = static_cast<int64_t>(sums[0].item<double>());
  if (group) {
    sums = sums.to(group->device());
    if (sharded) {
      dist::all_reduce(*group, sums);
    } else {
      dist::broadcast_when_ready(*group, sums, 0, timeout,
                                 "evaluation (TrainerOptions::eval_timeout)");
    }
  }
  sums = sums.cpu().contiguous();
  const double* v = sums.data_ptr<double>();
  r.count = static_cast<int64_t>(v[0]);
  r.metrics = named_metrics<Task>(task.finish(task_sums_at<Task>(v + 1)), "");
  r.loss = r.metrics[0].second;
  return r;
}

}  // namespace ddpkit::train
