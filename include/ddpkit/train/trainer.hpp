// SPDX-License-Identifier: BSD-3-Clause
// Trainer<Model, ParallelPolicy, SamplerPolicy, BNPolicy, LRScaling,
// Reduction>: the training loop of both reference recipes, composed at
// compile time. `fit` is a short loop over events; what happens at them
// (early stopping, checkpoints, progress, metrics files, TensorBoard, the
// user's own) are callbacks (callbacks.hpp).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/loader.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/scope_guard.hpp"
#include "ddpkit/detail/seed.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/nn/bn_policies.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/train/auto_settings.hpp"
#include "ddpkit/train/callbacks.hpp"
#include "ddpkit/train/checkpoint_connector.hpp"
#include "ddpkit/train/epoch_end.hpp"
#include "ddpkit/train/evaluation.hpp"
#include "ddpkit/train/every_rank.hpp"
#include "ddpkit/train/lr.hpp"
#include "ddpkit/train/memory_report.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/nonfinite.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/precision_check.hpp"
#include "ddpkit/train/reduction.hpp"
#include "ddpkit/train/run_folder.hpp"
#include "ddpkit/train/run_summary.hpp"
#include "ddpkit/train/signals.hpp"
#include "ddpkit/train/step.hpp"
#include "ddpkit/train/step_memory.hpp"
#include "ddpkit/train/step_times.hpp"
#include "ddpkit/train/task.hpp"
#include "ddpkit/train/tensorboard.hpp"
#include "ddpkit/version.hpp"

namespace ddpkit::train {

/// The loss scaler lives with the engines that unscale (parallel/); the
/// Trainer's name for it stays.
using parallel::LossScaler;

/// Makes the optimizer over the model's parameters (after they are on the
/// device and, for DDP, broadcast from rank 0).
using parallel::OptimizerFactory;

/// Trains `Model` the way the policies say.
///
/// Example:
/// ```
/// using Mode = ddpkit::DDP;  // or ddpkit::SingleDevice, ddpkit::DataParallel
/// ddpkit::Trainer<ResNet34, Mode, ddpkit::DistributedSampling, ddpkit::SyncBN,
///                 ddpkit::LinearScaling, ddpkit::ShardedEval>
///     trainer(model, make_sgd, opts, group);
/// auto result = trainer.fit(train_set, val_set, train_tf, eval_tf,
/// loader_opts);
/// ```
/// A wrong combination is a compile error naming the concept:
/// `sampler_matches_parallel_policy` (DistributedSampling with SingleDevice,
/// or a non-sharding sampler with DDP) or `bn_matches_parallel_policy`
/// (SyncBN without several processes). A policy of your own whose engine
/// lacks part of the contract fails `parallel_engine`, naming the piece.
template <class Model, class Parallel, class Sampler, class BN,
          class LRScaling = NoScaling, class Reduction = RankZeroEval,
          class Task = Classification>
  requires trainable_model<Model> && parallel_policy<Parallel> &&
           parallel_engine<Parallel, Model, dist::Group> &&
           sampler_policy<Sampler> && bn_policy<BN> &&
           lr_scaling_policy<LRScaling> && reduction_policy<Reduction> &&
           task_policy<Task> &&
           sampler_matches_parallel_policy<Parallel, Sampler> &&
           bn_matches_parallel_policy<Parallel, BN>
class Trainer : private CheckpointWriter {
  static_assert(Task::metrics.size() > 0 && Task::metrics[0] == "loss",
                "a task's first metric is its mean loss, named \"loss\"");

 public:
  using model_type = Model;
  using parallel_type = Parallel;
  using sampler_type = Sampler;
  using task_type = Task;
  using engine_type = typename Parallel::template engine<Model>;
  static constexpr std::size_t num_sums = Task::num_sums;

