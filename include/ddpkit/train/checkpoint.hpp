// Checkpoints written atomically (temporary file, flush, fsync, rename), so
// a crash mid-write never leaves a broken `last` or `best`, and loaded with
// errors that name the file and the first mismatching key.
#pragma once

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/archive_check.hpp"
#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/loaded_tensors.hpp"
#include "ddpkit/nn/state_dict.hpp"
#include "ddpkit/train/metrics.hpp"

namespace ddpkit::train {

/// Test hook: called between the temporary file's fsync and the rename.
using ddpkit::detail::before_rename_hook;

/// Writes `archive` to `path` atomically: `path.tmp` first, fsync, rename.
/// Readers see the old file or the new one, never a partial one.
inline void atomic_save(torch::serialize::OutputArchive& archive,
                        const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) {
    throw UsageError(ddpkit::detail::cat("cannot create folder ",
                                         path.parent_path().string(), ": ",
                                         ec.message()));
  }
  auto tmp = path;
  tmp += ".tmp";
  try {
    archive.save_to(tmp.string());
  } catch (const c10::Error& e) {
    fs::remove(tmp, ec);
    throw UsageError(ddpkit::detail::cat("cannot write checkpoint ",
                                         tmp.string(), ": ",
                                         e.what_without_backtrace()));
  }
  ddpkit::detail::commit_file(tmp, path);
}

/// Reads a checkpoint archive, turning libtorch's errors into one that names
/// the file. The archive is checked before libtorch reads it
/// (`archive_check.hpp`), and every tensor in it after (`loaded_tensors.hpp`):
/// a damaged file is a UsageError, not a crash or an out-of-bounds read.
inline torch::serialize::InputArchive open_checkpoint(
    const std::filesystem::path& path) {
  if (!std::filesystem::is_regular_file(path)) {
    throw UsageError(
        ddpkit::detail::cat("checkpoint ", path.string(), " does not exist"));
  }
  torch::serialize::InputArchive archive;
  auto unreadable = [&](std::string what) {
    return UsageError(ddpkit::detail::cat(
        "checkpoint ", path.string(),
        " cannot be read (truncated or not a ddpkit checkpoint): ",
        what.substr(0, what.find('\n'))));
  };
  try {
    // libtorch trusts the archive's sizes and compiles its code entries,
    // crashing or allocating gigabytes on some damaged ones: check first.
    ddpkit::detail::check_archive(
        path, ddpkit::detail::cat("checkpoint ", path.string()), "ddpkit");
    archive.load_from(path.string());
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw unreadable(e.what_without_backtrace());
  } catch (const std::exception& e) {
    // A damaged archive also makes libtorch's unpickler and TorchScript
    // importer throw standard exceptions (std::out_of_range from the
    // pickle's memo, torch::jit::ErrorReport from its code/ entries).
    throw unreadable(e.what());
  }
  for (const auto& key : archive.keys()) {
    c10::IValue value;
    if (archive.try_read(key, value)) {
      ddpkit::detail::check_loaded_tensors(
          value,
          ddpkit::detail::cat("checkpoint ", path.string(), ": '", key, "'"));
    }
  }
  return archive;
}

/// Loads a module's state from `archive[key]` (a dict written from
/// `nn::state_dict`), checking every parameter and buffer: a missing key or a
/// shape mismatch is an error naming the file and the first such key.
inline void load_module_checked(torch::nn::Module& module,
                                torch::serialize::InputArchive& archive,
                                const std::string& key,
                                const std::filesystem::path& file) {
  c10::IValue value;
  if (!archive.try_read(key, value) || !value.isGenericDict()) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(),
                                         " has no '", key, "' state"));
  }
  auto dict = value.toGenericDict();
  torch::NoGradGuard no_grad;
  auto check = [&](const std::string& name, torch::Tensor& target) {
    auto it = dict.find(name);
    if (it == dict.end()) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name,
          "' is missing (the checkpoint is of another model)"));
    }
    if (!it->value().isTensor()) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name, "' holds a ",
          it->value().tagKind(), ", not a tensor"));
    }
    auto t = it->value().toTensor();
    ddpkit::detail::check_loaded_tensor(
        t, ddpkit::detail::cat("checkpoint ", file.string(), ": key '", name,
                               "'"));
    if (t.sizes() != target.sizes()) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name, "' has shape ",
          c10::str(t.sizes()), " but the model expects ",
          c10::str(target.sizes())));
    }
    try {
      target.copy_(t);
    } catch (const c10::Error& e) {  // e.g. a quantized or complex tensor
      const std::string what = e.what_without_backtrace();
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name,
          "' cannot be copied into the model (", t.scalar_type(),
          "): ", what.substr(0, what.find('\n'))));
    }
  };
  for (auto& p : module.named_parameters()) check(p.key(), p.value());
  for (auto& b : module.named_buffers()) check(b.key(), b.value());
}

