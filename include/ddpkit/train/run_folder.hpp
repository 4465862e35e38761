// SPDX-License-Identifier: BSD-3-Clause
// The output folder of a run (rank 0's side): one run at a time holds it
// (detail/run_lock.hpp), a fresh run does not silently write over an
// earlier one, and `resume("auto")` finds the newest checkpoint that is
// whole, falling back from a damaged `last.pt` to `last-prev.pt`.
#pragma once

#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/files.hpp"
#include "ddpkit/detail/run_lock.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/train/options.hpp"

namespace ddpkit::train {

/// The newest checkpoint of a run and the one before it (kept until the
/// newest is durable).
inline std::filesystem::path last_checkpoint(const std::filesystem::path& out) {
  return out / "checkpoints" / "last.pt";
}
inline std::filesystem::path previous_checkpoint(
    const std::filesystem::path& out) {
  return out / "checkpoints" / "last-prev.pt";
}

/// The files in `out` that show an earlier run (its checkpoints, its
/// metrics), relative to `out`.
inline std::vector<std::string> earlier_run_files(
    const std::filesystem::path& out) {
  std::vector<std::string> found;
  for (const char* f :
       {"checkpoints/last.pt", "checkpoints/last-prev.pt", "metrics.jsonl"}) {
    std::error_code ec;
    if (std::filesystem::exists(out / f, ec)) found.emplace_back(f);
  }
  return found;
}

/// Rank 0, before training: makes `out`, locks it for this run, removes
/// temporaries a killed run left, and refuses to start fresh over an
/// earlier run unless `overwrite` (which then removes its checkpoints and
/// metrics). Returns the lock, to be held while the run writes.
inline ddpkit::detail::RunLock prepare_output_folder(
    const std::filesystem::path& out, const TrainerOptions& o) {
  namespace fs = std::filesystem;
  using ddpkit::detail::cat;
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec || ::access(out.c_str(), W_OK) != 0) {
    throw UsageError(cat("output folder ", out.string(), " is not writable",
                         ec ? cat(" (", ec.message(), ")") : std::string()));
  }
  ddpkit::detail::RunLock lock(out);
  ddpkit::detail::remove_stale_temporaries(out);
  ddpkit::detail::remove_stale_temporaries(out / "checkpoints");
  const auto earlier = earlier_run_files(out);
  const bool has_checkpoint = fs::exists(last_checkpoint(out), ec) ||
                              fs::exists(previous_checkpoint(out), ec);
  const bool fresh =
      o.resume().empty() || (o.resume() == "auto" && !has_checkpoint);
  if (fresh && !earlier.empty()) {
    if (!o.overwrite()) {
      const bool auto_resume = o.resume() == "auto";
      throw UsageError(cat(
          "output folder ", out.string(), " holds an earlier run (",
          ddpkit::detail::join(earlier, ", "), ")",
          auto_resume ? " but no checkpoint to resume from"
                      : "; continue it with resume(\"auto\") / --resume auto",
          "; start over there with overwrite(true) / --overwrite (removes its "
          "checkpoints and metrics), or choose another output folder"));
    }
    // Start over: what a later resume("auto") or a reader could mistake
    // for this run's.
    for (const auto& e : fs::directory_iterator(out / "checkpoints", ec)) {
      const std::string n = e.path().filename().string();
      if (n.starts_with("last") || n.starts_with("best")) {
        std::error_code ignored;
        fs::remove(e.path(), ignored);
      }
    }
    for (const char* f : {"metrics.jsonl", "metrics.csv", "summary.json"}) {
      std::error_code ignored;
      fs::remove(out / f, ignored);
    }
  }
  return lock;
}

/// A checkpoint's bytes as read for a resume, and from where.
struct ResumeSource {
  std::filesystem::path path;
  std::string bytes;
};

/// Rank 0: the checkpoint `resume` names, read whole. "auto": last.pt, or
/// when it is missing or `check` finds it damaged, last-prev.pt (a warning
/// on stderr names the damaged file and why); nullopt when the folder has
/// neither (a fresh start). A named path must exist and is not replaced.
inline std::optional<ResumeSource> read_resume_source(
    const std::string& resume, const std::filesystem::path& out,
    const std::function<void(const std::string&, const std::filesystem::path&)>&
        check) {
  namespace fs = std::filesystem;
  using ddpkit::detail::cat;
  auto read = [](const fs::path& p) {
    return ResumeSource{
        p, ddpkit::detail::read_whole_file(p, "checkpoint " + p.string())};
  };
  if (resume != "auto") {
    if (!fs::is_regular_file(resume)) {
      throw UsageError(cat("checkpoint ", resume, " does not exist"));
    }
    return read(resume);
  }
  const fs::path last = last_checkpoint(out), prev = previous_checkpoint(out);
  std::string why;
  if (fs::is_regular_file(last)) {
    try {
      auto src = read(last);
      check(src.bytes, src.path);
      return src;
    } catch (const Error& e) {
      if (!fs::is_regular_file(prev)) throw;
      why = e.what();
    }
  } else if (!fs::is_regular_file(prev)) {
    return std::nullopt;
  } else {
    why = "it is missing (a run stopped while replacing it)";
  }
  std::fprintf(stderr,
               "warning: resume auto: cannot use %s: %s; resuming from the "
               "checkpoint before it, %s\n",
               last.c_str(), why.c_str(), prev.c_str());
  auto src = read(prev);
  check(src.bytes, src.path);
  return src;
}

}  // namespace ddpkit::train
