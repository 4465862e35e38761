// SPDX-License-Identifier: BSD-3-Clause
// The settings `--precision auto` and `--memory-format auto` stand for:
// the precision by what the training device computes natively (a rule
// from measurements, docs/BENCHMARKS.md), the layout by timing the model
// (memory_format.hpp); and, for a run that resumes, what its checkpoint
// recorded, so a resumed run continues as it began.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include "ddpkit/detail/cpu.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/run_folder.hpp"

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

/// The precision and memory format a checkpoint was written with ("" for
/// each it does not record: checkpoints before them), and its path.
struct RecordedSettings {
  std::filesystem::path path;
  std::string precision, memory_format;
};

/// The settings recorded in the checkpoint a resume (`resume`: a path or
/// "auto", as TrainerOptions::resume; `out`: the run's folder) would start
/// from: for "auto", last.pt, or last-prev.pt when last.pt is missing or
/// cannot be read (as the Trainer's resume falls back). nullopt when
/// `resume` is empty, there is no such checkpoint, or it cannot be read
/// (the Trainer's resume then says why). Never throws. Reads the whole
/// checkpoint (the Trainer reads it again to resume).
inline std::optional<RecordedSettings> recorded_settings(
    const std::string& resume, const std::filesystem::path& out) noexcept {
  namespace fs = std::filesystem;
  auto read = [](const fs::path& path) -> std::optional<RecordedSettings> {
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) return std::nullopt;
    try {
      const Checkpoint c = open_checkpoint(path);
      RecordedSettings r{path, "", ""};
      c10::IValue v;
      if (c.try_read("precision", v) && v.isString()) {
        r.precision = v.toStringRef();
      }
      if (c.try_read("memory_format", v) && v.isString()) {
        r.memory_format = v.toStringRef();
      }
      return r;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  };
  try {
    if (resume.empty()) return std::nullopt;
    if (resume != "auto") return read(resume);
    if (auto r = read(last_checkpoint(out))) return r;
    return read(previous_checkpoint(out));
  } catch (...) {
    return std::nullopt;
  }
}

}  // namespace ddpkit::train
