// Trainer<Model, ParallelPolicy, SamplerPolicy, BNPolicy, LRScaling,
// Reduction>: the training loop of both reference recipes, composed at
// compile time. Declarations and documentation here; bodies in
// trainer_impl.hpp.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/loader.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/dist/collectives.hpp"
#include "ddpkit/nn/batch_norm.hpp"
#include "ddpkit/parallel/data_parallel.hpp"
#include "ddpkit/parallel/ddp.hpp"
#include "ddpkit/parallel/single_device.hpp"
#include "ddpkit/train/amp.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/clip.hpp"
#include "ddpkit/train/lr.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/reduction.hpp"
#include "ddpkit/train/signals.hpp"
#include "ddpkit/train/tensorboard.hpp"

namespace ddpkit::train {

/// What the Trainer does; each field says whether changing it after
/// construction has effect (all are read at `fit`).
/// What DDP training does when ranks have different numbers of batches in
/// an epoch.
enum class UnevenInputs {
  /// Fail before the epoch, on every rank, naming the counts (default).
  refuse,
  /// PyTorch's Join: ranks that run out keep taking part in the others'
  /// gradient all-reduces with zeros until every rank is done; the last
  /// rank to finish broadcasts its model (see BasicDDP::engine::join_round).
  join,
};

/// The validation number that ranks checkpoints for `keep_best`.
enum class BestMetric {
  val_acc,   ///< higher is better (default; early stopping always uses it)
  val_loss,  ///< lower is better
};

struct TrainerOptions {
  TORCH_ARG(int, epochs) = 30;
  /// Base learning rate, before the LR-scaling policy and the schedule.
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(ScheduleOptions, schedule) = {};
  /// Early stopping: stop after this many epochs without a better
  /// validation accuracy (0: never).
  TORCH_ARG(int, patience) = 0;
  /// Where rank 0 writes metrics, checkpoints and the summary.
  TORCH_ARG(std::string, out_dir) = "runs/ddpkit";
  /// "" (fresh), a checkpoint path, or "auto" (OUT/checkpoints/last.pt if
  /// it exists).
  TORCH_ARG(std::string, resume) = "";
  /// Resuming from a checkpoint written with another world size or seed is
  /// refused (the sampler's order and each rank's share would change);
  /// true resumes anyway and says what changes.
  TORCH_ARG(bool, resume_allow_changes) = false;
  /// Cap on steps per epoch (0: no cap), for smoke runs and benchmarks.
  TORCH_ARG(int64_t, max_steps) = 0;
  /// Seeds sampling, augmentation (with the rank) and dropout.
  TORCH_ARG(std::uint64_t, seed) = 42;
  /// Write checkpoints/last.pt every epoch and best.pt on improvement.
  TORCH_ARG(bool, checkpoints) = true;
  /// Keep the best this many epochs' checkpoints by `best_metric`:
  /// checkpoints/best.pt is always the best one; with k > 1 the k best are
  /// also kept as checkpoints/best-epoch-<E>.pt (best.pt a hard link to the
  /// first), files that drop out of the k best removed. Ties go to the
  /// earlier epoch. 0: no best checkpoints.
  TORCH_ARG(int, keep_best) = 1;
  /// Also write checkpoints/last.pt within epochs, every this many batches
  /// (counted over the run; 0: at epoch ends only). It holds the batch, the
  /// metrics so far and every rank's CPU generator, so `resume("auto")`
  /// continues at that batch with the weights an uninterrupted run has (CPU:
  /// bit for bit). Needs the same world size to resume; not with
  /// `uneven_inputs(join)`.
  TORCH_ARG(std::int64_t, checkpoint_every_n_steps) = 0;
  /// SIGTERM or SIGINT during `fit` (what torchrun, SLURM and Ctrl-C send
  /// before killing) stops training at the next batch boundary instead of
  /// at once: the ranks agree on the batch (one 8-byte all-reduce per
  /// optimizer step), rank 0 writes checkpoints/last.pt there (as
  /// `checkpoint_every_n_steps` does, resumable with `resume("auto")`), and
  /// `fit` throws `Interrupted` (`launch` exits 128 + the signal). A signal
  /// during evaluation stops after the epoch's checkpoint. A second signal
  /// ends the process at once. With `uneven_inputs(join)` the ranks stop
  /// at the epoch's end. false: the signals keep their usual effect.
  TORCH_ARG(bool, checkpoint_on_signal) = true;
  TORCH_ARG(BestMetric, best_metric) = BestMetric::val_acc;
  /// Also write the model's state dict (Python-loadable) each epoch to this
  /// pattern under OUT, `{epoch}` replaced (flowers:
  /// "weights/model-{epoch}.pt").
  TORCH_ARG(std::string, weights_pattern) = "";
  /// Rank 0 prints progress and one line per epoch.
  TORCH_ARG(bool, verbose) = true;
  /// Names the run in summary.json ("cifar10", "flowers-resnet34").
  TORCH_ARG(std::string, run_name) = "ddpkit";
  /// Drop the tail of the training set so every rank has equal batches.
  TORCH_ARG(bool, drop_last) = false;
  /// Ranks with different batch counts: refuse (default) or join.
  TORCH_ARG(UnevenInputs, uneven_inputs) = UnevenInputs::refuse;
  /// CUDA only: autocast forward and a dynamic loss scale whose overflow
  /// check is reduced across ranks.
  TORCH_ARG(bool, mixed_precision) = false;
  /// Gradient accumulation: this many batches per optimizer step (1: none).
  /// The gradients of the first k-1 are kept locally (the engine's
  /// `no_sync`: DDP communicates once per step, on the last batch), and
  /// each batch's loss is weighted by its share of the step's samples, so
  /// k batches of b equal one batch of k*b (a short last step at the end
  /// of an epoch included). `max_steps` still counts batches. Not with
  /// `uneven_inputs(join)`.
  TORCH_ARG(int, accumulate) = 1;
  /// Gradient clipping (off by default), applied to the averaged gradients
  /// before each optimizer step; with mixed precision after unscaling, and
  /// only on steps that are taken.
  TORCH_ARG(ClipOptions, clip) = {};
  /// Rank 0 writes TensorBoard event files to OUT/tb: per epoch (step =
  /// epoch, 1-based) the recipe's tags train/loss, train/acc, val/loss,
  /// val/acc, lr, plus train/images_per_second, time/train_seconds and
  /// time/val_seconds; per batch train/loss_step (below); the run's
  /// settings as text (tag "hparams"). Flushed at each epoch's end.
  TORCH_ARG(bool, tensorboard) = true;
  /// Every this many batches (counted over the whole run, resumes
  /// included) rank 0 logs its batch loss as train/loss_step (0: never).
  TORCH_ARG(int, log_every_n_steps) = 50;
};

/// The result of `fit`.
struct FitResult {
  std::vector<EpochMetrics> history;
  double best_val_acc = 0;
  int best_epoch = 0;
  int epochs_run = 0;
  bool stopped_early = false;
  double total_seconds = 0;
};

/// Validation loss and accuracy, the same on every rank.
struct EvalResult {
  double loss = 0;
  double accuracy = 0;
  int64_t count = 0;        ///< samples evaluated, all ranks together
  int64_t local_count = 0;  ///< of those, the samples this rank evaluated
};

/// Information handed to user hooks.
struct StepInfo {
  int epoch;
  std::size_t step;
  double loss;
};

/// No hooks: every call compiles away.
struct NoHooks {};

/// Makes the optimizer over the model's parameters (after they are on the
/// device and, for DDP, broadcast from rank 0).
using OptimizerFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::Tensor>)>;

