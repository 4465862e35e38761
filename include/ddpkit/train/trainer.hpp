// SPDX-License-Identifier: BSD-3-Clause
// Trainer<Model, ParallelPolicy, SamplerPolicy, BNPolicy, LRScaling,
// Reduction>: the training loop of both reference recipes, composed at
// compile time. `fit` is a short loop over events; what happens at them
// (early stopping, checkpoints, progress, metrics files, TensorBoard, the
// user's own) are callbacks (callbacks.hpp).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/loader.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/cpu.hpp"
#include "ddpkit/detail/scope_guard.hpp"
#include "ddpkit/detail/seed.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/nn/batch_norm.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/zero.hpp"
#include "ddpkit/train/callbacks.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/clip.hpp"
#include "ddpkit/train/evaluation.hpp"
#include "ddpkit/train/lr.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/options.hpp"
#include "ddpkit/train/reduction.hpp"
#include "ddpkit/train/run_folder.hpp"
#include "ddpkit/train/run_summary.hpp"
#include "ddpkit/train/signals.hpp"
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
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::Tensor>)>;

/// The device this rank should train on: its local GPU where CUDA is
/// available, else the CPU.
inline torch::Device default_device(const dist::Group& g) {
  if (torch::cuda::is_available()) {
    return torch::Device(torch::kCUDA,
                         static_cast<c10::DeviceIndex>(g.local_rank()));
  }
  return torch::kCPU;
}

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
        engine_(prepare(std::move(model), group_, options_), group_,
                std::move(parallel_options), device_) {
    check_options(options_);
    check_precision();
    // ZeRO's engine builds the optimizer over this rank's shard.
    if constexpr (requires { engine_.make_optimizer(make_optimizer); }) {
      optimizer_ = engine_.make_optimizer(make_optimizer);
    } else {
      // Each tensor once (tied weights: see unique_parameters).
      optimizer_ = make_optimizer(
          parallel::unique_parameters(parallel::as_module(engine_.module())));
    }
    if (!optimizer_) throw UsageError("the optimizer factory returned nothing");
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
    };
    FitScope scope(*this, callbacks...);
    FitState& s = scope.state;
    begin_fit(s, train.size(), data_fingerprint(train));
    SignalFlag signals(options_.checkpoint_on_signal());
    // A signal during a hang: the liveness watch ends the rank (the loop
    // cannot reach its step boundary), saying which checkpoint a resume
    // uses.
    if (multi() && signals.armed()) {
      group_.watch_interrupt(
          [&signals] { return signals.pending(); },
          [out = std::filesystem::path(options_.out_dir())] {
            std::error_code ec;
            if (!out.empty() &&
                std::filesystem::exists(last_checkpoint(out), ec)) {
              return ddpkit::detail::cat(
                  "a resume (--resume auto) starts from ",
                  last_checkpoint(out).string(),
                  ", the last checkpoint written");
            }
            return std::string(
                "no checkpoint was written yet: a resume starts from scratch");
          });
    }
    ddpkit::detail::ScopeExit unwatch([&] { group_.watch_interrupt({}, {}); });
    Sampler sampler(train.size(),
                    data::ShardSpec{.rank = rank(),
                                    .world_size = s.world,
                                    .seed = options_.seed(),
                                    .drop_last = options_.drop_last()});
    data::Loader loader(train, train_transform, lo);
    emit(FitBegin{s});
    for (; s.epoch < s.epochs && !s.stop; ++s.epoch) {
      auto batches = begin_epoch(s, sampler, loader, lo);
      emit(EpochBegin{s});
      restore_generator();            // resuming mid-epoch: as it was there
      std::vector<data::Batch> step;  // one optimizer step's batches
      auto asked = clock::now();      // for the next step's batches
      while (next_step(batches, step)) {
        const auto got = clock::now();
        s.times.data += seconds_between(asked, got);
        step_memory_.begin();
        const int sig = train_step(step, s, signals, emit);
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
      const EpochMetrics m = end_epoch(s, val, eval_transform, lo);
      if (options_.checkpoints()) prepare_checkpoint();
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
    auto forward = [&](const data::Batch& batch) {
      const data::Inputs x = to_device_inputs(batch, /*non_blocking=*/false);
      torch::Tensor y = batch.target.to(device_);
      std::optional<ddpkit::compat::AutocastGuard> mixed;
      if (options_.precision() != Precision::fp32) {
        mixed.emplace(autocast_state());
      }
      torch::Tensor out = engine_forward(x);
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
  const TrainerOptions& options() const {
    return options_;
  }

  /// Rank 0 writes OUT/summary.json (fit does this itself; call it again to
  /// add a test-set result).
  void write_summary(const FitResult& r, const EvalResult* test) const {
    std::optional<double> bytes;
    if constexpr (requires { engine_.last_step_bytes(); }) {
      bytes = static_cast<double>(engine_.last_step_bytes());
    }
    train::write_summary(run_info(), r, test, bytes);
  }

  /// What this run is, for summary.json and the hparams table.
  RunInfo run_info() const {
    RunInfo info;
    info.mode = Parallel::name;
    if constexpr (requires { engine_.mode_name(); }) {
      info.mode = engine_.mode_name();
    }
    info.sampler = Parallel::is_multi_process ? "distributed" : "local";
    info.bn = BN::name;
    info.lr_scaling = LRScaling::name;
    info.evaluation = Reduction::name;
    info.task = Task::name;
    info.world_size = world();
    if constexpr (Parallel::is_multi_process) {
      info.transport = group_.transport();
      info.hosts = group_.hosts();
    }
    if constexpr (requires { engine_.comm_name(); }) {
      info.comm = engine_.comm_name();
    }
    info.monitor = monitor_;
    info.options = options_;
    return info;
  }

 private:
  using clock = std::chrono::steady_clock;
  static constexpr bool can_join =
      requires(engine_type& e) { e.join_round(true); };

  /// A stateful callback as the checkpoint sees it.
  struct CallbackState {
    std::string key;  ///< "callbacks/<name>"
    std::function<c10::IValue()> save;
    std::function<void(const c10::IValue&)> load;
  };

  /// One fit's state, and the Trainer's view of it and of the callbacks'
  /// states, for as long as the fit runs (exceptions included).
  struct FitScope {
    template <class... Cs>
    FitScope(Trainer& t, Cs&... cs) : trainer(t) {
      std::vector<CallbackState> states;  // taken only if all are valid
      (add(states, cs), ...);
      t.callback_states_ = std::move(states);
      t.fit_ = &state;
    }
    ~FitScope() {
      trainer.fit_ = nullptr;
      trainer.callback_states_.clear();
    }
    FitScope(const FitScope&) = delete;
    FitScope& operator=(const FitScope&) = delete;

    template <class C>
    static void add(std::vector<CallbackState>& states, C& c) {
      if constexpr (stateful_callback<std::remove_cvref_t<C>>) {
        std::string key =
            "callbacks/" + std::string(std::remove_cvref_t<C>::name);
        for (const auto& other : states) {
          if (other.key == key) {
            throw UsageError(ddpkit::detail::cat(
                "two callbacks of one fit have the name '",
                std::remove_cvref_t<C>::name,
                "'; their states would overwrite each other in checkpoints"));
          }
        }
        states.push_back({std::move(key),
                          [&c] { return c10::IValue(c.state()); },
                          [&c](const c10::IValue& v) { c.load_state(v); }});
      }
    }

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

  /// Several processes: gathers `value` from every rank (a collective) and
  /// throws a UsageError with `message(rank, its value, rank 0's)` for the
  /// first rank whose value differs from rank 0's.
  template <class Message>
  void require_same_on_every_rank(std::size_t value, Message message) const {
    if (!multi()) return;
    dist::CollectiveTag tag("same on every rank");
    auto all = dist::all_gather_value(group_, static_cast<int64_t>(value));
    for (int r = 0; r < world(); ++r) {
      if (all[r] != all[0]) throw UsageError(message(r, all[r], all[0]));
    }
  }

  /// Runs `fn` on rank 0; a UsageError or IoError it throws is thrown on
  /// every rank (one broadcast), so no rank waits for one that failed.
  template <class Fn>
  void on_main_or_fail(Fn&& fn) {
    std::int64_t kind = 0;  // 0 fine, 1 usage, 2 I/O
    std::string error;
    if (is_main()) {
      try {
        fn();
      } catch (const UsageError& e) {
        if (!multi()) throw;
        kind = 1;
        error = e.what();
      } catch (const IoError& e) {
        if (!multi()) throw;
        kind = 2;
        error = e.what();
      }
    }
    if (!multi()) return;
    dist::CollectiveTag tag("rank 0 status");
    kind = dist::broadcast_value(group_, kind, 0);
    if (kind == 0) return;
    error = dist::broadcast_string(group_, error, 0);
    if (kind == 2) throw IoError(error);
    throw UsageError(error);
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
    on_main_or_fail([&] {
      if (!run_lock_.held()) run_lock_ = prepare_output_folder(s.out, options_);
    });
    // A failed collective or SIGUSR1 writes OUT/flight/rank-K.json (unless
    // DDPKIT_FLIGHT_DIR chose another folder); an earlier run's record of
    // this rank goes first, so ddpkit-doctor never reads a stale one.
    if (multi() && !s.out.empty() && group_.flight_recorder() &&
        !std::getenv("DDPKIT_FLIGHT_DIR")) {
      const fs::path dir = fs::path(s.out) / "flight";
      std::error_code ec;
      fs::remove(dir / cat("rank-", rank(), ".json"), ec);
      if (is_main() && fs::is_directory(dir, ec)) {
        for (const auto& f : fs::directory_iterator(dir, ec)) {
          const auto name = f.path().filename().string();
          if (name.rfind("rank-", 0) == 0 || name.rfind("verdict.", 0) == 0) {
            fs::remove(f.path(), ec);
          }
        }
      }
      group_.set_flight_dir(dir);
    }
    join_ = multi() && options_.uneven_inputs() == UnevenInputs::join;
    if (join_ && !can_join) {
      throw UsageError(
          "uneven_inputs(join) needs a parallel policy whose engine has "
          "join_round (DDP's has); this policy's engine has none");
    }
    // Ranks holding different datasets would deadlock later: say so now.
    require_same_on_every_rank(train_size, [](int r, auto mine, auto first) {
      return cat("rank ", r, " has ", mine, " training samples but rank 0 has ",
                 first, "; every rank must read the same dataset");
    });
    mid_ = {};
    data_size_ = static_cast<std::int64_t>(train_size);
    data_fingerprint_ = fingerprint;
    s.epoch = try_resume(s);
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
    const auto first = static_cast<std::size_t>(mid_.batches_done);
    auto batches =
        loader.epoch(indices, static_cast<std::size_t>(s.epoch), first);
    if (!join_) {
      // Uneven inputs would leave the ranks with more batches waiting in a
      // gradient all-reduce nobody else joins: refuse before the epoch.
      require_same_on_every_rank(
          batches.size(), [&](int r, auto mine, auto first) {
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
    if (first > 0) {
      // A run resumed from a mid-epoch checkpoint: every rank's generator
      // as it was there, and the metrics so far (all ranks' sums, counted
      // once: on rank 0).
      resume_rng_ = mid_.rng[rank()].contiguous().clone();
      const torch::Tensor m = mid_.sums.contiguous();
      const double* v = m.data_ptr<double>();
      if (is_main()) {
        s.loss_sum = v[0];
        s.count = v[1];
        s.sums.assign(v + 2, v + 2 + num_sums);
      }
      s.step = first;
      s.resumed_images = v[1];
      mid_ = {};
    }
    return batches;
  }

  /// The next optimizer step's batches (up to `accumulate`); false when
  /// the epoch is done. With join, every rank takes part in every round; a
  /// rank without a batch shadows the others' all-reduces inside
  /// join_round (accumulate is 1 then).
  template <class Batches>
  bool next_step(Batches& batches, std::vector<data::Batch>& step) {
    step.clear();
    if constexpr (can_join) {
      if (join_) {
        for (;;) {
          auto batch = batches.next();
          if (!engine_.join_round(batch.has_value())) return false;
          if (batch) {
            step.push_back(std::move(*batch));
            return true;
          }
        }
      }
    }
    const auto k = static_cast<std::size_t>(options_.accumulate());
    while (step.size() < k) {
      auto batch = batches.next();
      if (!batch) break;
      step.push_back(std::move(*batch));
    }
    return !step.empty();
  }

  /// Forward and backward over the step's batches (communicating on the
  /// last only); the ranks agree on a pending signal and on whether the
  /// step is finite; then unscale, clip and step; `BatchEnd` per batch.
  /// Returns the signal every rank agreed on (0: none).
  template <class Emit>
  int train_step(const std::vector<data::Batch>& step, FitState& s,
                 const SignalFlag& signals, Emit& emit) {
    // Each batch's loss counts by its share of the step's samples, so the
    // summed gradients are those of the joined batch.
    double step_samples = 0;
    for (const auto& b : step) {
      step_samples += static_cast<double>(b.target.size(0));
    }
    engine_.zero_grad();
    // 16-mixed: float16 autocast and the loss scaler (CUDA); bf16-mixed:
    // bfloat16 autocast, nothing scaled.
    const bool amp = options_.precision() == Precision::fp16_mixed;
    const bool autocast = options_.precision() != Precision::fp32;
    const double scale = amp ? scaler_.scale() : 1.0;
    struct Done {
      double loss, n;
      std::array<double, num_sums> sums;
    };
    std::vector<Done> done;
    StepTimes& times = s.times;
    const auto me = std::this_thread::get_id();
    for (std::size_t i = 0; i < step.size(); ++i) {
      const data::Inputs x = to_device_inputs(step[i], /*non_blocking=*/true);
      torch::Tensor y = step[i].target.to(device_, /*non_blocking=*/true);
      const double n = static_cast<double>(y.size(0));
      const double weight = step.size() == 1 ? 1.0 : n / step_samples;
      // Loss as backpropagated: weighted, and scaled under AMP.
      const double factor = weight * scale;
      // The loss is taken when the forward is done: on this thread (not
      // DataParallel's other replicas), that moment splits the step.
      auto forward_end = clock::now();
      auto loss_fn = [&](const torch::Tensor& a, const torch::Tensor& b) {
        if (std::this_thread::get_id() == me) forward_end = clock::now();
        return task_.loss(a, b);
      };
      auto run = [&] {
        if (autocast) {
          ddpkit::compat::AutocastGuard on(autocast_state());
          return engine_forward_backward(
              x, y, [&](const torch::Tensor& a, const torch::Tensor& b) {
                return loss_fn(a.to(torch::kFloat32), b) * factor;
              });
        }
        if (factor == 1.0) return engine_forward_backward(x, y, loss_fn);
        return engine_forward_backward(
            x, y, [&](const torch::Tensor& a, const torch::Tensor& b) {
              return loss_fn(a, b) * factor;
            });
      };
      const auto start = clock::now();
      parallel::StepOutput o;
      if (i + 1 < step.size()) {
        [[maybe_unused]] auto local_only = engine_.no_sync();  // sync last
        o = run();
      } else {
        o = run();
        if constexpr (engine_reports_wait<engine_type>) {
          times.grad_wait += engine_.last_wait_seconds();
        }
      }
      const auto end = clock::now();
      times.forward += seconds_between(start, forward_end);
      times.backward += seconds_between(forward_end, end);
      const double loss = factor == 1.0
                              ? o.loss.template item<double>()
                              : o.loss.template item<double>() / factor;
      done.push_back({loss, n, task_.sums(o.output, y, loss)});
    }
    // The gradients are averaged now. The ranks agree on a signal and on
    // whether the step is finite (one small all-reduce);
    bool loss_finite = true;
    for (const Done& d : done)
      loss_finite = loss_finite && std::isfinite(d.loss);
    const bool check = options_.check_finite() && !amp;
    const auto agree_start = clock::now();
    const bool grads_ok = !check || grads_finite(*s.module);
    const auto collective_start = clock::now();
    const StepAgreement a =
        agree_on_step(agreement_group(/*per_step=*/true), signals, check,
                      loss_finite, grads_ok, rank(), /*local_signal=*/!join_);
    const auto agree_end = clock::now();
    times.agree += seconds_between(agree_start, agree_end);
    times.agree_collective += seconds_between(collective_start, agree_end);
    if (check && (a.nonfinite_rank >= 0 || a.nonfinite_grads)) {
      skip_or_stop_nonfinite(s, a, done.size());
      return a.signal;
    }
    // unscale (AMP: one fused pass, one host sync, and the step is skipped
    // everywhere if any rank overflowed), clip, step.
    if (!amp || engine_.unscale_and_check(scaler_)) {
      if (options_.clip().enabled()) clip(*s.module);
      optimizer_->step();
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

  /// Clips the averaged gradients as the options say; by norm through the
  /// engine when its gradients are sharded (ZeRO-2: the norm is taken
  /// across the shards).
  void clip(torch::nn::Module& module) {
    const ClipOptions& c = options_.clip();
    if constexpr (requires { engine_.clip_grad_norm(1.0, 2.0); }) {
      if (c.max_norm() > 0) {
        engine_.clip_grad_norm(c.max_norm(), c.norm_type());
        return;
      }
    }
    clip_gradients(parallel::unique_parameters(module), c);
  }

  /// Each rank's memory (FitResult::memory), measured now; every rank
  /// calls it at the same point.
  FitResult::Memory measure_memory() {
    double state = optimizer_
                       ? static_cast<double>(
                             parallel::local_optimizer_state_bytes(*optimizer_))
                       : 0.0;
    double grads = 0, gather = 0;
    if constexpr (requires { engine_.peak_gradient_bytes(); }) {
      grads = static_cast<double>(engine_.peak_gradient_bytes());
    } else {
      grads = static_cast<double>(
          parallel::held_gradient_bytes(parallel::as_module(engine_.module())));
    }
    if constexpr (requires { engine_.gather_buffer_bytes(); }) {
      gather = static_cast<double>(engine_.gather_buffer_bytes());
    }
    // Measured outside the code above (Note [Measured memory]).
    const auto resident = static_cast<double>(step_memory_.peak_resident());
    const auto proportional =
        static_cast<double>(step_memory_.peak_proportional());
    const auto device = static_cast<double>(step_memory_.peak_device());
    FitResult::Memory m;
    m.peaks_per_step = step_memory_.per_step();
    std::vector<double> mine{state,    grads,        gather,
                             resident, proportional, device};
    std::vector<torch::Tensor> all{torch::tensor(mine, torch::kFloat64)};
    if (multi()) {
      dist::CollectiveTag tag("memory report");
      all = dist::all_gather(group_, all[0].to(group_.device()));
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
    }
    return m;
  }

  /// The autocast state of the chosen mixed precision on this device.
  ddpkit::compat::AutocastState autocast_state() const {
    return {true, autocast_dtype(options_.precision()), device_.type()};
  }

  /// 16-mixed needs CUDA; bf16-mixed on a CPU without bfloat16 hardware
  /// runs, with a warning (rank 0).
  void check_precision() const {
    using ddpkit::detail::cat;
    if (options_.precision() == Precision::fp16_mixed && !device_.is_cuda()) {
      throw UsageError(
          cat("precision 16-mixed needs a CUDA device, but this "
              "trainer runs on ",
              device_.str(),
              " (bf16-mixed works on CPUs and CUDA; 32 is the "
              "default)"));
    }
    if (options_.precision() == Precision::bf16_mixed && device_.is_cpu() &&
        !ddpkit::detail::cpu_has_bf16() && is_main()) {
      std::fprintf(stderr,
                   "warning: precision bf16-mixed on a CPU without "
                   "AVX512-BF16 or AMX: bfloat16 is emulated there, about "
                   "25x slower than 32 (ResNet-34 on an AVX2-only AMD EPYC, "
                   "docs/BENCHMARKS.md); --precision 32 on this CPU\n");
    }
  }

  /// Whether every gradient of `module` is finite (one host sync).
  static bool grads_finite(const torch::nn::Module& module) {
    return gradients_finite(parallel::unique_parameters(module));
  }

  /// A step whose loss or gradients were not finite, not taken: skipped
  /// (and reported) while `skip_nonfinite` allows, else a NonFiniteError
  /// on every rank.
  void skip_or_stop_nonfinite(FitState& s, const StepAgreement& a,
                              std::size_t batches) {
    using ddpkit::detail::cat;
    engine_.zero_grad();
    const std::string what =
        a.nonfinite_rank >= 0
            ? cat("non-finite loss on rank ", a.nonfinite_rank,
                  multi() ? " (the first rank whose loss was not finite)" : "")
            : cat("non-finite gradients",
                  multi() ? " (averaged over the ranks; every rank's loss "
                            "was finite)"
                          : " (the loss was finite)");
    const std::string where =
        cat("step ", s.global_step + 1, " (epoch ", s.epoch + 1, ", batch ",
            s.step + 1, " of ", s.steps, ")");
    if (skipped_steps_ < options_.skip_nonfinite()) {
      ++skipped_steps_;
      if (is_main()) {
        std::fprintf(stderr,
                     "warning: %s at %s: step skipped (%d of %d allowed)\n",
                     what.c_str(), where.c_str(), skipped_steps_,
                     options_.skip_nonfinite());
      }
      s.step += batches;  // consumed, not counted in the metrics
      s.global_step += static_cast<std::int64_t>(batches);
      return;
    }
    throw NonFiniteError(cat(
        what, " at ", where, "; the step was not taken, so the weights (and ",
        options_.checkpoints() ? "checkpoints/last.pt" : "the model",
        ") are the last finite ones",
        options_.skip_nonfinite() > 0
            ? cat(" (", skipped_steps_, " such steps skipped already)")
            : std::string(),
        ". Lower the learning rate, clip the gradients (clip / "
        "--clip-grad-norm), or skip such steps (skip_nonfinite / "
        "--skip-nonfinite N)"));
  }

  /// Reduces the epoch's training metrics, evaluates, times, and keeps the
  /// best; the new row is `s.history.back()`.
  template <class Dataset, class EvalTransform>
  EpochMetrics end_epoch(FitState& s, const Dataset& val,
                         EvalTransform& eval_transform,
                         const data::LoaderOptions& lo) {
    // Training metrics over every rank's samples, and (several processes)
    // each rank's wait for the others in its own slot: one all-reduce.
    auto t = epoch_sums(s);
    const int64_t waits_at = t.size(0);
    if (multi()) {
      auto waits = torch::zeros({world()}, torch::kFloat64);
      waits[rank()] = s.times.waited() - s.wait_at_epoch_start;
      t = torch::cat({t, waits});
    }
    t = t.to(group_.device());
    dist::CollectiveTag tag("epoch end");
    if (multi()) dist::all_reduce(group_, t);
    t = t.cpu().contiguous();
    const auto t_train = clock::now();
    auto ev = evaluate(val, eval_transform, lo);
    const auto t_val = clock::now();
    EpochMetrics m;
    m.epoch = s.epoch + 1;
    const double total = t[1].template item<double>();
    m.task = named_metrics<Task>(
        task_.finish(task_sums_at<Task>(t.data_ptr<double>() + 2)), "train_");
    for (const auto& [name, value] : ev.metrics) {
      m.task.emplace_back("val_" + name, value);
    }
    if (multi()) {
      const double* w = t.data_ptr<double>() + waits_at;
      m.rank_wait_seconds.assign(w, w + world());
    }
    m.lr = s.lr;
    const auto since = [](auto a, auto b) {
      return std::chrono::duration<double>(b - a).count();
    };
    m.seconds = since(s.epoch_start, clock::now());
    m.train_seconds = since(s.epoch_start, t_train);
    m.val_seconds = since(t_train, t_val);
    if (multi()) {
      // Every rank records rank 0's clock, so all hold identical numbers.
      auto times = torch::tensor({m.seconds, m.train_seconds, m.val_seconds},
                                 torch::kFloat64)
                       .to(group_.device());
      dist::broadcast(group_, times, 0);
      times = times.cpu();
      m.seconds = times[0].template item<double>();
      m.train_seconds = times[1].template item<double>();
      m.val_seconds = times[2].template item<double>();
    }
    // Images trained in this process's time (an epoch resumed mid-way
    // counts only those after its checkpoint).
    const double trained = total - s.resumed_images;
    m.train_images_per_second =
        m.train_seconds > 0 ? trained / m.train_seconds : 0;
    m.epoch_images_per_second = m.seconds > 0 ? trained / m.seconds : 0;
    s.history.push_back(m);
    // Decisions use only values every rank holds, so every rank decides
    // the same.
    rank_epoch(s, m);
    return m;
  }

  /// Sets the CPU generator to the state a mid-epoch checkpoint saved for
  /// this rank (after EpochBegin, as in the uninterrupted run).
  void restore_generator() {
    if (!resume_rng_.defined()) return;
    at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(resume_rng_);
    }
    resume_rng_ = torch::Tensor();
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
    FitResult result;
    result.monitor = s.monitor;
    result.best_value = s.best_epoch > 0 ? s.best : 0.0;
    result.best_epoch = s.best_epoch;
    result.stopped_early = s.stop;
    result.epochs_run = static_cast<int>(s.history.size());
    result.history = std::move(s.history);
    result.total_seconds =
        std::chrono::duration<double>(clock::now() - fit_start).count();
    result.step_times = s.times;
    for (const EpochMetrics& m : result.history) {
      const auto& w = m.rank_wait_seconds;
      if (w.empty()) continue;
      if (result.rank_wait_seconds.empty()) {
        result.rank_wait_seconds.assign(w.size(), 0.0);
      }
      if (w.size() != result.rank_wait_seconds.size()) continue;
      for (std::size_t r = 0; r < w.size(); ++r) {
        result.rank_wait_seconds[r] += w[r];
      }
    }
    result.slowest_rank = EpochMetrics::least_waiting(result.rank_wait_seconds);
    result.memory = measure_memory();
    if (is_main()) write_summary(result, nullptr);
    return result;
  }

  // CheckpointWriter, for ModelCheckpoint and stop_on_signal.
  void write(const std::filesystem::path& path) override {
    save_checkpoint(path, fit_->epoch + 1);
  }
  void write_mid_epoch(const std::filesystem::path& path) override {
    // Every rank takes part: the metrics so far over all ranks, and every
    // rank's generator, which only rank 0 writes.
    const FitState& s = *fit_;
    prepare_checkpoint();
    dist::CollectiveTag tag("mid-epoch checkpoint");
    torch::Tensor all = epoch_sums(s).to(group_.device());
    if (multi()) dist::all_reduce(group_, all);
    auto rng = at::detail::getDefaultCPUGenerator().get_state();
    torch::Tensor states = rng.unsqueeze(0);
    if (multi()) {
      states =
          torch::stack(dist::all_gather(group_, rng.to(group_.device()))).cpu();
    }
    if (!is_main()) return;
    mid_ = {static_cast<std::int64_t>(s.step), all.cpu(), states};
    save_checkpoint(path, s.epoch);
    mid_ = {};
  }

  /// Every rank, before rank 0 writes a checkpoint: ZeRO gathers the
  /// optimizer's shards on rank 0 (nothing for the other policies).
  void prepare_checkpoint() {
    if constexpr (requires { engine_.consolidate_optimizer(); }) {
      engine_.consolidate_optimizer();
    }
  }

  /// This rank's epoch so far: [loss sum, samples, task sums...].
  static torch::Tensor epoch_sums(const FitState& s) {
    std::vector<double> v{s.loss_sum, s.count};
    v.insert(v.end(), s.sums.begin(), s.sums.end());
    return torch::tensor(v, torch::kFloat64);
  }

  void save_checkpoint(const std::filesystem::path& path, int epochs_done) {
    // The one place a checkpoint is made: TrainingState holds every key
    // (train/checkpoint.hpp); the callbacks' states are added by name.
    const FitState& s = *fit_;
    TrainingState t;
    t.epochs_done = epochs_done;
    t.best = s.best;
    t.best_epoch = s.best_epoch;
    t.bad_epochs = s.bad_epochs;
    t.monitor = s.monitor.name;
    t.monitor_mode = std::string(s.monitor.goal_name());
    t.world_size = world();
    t.seed = static_cast<int64_t>(options_.seed());
    t.data_size = data_size_;
    t.data_fingerprint = data_fingerprint_;
    t.precision = precision_name(options_.precision());
    t.memory_format = memory_format_name(options_.memory_format());
    t.loss_scale = scaler_.scale();
    t.global_step = s.global_step;
    t.history = s.history;
    t.columns = metric_columns<Task>();
    t.rng_cpu = at::detail::getDefaultCPUGenerator().get_state();
    t.epoch_batches_done = mid_.batches_done;
    t.epoch_sums = mid_.sums;
    t.rng_ranks = mid_.rng;
    torch::nn::Module& module = parallel::as_module(engine_.module());
    require_finite_weights(module, path);
    Checkpoint archive;
    t.save(archive, module, *optimizer_);
    for (const auto& c : callback_states_) archive.write(c.key, c.save());
    // last.pt: the one before stays as last-prev.pt until this one is
    // durable, for a resume that finds last.pt damaged.
    const std::filesystem::path out(options_.out_dir());
    atomic_save(archive, path,
                path == last_checkpoint(out) ? previous_checkpoint(out)
                                             : std::filesystem::path());
  }

  /// A checkpoint never holds non-finite weights: refuses naming the first
  /// parameter or buffer that has one.
  static void require_finite_weights(const torch::nn::Module& module,
                                     const std::filesystem::path& path) {
    for (const auto& kv : module.named_parameters()) {
      if (!torch::isfinite(kv.value()).all().template item<bool>()) {
        throw NonFiniteError(ddpkit::detail::cat(
            "refusing to write checkpoint ", path.string(), ": parameter '",
            kv.key(), "' holds non-finite values"));
      }
    }
    for (const auto& kv : module.named_buffers()) {
      if (kv.value().is_floating_point() &&
          !torch::isfinite(kv.value()).all().template item<bool>()) {
        throw NonFiniteError(ddpkit::detail::cat(
            "refusing to write checkpoint ", path.string(), ": buffer '",
            kv.key(), "' holds non-finite values"));
      }
    }
  }

  int try_resume(FitState& s) {
    namespace fs = std::filesystem;
    using ddpkit::detail::cat;
    const std::string& what = options_.resume();
    if (what.empty()) return 0;
    // Rank 0 alone reads the file (only rank 0 writes checkpoints, so on a
    // second host without a shared filesystem the others have none) and
    // sends its bytes; every rank parses the same bytes, so every rank
    // resumes, starts fresh or fails alike. Status: 0 fresh, 1 bytes follow,
    // 2 rank 0's error message follows.
    std::int64_t status = 0;
    std::string bytes;
    std::optional<Checkpoint> parsed;  // rank 0's, from checking the file
    fs::path path =
        what == "auto" ? last_checkpoint(options_.out_dir()) : fs::path(what);
    if (is_main()) {
      try {
        auto src = read_resume_source(
            what, options_.out_dir(),
            [&](const std::string& b, const fs::path& p) {
              parsed = parse_checkpoint(b, p);
              TrainingState::load(*parsed, p, metric_columns<Task>(), num_sums);
            });
        if (src) {
          path = src->path;
          bytes = std::move(src->bytes);
          status = 1;
        }
      } catch (const std::exception& e) {
        if (!multi()) throw;
        status = 2;
        bytes = e.what();
      }
    }
    if (multi()) {
      dist::CollectiveTag tag("resume");
      status = dist::broadcast_value(group_, status, 0);
      if (status != 0) {
        bytes = dist::broadcast_string(group_, bytes, 0);
        path = dist::broadcast_string(group_, path.string(), 0);
      }
    }
    if (status == 2) throw UsageError(bytes);
    if (status == 0) {
      if (is_main() && options_.verbose()) {
        std::printf("resume auto: no checkpoint at %s, starting fresh\n",
                    path.c_str());
      }
      return 0;
    }
    auto archive = parsed ? std::move(*parsed) : parse_checkpoint(bytes, path);
    const auto state =
        TrainingState::load(archive, path, metric_columns<Task>(), num_sums);
    check_resume_settings(state, path);
    load_module_checked(parallel::as_module(engine_.module()), archive, "model",
                        path);
    load_optimizer_checked(*optimizer_, archive, path);
    const int done = state.epochs_done;
    s.history = state.history;
    if (state.monitor == s.monitor.name &&
        state.monitor_mode == s.monitor.goal_name()) {
      s.best = state.best;
      s.best_epoch = state.best_epoch;
      s.bad_epochs = state.bad_epochs;
    } else {
      // Another monitor than the checkpoint's: its best, from the history.
      rank_history(s);
      if (is_main() && options_.verbose()) {
        std::printf(
            "resume: the checkpoint monitored %s (%s), this run %s (%s); "
            "best epoch recomputed from the history: %d\n",
            state.monitor.c_str(), state.monitor_mode.c_str(),
            s.monitor.name.c_str(), std::string(s.monitor.goal_name()).c_str(),
            s.best_epoch);
      }
    }
    scaler_.set_scale(state.loss_scale);
    s.global_step = state.global_step;
    read_mid_epoch(state, path);
    for (auto& c : callback_states_) {
      c10::IValue v;
      if (archive.try_read(c.key, v)) c.load(v);
    }
    if (is_main() && options_.verbose()) {
      std::printf("resumed from %s after epoch %d (best %s %.4f)\n",
                  path.c_str(), done, s.monitor.name.c_str(),
                  s.best_epoch > 0 ? s.best : 0.0);
    }
    return done;
  }

  /// Best value, its epoch and the epochs since, from the history alone.
  static void rank_history(FitState& s) {
    s.best = std::numeric_limits<double>::quiet_NaN();
    s.best_epoch = s.bad_epochs = 0;
    for (const auto& m : s.history) rank_epoch(s, m);
  }

  /// Counts epoch `m` towards the best (a better monitored value, the
  /// first that is not NaN) or the bad epochs since.
  static void rank_epoch(FitState& s, const EpochMetrics& m) {
    const double v = m.value(s.monitor.name);
    if (s.best_epoch == 0 ? !std::isnan(v) : s.monitor.better(v, s.best)) {
      s.best = v;
      s.best_epoch = m.epoch;
      s.bad_epochs = 0;
    } else {
      ++s.bad_epochs;
    }
  }

  void read_mid_epoch(const TrainingState& state,
                      const std::filesystem::path& path) {
    using ddpkit::detail::cat;
    mid_ = {};
    if (state.epoch_batches_done == 0) return;
    const std::int64_t world = this->world();
    if (state.rng_ranks.size(0) != world) {
      throw UsageError(cat(
          "checkpoint ", path.string(),
          " was written in the middle of an epoch by ", state.rng_ranks.size(0),
          " ranks; it can only be resumed by as many (this run has ", world,
          "), since each rank's share of the epoch depends on it. Resume "
          "from an epoch's end, or with ",
          state.rng_ranks.size(0), " ranks"));
    }
    mid_ = {state.epoch_batches_done, state.epoch_sums, state.rng_ranks};
    if (is_main() && options_.verbose()) {
      std::printf("continuing epoch %d at batch %lld\n", state.epochs_done + 1,
                  static_cast<long long>(state.epoch_batches_done + 1));
    }
  }

  void check_resume_settings(const TrainingState& state,
                             const std::filesystem::path& path) {
    using ddpkit::detail::cat;
    const std::int64_t world = this->world();
    const auto seed = static_cast<std::int64_t>(options_.seed());
    std::string changes;
    if (state.world_size && *state.world_size != world) {
      changes += cat("world size ", *state.world_size, " -> ", world,
                     " (each rank's share of the data and the effective batch "
                     "change)");
    }
    if (state.seed && *state.seed != seed) {
      changes +=
          cat(changes.empty() ? "" : "; ", "seed ", *state.seed, " -> ", seed,
              " (the sampler's order, augmentation and dropout draw "
              "differently from the original run)");
    }
    const auto per_class =
        fingerprint_difference(state.data_fingerprint, data_fingerprint_);
    if (state.data_size && *state.data_size != data_size_) {
      changes += cat(changes.empty() ? "" : "; ", "the training set had ",
                     *state.data_size, " samples, now ", data_size_, " (",
                     per_class.empty() ? "files added or removed?" : per_class,
                     "; the sampler's order and a mid-epoch position "
                     "change)");
    } else if (state.data_size && !state.data_fingerprint.empty() &&
               !data_fingerprint_.empty() &&
               fingerprint_identity(state.data_fingerprint) !=
                   fingerprint_identity(data_fingerprint_)) {
      changes += cat(changes.empty() ? "" : "; ", "the training set has ",
                     data_size_, " samples as before but other contents (",
                     fingerprint_identity(state.data_fingerprint), " -> ",
                     fingerprint_identity(data_fingerprint_), ": ",
                     per_class.empty() ? "files renamed, replaced or relabelled"
                                       : per_class,
                     ")");
    }
    const std::string precision = precision_name(options_.precision());
    if (!state.precision.empty() && state.precision != precision) {
      changes += cat(changes.empty() ? "" : "; ", "precision ", state.precision,
                     " -> ", precision,
                     " (the continuation rounds "
                     "differently from the original run)");
    }
    // A layout changes nothing for a model without 4-D tensors.
    const bool four_d =
        parallel::has_4d_tensors(parallel::as_module(engine_.module()));
    const std::string layout = memory_format_name(options_.memory_format());
    if (four_d && !state.memory_format.empty() &&
        state.memory_format != layout) {
      changes += cat(changes.empty() ? "" : "; ", "memory format ",
                     state.memory_format, " -> ", layout,
                     " (other kernels: the continuation rounds differently)");
    }
    if (changes.empty()) return;
    if (!options_.resume_allow_changes()) {
      throw UsageError(
          cat("checkpoint ", path.string(),
              " was written by a run with other settings: ", changes,
              ". Resume with the original settings, or allow the "
              "change (resume_allow_changes, "
              "--resume-allow-changes)"));
    }
    if (is_main() && options_.verbose()) {
      std::printf("resuming %s with changed settings: %s\n", path.c_str(),
                  changes.c_str());
    }
  }

  static Model prepare(Model model, const dist::Group& g,
                       const TrainerOptions& o) {
    BN::apply(parallel::as_module(model), g);
    if (o.memory_format() == torch::MemoryFormat::ChannelsLast) {
      // Before the engine exists: DDP's buckets take these strides.
      parallel::to_memory_format(parallel::as_module(model), o.memory_format());
    }
    return model;
  }

  /// A batch's inputs on the device, each 4-D one in the chosen memory
  /// format.
  data::Inputs to_device_inputs(const data::Batch& b, bool non_blocking) const {
    const bool channels_last =
        options_.memory_format() == torch::MemoryFormat::ChannelsLast;
    return b.inputs().map([&](const torch::Tensor& x) {
      auto on = x.to(device_, non_blocking);
      if (on.dim() == 4 && channels_last) {
        on = on.contiguous(torch::MemoryFormat::ChannelsLast);
      }
      return on;
    });
  }

  /// The engine's forward (and forward_backward) with a batch's inputs; an
  /// engine of your own that takes one tensor gets the first, and a batch of
  /// several inputs is refused for it.
  static constexpr bool engine_takes_inputs =
      requires(engine_type& e, const data::Inputs& x) { e.forward(x); };
  static const torch::Tensor& single_input(const data::Inputs& x) {
    if (x.size() != 1) {
      throw UsageError(ddpkit::detail::cat(
          "the parallel policy's engine takes one input tensor, and the batch "
          "has ",
          x.size(), ": give its forward and forward_backward a data::Inputs"));
    }
    return x[0];
  }
  torch::Tensor engine_forward(const data::Inputs& x) {
    if constexpr (engine_takes_inputs) {
      return engine_.forward(x);
    } else {
      return engine_.forward(single_input(x));
    }
  }
  template <class LossFn>
  parallel::StepOutput engine_forward_backward(const data::Inputs& x,
                                               const torch::Tensor& y,
                                               LossFn&& loss_fn) {
    if constexpr (engine_takes_inputs) {
      return engine_.forward_backward(x, y, std::forward<LossFn>(loss_fn));
    } else {
      return engine_.forward_backward(single_input(x), y,
                                      std::forward<LossFn>(loss_fn));
    }
  }

  dist::Group group_;
  TrainerOptions options_;
  Task task_;
  Monitor monitor_;  ///< options_.monitor(), or the task's
  torch::Device device_;
  engine_type engine_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  LossScaler scaler_;
  bool join_ = false;         ///< this fit runs uneven_inputs(join)
  torch::Tensor resume_rng_;  ///< set by a mid-epoch resume until applied
  ddpkit::detail::RunLock
      run_lock_;           ///< rank 0: OUT held from the first fit on
  int skipped_steps_ = 0;  ///< non-finite steps skipped in this process
  StepMemory step_memory_{device_};  ///< the steps' measured peaks
  std::int64_t data_size_ = 0;       ///< the training set's, for checkpoints
  std::string data_fingerprint_;     ///< its `fingerprint()`, or ""

  /// `d.fingerprint()` where the dataset has one (ImageFiles,
  /// ImageTensors), else "": recorded in checkpoints, compared at resume.
  template <class Dataset>
  static std::string data_fingerprint(const Dataset& d) {
    if constexpr (requires {
                    { d.fingerprint() } -> std::convertible_to<std::string>;
                  }) {
      return d.fingerprint();
    } else {
      return "";
    }
  }
  FitState* fit_ = nullptr;  ///< the fit running (for checkpoints)
  std::vector<CallbackState> callback_states_;  ///< the fit's, by key
  /// Where an unfinished epoch stands: saved in mid-epoch checkpoints, and
  /// read from one until the resumed epoch starts.
  struct MidEpoch {
    std::int64_t batches_done = 0;  ///< 0: at an epoch's end
    torch::Tensor sums;  ///< [loss sum, samples, task sums...], all ranks
    torch::Tensor rng;   ///< [world, state]: each rank's generator
  } mid_;
};

}  // namespace ddpkit::train
