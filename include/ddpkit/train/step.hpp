// SPDX-License-Identifier: BSD-3-Clause
// One optimizer step of the Trainer: forward and backward over the step's
// batches (accumulating without communication until the last), the ranks'
// agreement on a signal and on finiteness, then unscale, clip and step;
// and how the Trainer calls an engine (a batch's inputs on the device, in
// the chosen layout, through the engine's declared capabilities).
#pragma once

#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/inputs.hpp"
#include "ddpkit/data/loader.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/train/callbacks.hpp"
#include "ddpkit/train/clip.hpp"
#include "ddpkit/train/nonfinite.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/precision_check.hpp"
#include "ddpkit/train/signals.hpp"
#include "ddpkit/train/step_times.hpp"

namespace ddpkit::train {

// Note [Gradient accumulation and clipping live in the Trainer's step]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Gradient accumulation and clipping live in the Trainer's step.
// `TrainerOptions::accumulate(k)` takes up to k batches from the loader (kept
// on the host), zeroes once, runs the first k-1 under the engine's `no_sync`
// and the last synchronised, then unscales (AMP), clips, steps. Each batch's
// loss is weighted by its share of the step's samples (not 1/k), so a short
// last step of an epoch, or a short last batch, still equals one batch of the
// same samples; measured: DDP world 2, batches 4+4+2 per step vs one process
// with 20 samples, 1.5e-7; with 1/k weights 0.17. The collectives started
// during a fit are the same with k = 3 as with one batch of 10 (23 and 23,
// the signal check's all-reduce per step and per epoch included; measured
// before that check existed: 17 and 17, and 23 with `no_sync` broken). Not
// combined with `uneven_inputs(join)` (refused: a rank that ran out cannot
// know which of the others' batches communicate). Clipping
// (`train::ClipOptions`: by norm of any order, or by value) runs libtorch's
// `clip_grad_norm_`/`clip_grad_value_` on the averaged gradients, so every
// rank clips the same numbers; with AMP only on steps that are taken, after
// unscaling.

/// A batch's inputs on `device`, each 4-D one in `format` (channels-last or
/// left as it is).
inline data::Inputs to_device_inputs(const data::Batch& b, torch::Device device,
                                     torch::MemoryFormat format,
                                     bool non_blocking) {
  const bool channels_last = format == torch::MemoryFormat::ChannelsLast;
  return b.inputs().map([&](const torch::Tensor& x) {
    auto on = x.to(device, non_blocking);
    if (on.dim() == 4 && channels_last) {
      on = on.contiguous(torch::MemoryFormat::ChannelsLast);
    }
    return on;
  });
}

/// The one input tensor an engine without capability::takes_inputs gets;
/// a batch of several inputs is refused for it.
inline const torch::Tensor& single_input(const data::Inputs& x) {
  if (x.size() != 1) {
    throw UsageError(ddpkit::detail::cat(
        "the parallel policy's engine takes one input tensor, and the batch "
        "has ",
        x.size(),
        ": give its forward and forward_backward a data::Inputs (and "
        "declare capability::takes_inputs)"));
  }
  return x[0];
}

/// The engine's forward with a batch's inputs.
template <class Engine>
torch::Tensor engine_forward(Engine& engine, const data::Inputs& x) {
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::takes_inputs>) {
    return engine.forward(x);
  } else {
    return engine.forward(single_input(x));
  }
}

/// The engine's forward_backward with a batch's inputs.
template <class Engine, class LossFn>
parallel::StepOutput engine_forward_backward(Engine& engine,
                                             const data::Inputs& x,
                                             const torch::Tensor& y,
                                             LossFn&& loss_fn) {
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::takes_inputs>) {
    return engine.forward_backward(x, y, std::forward<LossFn>(loss_fn));
  } else {
    return engine.forward_backward(single_input(x), y,
                                   std::forward<LossFn>(loss_fn));
  }
}