/// The default loss: cross entropy on logits.
struct CrossEntropy {
  torch::Tensor operator()(const torch::Tensor& out,
                           const torch::Tensor& target) const {
    return torch::nn::functional::cross_entropy(out, target);
  }
};

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
          class LRScaling = NoScaling, class Reduction = RankZeroEval>
requires trainable_model<Model> && parallel_policy<Parallel> &&
    parallel_engine<Parallel, Model, dist::Group> && sampler_policy<Sampler> &&
    bn_policy<BN> && lr_scaling_policy<LRScaling> &&
    reduction_policy<Reduction> &&
    sampler_matches_parallel_policy<Parallel, Sampler> &&
    bn_matches_parallel_policy<Parallel, BN>
class Trainer {
 public:
  using model_type = Model;
  using parallel_type = Parallel;
  using sampler_type = Sampler;
  using engine_type = typename Parallel::template engine<Model>;

  Trainer(Model model, OptimizerFactory make_optimizer, TrainerOptions options,
          dist::Group group = {},
          typename Parallel::options_type parallel_options = {},
          std::optional<torch::Device> device = std::nullopt);

  /// Trains for `options.epochs()` epochs (from a checkpoint when resuming),
  /// evaluating on `val` after each; rank 0 writes metrics, checkpoints and
  /// the summary. `hooks` may define `on_epoch_begin(int)`,
  /// `on_step_end(const StepInfo&)`, `on_epoch_end(const EpochMetrics&)`.
  template <class Dataset, class TrainTransform, class EvalTransform,
            class Hooks = NoHooks>
  FitResult fit(const Dataset& train, const Dataset& val,
                TrainTransform train_transform, EvalTransform eval_transform,
                data::LoaderOptions loader_options, Hooks&& hooks = {});

