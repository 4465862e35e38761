// SPDX-License-Identifier: BSD-3-Clause
// The settings `--precision auto` and `--memory-format auto` stand for:
// the precision by what the training device computes natively (a rule
// from measurements, docs/BENCHMARKS.md), the layout by timing the model
// (memory_format.hpp); and, for a run that resumes, what its checkpoint
// recorded (CheckpointConnector::read_ahead), so a resumed run continues
// as it began. The Trainer resolves them when it is built.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/torch.h>

#include "ddpkit/detail/cpu.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/train/checkpoint_connector.hpp"
#include "ddpkit/train/memory_format.hpp"
#include "ddpkit/train/options.hpp"

namespace ddpkit::train {

// Note [auto settings]
// ~~~~~~~~~~~~~~~~~~~~
// `auto` settings: a rule for precision, a timing for the layout, the
// checkpoint on resume. `Precision::automatic` and `MemoryFormat::
// automatic` are values of TrainerOptions, from the command line's "auto"
// (the examples' default precision) to the Trainer, which resolves them
// when it is built (`resolve_auto_settings`), rank 0 deciding for all,
// before the engine exists (DDP's buckets take the layout's strides); its
// `options()` then hold the choice, and checkpoints record it. The
// precision follows a rule (`auto_precision`: bf16-mixed on CUDA with native
// bfloat16 or a CPU with AMX, else 32), not a timing, so the same command on
// the same machine trains the same way every time; the layout is timed
// (`choose_memory_format`) and therefore stays opt-in. Every checkpoint
// records its precision and memory format; a resume with `auto` takes them
// (the connector's `read_ahead` reads the checkpoint the resume will start
// from, and the resume uses that read: the file is opened once), and
// `check_resume_settings` refuses a resume whose explicit settings differ
// unless `resume_allow_changes`, as it does for the world size and seed. A
// recorded 16-mixed on a device without CUDA is refused in
// `resolve_auto_settings` itself, naming the checkpoint, since the Trainer's
// own "16-mixed needs a CUDA device" would not say where 16-mixed came from.

/// The settings recorded in the checkpoint a resume (`resume`: a path or
/// "auto", as TrainerOptions::resume; `out`: the run's folder) would start
/// from, found as the resume finds it (read_resume_source: for "auto",
/// last.pt, or last-prev.pt when last.pt is missing or cannot be read).
/// nullopt when `resume` is empty, there is no such checkpoint, or it
/// cannot be read (the Trainer's resume then says why). Never throws.
/// Reads the whole checkpoint (a tool's question; the Trainer asks its
/// connector, `read_ahead`, whose read the resume then uses).
inline std::optional<RecordedSettings> recorded_settings(
    const std::string& resume, const std::filesystem::path& out) noexcept {
  try {
    if (resume.empty()) return std::nullopt;
    std::pair<std::string, std::string> found;
    auto src = read_resume_source(
        resume, out,
        [&](const std::string& bytes, const std::filesystem::path& path) {
          found =
              TrainingState::recorded_settings(parse_checkpoint(bytes, path));
        },
        /*warn=*/false);
    if (!src) return std::nullopt;
    if (resume != "auto") {  // a named file is not checked by the reader
      found = TrainingState::recorded_settings(
          parse_checkpoint(src->bytes, src->path));
    }
    return RecordedSettings{src->path, found.first, found.second};
  } catch (...) {
    return std::nullopt;
  }
}

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
/// channels-last; at the examples' default epochs over 3 seeds the best
/// validation accuracy was 0.999 vs 1.000 (cifar10) and 0.967 vs 0.978
/// (flowers, 64 px) in bf16-mixed vs 32, within 32's range over the
/// seeds: docs/BENCHMARKS.md, "bf16-mixed on a CPU with AMX") — else 32. A CPU with AVX512-BF16 but no AMX gets 32: bfloat16 autocast
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

/// The device this rank should train on: its local GPU where CUDA is
/// available, else the CPU.
inline torch::Device default_device(const dist::Group& g) {
  if (torch::cuda::is_available()) {
    return torch::Device(torch::kCUDA,
                         static_cast<c10::DeviceIndex>(g.local_rank()));
  }
  return torch::kCPU;
}

/// Resolves `o`'s automatic precision and memory format (Precision::
/// automatic, MemoryFormat::automatic) in place, alike on every rank of
/// `group` (each rank must call it; rank 0 decides), and tells
/// `checkpoints` the result; returns why, one line per setting resolved
/// ("" when neither was automatic). The Trainer calls it when it is built,
/// before the engine exists (DDP's buckets take the layout's strides). A
/// run that resumes takes what its checkpoint recorded (read once, by
/// `checkpoints.read_ahead()`: the resume uses the same read), so it
/// continues as it began; otherwise the precision follows the hardware
/// (auto_precision, on `device`) and the layout is timed on
/// `o.layout_sample()` (choose_memory_format, at the resolved precision).
/// A UsageError when the layout must be timed and there is no sample, or
/// when a run that trained in 16-mixed resumes with an automatic precision
/// where there is no CUDA device.
template <class Model>
std::string resolve_auto_settings(TrainerOptions& o,
                                  CheckpointConnector& checkpoints,
                                  Model& model, torch::Device device,
                                  const dist::Group& group) {
  const bool precision_auto = o.precision() == Precision::automatic;
  const bool layout_auto = o.memory_format() == MemoryFormat::automatic;
  if (!precision_auto && !layout_auto) return "";
  // Rank 0 reads the checkpoint; the codes travel to every rank.
  struct Codes {
    int precision = -1;  // a Precision, -1: not auto
    int by_rule = 0;     // 1: precision from auto_precision
    int layout = -1;     // a MemoryFormat, -1: not recorded
  } codes;
  std::string from;
  bool predates = false;  // a checkpoint from before the keys existed
  std::optional<PrecisionChoice> rule;
  if (group.rank() == 0) {
    if (auto r = checkpoints.read_ahead()) {
      from = r->path.string();
      if (auto p = precision_from_name(r->precision);
          p && *p != Precision::automatic && precision_auto) {
        codes.precision = static_cast<int>(*p);
      } else if (r->precision.empty() && precision_auto) {
        // Written before checkpoints recorded it, when 32 was the default.
        codes.precision = static_cast<int>(Precision::fp32);
        predates = true;
      }
      if (auto f = memory_format_from_name(r->memory_format);
          f && *f != MemoryFormat::automatic && layout_auto) {
        codes.layout = static_cast<int>(*f);
      }
    }
    if (precision_auto && codes.precision < 0) {  // not recorded: the rule
      rule = auto_precision(device);
      codes.precision = static_cast<int>(rule->precision);
      codes.by_rule = 1;
    }
  }
  dist::CollectiveTag tag("auto settings");
  if (group.size() > 1) codes = dist::broadcast_value(group, codes, 0);
  std::string why;
  if (precision_auto) {
    if (codes.by_rule) {
      // Rank 0's choice; the reason as this rank's hardware gives it.
      if (!rule) rule = auto_precision(device);
      why = "precision auto: " + rule->reason;
    } else {
      why = predates ? "precision auto: 32, as the run being resumed trained "
                       "(" +
                           from +
                           " records no precision: it was written when 32 "
                           "was the default)"
                     : "precision auto: as the run being resumed trained (" +
                           from + ")";
    }
    o.precision(static_cast<Precision>(codes.precision));
    // A run trained in 16-mixed on a GPU, resumed where there is none: say
    // where 16-mixed came from and how to continue in another precision.
    if (!codes.by_rule && o.precision() == Precision::fp16_mixed &&
        !device.is_cuda()) {
      throw UsageError(
          "precision auto: the run being resumed (" +
          (from.empty() ? std::string("its checkpoint") : from) +
          ") trained in 16-mixed, which needs a CUDA device, but this run "
          "trains on " +
          device.str() +
          ". To continue it in another precision: --precision 32 (or "
          "bf16-mixed) --resume-allow-changes");
    }
  }
  if (layout_auto) {
    if (!why.empty()) why += "\n";
    if (codes.layout >= 0) {
      o.memory_format(static_cast<MemoryFormat>(codes.layout));
      why +=
          "memory format auto: as the run being resumed trained (" + from + ")";
    } else {
      if (!o.layout_sample().defined()) {
        throw UsageError(
            "memory_format(MemoryFormat::automatic) needs layout_sample: a "
            "batch of the training input's shape to time both layouts on "
            "(or choose contiguous or channels-last)");
      }
      const auto c = choose_memory_format(model, o.layout_sample(),
                                          o.precision(), device, group);
      o.memory_format(memory_format_of(c.format));
      why += "memory format auto: " + c.reason;
    }
  }
  checkpoints.set_settings(o.precision(), o.memory_format());
  return why;
}

}  // namespace ddpkit::train
