// SPDX-License-Identifier: BSD-3-Clause
// The command line shared by ddpkit's examples and by programs modelled on
// them (CLI11, with an optional --config FILE holding the same keys). Bad
// values are a message and exit code 2. Include it explicitly: it needs
// CLI11 (Debian: libcli11-dev), which the rest of ddpkit does not.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>

#include <torch/torch.h>

#include "ddpkit/policies.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/trainer.hpp"
#include "ddpkit/version.hpp"

namespace ddpkit::cli {

/// Flags every example understands (see each example's README).
struct CommonArgs {
  std::string data;  ///< --data DIR (empty: built-in synthetic data)
  std::string out;   ///< --out DIR (default runs/<example>-<mode>)
  int epochs = 30;
  int batch_size = 64;  ///< per rank
  double lr = 1e-3;
  int world_size = 0;  ///< self-spawn this many ranks (ddp builds)
  int devices = 2;     ///< DataParallel replicas
  int zero_stage = 2;  ///< the zero build's ZeRO stage (--zero-stage)
  std::uint64_t seed = 42;
  std::string resume;                 ///< PATH or auto
  bool resume_allow_changes = false;  ///< resume with another world/seed
  bool overwrite = false;             ///< start fresh over an earlier run
  bool check_finite = true;           ///< stop on a non-finite loss/gradient
  int skip_nonfinite = 0;             ///< non-finite steps skipped first
  std::int64_t max_steps = 0;         ///< cap on steps per epoch
  int threads = 1;                    ///< intra-op threads per rank
  int workers = 2;                    ///< loader threads
  bool quiet = false;
  std::int64_t progress_every_n_steps = 0;  ///< plain progress lines (no tty)
  double progress_every_seconds = 30;       ///< plain progress lines (no tty)
  bool amp = false;                         ///< --amp: --precision 16-mixed
  /// --precision auto|32|bf16-mixed|16-mixed (auto: the Trainer resolves)
  std::string precision = "auto";
  std::string memory_format = "contiguous";  ///< --memory-format
  int accumulate = 1;                        ///< batches per optimizer step
  double clip_grad_norm = 0;          ///< clip by global L2 norm (0: off)
  double clip_grad_value = 0;         ///< clip each element (0: off)
  bool tensorboard = true;            ///< rank 0 writes OUT/tb event files
  int log_every_n_steps = 50;         ///< train/loss_step every N batches
  int keep_best = 1;                  ///< best checkpoints kept
  std::int64_t checkpoint_every = 0;  ///< mid-epoch checkpoints (batches)
  bool checkpoint_on_signal = true;   ///< SIGTERM/SIGINT: checkpoint, stop
  bool async_checkpoint = false;      ///< write checkpoints in the background
  bool sharded_checkpoint = false;    ///< every rank writes its own part
  std::string consolidate;     ///< write the checkpoint's model here, and exit
  bool meter_memory = false;   ///< meter the CPU allocator (peak_step)
  bool static_graph = false;   ///< DDP builds: DDPOptions::static_graph
  bool cuda_graphs = false;    ///< --cuda-graphs (refused: see finish_args)
  double eval_timeout = 3600;  ///< seconds others wait for rank 0's eval
  /// --monitor: what "best" means (early stopping, keep-best, best.pt,
  /// summary.json); "" : the task's own. --mode: min or max ("": the
  /// task's, or min for a *_loss).
  std::string monitor;
  std::string monitor_mode;
};

/// Adds the common flags to `app`, with `args`' current values as defaults.
/// A numeric option checked by `check`, its default shown in --help.
template <class T>
CLI::Option* add_number(CLI::App& app, const std::string& flag, T& value,
                        const std::string& help, const CLI::Validator& check) {
  return app.add_option(flag, value, help)->check(check)->capture_default_str();
}

inline void add_common_options(CLI::App& app, CommonArgs& args) {
  app.set_config("--config", "", "read these options from a TOML/INI file");
  app.set_version_flag("--version", std::string("ddpkit ") + ddpkit::version +
                                        ", libtorch " + TORCH_VERSION);
  app.add_option("--data", args.data,
                 "dataset folder (default: built-in synthetic data)");
  app.add_option("--out", args.out,
                 "output folder (default runs/<example>-<mode>)");
  add_number(app, "--epochs", args.epochs, "epochs", CLI::PositiveNumber);
  add_number(app, "--batch-size", args.batch_size, "batch size per rank",
             CLI::PositiveNumber);
  add_number(app, "--lr", args.lr, "base learning rate", CLI::PositiveNumber);
  app.add_option("--world-size", args.world_size,
                 "start this many ranks on this machine (ddp builds; otherwise "
                 "the launcher's environment decides)")
      ->check(CLI::PositiveNumber);
  add_number(app, "--devices", args.devices,
             "DataParallel replicas (dp builds)", CLI::PositiveNumber);
  app.add_option("--seed", args.seed, "seed")->capture_default_str();
  app.add_option("--resume", args.resume,
                 "checkpoint PATH, or auto (OUT/checkpoints/last.pt; "
                 "last-prev.pt if that is damaged; fresh if OUT is empty)");
  app.add_flag("--resume-allow-changes", args.resume_allow_changes,
               "resume even if the checkpoint was written with another world "
               "size, seed or training set (refused otherwise)");
  app.add_flag("--overwrite", args.overwrite,
               "start fresh in an output folder that holds an earlier run "
               "(refused otherwise); its checkpoints are removed first");
  app.add_flag("--check-finite,!--no-check-finite", args.check_finite,
               "stop at a step whose loss or gradients are not finite, before "
               "its update, naming the step and rank (on by default)");
  add_number(app, "--skip-nonfinite", args.skip_nonfinite,
             "skip up to N non-finite steps (not taken, not counted) "
             "before stopping",
             CLI::NonNegativeNumber);
  add_number(app, "--max-steps", args.max_steps,
             "cap on steps per epoch (0: none)", CLI::NonNegativeNumber);
  add_number(app, "--threads", args.threads, "intra-op threads per rank",
             CLI::PositiveNumber);
  add_number(app, "--workers", args.workers, "data loader threads",
             CLI::NonNegativeNumber);
  app.add_flag("--quiet", args.quiet, "no progress or per-epoch output");
  add_number(app, "--accumulate", args.accumulate,
             "gradient accumulation: batches per optimizer step (DDP "
             "communicates once per step)",
             CLI::PositiveNumber);
  auto* by_norm =
      add_number(app, "--clip-grad-norm", args.clip_grad_norm,
                 "clip the averaged gradients to this global L2 norm "
                 "(0: off)",
                 CLI::NonNegativeNumber);
  app.add_option("--clip-grad-value", args.clip_grad_value,
                 "clip each averaged gradient element to [-V, V] (0: off)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->excludes(by_norm);
  add_number(app, "--checkpoint-every", args.checkpoint_every,
             "also write checkpoints/last.pt every N batches within "
             "epochs; --resume auto continues there (0: epoch ends only)",
             CLI::NonNegativeNumber);
  add_number(app, "--eval-timeout", args.eval_timeout,
             "with rank-0 evaluation, how long (seconds) the other ranks "
             "wait for rank 0 to evaluate the validation set (not bounded "
             "by the collective timeout)",
             CLI::PositiveNumber);
  app.add_flag("--async-checkpoint,!--no-async-checkpoint",
               args.async_checkpoint,
               "rank 0 writes checkpoints in the background: the step "
               "blocks only while the state is copied to memory (one more "
               "copy of the model and optimizer state while a write runs)");
  app.add_flag("--sharded-checkpoint", args.sharded_checkpoint,
               "every rank writes its own part of the model and optimizer "
               "state (checkpoints/shards/); last.pt names the parts. "
               "Resumes at any world size and mode; the out folder must be "
               "shared by all hosts");
  app.add_option("--consolidate", args.consolidate,
                 "write the model's whole state dict (torch.save's format: "
                 "Python's torch.load reads it) of the checkpoint --resume "
                 "names (default OUT/checkpoints/last.pt; a sharded one's "
                 "parts are read in) to this file, and exit")
      ->type_name("FILE");
  app.add_flag("--meter-memory", args.meter_memory,
               "meter libtorch's CPU allocator: summary.json's "
               "memory_bytes_per_rank gains step_peak_allocated and "
               "peak_step (measured per step; one small heap object per "
               "CPU allocation)");
  app.add_flag("--cuda-graphs", args.cuda_graphs,
               "capture the whole training step in a CUDA graph and replay "
               "it. Not built yet: refused with exit 2 (on a machine without "
               "CUDA, naming that first)");
  app.add_flag("--checkpoint-on-signal,!--no-checkpoint-on-signal",
               args.checkpoint_on_signal,
               "on SIGTERM/SIGINT, finish the batch, write checkpoints/last.pt "
               "there and exit 128+signal (a second signal kills at once; on "
               "by default)");
  add_number(app, "--keep-best", args.keep_best,
             "keep the K best epochs' checkpoints (best-epoch-E.pt; "
             "best.pt is the best)",
             CLI::NonNegativeNumber);
  app.add_option("--monitor", args.monitor,
                 "the metric that means best for early stopping, --keep-best, "
                 "best.pt and summary.json: a metrics.jsonl column such as "
                 "val_loss (default: the task's; classification: val_acc)");
  app.add_option("--mode", args.monitor_mode,
                 "whether the monitored metric is better when lower (min) or "
                 "higher (max); default: the task's, min for a *_loss")
      ->check(CLI::IsMember({"min", "max"}));
  app.add_flag("--tensorboard,!--no-tensorboard", args.tensorboard,
               "write TensorBoard event files to OUT/tb (rank 0; on by "
               "default)");
  add_number(app, "--log-every-n-steps", args.log_every_n_steps,
             "TensorBoard: log the batch loss every N batches (0: never)",
             CLI::NonNegativeNumber);
  add_number(app, "--progress-every-n-steps", args.progress_every_n_steps,
             "when stdout is not a terminal, print a progress line every "
             "N batches (0: off)",
             CLI::NonNegativeNumber);
  add_number(app, "--progress-every-seconds", args.progress_every_seconds,
             "when stdout is not a terminal, print a progress line at "
             "least every S seconds (0: off)",
             CLI::NonNegativeNumber);
  app.add_option("--precision", args.precision,
                 "auto (bf16-mixed on a CUDA device with native bfloat16 or a "
                 "CPU with AMX, else 32; a resumed run keeps its "
                 "checkpoint's), 32 (float32), bf16-mixed (bfloat16 "
                 "autocast, CPU and CUDA) or 16-mixed (float16 autocast and "
                 "dynamic loss scaling, CUDA only); the environment "
                 "variable DDPKIT_PRECISION sets it when the flag is absent")
      ->envname("DDPKIT_PRECISION")
      ->check(CLI::IsMember({"auto", "32", "bf16-mixed", "16-mixed"}))
      ->capture_default_str();
  app.add_option("--memory-format", args.memory_format,
                 "layout of 4-D weights and inputs: contiguous (NCHW), "
                 "channels-last (NHWC), or auto (the faster of the two for "
                 "this model, batch, precision and device, timed at start; a "
                 "resumed run keeps its checkpoint's)")
      ->check(CLI::IsMember({"contiguous", "channels-last", "auto"}))
      ->capture_default_str();
  app.add_flag("--amp,!--no-amp", args.amp,
               "the same as --precision 16-mixed (CUDA only)");
}

/// `--precision`'s value as a `Precision` (`--amp`: 16-mixed; "auto":
/// Precision::automatic, which the Trainer resolves).
inline train::Precision precision_of(const CommonArgs& args) {
  if (args.amp) return train::Precision::fp16_mixed;
  return train::precision_from_name(args.precision)
      .value_or(train::Precision::automatic);
}

/// "precision 32, memory format contiguous": the settings a Trainer trains
/// with (`Trainer::options()`, automatic ones resolved), as an example's
/// first output line names them (`layout` false: precision only).
inline std::string precision_summary(const train::TrainerOptions& o,
                                     bool layout = true) {
  std::string s =
      std::string("precision ") + train::precision_name(o.precision());
  if (layout) {
    s += std::string(", memory format ") +
         train::memory_format_name(o.memory_format());
  }
  return s;
}

/// The Trainer options the common flags set (epochs, lr, output, resume,
/// steps, seed, output level, AMP, accumulation, clipping, TensorBoard,
/// best checkpoints); the example adds its own (schedule, patience, name).
inline train::TrainerOptions trainer_options(const CommonArgs& args) {
  return train::TrainerOptions()
      .epochs(args.epochs)
      .lr(args.lr)
      .out_dir(args.out)
      .resume(args.resume)
      .resume_allow_changes(args.resume_allow_changes)
      .overwrite(args.overwrite)
      .check_finite(args.check_finite)
      .skip_nonfinite(args.skip_nonfinite)
      .max_steps(args.max_steps)
      .seed(args.seed)
      .verbose(!args.quiet)
      .progress(train::ProgressOptions()
                    .every_n_steps(args.progress_every_n_steps)
                    .every_seconds(args.progress_every_seconds))
      .precision(precision_of(args))
      .memory_format(train::memory_format_from_name(args.memory_format)
                         .value_or(train::MemoryFormat::contiguous))
      .accumulate(args.accumulate)
      .clip(train::ClipOptions()
                .max_norm(args.clip_grad_norm)
                .max_value(args.clip_grad_value))
      .tensorboard(args.tensorboard)
      .log_every_n_steps(args.log_every_n_steps)
      .keep_best(args.keep_best)
      .checkpoint_every_n_steps(args.checkpoint_every)
      .checkpoint_on_signal(args.checkpoint_on_signal)
      .async_checkpoints(args.async_checkpoint)
      .sharded_checkpoints(args.sharded_checkpoint)
      .eval_timeout(args.eval_timeout)
      .monitor(args.monitor)
      .monitor_mode(args.monitor_mode);
}

/// Whether `Mode`'s options choose a ZeRO stage (parallel::ZeRO2).
template <class Mode>
constexpr bool has_zero_stage =
    requires(typename Mode::options_type o) { o.stage(1); };

/// Whether `Mode`'s options have DDP's static_graph.
template <class Mode>
constexpr bool has_static_graph =
    requires(typename Mode::options_type o) { o.static_graph(true); };

/// The options only some modes have: `--zero-stage 1|2|3` in a ZeRO build,
/// `--static-graph` in a DDP build.
template <class Mode>
void add_mode_options(CLI::App& app, CommonArgs& args) {
  if constexpr (has_static_graph<Mode>) {
    app.add_flag("--static-graph", args.static_graph,
                 "DDP's static_graph: the graph is the same every step, "
                 "recorded in the first (which reduces its gradients after "
                 "backward); allows a module run twice under activation "
                 "checkpointing");
  }
  if constexpr (has_zero_stage<Mode>) {
    app.add_option("--zero-stage", args.zero_stage,
                   "ZeRO stage: 1 shards the optimizer state across "
                   "processes, 2 the gradients too, 3 the parameters too "
                   "(each nn::Unit of the model gathered for its call)")
        ->check(CLI::IsMember({1, 2, 3}))
        ->capture_default_str();
  }
}

/// Calls `f.template operator()<Policy>()` with the parallel policy the
/// command line chose: in a build whose `Mode` takes a ZeRO stage
/// (parallel::ZeRO2), `--zero-stage 3` runs parallel::ZeRO3 (a separate
/// policy: the parameters sharded by unit); otherwise `Mode`. Returns what
/// `f` returns.
template <class Mode, class F>
decltype(auto) with_policy(const CommonArgs& args, F&& f) {
  if constexpr (has_zero_stage<Mode>) {
    if (args.zero_stage == 3) {
      return std::forward<F>(f).template operator()<parallel::ZeRO3>();
    }
  }
  return std::forward<F>(f).template operator()<Mode>();
}

/// `Mode`'s options as the command line chose them (DataParallel's
/// replicas, the ZeRO stage).
template <class Mode>
typename Mode::options_type mode_options(const CommonArgs& args) {
  auto o = parallel_options<Mode>(args.devices);
  if constexpr (has_zero_stage<Mode>) o.stage(args.zero_stage);
  if constexpr (has_static_graph<Mode>) o.static_graph(args.static_graph);
  return o;
}

/// The mode's name as summary.json gives it ("zero1" for a ZeRO build at
/// stage 1, "zero3" at stage 3).
template <class Mode>
std::string mode_name(const CommonArgs& args) {
  if constexpr (has_zero_stage<Mode>) {
    if (args.zero_stage == 3) return parallel::ZeRO3::name;
    return Mode::name_of_stage(args.zero_stage);
  }
  return Mode::name;
}

/// Parses; on a bad value prints the reason and returns 2, on --help
/// prints the help and returns 0; nullopt means go on.
inline std::optional<int> parse(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "error: %s\nRun with --help for the options.\n",
                 e.what());
    return 2;
  }
  return std::nullopt;
}