/// Clips the averaged gradients as `c` says; by norm through the engine
/// when it clips globally (ZeRO-2: the norm is taken across the shards).
template <class Engine>
void clip_step(Engine& engine, torch::nn::Module& module,
               const ClipOptions& c) {
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::clips_globally>) {
    if (c.max_norm() > 0) {
      engine.clip_grad_norm(c.max_norm(), c.norm_type());
      return;
    }
  }
  if constexpr (parallel::declares<Engine,
                                   parallel::capability::shards_parameters>) {
    // By value, elementwise: on the shards, which hold the gradients.
    clip_gradients(engine.shards(), c);
  } else {
    clip_gradients(parallel::unique_parameters(module), c);
  }
}

/// The next optimizer step's batches from `batches` (up to `accumulate`);
/// false when the epoch is done. With `join` (the engine joins), every rank
/// takes part in every round; a rank without a batch shadows the others'
/// all-reduces inside join_round (accumulate is 1 then).
template <class Engine, class Batches>
bool next_step(Engine& engine, Batches& batches, std::vector<data::Batch>& step,
               int accumulate, bool join) {
  step.clear();
  if constexpr (parallel::declares<Engine, parallel::capability::joins>) {
    if (join) {
      for (;;) {
        auto batch = batches.next();
        if (!engine.join_round(batch.has_value())) return false;
        if (batch) {
          step.push_back(std::move(*batch));
          return true;
        }
      }
    }
  }
  const auto k = static_cast<std::size_t>(accumulate);
  while (step.size() < k) {
    auto batch = batches.next();
    if (!batch) break;
    step.push_back(std::move(*batch));
  }
  return !step.empty();
}

/// What a step works with: the Trainer's parts, by reference, for one call.
template <class Engine, class Task>
struct StepContext {
  Engine& engine;
  torch::optim::Optimizer& optimizer;
  Task& task;
  const TrainerOptions& options;
  torch::Device device;
  parallel::LossScaler& scaler;
  NonFiniteGuard& nonfinite;
  const dist::Group* agreement;  ///< per-step agreement group (or none)
  int rank = 0;
  bool multi = false;   ///< several processes
  bool is_main = true;  ///< rank 0
  bool join = false;    ///< uneven_inputs(join) in this fit
};