  Trainer(Model model, OptimizerFactory make_optimizer, TrainerOptions options,
          dist::Group group = {},
          typename Parallel::options_type parallel_options = {},
          std::optional<torch::Device> device = std::nullopt, Task task = {})
      : group_(std::move(group)),
        options_(std::move(options)),
        task_(std::move(task)),
        monitor_(resolve_monitor<Task>(options_)),
        device_(device.value_or(default_device(group_))),
        checkpoints_(group_, options_, rank(), world(), metric_columns<Task>(),
                     num_sums),
        auto_reason_(resolve_auto_settings(options_, checkpoints_, model,
                                           device_, group_)),
        engine_(prepare(std::move(model), group_, options_), group_,
                std::move(parallel_options), device_) {
    check_options(options_);
    check_precision(options_.precision(), device_, is_main());
    // ZeRO's engine builds the optimizer over this rank's shard.
    if constexpr (parallel::declares<engine_type,
                                     parallel::capability::shards_optimizer>) {
      optimizer_ = engine_.make_optimizer(make_optimizer);
    } else {
      // Each tensor once (tied weights: see unique_parameters).
      optimizer_ = make_optimizer(
          parallel::unique_parameters(parallel::as_module(engine_.module())));
    }
    if (!optimizer_) throw UsageError("the optimizer factory returned nothing");
    has_batch_norm_ =
        parallel::has_batch_norm(parallel::as_module(engine_.module()));
    checkpoints_.set_target(
        {&parallel::as_module(engine_.module()), optimizer_.get(), &scaler_});
  }

  /// Trains for `options.epochs()` epochs (from a checkpoint when resuming),
  /// evaluating on `val` after each; rank 0 writes metrics, checkpoints and
  /// the summary. `callbacks` (see callbacks.hpp) get every event in the
  /// order given, after EarlyStopping and before the other ready-made ones
  /// (so a checkpoint holds their state after the event); each must
  /// satisfy `callback`. Only rank 0's `state()` is saved, and every rank
  /// loads it on resume.
  /// Throws `Interrupted` after a checkpoint when SIGTERM/SIGINT arrives
  /// (`TrainerOptions::checkpoint_on_signal`).
  template <class Dataset, class TrainTransform, class EvalTransform,
            class... Callbacks>
    requires callbacks<Callbacks...> &&
             (state_complete<std::remove_cvref_t<Callbacks>> && ...)
  FitResult fit(const Dataset& train, const Dataset& val,
                TrainTransform train_transform, EvalTransform eval_transform,
                data::LoaderOptions lo, Callbacks&&... callbacks) {
    const auto fit_start = std::chrono::steady_clock::now();
    lo.seed(options_.seed()).rank(rank());
    // Early stopping first, then the user's callbacks, then the rest of
    // the ready-made ones: the checkpoint written at a StepEnd or EpochEnd
    // holds what every callback (and the generator) has after it.
    EarlyStopping early(options_.patience());
    std::tuple after_user{
        ModelCheckpoint(ModelCheckpointOptions()
                            .enabled(options_.checkpoints())
                            .keep_best(options_.keep_best())
                            .every_n_steps(options_.checkpoint_every_n_steps())
                            .weights_pattern(options_.weights_pattern())),
        MetricsFiles{},
        TensorBoardLog(options_.tensorboard(), options_.log_every_n_steps(),
                       hparams_markdown(run_info(), lo.batch_size())),
        ProgressDisplay(is_main() && options_.verbose(), options_.progress(),
                        std::string(sample_unit<Task>()))};
    auto emit = [&](const auto& event) {
      std::apply(
          [&](auto&... b) { train::emit(event, early, callbacks..., b...); },
          after_user);
      checkpoints_.launch();  // what the event queued (asynchronous only)
    };
    FitScope scope(*this, callbacks...);
    FitState& s = scope.state;
    begin_fit(s, train.size(), CheckpointConnector::data_fingerprint(train));
    SignalFlag signals(options_.checkpoint_on_signal());
    // A signal during a hang: the liveness watch ends the rank (the loop
    // cannot reach its step boundary), saying which checkpoint a resume
    // uses.
    if (multi() && signals.armed()) {
      group_.watch_interrupt([&signals] { return signals.pending(); },
                             [out = std::filesystem::path(options_.out_dir())] {
                               return resume_hint(out);
                             });
    }
    ddpkit::detail::ScopeExit unwatch([&] { group_.watch_interrupt({}, {}); });
    auto sampler =
        training_sampler<Sampler>(options_, train.size(), rank(), s.world);
    data::Loader loader(train, train_transform, lo);
    emit(FitBegin{s});
    for (; s.epoch < s.epochs && !s.stop; ++s.epoch) {
      auto batches = begin_epoch(s, sampler, loader, lo);
      emit(EpochBegin{s});
      checkpoints_.restore_generator();  // resuming mid-epoch: as it was
      std::vector<data::Batch> step;     // one optimizer step's batches
      auto asked = clock::now();         // for the next step's batches
      while (next_step(engine_, batches, step, options_.accumulate(), join_)) {
        const auto got = clock::now();
        s.times.data += seconds_between(asked, got);
        step_memory_.begin();
        const int sig = train_step(step_context(), step, s, signals, emit);
        step_memory_.end();
        emit(StepEnd{s});
        const auto done = clock::now();
        s.times.total += seconds_between(asked, done);
        ++s.times.steps;
        asked = done;
        if (sig != 0) {
          stop_on_signal(s, sig, /*mid_epoch=*/true, emit);
        }
      }
      const EpochMetrics m =
          end_epoch(s, task_, agreement_group(), rank(),
                    [&] { return evaluate(val, eval_transform, lo); });
      if (options_.checkpoints() ||
          (shards_parameters && !options_.weights_pattern().empty())) {
        prepare_checkpoint();  // (sharded parameters: whole for the weights)
      }
      emit(EpochEnd{s, m});
      const bool stopping = s.stop;
      const int sig = agree_at_epoch_end(agreement_group(), signals, s.stop);
      if (s.stop && !stopping) {
        s.stop_reason = "stopped: a callback on another rank asked to";
      }
      if (sig != 0) stop_on_signal(s, sig, /*mid_epoch=*/false, emit);
    }
    emit(FitEnd{s});
    return finish_fit(s, fit_start);
  }

