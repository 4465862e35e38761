// SPDX-License-Identifier: BSD-3-Clause
// A precision as the Trainer applies it: the autocast state it trains and
// evaluates under, and what the device allows (16-mixed needs CUDA;
// bf16-mixed on a CPU without bfloat16 hardware is refused nothing but
// warned about). Choosing a precision (`auto`) is auto_settings.hpp's.
#pragma once

#include <cstdio>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/cpu.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/train/options.hpp"

namespace ddpkit::train {

// Note [Precision is one option, autocast is per device type]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Precision is one option, autocast is per device type.
// `TrainerOptions::precision` (`32`, `bf16-mixed`, `16-mixed`, Lightning's
// names): the mixed ones wrap each forward+backward (and evaluation's
// forward) in `compat::AutocastGuard` for the trainer's device type (CPU or
// CUDA; `AutocastState` carries it, and 1.13's separate CPU/GPU calls live in
// compat.hpp); the loss is computed on the output cast to float32. Only
// `16-mixed` uses the loss scaler and skips the finiteness check (the scaler
// has its own); `bf16-mixed` keeps `check_finite`. Parameters, gradients, DDP
// buckets and optimizer state stay float32, so the reducer, comm hooks,
// clipping, accumulation and checkpoints are unchanged.
// `memory_format(ChannelsLast)` converts 4-D parameters and buffers in
// `prepare` (`parallel::to_memory_format`, in place through `set_data`, the
// one conversion the Trainer, `choose_memory_format` and the benchmarks
// share), before the engine (and DDP's buckets, which keep each parameter's
// strides) exist, and each input at its copy to the device. Measured in
// docs/BENCHMARKS.md ("Precision and memory layout").

/// The autocast state of mixed precision `p` on `device`.
inline ddpkit::compat::AutocastState autocast_state(Precision p,
                                                    torch::Device device) {
  return {true, autocast_dtype(p), device.type()};
}

/// 16-mixed needs a CUDA device (a UsageError otherwise); bf16-mixed on a
/// CPU without bfloat16 hardware runs, with a warning (`warn`: rank 0).
inline void check_precision(Precision p, torch::Device device, bool warn) {
  using ddpkit::detail::cat;
  if (p == Precision::fp16_mixed && !device.is_cuda()) {
    throw UsageError(
        cat("precision 16-mixed needs a CUDA device, but this "
            "trainer runs on ",
            device.str(),
            " (bf16-mixed works on CPUs and CUDA; 32 is the "
            "default)"));
  }
  if (p == Precision::bf16_mixed && device.is_cpu() &&
      !ddpkit::detail::cpu_has_bf16() && warn) {
    std::fprintf(stderr,
                 "warning: precision bf16-mixed on a CPU without "
                 "AVX512-BF16 or AMX: bfloat16 is emulated there, about "
                 "25x slower than 32 (ResNet-34 on an AVX2-only AMD EPYC, "
                 "docs/BENCHMARKS.md); --precision 32 on this CPU\n");
  }
}

}  // namespace ddpkit::train
