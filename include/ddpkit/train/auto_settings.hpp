// SPDX-License-Identifier: BSD-3-Clause
// The settings `--precision auto` and `--memory-format auto` stand for:
// the precision by what the training device computes natively (a rule
// from measurements, docs/BENCHMARKS.md), the layout by timing the model
// (memory_format.hpp); and, for a run that resumes, what its checkpoint
// recorded (recorded_settings, checkpoint_connector.hpp), so a resumed run
// continues as it began.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include "ddpkit/detail/cpu.hpp"
#include "ddpkit/train/checkpoint_connector.hpp"
#include "ddpkit/train/options.hpp"

namespace ddpkit::train {

/// What `auto_precision` chose, and why in words.
struct PrecisionChoice {
  Precision precision = Precision::fp32;
  std::string reason;
};

/// The precision to train with on `device` when none is asked for:
/// bf16-mixed where bfloat16 is native and fast — a CUDA device whose
/// cuDNN takes bfloat16 convolutions (compute capability 8.0 on), or a CPU
/// with AMX (`amx_bf16` in /proc/cpuinfo; on one, ddpkit's DDP trained
/// ResNet-34 at 128 px 1.84-1.86x faster in bf16-mixed and 2.01-2.14x with
/// channels-last, and the flowers example's validation accuracy over 3
/// seeds was 0.628 in bf16-mixed, 0.583 in 32: docs/BENCHMARKS.md,
/// "bf16-mixed on a CPU with AMX") — else 32. A CPU with AVX512-BF16 but no AMX gets 32: bfloat16 autocast
/// measured 0.67-0.95x float32's speed on two such Intel CPUs and 1.3-1.7x
/// on an AMD one (docs/BENCHMARKS.md); ask for bf16-mixed where it pays.
/// 16-mixed is never chosen (it needs a loss scale; ask for it).
inline PrecisionChoice auto_precision(torch::Device device) {
  if (device.is_cuda()) {
    if (at::detail::getCUDAHooks().supportsBFloat16ConvolutionWithCuDNNv8()) {
      return {Precision::bf16_mixed,
              "this CUDA device computes bfloat16 natively (compute "
              "capability 8.0 or later)"};
    }
    return {Precision::fp32,
            "this CUDA device has no native bfloat16 convolutions (compute "
            "capability below 8.0, or cuDNN without them)"};
  }
  if (ddpkit::detail::cpu_has_flag("amx_bf16")) {
    return {Precision::bf16_mixed,
            "this CPU has AMX (amx_bf16), which oneDNN uses for bfloat16 "
            "convolutions and matrix products"};
  }
  if (ddpkit::detail::cpu_has_flag("avx512_bf16")) {
    return {Precision::fp32,
            "this CPU has AVX512-BF16 but no AMX; bfloat16 autocast measured "
            "0.67x to 1.7x float32's speed on such CPUs (docs/BENCHMARKS.md), "
            "so float32; --precision bf16-mixed to try it"};
  }
  return {Precision::fp32,
          "this CPU has no bfloat16 arithmetic (neither AMX nor AVX512-BF16; "
          "bfloat16 autocast measured about 25x slower than float32 on such "
          "a CPU, docs/BENCHMARKS.md)"};
}

}  // namespace ddpkit::train