  /// `fit` for datasets whose `get(i)` returns one sample (`data::Example`,
  /// a pair or a tuple of input and target tensors): each batch is the
  /// samples stacked (`data::Stack`). For another collate step (padding,
  /// say) pass it as both transforms of the five-argument `fit`.
  template <class Dataset, class... Callbacks>
    requires data::sample_dataset<Dataset> && callbacks<Callbacks...> &&
             (state_complete<std::remove_cvref_t<Callbacks>> && ...)
  FitResult fit(const Dataset& train, const Dataset& val,
                data::LoaderOptions lo, Callbacks&&... callbacks) {
    return fit(train, val, data::Stack{}, data::Stack{}, std::move(lo),
               std::forward<Callbacks>(callbacks)...);
  }

  /// `evaluate` for a dataset of samples (see the three-argument `fit`).
  template <class Dataset>
    requires data::sample_dataset<Dataset>
  EvalResult evaluate(const Dataset& set, data::LoaderOptions lo) {
    return evaluate(set, data::Stack{}, std::move(lo));
  }

  /// The task's metrics over `set`, computed as `Reduction` says and
  /// identical on every rank (evaluation.hpp).
  template <class Dataset, class EvalTransform>
  EvalResult evaluate(const Dataset& set, EvalTransform eval_transform,
                      data::LoaderOptions lo) {
    lo.drop_last(false);
    lo.rank(group_.rank());
    // Sharded parameters: whole for the pass (the ranks' shards of the set
    // may differ by a batch, and rank 0 may evaluate alone).
    [[maybe_unused]] auto whole = whole_parameters();
    auto forward = [&](const data::Batch& batch) {
      const data::Inputs x = to_device_inputs(
          batch, device_, torch_memory_format(options_.memory_format()),
          /*non_blocking=*/false);
      torch::Tensor y = batch.target.to(device_);
      std::optional<ddpkit::compat::AutocastGuard> mixed;
      if (options_.precision() != Precision::fp32) {
        mixed.emplace(autocast_state(options_.precision(), device_));
      }
      torch::Tensor out = engine_forward(engine_, x);
      if (mixed) {
        mixed.reset();  // the task's sums in float32
        if (out.is_floating_point()) out = out.to(torch::kFloat32);
      }
      return std::pair{out, y};
    };
    return evaluate_across(
        task_, multi() ? &group_ : nullptr, Reduction::shards_evaluation,
        std::chrono::milliseconds(
            static_cast<int64_t>(options_.eval_timeout() * 1000)),
        set.size(), [&](const std::vector<std::size_t>& indices) {
          return evaluation_sums_over(
              task_, parallel::as_module(engine_.module()), set, eval_transform,
              lo, indices, forward);
        });
  }

  /// An engine whose parameters are sharded (ZeRO3).
  static constexpr bool shards_parameters =
      parallel::declares<engine_type, parallel::capability::shards_parameters>;

  /// Every rank at once (a collective under ZeRO3): while the returned
  /// guard lives, `model()` holds every parameter whole, to be read (a
  /// sample, an export) outside `fit` and `evaluate`, which do this
  /// themselves. `write_back`: changes made to them under the guard are
  /// kept (each rank's part copied into its shards). Null and free under
  /// an engine that does not shard the parameters.
  auto whole_parameters(bool write_back = false) {
    if constexpr (shards_parameters) {
      return engine_.whole_parameters(write_back);
    } else {
      (void)write_back;
      return std::unique_ptr<int>();
    }
  }

