// Checkpoints written atomically (temporary file, flush, fsync, rename), so
// a crash mid-write never leaves a broken `last` or `best`, and loaded with
// errors that name the file and the first mismatching key.
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/nn/state_dict.hpp"

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
/// the file.
inline torch::serialize::InputArchive open_checkpoint(
    const std::filesystem::path& path) {
  if (!std::filesystem::is_regular_file(path)) {
    throw UsageError(
        ddpkit::detail::cat("checkpoint ", path.string(), " does not exist"));
  }
  torch::serialize::InputArchive archive;
  try {
    archive.load_from(path.string());
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    throw UsageError(ddpkit::detail::cat("checkpoint ", path.string(),
                                         " cannot be read (truncated or not a "
                                         "ddpkit checkpoint): ",
                                         what.substr(0, what.find('\n'))));
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
    auto t = it->value().toTensor();
    if (t.sizes() != target.sizes()) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name, "' has shape ",
          c10::str(t.sizes()), " but the model expects ",
          c10::str(target.sizes())));
    }
    target.copy_(t);
  };
  for (auto& p : module.named_parameters()) check(p.key(), p.value());
  for (auto& b : module.named_buffers()) check(b.key(), b.value());
}

}  // namespace ddpkit::train