/// Loads `optimizer`'s state from `archive["optimizer"]`; a UsageError
/// naming the file when it is missing or does not fit (libtorch throws
/// c10::Error or, for a damaged archive, torch::jit::ObjectAttributeError).
inline void load_optimizer_checked(torch::optim::Optimizer& optimizer,
                                   torch::serialize::InputArchive& archive,
                                   const std::filesystem::path& file) {
  torch::serialize::InputArchive opt_archive;
  if (!archive.try_read("optimizer", opt_archive)) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(),
                                         " has no optimizer state"));
  }
  auto does_not_fit = [&](const std::string& what) {
    return UsageError(
        ddpkit::detail::cat("checkpoint ", file.string(),
                            ": optimizer state does not fit this "
                            "optimizer (another optimizer type or model?): ",
                            what.substr(0, 200)));
  };
  try {
    optimizer.load(opt_archive);
  } catch (const c10::Error& e) {
    throw does_not_fit(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw does_not_fit(e.what());
  }
}

/// The number `archive[key]` (a one-element real or integer tensor); a
/// UsageError naming the file and key when it is missing or not one number.
inline double read_checkpoint_scalar(torch::serialize::InputArchive& archive,
                                     const std::string& key,
                                     const std::filesystem::path& file) {
  c10::IValue v;
  if (!archive.try_read(key, v)) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(),
                                         " lacks '", key, "'"));
  }
  if (!v.isTensor() || v.toTensor().numel() != 1 ||
      !(v.toTensor().is_floating_point() ||
        c10::isIntegralType(v.toTensor().scalar_type(),
                            /*includeBool=*/true))) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(), ": '",
                                         key, "' is not a number"));
  }
  return v.toTensor().to(torch::kFloat64).item<double>();
}

/// `read_checkpoint_scalar` for a whole number in [lo, hi].
inline int read_checkpoint_int(torch::serialize::InputArchive& archive,
                               const std::string& key,
                               const std::filesystem::path& file, int lo,
                               int hi) {
  const double v = read_checkpoint_scalar(archive, key, file);
  if (!(v >= lo && v <= hi) || v != std::floor(v)) {
    std::ostringstream value;
    value << std::setprecision(17) << v;
    throw UsageError(ddpkit::detail::cat(
        "checkpoint ", file.string(), ": '", key, "' is ", value.str(),
        ", not a whole number in ", lo, "..", hi));
  }
  return static_cast<int>(v);
}

/// What `Trainer` resumes from besides the model and the optimizer.
struct ResumeState {
  int epochs_done = 0;
  double best_val_acc = 0;
  int best_epoch = 0;
  int bad_epochs = 0;
  double loss_scale = 1;
  std::vector<EpochMetrics> history;
};

/// Reads `ResumeState` from a checkpoint `Trainer` wrote; a UsageError
/// naming the file and key for anything missing or malformed.
inline ResumeState read_resume_state(torch::serialize::InputArchive& archive,
                                     const std::filesystem::path& file) {
  constexpr int kMax = std::numeric_limits<int>::max();
  ResumeState r;
  r.epochs_done = read_checkpoint_int(archive, "epochs_done", file, 0, kMax);
  r.best_val_acc = read_checkpoint_scalar(archive, "best_val_acc", file);
  r.best_epoch = read_checkpoint_int(archive, "best_epoch", file, -1, kMax);
  r.bad_epochs = read_checkpoint_int(archive, "bad_epochs", file, 0, kMax);
  r.loss_scale = read_checkpoint_scalar(archive, "loss_scale", file);
  c10::IValue hist;
  if (archive.try_read("history", hist)) {
    const bool ok = hist.isTensor() && hist.toTensor().dim() == 2 &&
                    hist.toTensor().size(1) == EpochMetrics::kFields &&
                    hist.toTensor().is_floating_point();
    if (!ok) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": 'history' is not an N x ",
          EpochMetrics::kFields, " table of numbers"));
    }
    auto h = hist.toTensor().to(torch::kFloat64).contiguous();
    for (int64_t i = 0; i < h.size(0); ++i) {
      const double epoch = h[i][0].item<double>();
      if (!(epoch >= 0 && epoch <= kMax)) {
        throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(),
                                             ": 'history' row ", i,
                                             " has epoch ", epoch));
      }
      r.history.push_back(EpochMetrics::from_tensor(h[i]));
    }
  }
  return r;
}

}  // namespace ddpkit::train