/// Forward and backward over the step's batches (communicating on the
/// last only); the ranks agree on a pending signal and on whether the
/// step is finite; then unscale, clip and step; `BatchEnd` per batch.
/// Returns the signal every rank agreed on (0: none).
template <class Engine, class Task, class Emit>
int train_step(const StepContext<Engine, Task>& c,
               const std::vector<data::Batch>& step, FitState& s,
               const SignalFlag& signals, Emit& emit) {
  using clock = std::chrono::steady_clock;
  constexpr std::size_t num_sums = Task::num_sums;
  const TrainerOptions& o = c.options;
  // Each batch's loss counts by its share of the step's samples, so the
  // summed gradients are those of the joined batch.
  double step_samples = 0;
  for (const auto& b : step) {
    step_samples += static_cast<double>(b.target.size(0));
  }
  c.engine.zero_grad();
  // 16-mixed: float16 autocast and the loss scaler (CUDA); bf16-mixed:
  // bfloat16 autocast, nothing scaled.
  const bool amp = o.precision() == Precision::fp16_mixed;
  const bool autocast = o.precision() != Precision::fp32;
  const double scale = amp ? c.scaler.scale() : 1.0;
  struct Done {
    double loss, n;
    std::array<double, num_sums> sums;
  };
  std::vector<Done> done;
  StepTimes& times = s.times;
  const auto me = std::this_thread::get_id();
  for (std::size_t i = 0; i < step.size(); ++i) {
    const data::Inputs x = to_device_inputs(
        step[i], c.device, torch_memory_format(o.memory_format()),
        /*non_blocking=*/true);
    torch::Tensor y = step[i].target.to(c.device, /*non_blocking=*/true);
    const double n = static_cast<double>(y.size(0));
    const double weight = step.size() == 1 ? 1.0 : n / step_samples;
    // Loss as backpropagated: weighted, and scaled under AMP.
    const double factor = weight * scale;
    // The loss is taken when the forward is done: on this thread (not
    // DataParallel's other replicas), that moment splits the step.
    auto forward_end = clock::now();
    auto loss_fn = [&](const torch::Tensor& a, const torch::Tensor& b) {
      if (std::this_thread::get_id() == me) forward_end = clock::now();
      return c.task.loss(a, b);
    };
    auto run = [&] {
      if (autocast) {
        ddpkit::compat::AutocastGuard on(
            autocast_state(o.precision(), c.device));
        return engine_forward_backward(
            c.engine, x, y,
            [&](const torch::Tensor& a, const torch::Tensor& b) {
              return loss_fn(a.to(torch::kFloat32), b) * factor;
            });
      }
      if (factor == 1.0)
        return engine_forward_backward(c.engine, x, y, loss_fn);
      return engine_forward_backward(
          c.engine, x, y, [&](const torch::Tensor& a, const torch::Tensor& b) {
            return loss_fn(a, b) * factor;
          });
    };
    const auto start = clock::now();
    parallel::StepOutput out;
    if (i + 1 < step.size()) {
      [[maybe_unused]] auto local_only = c.engine.no_sync();  // sync last
      out = run();
    } else {
      out = run();
      times.grad_wait += c.engine.last_wait_seconds();
    }
    if constexpr (parallel::declares<std::remove_cvref_t<decltype(c.engine)>,
                                     parallel::capability::shards_parameters>) {
      times.gather_wait += c.engine.last_gather_seconds();
    }
    const auto end = clock::now();
    times.forward += seconds_between(start, forward_end);
    times.backward += seconds_between(forward_end, end);
    const double loss = factor == 1.0
                            ? out.loss.template item<double>()
                            : out.loss.template item<double>() / factor;
    done.push_back({loss, n, c.task.sums(out.output, y, loss)});
  }
  // The gradients are averaged now. The ranks agree on a signal and on
  // whether the step is finite (one small all-reduce);
  bool loss_finite = true;
  for (const Done& d : done) loss_finite = loss_finite && std::isfinite(d.loss);
  const bool check = o.check_finite() && !amp;
  torch::nn::Module& module = parallel::as_module(c.engine.module());
  const auto agree_start = clock::now();
  bool grads_ok = true;
  if (check) {
    if constexpr (parallel::declares<std::remove_cvref_t<decltype(c.engine)>,
                                     parallel::capability::shards_parameters>) {
      grads_ok = gradients_finite(c.engine.shards());  // sharded gradients
    } else {
      grads_ok = grads_finite(module);
    }
  }
  const auto collective_start = clock::now();
  const StepAgreement a =
      agree_on_step(c.agreement, signals, check, loss_finite, grads_ok, c.rank,
                    /*local_signal=*/!c.join);
  const auto agree_end = clock::now();
  times.agree += seconds_between(agree_start, agree_end);
  times.agree_collective += seconds_between(collective_start, agree_end);
  if (check && (a.nonfinite_rank >= 0 || a.nonfinite_grads)) {
    c.engine.zero_grad();
    c.nonfinite.skip_or_throw(s, a, done.size(), o, c.multi, c.is_main);
    return a.signal;
  }
  // unscale (AMP: one fused pass, one host sync, and the step is skipped
  // everywhere if any rank overflowed), clip, step.
  if (!amp || c.engine.unscale_and_check(c.scaler)) {
    if (o.clip().enabled()) clip_step(c.engine, module, o.clip());
    c.optimizer.step();
  }
  times.optimizer += seconds_between(agree_end, clock::now());
  for (const Done& d : done) {  // after the step, batch by batch
    s.loss_sum += d.loss * d.n;
    s.count += d.n;
    for (std::size_t k = 0; k < num_sums; ++k) s.sums[k] += d.sums[k];
    ++s.step;
    ++s.global_step;
    emit(BatchEnd{s, d.loss});
  }
  return a.signal;
}

}  // namespace ddpkit::train
