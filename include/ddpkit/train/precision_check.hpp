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
