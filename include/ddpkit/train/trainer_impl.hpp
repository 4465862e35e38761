// Bodies of Trainer's members (see trainer.hpp for what they do).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <mutex>

#include "ddpkit/data/loader.hpp"

#define DDPKIT_TRAINER_TEMPLATE                                      \
  template <class Model, class Parallel, class Sampler, class BN,    \
            class LRScaling, class Reduction>                        \
  requires trainable_model<Model> && parallel_policy<Parallel> &&    \
      parallel_engine<Parallel, Model, dist::Group> &&               \
      sampler_policy<Sampler> && bn_policy<BN> &&                    \
      lr_scaling_policy<LRScaling> && reduction_policy<Reduction> && \
      sampler_matches_parallel_policy<Parallel, Sampler> &&          \
      bn_matches_parallel_policy<Parallel, BN>
#define DDPKIT_TRAINER \
  Trainer<Model, Parallel, Sampler, BN, LRScaling, Reduction>

namespace ddpkit::train {

DDPKIT_TRAINER_TEMPLATE
DDPKIT_TRAINER::Trainer(Model model, OptimizerFactory make_optimizer,
                        TrainerOptions options, dist::Group group,
                        typename Parallel::options_type parallel_options,
                        std::optional<torch::Device> device)
    : group_(std::move(group)),
      options_(std::move(options)),
      device_(device.value_or(default_device(group_))),
      engine_(prepare(std::move(model), group_), group_,
              std::move(parallel_options), device_) {
  using ddpkit::detail::cat;
  if (options_.epochs() < 1) {
    throw UsageError(cat("epochs ", options_.epochs(), " must be >= 1"));
  }
  if (!(options_.lr() > 0)) {
    throw UsageError(cat("lr ", options_.lr(), " must be > 0"));
  }
  if (options_.max_steps() < 0) {
    throw UsageError(cat("max_steps ", options_.max_steps(), " must be >= 0"));
  }
  if (options_.checkpoint_every_n_steps() < 0) {
    throw UsageError(cat("checkpoint_every_n_steps ",
                         options_.checkpoint_every_n_steps(),
                         " must be >= 0 (0: at epoch ends only)"));
  }
  if (options_.checkpoint_every_n_steps() > 0 &&
      options_.uneven_inputs() == UnevenInputs::join) {
    throw UsageError(
        "checkpoint_every_n_steps cannot be combined with "
        "uneven_inputs(join): ranks with different batch counts cannot agree "
        "on a step to checkpoint at");
  }
  if (options_.keep_best() < 0) {
    throw UsageError(cat("keep_best ", options_.keep_best(),
                         " must be >= 0 (0: no best checkpoints)"));
  }
  if (options_.log_every_n_steps() < 0) {
    throw UsageError(cat("log_every_n_steps ", options_.log_every_n_steps(),
                         " must be >= 0 (0: never)"));
  }
  if (options_.accumulate() < 1) {
    throw UsageError(cat("accumulate ", options_.accumulate(),
                         " must be >= 1 (batches per optimizer step)"));
  }
  if (options_.accumulate() > 1 &&
      options_.uneven_inputs() == UnevenInputs::join) {
    throw UsageError(cat("accumulate ", options_.accumulate(),
                         " cannot be combined with uneven_inputs(join): a "
                         "rank that has run out cannot tell which of the "
                         "others' batches communicate"));
  }
  options_.clip().check();
  optimizer_ =
      make_optimizer(parallel::as_module(engine_.module()).parameters());
  if (!optimizer_) throw UsageError("the optimizer factory returned nothing");
}

DDPKIT_TRAINER_TEMPLATE
template <class Dataset, class EvalTransform>
torch::Tensor DDPKIT_TRAINER::eval_sums(
    const Dataset& set, EvalTransform& tf, const data::LoaderOptions& lo,
    const std::vector<std::size_t>& indices) {
  // [loss sum, correct, count] in double, so sums are exact enough to be
  // identical whichever rank computed them.
  auto sums = torch::zeros({3}, torch::kFloat64);
  if (indices.empty()) return sums;
  torch::NoGradGuard no_grad;
  torch::nn::Module& module = parallel::as_module(engine_.module());
  const bool was_training = module.is_training();
  module.eval();
  data::Loader loader(set, tf, lo);
  auto epoch = loader.epoch(indices, 0);
  while (auto batch = epoch.next()) {
    torch::Tensor x = batch->data.to(device_);
    torch::Tensor y = batch->target.to(device_);
    torch::Tensor out = engine_.forward(x);
    torch::Tensor loss = torch::nn::functional::cross_entropy(
        out, y,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(
            torch::kSum));
    sums[0] += loss.template item<double>();
    sums[1] += out.argmax(1).eq(y).sum().template item<double>();
    sums[2] += static_cast<double>(y.size(0));
  }
  module.train(was_training);
  return sums;
}

DDPKIT_TRAINER_TEMPLATE
template <class Dataset, class EvalTransform>
EvalResult DDPKIT_TRAINER::evaluate(const Dataset& set,
                                    EvalTransform eval_transform,
                                    data::LoaderOptions lo) {
  lo.drop_last(false);
  lo.rank(group_.rank());
  const std::size_t n = set.size();
  torch::Tensor sums;
  int64_t local = 0;
  const bool distributed = Parallel::is_multi_process && group_.size() > 1;
  if (distributed && Reduction::shards_evaluation) {
    data::DistributedSampling shard(
        n, {.rank = group_.rank(), .world_size = group_.size()},
        data::DistributedSamplingOptions().shuffle(false).evaluation(true));
    sums = eval_sums(set, eval_transform, lo, shard.indices());
    local = static_cast<int64_t>(sums[2].template item<double>());
    sums = sums.to(group_.device());
    dist::all_reduce(group_, sums);
  } else {
    data::SequentialSampling all(n);
    sums = (!distributed || is_main())
               ? eval_sums(set, eval_transform, lo, all.indices())
               : torch::zeros({3}, torch::kFloat64);
    local = static_cast<int64_t>(sums[2].template item<double>());
    sums = sums.to(group_.device());
    if (distributed) dist::broadcast(group_, sums, 0);
  }
  sums = sums.cpu();
  EvalResult r;
  r.count = static_cast<int64_t>(sums[2].template item<double>());
  r.local_count = local;
  if (r.count > 0) {
    r.loss = sums[0].template item<double>() / r.count;
    r.accuracy = sums[1].template item<double>() / r.count;
  }
  return r;
}

DDPKIT_TRAINER_TEMPLATE
void DDPKIT_TRAINER::save_checkpoint(const std::filesystem::path& path,
                                     int epochs_done,
                                     const std::vector<EpochMetrics>& history,
                                     double best, int best_epoch,
                                     int bad_epochs) {
  Checkpoint archive;
  archive.write("format", std::string(kCheckpointFormat));
  archive.write("format_version", kCheckpointVersion);
  archive.write("torch_version", ddpkit::compat::torch_version());
  archive.write(
      "model",
      c10::IValue(nn::state_dict(parallel::as_module(engine_.module()))));
  archive.write_optimizer(*optimizer_);
  archive.write("epochs_done", static_cast<int64_t>(epochs_done));
  archive.write("best_val_acc", best);
  archive.write("best_epoch", static_cast<int64_t>(best_epoch));
  archive.write("bad_epochs", static_cast<int64_t>(bad_epochs));
  archive.write("sampler_epoch", static_cast<int64_t>(epochs_done));
  archive.write("world_size", static_cast<int64_t>(lr_world_size()));
  archive.write("seed", static_cast<int64_t>(options_.seed()));
  archive.write("loss_scale", scaler_.scale());
  archive.write("global_step", global_step_);
  // Batches done in the unfinished epoch `epochs_done` (0: at an epoch's
  // end), and what resuming there needs.
  archive.write("epoch_batches_done", mid_.batches_done);
  if (mid_.batches_done > 0) {
    archive.write("epoch_sums", mid_.sums);
    archive.write("rng_cpu_ranks", mid_.rng);
  }
  auto hist = torch::zeros(
      {static_cast<int64_t>(history.size()), EpochMetrics::kFields},
      torch::kFloat64);
  for (std::size_t i = 0; i < history.size(); ++i) {
    hist[static_cast<int64_t>(i)] = history[i].to_tensor();
  }
  archive.write("history", hist);
  archive.write("rng_cpu", at::detail::getDefaultCPUGenerator().get_state());
  atomic_save(archive, path);
}

DDPKIT_TRAINER_TEMPLATE
int DDPKIT_TRAINER::try_resume(std::vector<EpochMetrics>& history, double& best,
                               int& best_epoch, int& bad_epochs) {
  namespace fs = std::filesystem;
  using ddpkit::detail::cat;
  const std::string& what = options_.resume();
  if (what.empty()) return 0;
  const fs::path path =
      what == "auto" ? fs::path(options_.out_dir()) / "checkpoints" / "last.pt"
                     : fs::path(what);
  // Rank 0 alone reads the file (only rank 0 writes checkpoints, so on a
  // second host without a shared filesystem the others have none) and
  // sends its bytes; every rank parses the same bytes, so every rank
  // resumes, starts fresh or fails alike. Status: 0 fresh, 1 bytes follow,
  // 2 rank 0's error message follows.
  const bool multi = Parallel::is_multi_process && group_.size() > 1;
  std::int64_t status = 0;
  std::string bytes;
  if (is_main()) {
    try {
      if (what != "auto" || fs::is_regular_file(path)) {
        if (!fs::is_regular_file(path)) {
          throw UsageError(
              cat("checkpoint ", path.string(), " does not exist"));
        }
        bytes = ddpkit::detail::read_whole_file(path,
                                                "checkpoint " + path.string());
        status = 1;
      }
    } catch (const std::exception& e) {
      if (!multi) throw;
      status = 2;
      bytes = e.what();
    }
  }
  if (multi) {
    status = dist::broadcast_value(group_, status, 0);
    if (status != 0) bytes = dist::broadcast_string(group_, bytes, 0);
  }
  if (status == 2) throw UsageError(bytes);
  if (status == 0) {
    if (is_main() && options_.verbose()) {
      std::printf("resume auto: no checkpoint at %s, starting fresh\n",
                  path.c_str());
    }
    return 0;
  }
  auto archive = parse_checkpoint(bytes, path);
  check_resume_settings(archive, path);
  load_module_checked(parallel::as_module(engine_.module()), archive, "model",
                      path);
  load_optimizer_checked(*optimizer_, archive, path);
  const auto state = read_resume_state(archive, path);
  const int done = state.epochs_done;
  best = state.best_val_acc;
  best_epoch = state.best_epoch;
  bad_epochs = state.bad_epochs;
  scaler_.set_scale(state.loss_scale);
  global_step_ = state.global_step;
  history = state.history;
  read_mid_epoch(archive, path);
  if (is_main() && options_.verbose()) {
    std::printf("resumed from %s after epoch %d (best val_acc %.4f)\n",
                path.c_str(), done, best);
  }
  return done;
}

DDPKIT_TRAINER_TEMPLATE
void DDPKIT_TRAINER::save_mid_epoch(const std::filesystem::path& out, int epoch,
                                    std::size_t batches_done,
                                    const torch::Tensor& sums,
                                    const std::vector<EpochMetrics>& history,
                                    double best, int best_epoch,
                                    int bad_epochs) {
  // Every rank takes part: the metrics so far over all ranks, and every
  // rank's generator, which only rank 0 writes.
  const bool multi = Parallel::is_multi_process && group_.size() > 1;
  torch::Tensor all = sums.to(group_.device());
  if (multi) dist::all_reduce(group_, all);
  auto rng = at::detail::getDefaultCPUGenerator().get_state();
  torch::Tensor states = rng.unsqueeze(0);
  if (multi) {
    states =
        torch::stack(dist::all_gather(group_, rng.to(group_.device()))).cpu();
  }
  if (!is_main()) return;
  mid_ = {static_cast<std::int64_t>(batches_done), all.cpu(), states};
  save_checkpoint(out / "checkpoints" / "last.pt", epoch, history, best,
                  best_epoch, bad_epochs);
  mid_ = {};
}

DDPKIT_TRAINER_TEMPLATE
void DDPKIT_TRAINER::read_mid_epoch(const Checkpoint& archive,
                                    const std::filesystem::path& path) {
  using ddpkit::detail::cat;
  mid_ = {};
  c10::IValue v;
  if (!archive.try_read("epoch_batches_done", v)) return;  // format 2
  const int done = read_checkpoint_int(archive, "epoch_batches_done", path, 0,
                                       std::numeric_limits<int>::max());
  if (done == 0) return;
  const std::int64_t world = lr_world_size();
  c10::IValue sums, rng;
  const bool ok = archive.try_read("epoch_sums", sums) && sums.isTensor() &&
                  sums.toTensor().numel() == 3 &&
                  archive.try_read("rng_cpu_ranks", rng) && rng.isTensor() &&
                  rng.toTensor().dim() == 2 &&
                  rng.toTensor().scalar_type() == torch::kUInt8;
  if (!ok) {
    throw UsageError(cat("checkpoint ", path.string(), " stops after batch ",
                         done,
                         " of an epoch but lacks 'epoch_sums' or "
                         "'rng_cpu_ranks' (a damaged file?)"));
  }
  if (rng.toTensor().size(0) != world) {
    throw UsageError(cat("checkpoint ", path.string(),
                         " was written in the middle of an epoch "
                         "by ",
                         rng.toTensor().size(0),
                         " ranks; it can only be resumed by as "
                         "many (this run has ",
                         world,
                         "), since each rank's share of the epoch "
                         "depends on it. Resume from an epoch's end, or with ",
                         rng.toTensor().size(0), " ranks"));
  }
  mid_ = {done, sums.toTensor().to(torch::kFloat64).cpu(),
          rng.toTensor().cpu()};
  if (is_main() && options_.verbose()) {
    std::printf(
        "continuing epoch %lld at batch %d\n",
        static_cast<long long>(read_checkpoint_int(
            archive, "epochs_done", path, 0, std::numeric_limits<int>::max())) +
            1,
        done + 1);
  }
}

DDPKIT_TRAINER_TEMPLATE
void DDPKIT_TRAINER::check_resume_settings(const Checkpoint& archive,
                                           const std::filesystem::path& path) {
  using ddpkit::detail::cat;
  const std::int64_t world = Parallel::is_multi_process ? group_.size() : 1;
  const auto seed = static_cast<std::int64_t>(options_.seed());
  std::string changes;
  c10::IValue v;
  if (archive.try_read("world_size", v) && v.isInt() && v.toInt() != world) {
    changes += cat("world size ", v.toInt(), " -> ", world,
                   " (each rank's share of the data and the effective batch "
                   "change)");
  }
  if (archive.try_read("seed", v) && v.isInt() && v.toInt() != seed) {
    changes +=
        cat(changes.empty() ? "" : "; ", "seed ", v.toInt(), " -> ", seed,
            " (the sampler's order, augmentation and dropout draw "
            "differently from the original run)");
  }
  if (changes.empty()) return;
  if (!options_.resume_allow_changes()) {
    throw UsageError(cat("checkpoint ", path.string(),
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

/// The epochs (1-based) of the `k` best rows of `history` by `metric`,
/// best first; ties go to the earlier epoch, NaN ranks last.
inline std::vector<int> best_epochs(const std::vector<EpochMetrics>& history,
                                    BestMetric metric, int k) {
  auto score = [&](const EpochMetrics& m) {
    const double v = metric == BestMetric::val_acc ? m.val_acc : -m.val_loss;
    return std::isnan(v) ? -std::numeric_limits<double>::infinity() : v;
  };
  std::vector<const EpochMetrics*> rows;
  for (const auto& m : history) rows.push_back(&m);
  std::stable_sort(rows.begin(), rows.end(),
                   [&](auto* a, auto* b) { return score(*a) > score(*b); });
  std::vector<int> epochs;
  for (int i = 0; i < k && i < static_cast<int>(rows.size()); ++i) {
    epochs.push_back(rows[i]->epoch);
  }
  return epochs;
}

DDPKIT_TRAINER_TEMPLATE
void DDPKIT_TRAINER::keep_best_checkpoints(
    const std::filesystem::path& dir, const std::vector<EpochMetrics>& history,
    double best, int best_epoch, int bad_epochs) {
  namespace fs = std::filesystem;
  const int k = options_.keep_best();
  if (k == 0 || history.empty()) return;
  // Ranked from the history alone, so a resumed run keeps the same set.
  const auto top = best_epochs(history, options_.best_metric(), k);
  const int epoch = history.back().epoch;
  const int epochs_done = static_cast<int>(history.size());
  auto epoch_file = [&](int e) {
    return dir / ("best-epoch-" + std::to_string(e) + ".pt");
  };
  if (std::find(top.begin(), top.end(), epoch) != top.end()) {
    if (k == 1) {
      save_checkpoint(dir / "best.pt", epochs_done, history, best, best_epoch,
                      bad_epochs);
    } else {
      save_checkpoint(epoch_file(epoch), epochs_done, history, best, best_epoch,
                      bad_epochs);
      if (top.front() == epoch) {
        // best.pt names the same file: a hard link made beside it and
        // renamed over it, so best.pt is always whole.
        const fs::path tmp = dir / "best.pt.link.tmp";
        std::error_code ec;
        fs::remove(tmp, ec);
        fs::create_hard_link(epoch_file(epoch), tmp);
        fs::rename(tmp, dir / "best.pt");
      }
    }
  }
  // Files of epochs no longer among the best (only after the new one is in
  // place: a crash in between leaves one file too many, removed next time).
  // With k = 1 there are none to remove (an earlier run's are left alone).
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    int e = 0;
    char tail = 0;
    if (std::sscanf(name.c_str(), "best-epoch-%d.p%c", &e, &tail) == 2 &&
        name == epoch_file(e).filename().string() && k > 1 &&
        std::find(top.begin(), top.end(), e) == top.end()) {
      fs::remove(entry.path(), ec);
    }
  }
}

DDPKIT_TRAINER_TEMPLATE
std::string DDPKIT_TRAINER::hparams_markdown(
    const data::LoaderOptions& lo) const {
  std::string md = "| setting | value |\n|---|---|\n";
  auto row = [&](const std::string& k, const std::string& v) {
    md += "| " + k + " | " + v + " |\n";
  };
  using detail::num;
  row("run", options_.run_name());
  row("mode", Parallel::name);
  row("world_size", std::to_string(lr_world_size()));
  row("bn", BN::name);
  row("lr_scaling", LRScaling::name);
  row("evaluation", Reduction::name);
  row("epochs", std::to_string(options_.epochs()));
  row("lr", num(options_.lr()));
  row("batch_size_per_rank", std::to_string(lo.batch_size()));
  row("accumulate", std::to_string(options_.accumulate()));
  row("clip_grad_norm", num(options_.clip().max_norm()));
  row("clip_grad_value", num(options_.clip().max_value()));
  row("seed", std::to_string(options_.seed()));
  row("max_steps", std::to_string(options_.max_steps()));
  row("mixed_precision", options_.mixed_precision() ? "true" : "false");
  if constexpr (requires { engine_.comm_name(); }) {
    row("comm", engine_.comm_name());
  }
  row("torch", ddpkit::compat::torch_version());
  return md;
}

DDPKIT_TRAINER_TEMPLATE
void DDPKIT_TRAINER::write_summary(const FitResult& r,
                                   const EvalResult* test) const {
  JsonObject j;
  j.add("example", options_.run_name())
      .add("mode", std::string(Parallel::name))
      .add("world_size", Parallel::is_multi_process ? group_.size() : 1)
      .add("sampler",
           std::string(Parallel::is_multi_process ? "distributed" : "local"))
      .add("bn", std::string(BN::name))
      .add("lr_scaling", std::string(LRScaling::name))
      .add("evaluation", std::string(Reduction::name))
      .add("epochs_run", r.epochs_run)
      .add("stopped_early", r.stopped_early)
      .add("best_epoch", r.best_epoch)
      .add("best_val_acc", r.best_val_acc)
      .add("final_val_acc", r.history.empty() ? 0.0 : r.history.back().val_acc);
  if (test) j.add("test_acc", test->accuracy).add("test_loss", test->loss);
  if constexpr (requires { engine_.comm_name(); }) {
    j.add("comm", engine_.comm_name())
        .add("gradient_bytes_per_step",
             static_cast<double>(engine_.last_step_bytes()));
  }
  // Over the epochs with a train/val split (older checkpoints' rows have
  // none: NaN).
  double images = 0, seconds = 0, train_seconds = 0;
  for (const auto& m : r.history) {
    if (!std::isfinite(m.train_seconds)) continue;
    images += m.epoch_images_per_second * m.seconds;
    seconds += m.seconds;
    train_seconds += m.train_seconds;
  }
  j.add("total_seconds", r.total_seconds)
      .add("train_images_per_second",
           train_seconds > 0 ? images / train_seconds : 0.0)
      .add("epoch_images_per_second", seconds > 0 ? images / seconds : 0.0);
  if (options_.accumulate() > 1) j.add("accumulate", options_.accumulate());
  if (options_.keep_best() != 1 ||
      options_.best_metric() != BestMetric::val_acc) {
    j.add("keep_best", options_.keep_best())
        .add("best_metric",
             std::string(options_.best_metric() == BestMetric::val_acc
                             ? "val_acc"
                             : "val_loss"));
  }
  if (options_.clip().max_norm() > 0) {
    j.add("clip_grad_norm", options_.clip().max_norm())
        .add("clip_norm_type", options_.clip().norm_type());
  }
  if (options_.clip().max_value() > 0) {
    j.add("clip_grad_value", options_.clip().max_value());
  }
  ddpkit::detail::write_atomically(
      std::filesystem::path(options_.out_dir()) / "summary.json", j.str());
}

DDPKIT_TRAINER_TEMPLATE
template <class Dataset, class TrainTransform, class EvalTransform, class Hooks>
FitResult DDPKIT_TRAINER::fit(const Dataset& train, const Dataset& val,
                              TrainTransform train_transform,
                              EvalTransform eval_transform,
                              data::LoaderOptions lo, Hooks&& hooks) {
  namespace fs = std::filesystem;
  using clock = std::chrono::steady_clock;
  const auto fit_start = clock::now();
  const fs::path out = options_.out_dir();
  if (is_main()) {
    std::error_code ec;
    fs::create_directories(out, ec);
    if (ec || access(out.c_str(), W_OK) != 0) {
      throw UsageError(ddpkit::detail::cat("output folder ", out.string(),
                                           " is not writable"));
    }
  }
  const bool multi = Parallel::is_multi_process && group_.size() > 1;
  const int rank = Parallel::is_multi_process ? group_.rank() : 0;
  const int world = Parallel::is_multi_process ? group_.size() : 1;
  if (multi) {
    // Ranks holding different datasets would deadlock later: say so now.
    auto sizes =
        dist::all_gather_value(group_, static_cast<int64_t>(train.size()));
    for (int r = 0; r < world; ++r) {
      if (sizes[r] != sizes[0]) {
        throw UsageError(ddpkit::detail::cat(
            "rank ", r, " has ", sizes[r], " training samples but rank 0 has ",
            sizes[0], "; every rank must read the same dataset"));
      }
    }
  }
  lo.seed(options_.seed()).rank(rank);
  Sampler sampler(train.size(),
                  data::ShardSpec{.rank = rank,
                                  .world_size = world,
                                  .seed = options_.seed(),
                                  .drop_last = options_.drop_last()});
  FitResult result;
  double best = -1;
  int best_epoch = 0, bad_epochs = 0;
  int start = try_resume(result.history, best, best_epoch, bad_epochs);
  last_checkpoint_step_ = global_step_;
  Progress progress(is_main() && options_.verbose());
  std::optional<TensorBoardWriter> tb;
  if (is_main() && options_.tensorboard()) {
    tb.emplace(out / "tb");
    tb->add_text("hparams", hparams_markdown(lo), start);
    tb->flush();
  }
  const auto log_every = options_.log_every_n_steps();
  // SIGTERM/SIGINT only raise a flag from here on; the ranks agree on it
  // (a signal may reach one rank only) and stop after a checkpoint.
  SignalFlag signals(options_.checkpoint_on_signal());
  auto agreed_signal = [&]() -> int {
    if (!signals.armed()) return 0;
    return multi ? dist::all_reduce_value(group_, signals.pending(),
                                          dist::Reduce::max)
                 : signals.pending();
  };
  auto interrupted = [&](int sig, const std::string& where) {
    const char* name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    const std::string msg = ddpkit::detail::cat(
        "stopped by ", name, " ", where, " (global step ", global_step_, "); ",
        options_.checkpoints()
            ? ddpkit::detail::cat(
                  "checkpoint ", (out / "checkpoints" / "last.pt").string(),
                  " holds it: run again with resume(\"auto\") / --resume "
                  "auto to continue")
            : std::string("no checkpoint written (checkpoints are off)"));
    progress.line(msg);
    throw Interrupted(msg, sig);
  };
  torch::nn::Module& module = parallel::as_module(engine_.module());
  const int epochs = options_.epochs();
  data::Loader loader(train, train_transform, lo);
  for (int epoch = start; epoch < epochs; ++epoch) {
    const auto t0 = clock::now();
    const double lr = lr_at<LRScaling>(options_.lr(), world,
                                       options_.schedule(), epoch, epochs);
    set_lr(*optimizer_, lr);
    // Dropout and other in-model randomness: a function of (seed, epoch,
    // rank) alone, so a resumed run draws exactly what the original did.
    torch::manual_seed(options_.seed() * 1000003ull + epoch * 7919ull + rank);
    sampler.set_epoch(static_cast<std::size_t>(epoch));
    std::vector<std::size_t> indices = sampler.indices();
    if (options_.max_steps() > 0) {
      auto cap =
          static_cast<std::size_t>(options_.max_steps()) * lo.batch_size();
      if (indices.size() > cap) indices.resize(cap);
    }
    if constexpr (requires { hooks.on_epoch_begin(epoch); })
      hooks.on_epoch_begin(epoch);
    module.train();
    // A run resumed from a mid-epoch checkpoint continues at its batch.
    const auto first = static_cast<std::size_t>(mid_.batches_done);
    auto batches =
        loader.epoch(indices, static_cast<std::size_t>(epoch), first);
    constexpr bool can_join = requires(engine_type & e) {
      e.join_round(true);
    };
    const bool join = multi && options_.uneven_inputs() == UnevenInputs::join;
    if (join && !can_join) {
      throw UsageError(ddpkit::detail::cat(
          "uneven_inputs(join) needs a parallel policy whose engine has "
          "join_round (DDP's has); this policy's engine has none"));
    }
    if (multi && !join) {
      // Uneven inputs would leave the ranks with more batches waiting in a
      // gradient all-reduce nobody else joins: refuse before the epoch.
      auto counts =
          dist::all_gather_value(group_, static_cast<int64_t>(batches.size()));
      for (int r = 0; r < world; ++r) {
        if (counts[r] != counts[0]) {
          throw UsageError(ddpkit::detail::cat(
              "epoch ", epoch + 1, ": rank ", r, " has ", counts[r],
              " batches but rank 0 has ", counts[0],
              " (uneven inputs would hang DDP); use a sampler that gives "
              "every rank the same number of samples, e.g. "
              "DistributedSampling"));
        }
      }
    }
    progress.begin_epoch(epoch + 1, epochs, batches.size());
    double loss_sum = 0, correct = 0, count = 0;
    std::size_t step = 0;
    const auto k = static_cast<std::size_t>(options_.accumulate());
    std::vector<data::Batch> group;  // one optimizer step's batches
    double resumed_images = 0;       // trained before a mid-epoch checkpoint
    if (first > 0) {
      // Every rank's generator as it was there, and the metrics so far
      // (all ranks' sums, counted once: on rank 0).
      auto state = mid_.rng[rank].contiguous().clone();
      at::Generator gen = at::detail::getDefaultCPUGenerator();  // a handle
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(state);
      if (is_main()) {
        loss_sum = mid_.sums[0].template item<double>();
        correct = mid_.sums[1].template item<double>();
        count = mid_.sums[2].template item<double>();
      }
      step = first;
      resumed_images = mid_.sums[2].template item<double>();
      mid_ = {};
    }
    struct Done {
      double loss, n, correct;
    };
    std::vector<Done> done;
    for (;;) {
      group.clear();
      done.clear();
      if constexpr (can_join) {
        if (join) {
          // Every rank, every round; a rank without a batch shadows the
          // others' all-reduces inside join_round (accumulate is 1 here).
          auto batch = batches.next();
          if (!engine_.join_round(batch.has_value())) break;
          if (!batch) continue;
          group.push_back(std::move(*batch));
        }
      }
      if (!join) {
        while (group.size() < k) {
          auto batch = batches.next();
          if (!batch) break;
          group.push_back(std::move(*batch));
        }
      }
      if (group.empty()) break;
      // Each batch's loss counts by its share of the step's samples, so the
      // summed gradients are those of the joined batch.
      double group_samples = 0;
      for (const auto& b : group) {
        group_samples += static_cast<double>(b.target.size(0));
      }
      engine_.zero_grad();
      const bool amp = options_.mixed_precision() && device_.is_cuda();
      const double scale = amp ? scaler_.scale() : 1.0;
      for (std::size_t i = 0; i < group.size(); ++i) {
        torch::Tensor x = group[i].data.to(device_, /*non_blocking=*/true);
        torch::Tensor y = group[i].target.to(device_, /*non_blocking=*/true);
        const double n = static_cast<double>(y.size(0));
        const double weight = group.size() == 1 ? 1.0 : n / group_samples;
        // Loss as backpropagated: weighted, and scaled under AMP.
        const double factor = weight * scale;
        parallel::StepOutput o;
        auto run = [&] {
          if (amp) {
            ddpkit::compat::AutocastGuard autocast(true, torch::kHalf);
            return engine_.forward_backward(
                x, y, [&](const torch::Tensor& a, const torch::Tensor& b) {
                  return loss_fn_(a.to(torch::kFloat32), b) * factor;
                });
          }
          if (factor == 1.0) return engine_.forward_backward(x, y, loss_fn_);
          return engine_.forward_backward(
              x, y, [&](const torch::Tensor& a, const torch::Tensor& b) {
                return loss_fn_(a, b) * factor;
              });
        };
        if (i + 1 < group.size()) {
          [[maybe_unused]] auto local_only = engine_.no_sync();  // sync last
          o = run();
        } else {
          o = run();
        }
        const double loss = factor == 1.0
                                ? o.loss.template item<double>()
                                : o.loss.template item<double>() / factor;
        done.push_back(
            {loss, n, o.output.argmax(1).eq(y).sum().template item<double>()});
      }
      // The gradients are averaged now; unscale (AMP: one fused pass, one
      // host sync, and the step is skipped everywhere if any rank
      // overflowed), clip, step.
      if (!amp || engine_.unscale_and_check(scaler_)) {
        if (options_.clip().enabled()) {
          clip_gradients(module.parameters(), options_.clip());
        }
        optimizer_->step();
      }
      for (const Done& d : done) {  // after the step, batch by batch
        loss_sum += d.loss * d.n;
        correct += d.correct;
        count += d.n;
        ++step;
        double secs = std::chrono::duration<double>(clock::now() - t0).count();
        progress.step(step, loss_sum / count,
                      secs > 0 ? count * world / secs : 0);
        ++global_step_;
        if (tb && log_every > 0 && global_step_ % log_every == 0) {
          tb->add_scalar("train/loss_step", d.loss, global_step_);
        }
        if constexpr (requires { hooks.on_step_end(StepInfo{}); }) {
          hooks.on_step_end(StepInfo{epoch, step, d.loss});
        }
      }
      // A signal stops the run here, on the batch every rank agrees on,
      // after a checkpoint; so may the periodic checkpoint.
      const int stop_signal = join ? 0 : agreed_signal();
      const auto every = options_.checkpoint_every_n_steps();
      const bool periodic =
          every > 0 && step < batches.size() &&
          global_step_ / every > last_checkpoint_step_ / every;
      if (options_.checkpoints() && (periodic || stop_signal != 0)) {
        save_mid_epoch(
            out, epoch, step,
            torch::tensor({loss_sum, correct, count}, torch::kFloat64),
            result.history, best, best_epoch, bad_epochs);
        if (tb && is_main()) tb->flush();
        last_checkpoint_step_ = global_step_;
      }
      if (stop_signal != 0) {
        interrupted(stop_signal, ddpkit::detail::cat("after batch ", step,
                                                     " of ", batches.size(),
                                                     " in epoch ", epoch + 1));
      }
    }
    // Training metrics over every rank's samples.
    auto t = torch::tensor({loss_sum, correct, count}, torch::kFloat64)
                 .to(group_.device());
    if (multi) dist::all_reduce(group_, t);
    t = t.cpu();
    const auto t_train = clock::now();
    auto ev = evaluate(val, eval_transform, lo);
    const auto t_val = clock::now();
    EpochMetrics m;
    m.epoch = epoch + 1;
    const double total = t[2].template item<double>();
    m.train_loss = total > 0 ? t[0].template item<double>() / total : 0;
    m.train_acc = total > 0 ? t[1].template item<double>() / total : 0;
    m.val_loss = ev.loss;
    m.val_acc = ev.accuracy;
    m.lr = lr;
    const auto since = [](auto a, auto b) {
      return std::chrono::duration<double>(b - a).count();
    };
    m.seconds = since(t0, clock::now());
    m.train_seconds = since(t0, t_train);
    m.val_seconds = since(t_train, t_val);
    if (multi) {
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
    const double trained = total - resumed_images;
    m.train_images_per_second =
        m.train_seconds > 0 ? trained / m.train_seconds : 0;
    m.epoch_images_per_second = m.seconds > 0 ? trained / m.seconds : 0;
    result.history.push_back(m);
    // Decisions use only values every rank holds, so every rank decides
    // the same.
    const bool improved = m.val_acc > best;
    if (improved) {
      best = m.val_acc;
      best_epoch = m.epoch;
      bad_epochs = 0;
    } else {
      ++bad_epochs;
    }
    progress.end_epoch(m);
    if (is_main()) {
      if (options_.checkpoints()) {
        save_checkpoint(out / "checkpoints" / "last.pt", epoch + 1,
                        result.history, best, best_epoch, bad_epochs);
        keep_best_checkpoints(out / "checkpoints", result.history, best,
                              best_epoch, bad_epochs);
      }
      if (!options_.weights_pattern().empty()) {
        std::string rel = options_.weights_pattern();
        auto at = rel.find("{epoch}");
        if (at != std::string::npos) rel.replace(at, 7, std::to_string(epoch));
        auto path = out / rel;
        fs::create_directories(path.parent_path());
        nn::save_state_dict(module, path);
      }
      write_metrics_files(out, result.history);
      if (tb) {
        // After the checkpoint: a run killed in between lacks this epoch
        // here rather than logging it twice once resumed.
        const std::pair<const char*, double> scalars[] = {
            {"train/loss", m.train_loss},
            {"train/acc", m.train_acc},
            {"val/loss", m.val_loss},
            {"val/acc", m.val_acc},
            {"lr", m.lr},
            {"train/images_per_second", m.train_images_per_second},
            {"time/train_seconds", m.train_seconds},
            {"time/val_seconds", m.val_seconds}};
        for (const auto& [tag, value] : scalars) {
          tb->add_scalar(tag, value, m.epoch);
        }
        tb->flush();
      }
    }
    if constexpr (requires { hooks.on_epoch_end(m); }) hooks.on_epoch_end(m);
    if (const int sig = agreed_signal()) {
      interrupted(sig, ddpkit::detail::cat("after epoch ", m.epoch));
    }
    if (options_.patience() > 0 && bad_epochs >= options_.patience()) {
      result.stopped_early = true;
      progress.line(ddpkit::detail::cat("early stopping after epoch ", m.epoch,
                                        ": no better val_acc for ",
                                        options_.patience(), " epochs"));
      break;
    }
  }
  result.best_val_acc = std::max(best, 0.0);
  result.best_epoch = best_epoch;
  result.epochs_run = static_cast<int>(result.history.size());
  result.total_seconds =
      std::chrono::duration<double>(clock::now() - fit_start).count();
  if (is_main()) write_summary(result, nullptr);
  return result;
}

}  // namespace ddpkit::train

#undef DDPKIT_TRAINER_TEMPLATE
#undef DDPKIT_TRAINER
