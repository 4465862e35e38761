// SPDX-License-Identifier: BSD-3-Clause
// Choosing a convolutional model's memory layout by measuring it
// (`--memory-format auto`): whether channels-last pays depends on the
// shapes, the precision and the device (on this project's CPUs it gains
// little at 64 px and more at 128 px with bfloat16), so it is timed, not
// assumed.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/inputs.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/train/options.hpp"

namespace ddpkit::train {

// Note [Channels-last is measured, not assumed]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Channels-last is measured, not assumed (`train/memory_format.hpp`, issue
// 32): `choose_memory_format` times `reps` forward + backward passes of the
// user's model on a sample batch in each layout, under the run's autocast,
// before the Trainer exists (DDP's buckets take the parameters' strides at
// construction, so the layout cannot change later), and keeps contiguous
// unless channels-last is at least 3 % faster on rank 0, whose choice every
// rank takes (one all-reduce). The model is restored (parameters, BatchNorm
// statistics, layout, gradients, the CPU generator's state, so the run draws
// what it would have drawn). Test: the restoration (red without it) and the
// margin's decision; which layout wins is this machine's business and is not
// asserted. The cifar10 and flowers examples call it for `--memory-format
// auto` (their default stays contiguous: a choice made by timing can differ
// between a run and its resume, and the resumed run would then not be
// bit-identical; test `example.cifar10-ddp-memory-format-auto`, world 2).

/// What `choose_memory_format` measured and chose.
struct MemoryFormatChoice {
  torch::MemoryFormat format = torch::MemoryFormat::Contiguous;
  /// This rank's best milliseconds of one forward + backward in each
  /// layout (0: not measured).
  double contiguous_ms = 0, channels_last_ms = 0;
  /// Why, in words ("no 4-D weights", "channels-last 0.71x contiguous's
  /// time on rank 0 (...)").
  std::string reason;
};

/// Times `reps` forward + backward passes (after one warm-up each; the
/// layouts alternated, the best pass of each kept) of `model`
/// on `sample` (a batch of the model's input, e.g. zeros of the training
/// batch's shape) in each layout — 4-D parameters, buffers and the input
/// contiguous, then channels-last — under `precision`'s autocast on
/// `device`, and picks channels-last when it took at most (1 - `margin`)
/// of contiguous's time on rank 0 (a near tie keeps the default). Every
/// rank of `group` must call it (rank 0's choice is sent to all, so every
/// rank lays out its model alike). A model without 4-D parameters is
/// contiguous without timing. Afterwards `model` is on `device` with its
/// parameters and buffers as they were (values and layout: BatchNorm's
/// running statistics restored), no gradients, and the default CPU
/// generator's state as before (CUDA's generator is not restored). Call it
/// before the
/// Trainer is built, and pass the choice as
/// `TrainerOptions::memory_format`.
template <class Model>
MemoryFormatChoice choose_memory_format(Model& model,
                                        const torch::Tensor& sample,
                                        Precision precision,
                                        torch::Device device,
                                        const dist::Group& group = {},
                                        int reps = 2, double margin = 0.03) {
  MemoryFormatChoice c;
  auto& m = parallel::as_module(model);
  m.to(device);
  if (!parallel::has_4d_tensors(m)) {
    c.reason = "no 4-D weights";
    return c;
  }
  std::vector<torch::Tensor> state;
  for (auto& p : m.parameters()) state.push_back(p);
  for (auto& b : m.buffers()) state.push_back(b);
  std::vector<torch::Tensor> saved;
  {
    torch::NoGradGuard no_grad;
    for (const auto& t : state) saved.push_back(t.detach().clone());
  }
  // Dropout would draw from the default generator: the run after the
  // probe draws what it would have drawn without it.
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  const auto rng = gen.get_state();
  const torch::Tensor x = sample.to(device);
  // One forward + backward in layout `f` (the conversion untimed), in ms.
  auto timed_pass = [&](torch::MemoryFormat f) {
    parallel::to_memory_format(m, f);
    const torch::Tensor in = x.dim() == 4 ? x.contiguous(f) : x;
    const auto t0 = std::chrono::steady_clock::now();
    torch::Tensor out;
    {
      std::optional<ddpkit::compat::AutocastGuard> autocast;
      if (precision != Precision::fp32) {
        autocast.emplace(ddpkit::compat::AutocastState{
            true, autocast_dtype(precision), device.type()});
      }
      out = data::forward_inputs(model, data::Inputs(in));
    }
    out.to(torch::kFloat).sum().backward();
    if (device.is_cuda()) torch::cuda::synchronize();
    const std::chrono::duration<double, std::milli> d =
        std::chrono::steady_clock::now() - t0;
    parallel::clear_grads(m);
    return d.count();
  };
  const auto contiguous = torch::MemoryFormat::Contiguous;
  const auto channels_last = torch::MemoryFormat::ChannelsLast;
  // A warm-up in each (kernels chosen, memory allocated), then the layouts
  // alternated, the best pass of each kept (this machine's speed drifts).
  timed_pass(contiguous);
  timed_pass(channels_last);
  c.contiguous_ms = c.channels_last_ms = std::numeric_limits<double>::max();
  for (int i = 0; i < std::max(1, reps); ++i) {
    c.contiguous_ms = std::min(c.contiguous_ms, timed_pass(contiguous));
    c.channels_last_ms =
        std::min(c.channels_last_ms, timed_pass(channels_last));
  }
  {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < state.size(); ++i) state[i].set_data(saved[i]);
  }
  gen.set_state(rng);
  const double ratio = c.channels_last_ms / c.contiguous_ms;
  int pick = ratio <= 1.0 - margin ? 1 : 0;
  double rank0_ratio = ratio;
  if (group.size() > 1) {
    pick = dist::all_reduce_value(group, group.rank() == 0 ? pick : 0,
                                  dist::Reduce::sum);
    rank0_ratio = dist::all_reduce_value(group, group.rank() == 0 ? ratio : 0.0,
                                         dist::Reduce::sum);
  }
  c.format = pick ? channels_last : contiguous;
  char buf[160];
  std::snprintf(buf, sizeof buf,
                "channels-last took %.2fx contiguous's time per forward + "
                "backward on rank 0 (the best of %d alternated passes each; "
                "chosen below %.2fx)",
                rank0_ratio, reps, 1.0 - margin);
  c.reason = buf;
  return c;
}

}  // namespace ddpkit::train