  Model& model() {
    return engine_.module();
  }
  engine_type& engine() {
    return engine_;
  }
  torch::optim::Optimizer& optimizer() {
    return *optimizer_;
  }
  const dist::Group& group() const {
    return group_;
  }
  /// The world size the LR is scaled for (processes for DDP, else 1).
  int lr_world_size() const {
    return world();
  }
  bool is_main() const {
    return group_.rank() == 0;
  }
  /// The options as training uses them: automatic precision and layout
  /// resolved (see `auto_reason`).
  const TrainerOptions& options() const {
    return options_;
  }
  /// Why automatic settings resolved as they did ("" when none was).
  const std::string& auto_reason() const {
    return auto_reason_;
  }

  /// Rank 0 writes OUT/summary.json (fit does this itself; call it again to
  /// add a test-set result).
  void write_summary(const FitResult& r, const EvalResult* test) const {
    std::optional<double> bytes;
    if constexpr (parallel::declares<engine_type,
                                     parallel::capability::counts_traffic>) {
      bytes = static_cast<double>(engine_.last_step_bytes());
    }
    train::write_summary(run_info(), r, test, bytes);
  }

  /// What this run is, for summary.json and the hparams table.
  RunInfo run_info() const {
    RunInfo info;
    info.mode = Parallel::name;
    if constexpr (parallel::declares<engine_type,
                                     parallel::capability::names_mode>) {
      info.mode = engine_.mode_name();
    }
    info.sampler = Parallel::is_multi_process ? "distributed" : "local";
    // The BN policy means nothing for a model without batch norm.
    info.bn = has_batch_norm_ ? std::string(BN::name) : std::string("none");
    info.lr_scaling = LRScaling::name;
    info.evaluation = Reduction::name;
    info.task = Task::name;
    info.world_size = world();
    if constexpr (Parallel::is_multi_process) {
      info.transport = group_.transport();
      info.hosts = group_.hosts();
    }
    if constexpr (parallel::declares<engine_type,
                                     parallel::capability::names_comm>) {
      info.comm = engine_.comm_name();
    }
    info.monitor = monitor_;
    info.options = options_;
    return info;
  }

 private:
  using clock = std::chrono::steady_clock;
  static constexpr bool can_join =
      parallel::declares<engine_type, parallel::capability::joins>;

  /// One fit's state, and the Trainer's view of it and of the callbacks'
  /// states, for as long as the fit runs (exceptions included).
  struct FitScope {
    template <class... Cs>
    FitScope(Trainer& t, Cs&... cs) : trainer(t) {
      std::vector<CallbackState> states;  // taken only if all are valid
      (add_callback_state(states, cs), ...);
      t.checkpoints_.set_callbacks(std::move(states));
      t.fit_ = &state;
    }
    ~FitScope() {
      trainer.checkpoints_.finish_quietly();  // written whole, even if failing
      trainer.fit_ = nullptr;
      trainer.checkpoints_.set_callbacks({});
    }
    FitScope(const FitScope&) = delete;
    FitScope& operator=(const FitScope&) = delete;

    Trainer& trainer;
    FitState state;
  };

  /// This process's rank and the ranks training together (0 and 1 unless
  /// the policy runs several processes).
  int rank() const {
    return Parallel::is_multi_process ? group_.rank() : 0;
  }
  int world() const {
    return Parallel::is_multi_process ? group_.size() : 1;
  }
  bool multi() const {
    return Parallel::is_multi_process && group_.size() > 1;
  }

  /// The group the ranks agree through at step and epoch ends: none with
  /// one process, nor per step under join (ranks step unevenly there).
  const dist::Group* agreement_group(bool per_step = false) const {
    if (!multi() || (per_step && join_)) return nullptr;
    return &group_;
  }