  /// Loss and accuracy over `set`, computed as `Reduction` says and
  /// identical on every rank.
  template <class Dataset, class EvalTransform>
  EvalResult evaluate(const Dataset& set, EvalTransform eval_transform,
                      data::LoaderOptions loader_options);

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
    return Parallel::is_multi_process ? group_.size() : 1;
  }
  bool is_main() const {
    return group_.rank() == 0;
  }
  const TrainerOptions& options() const {
    return options_;
  }

  /// Rank 0 writes OUT/summary.json (fit does this itself; call it again to
  /// add a test-set result).
  void write_summary(const FitResult& r, const EvalResult* test) const;

 private:
  void save_checkpoint(const std::filesystem::path& path, int epochs_done,
                       const std::vector<EpochMetrics>& history, double best,
                       int best_epoch, int bad_epochs);
  int try_resume(std::vector<EpochMetrics>& history, double& best,
                 int& best_epoch, int& bad_epochs);
  std::string hparams_markdown(const data::LoaderOptions& lo) const;
  void save_mid_epoch(const std::filesystem::path& out, int epoch,
                      std::size_t batches_done, const torch::Tensor& sums,
                      const std::vector<EpochMetrics>& history, double best,
                      int best_epoch, int bad_epochs);
  void read_mid_epoch(const Checkpoint& archive,
                      const std::filesystem::path& path);
  void check_resume_settings(const Checkpoint& archive,
                             const std::filesystem::path& path);
  void keep_best_checkpoints(const std::filesystem::path& dir,
                             const std::vector<EpochMetrics>& history,
                             double best, int best_epoch, int bad_epochs);
  template <class Dataset, class EvalTransform>
  torch::Tensor eval_sums(const Dataset& set, EvalTransform& tf,
                          const data::LoaderOptions& lo,
                          const std::vector<std::size_t>& indices);

  static Model prepare(Model model, const dist::Group& g) {
    BN::apply(parallel::as_module(model), g);
    return model;
  }

  dist::Group group_;
  TrainerOptions options_;
  torch::Device device_;
  engine_type engine_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  CrossEntropy loss_fn_;
  LossScaler scaler_;
  std::int64_t global_step_ = 0;  ///< batches trained, resumes included
  std::int64_t last_checkpoint_step_ = 0;
  /// Where an unfinished epoch stands: saved in mid-epoch checkpoints, and
  /// read from one until the resumed epoch starts.
  struct MidEpoch {
    std::int64_t batches_done = 0;  ///< 0: at an epoch's end
    torch::Tensor sums;             ///< [loss sum, correct, count], all ranks
    torch::Tensor rng;              ///< [world, state]: each rank's generator
  } mid_;
};

}  // namespace ddpkit::train

#include "ddpkit/train/trainer_impl.hpp"