/// Checks what the parallel policy `Mode` can do with `args` (only DDP
/// builds spawn ranks) and fills in the default output folder
/// `runs/<example>-<mode>`. Returns 2 after a message, or nullopt.
template <class Mode>
std::optional<int> finish_args(CommonArgs& args, const std::string& example) {
  if (!Mode::is_multi_process && args.world_size > 1) {
    std::fprintf(stderr,
                 "error: --world-size %d needs the ddp build (%s-ddp); this is "
                 "the %s build\n",
                 args.world_size, example.c_str(), Mode::name);
    return 2;
  }
  if (args.amp && args.precision == "auto") args.precision = "16-mixed";
  if (args.amp && args.precision != "32" && args.precision != "16-mixed") {
    std::fprintf(stderr,
                 "error: --amp means --precision 16-mixed, but --precision "
                 "is %s\n",
                 args.precision.c_str());
    return 2;
  }
  if (precision_of(args) == train::Precision::fp16_mixed &&
      !torch::cuda::is_available()) {
    std::fprintf(stderr,
                 "error: %s needs a CUDA device, and none is visible "
                 "(torch::cuda::is_available() is false); on a CPU use "
                 "--precision bf16-mixed\n",
                 args.amp ? "--amp" : "--precision 16-mixed");
    return 2;
  }
  if (args.cuda_graphs) {
    if (!torch::cuda::is_available()) {
      std::fprintf(stderr,
                   "error: --cuda-graphs captures the training step in a CUDA "
                   "graph and needs a CUDA device, and none is visible "
                   "(torch::cuda::is_available() is false)\n");
    } else {
      std::fprintf(stderr,
                   "error: --cuda-graphs: whole-step CUDA graph capture is "
                   "not built yet in this version of ddpkit; run without it "
                   "(train::check_capture_safety lists what in a step "
                   "would stop a capture)\n");
    }
    return 2;
  }
  if (args.out.empty()) args.out = "runs/" + example + "-" + Mode::name;
  if (!args.consolidate.empty()) {
    const std::filesystem::path from =
        args.resume.empty() || args.resume == "auto"
            ? std::filesystem::path(args.out) / "checkpoints" / "last.pt"
            : std::filesystem::path(args.resume);
    try {
      train::consolidate_state_dict(from, args.consolidate);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "error: --consolidate: %s\n", e.what());
      return 2;
    }
    std::printf("wrote the model's state dict of %s to %s\n", from.c_str(),
                args.consolidate.c_str());
    return 0;
  }
  // Before any tensor of the run is made (each rank parses again).
  if (args.meter_memory) train::meter_cpu_memory();
  return std::nullopt;
}

}  // namespace ddpkit::cli