  /// Checks what must hold before training (a writable output folder, the
  /// same dataset on every rank) and resumes.
  void begin_fit(FitState& s, std::size_t train_size,
                 const std::string& fingerprint) {
    namespace fs = std::filesystem;
    using ddpkit::detail::cat;
    s.out = options_.out_dir();
    s.is_main = is_main();
    s.world = world();
    s.epochs = options_.epochs();
    s.module = &parallel::as_module(engine_.module());
    s.checkpoints = this;
    s.monitor = monitor_;
    // Rank 0 makes, locks and checks OUT; every rank fails alike if not.
    on_main_or_fail(agreement_group(), is_main(), [&] {
      if (!run_lock_.held()) run_lock_ = prepare_output_folder(s.out, options_);
    });
    // A failed collective or SIGUSR1 writes OUT/flight/rank-K.json (unless
    // DDPKIT_FLIGHT_DIR chose another folder); an earlier run's record of
    // this rank goes first, so ddpkit-doctor never reads a stale one.
    if (multi() && !s.out.empty() && group_.flight_recorder() &&
        !std::getenv("DDPKIT_FLIGHT_DIR")) {
      group_.set_flight_dir(prepare_flight_folder(s.out, rank()));
    }
    join_ = multi() && options_.uneven_inputs() == UnevenInputs::join;
    if (join_ && !can_join) {
      throw UsageError(
          "uneven_inputs(join) needs a parallel policy whose engine has "
          "join_round (DDP's has); this policy's engine has none");
    }
    // Ranks holding different datasets would deadlock later: say so now.
    require_same_on_every_rank(
        agreement_group(), train_size, [](int r, auto mine, auto first) {
          return cat("rank ", r, " has ", mine,
                     " training samples but rank 0 has ", first,
                     "; every rank must read the same dataset");
        });
    checkpoints_.begin(train_size, fingerprint);
    {
      // Sharded parameters: loaded whole, each rank keeping its part.
      [[maybe_unused]] auto whole = whole_parameters(/*write_back=*/true);
      s.epoch = checkpoints_.resume(s);
    }
    s.last_checkpoint_step = s.global_step;
  }

  /// Sets the epoch's lr and seeds, and starts its batches (where a
  /// mid-epoch checkpoint stopped, when resuming from one).
  template <class Loader>
  auto begin_epoch(FitState& s, Sampler& sampler, const Loader& loader,
                   const data::LoaderOptions& lo) {
    s.epoch_start = clock::now();
    s.wait_at_epoch_start = s.times.waited();
    s.lr = lr_at<LRScaling>(options_.lr(), s.world, options_.schedule(),
                            s.epoch, s.epochs);
    set_lr(*optimizer_, s.lr);
    // Dropout and other in-model randomness: a function of (seed, epoch,
    // rank) alone, so a resumed run draws exactly what the original did.
    torch::manual_seed(ddpkit::detail::mix_seed(
        {options_.seed(), static_cast<std::uint64_t>(s.epoch),
         static_cast<std::uint64_t>(rank())}));
    sampler.set_epoch(static_cast<std::size_t>(s.epoch));
    std::vector<std::size_t> indices = sampler.indices();
    if (options_.max_steps() > 0) {
      auto cap =
          static_cast<std::size_t>(options_.max_steps()) * lo.batch_size();
      if (indices.size() > cap) indices.resize(cap);
    }
    s.module->train();
    const std::size_t first = checkpoints_.batches_done();
    auto batches =
        loader.epoch(indices, static_cast<std::size_t>(s.epoch), first);
    if (!join_) {
      // Uneven inputs would leave the ranks with more batches waiting in a
      // gradient all-reduce nobody else joins: refuse before the epoch.
      require_same_on_every_rank(
          agreement_group(), batches.size(), [&](int r, auto mine, auto first) {
            return ddpkit::detail::cat(
                "epoch ", s.epoch + 1, ": rank ", r, " has ", mine,
                " batches but rank 0 has ", first,
                " (uneven inputs would hang DDP); use a sampler that gives "
                "every rank the same number of samples, e.g. "
                "DistributedSampling");
          });
    }
    s.steps = batches.size();
    s.step = 0;
    s.loss_sum = s.count = s.resumed_images = 0;
    s.sums.assign(num_sums, 0.0);
    // Resumed mid-epoch: the generator and the metrics as they were there.
    checkpoints_.continue_epoch(s);
    return batches;
  }

  /// The step's view of this Trainer (train_step, step.hpp).
  StepContext<engine_type, Task> step_context() {
    return {
        engine_, *optimizer_, task_,      options_,
        device_, scaler_,     nonfinite_, agreement_group(/*per_step=*/true),
        rank(),  multi(),     is_main(),  join_};
  }

