// SPDX-License-Identifier: BSD-3-Clause
// Each rank's memory at the end of a fit (FitResult::Memory, summary.json):
// what the engine and optimizer account for (optimizer state, gradients,
// the parameters' gather buffer) beside what the kernel and the allocator
// measured during the steps (step_memory.hpp: Note [Measured memory]),
// gathered from every rank.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/process_memory.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/zero.hpp"
#include "ddpkit/train/run_summary.hpp"
#include "ddpkit/train/step_memory.hpp"

namespace ddpkit::train {

// Note [Memory is counted from the tensors, and measured by the kernel]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Memory is counted from the tensors, and measured by the kernel
// (`FitResult::memory`, summary.json's `memory_bytes_per_rank`, gathered from
// every rank at the fit's end). Counted by ddpkit: `parameters` — the bytes
// of parameters a rank keeps between steps (each tensor once; under ZeRO3
// its shards, the units' whole parameters being released after use);
// `optimizer_state` — the
// bytes of the tensors in the optimizer's state (`optimizer_state_bytes`:
// SGD's momentum, Adam's and AdamW's moments, RMSprop's, Adagrad's; a
// ShardedOptimizer's shard); `gradients_peak` — the reducer's largest
// simultaneous bytes of bucket buffers plus gradients held outside them,
// counted at each allocation and at each step's start (not counted: the one
// gradient autograd makes before its ZeRO-2 bucket exists, copied at once);
// `parameter_gather` — the largest buffer the parameters were gathered
// through (the shared gather buffer, or a chunk). The same accounting in a
// table for the ZeRO paper's 7.5B-parameter model is in docs/BENCHMARKS.md.
// Measured outside that code (`train/step_memory.hpp`,
// `detail/process_memory.hpp`, Note [Measured memory]): around every training
// step the kernel's resident high-water mark is reset
// (`/proc/self/clear_refs`) and read after (`step_peak_resident`, the largest
// over the steps; `step_peaks_per_step` false where the kernel refuses the
// reset, and the figure is then the process's peak since start);
// `step_peak_proportional` counts the shared-memory pages (buckets, the
// gather buffer) by each rank's share (Pss_Shmem), so DDP's shared buckets
// are not counted once per rank and ZeRO is not flattered; on CUDA
// `step_peak_device_allocated` is the caching allocator's peak.
// Where tensors get their memory, a metered CPU allocator wraps libtorch's
// (detail/metered_allocator.hpp: bytes in use, their peak, an optional
// cap). Installed (meter_cpu_memory, the examples' --meter-memory), it
// gives `step_peak_allocated`, reset at each step's start and read at its
// end, and `peak_step`, that plus the shared segments by the rank's share
// (Pss_Shmem): the kernel's resident figure would not show ZeRO-3's saving,
// as glibc keeps freed memory resident. A test caps it to show a model
// that only ZeRO-3 can train.
// `example.flowers-resnet34-zero-memory` checks that, over the ranks, the
// saving the kernel measures against DDP is at least 3/4 of the saving
// counted (measured 117-144 %; buckets counted as freed but kept alive
// measured -13 %: red).

/// Each rank's memory, measured now; with `group` (several processes)
/// every rank calls it at the same point and all receive every rank's.
template <class Engine>
FitResult::Memory measure_memory(Engine& engine,
                                 const torch::optim::Optimizer* optimizer,
                                 const StepMemory& steps,
                                 const dist::Group* group) {
  double state = 0;
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::shards_optimizer>) {
    state = static_cast<double>(engine.optimizer_state_bytes());
  } else if (optimizer) {
    state = static_cast<double>(parallel::optimizer_state_bytes(*optimizer));
  }
  double params = 0;
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::shards_parameters>) {
    // Its shards: the model's own tensors are released between steps.
    params = static_cast<double>(engine.shard_bytes());
  } else {
    for (const auto& p :
         parallel::unique_parameters(parallel::as_module(engine.module()))) {
      params += static_cast<double>(p.numel() * p.element_size());
    }
  }
  double grads = 0, gather = 0;
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::measures_gradients>) {
    grads = static_cast<double>(engine.peak_gradient_bytes());
  } else {
    grads = static_cast<double>(
        parallel::held_gradient_bytes(parallel::as_module(engine.module())));
  }
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::shards_optimizer>) {
    gather = static_cast<double>(engine.gather_buffer_bytes());
  }
  // Measured outside the code above (Note [Measured memory]).
  const auto resident = static_cast<double>(steps.peak_resident());
  const auto proportional = static_cast<double>(steps.peak_proportional());
  const auto device = static_cast<double>(steps.peak_device());
  // The allocator's step peak (private tensor memory) plus the shared
  // segments by this rank's share: the two never count the same bytes
  // (the segments are mapped, not allocated through libtorch).
  const auto allocated = static_cast<double>(steps.peak_allocated());
  const auto shared =
      static_cast<double>(ddpkit::detail::ProcessMemory::shared_proportional());
  FitResult::Memory m;
  m.peaks_per_step = steps.per_step();
  m.metered = StepMemory::metered();
  std::vector<double> mine{state,    grads,        gather,
                           resident, proportional, device,
                           params,   allocated,    allocated + shared};
  std::vector<torch::Tensor> all{torch::tensor(mine, torch::kFloat64)};
  if (group) {
    dist::CollectiveTag tag("memory report");
    all = dist::all_gather(*group, all[0].to(group->device()));
  }
  for (const auto& t : all) {
    const auto v = t.cpu();
    const auto at = [&](int64_t i) { return v[i].template item<double>(); };
    m.optimizer_state.push_back(at(0));
    m.gradients_peak.push_back(at(1));
    m.parameter_gather.push_back(at(2));
    m.peak_resident.push_back(at(3));
    m.peak_proportional.push_back(at(4));
    m.device_peak.push_back(at(5));
    m.parameters.push_back(at(6));
    m.peak_allocated.push_back(at(7));
    m.peak_step.push_back(at(8));
  }
  return m;
}

}  // namespace ddpkit::train