  /// Every rank: a checkpoint where the run stands (mid-epoch: written
  /// here; at an epoch's end: ModelCheckpoint has written it), `FitEnd`,
  /// then `Interrupted`.
  template <class Emit>
  [[noreturn]] void stop_on_signal(FitState& s, int sig, bool mid_epoch,
                                   Emit& emit) {
    using ddpkit::detail::cat;
    const std::filesystem::path last = s.out / "checkpoints" / "last.pt";
    if (mid_epoch && options_.checkpoints() &&
        s.last_checkpoint_step != s.global_step) {
      write_mid_epoch(last);
      s.last_checkpoint_step = s.global_step;
    }
    s.signal = sig;
    s.stop_reason =
        cat("stopped by ", sig == SIGINT ? "SIGINT" : "SIGTERM", " ",
            mid_epoch ? cat("after batch ", s.step, " of ", s.steps,
                            " in epoch ", s.epoch + 1)
                      : cat("after epoch ", s.epoch + 1),
            " (global step ", s.global_step, "); ",
            options_.checkpoints()
                ? cat("checkpoint ", last.string(),
                      " holds it: run again with resume(\"auto\") / --resume "
                      "auto to continue")
                : std::string("no checkpoint written (checkpoints are off)"));
    emit(FitEnd{s});
    throw Interrupted(s.stop_reason, sig);
  }

  FitResult finish_fit(FitState& s, clock::time_point fit_start) {
    checkpoints_.finish();  // every checkpoint on disk, or its error here
    FitResult result = fit_result(
        s, std::chrono::duration<double>(clock::now() - fit_start).count());
    result.memory = measure_memory(engine_, optimizer_.get(), step_memory_,
                                   multi() ? &group_ : nullptr);
    result.checkpoints = checkpoints_.summary();
    if (is_main()) write_summary(result, nullptr);
    return result;
  }

  // CheckpointWriter, for ModelCheckpoint and stop_on_signal.
  void write(const std::filesystem::path& path) override {
    checkpoints_.save(path, *fit_, fit_->epoch + 1);
  }
  void write_mid_epoch(const std::filesystem::path& path) override {
    prepare_checkpoint(/*mid_epoch=*/true);
    checkpoints_.save_mid_epoch(path, *fit_);
  }
  void then(std::function<void()> fn) override {
    checkpoints_.then(std::move(fn));
  }

  /// Every rank, before rank 0 writes a checkpoint (at an epoch's end, or
  /// mid-epoch): with sharded checkpoints each rank writes its part (the
  /// mid-epoch one's are written by save_mid_epoch); otherwise an engine
  /// that shards the optimizer gathers its shards on rank 0. An engine
  /// that shards the parameters gathers them until the next step where
  /// the whole model is written (a plain checkpoint, weights files).
  void prepare_checkpoint(bool mid_epoch = false) {
    const bool sharded =
        options_.sharded_checkpoints() && options_.checkpoints();
    if (sharded && !mid_epoch) {
      checkpoints_.write_shards(fit_->global_step, fit_->epoch + 1, 0);
    }
    if constexpr (parallel::declares<engine_type,
                                     parallel::capability::shards_optimizer>) {
      constexpr bool shards_parameters =
          parallel::declares<engine_type,
                             parallel::capability::shards_parameters>;
      if (!sharded || (shards_parameters && !mid_epoch &&
                       !options_.weights_pattern().empty())) {
        engine_.consolidate_optimizer();
      }
    }
  }

  static Model prepare(Model model, const dist::Group& g,
                       const TrainerOptions& o) {
    BN::apply(parallel::as_module(model), g);
    if (o.memory_format() == MemoryFormat::channels_last) {
      // Before the engine exists: DDP's buckets take these strides.
      parallel::to_memory_format(parallel::as_module(model),
                                 torch::MemoryFormat::ChannelsLast);
    }
    return model;
  }

  dist::Group group_;
  TrainerOptions options_;
  Task task_;
  Monitor monitor_;  ///< options_.monitor(), or the task's
  torch::Device device_;
  CheckpointConnector checkpoints_;  ///< saves and resumes
  std::string auto_reason_;          ///< why automatic settings resolved so
  engine_type engine_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  bool has_batch_norm_ = false;  // summary.json's "bn" (run_info)
  LossScaler scaler_;
  bool join_ = false;                 ///< this fit runs uneven_inputs(join)
  ddpkit::detail::RunLock run_lock_;  ///< rank 0: OUT held from 1st fit on
  NonFiniteGuard nonfinite_;          ///< non-finite steps skipped
  StepMemory step_memory_{device_};   ///< the steps' measured peaks
  FitState* fit_ = nullptr;           ///< the fit running (for checkpoints)
};

}  // namespace ddpkit::train
