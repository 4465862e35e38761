// SPDX-License-Identifier: BSD-3-Clause
// The output folder of a run (rank 0's side): one run at a time holds it
// (detail/run_lock.hpp), a fresh run does not silently write over an
// earlier one; where its checkpoints are (`resume("auto")` reads them:
// checkpoint_connector.hpp).
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

// Note [The output folder]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// The output folder (`train/run_folder.hpp`, rank 0): `OUT/.lock` held with
// flock(2) while the Trainer lives (the kernel drops it with the process, so
// a killed run never blocks); a fresh run refuses a folder with an earlier
// run's `last.pt`/`last-prev.pt`/`metrics.jsonl` unless `overwrite`. Errors
// on rank 0 reach every rank through one broadcast
// (`Trainer::on_main_or_fail`), so no rank waits for one that failed.

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

/// What a resume of the run in `out` would start from, in words (for a
/// rank ended by the liveness watch while a signal waited).
inline std::string resume_hint(const std::filesystem::path& out) {
  std::error_code ec;
  if (!out.empty() && std::filesystem::exists(last_checkpoint(out), ec)) {
    return ddpkit::detail::cat("a resume (--resume auto) starts from ",
                               last_checkpoint(out).string(),
                               ", the last checkpoint written");
  }
  return "no checkpoint was written yet: a resume starts from scratch";
}

/// Rank `rank`'s flight record goes to OUT/flight/rank-K.json: an earlier
/// run's record of this rank is removed first (and, on rank 0, every
/// rank's and the doctor's verdicts), so ddpkit-doctor never reads a stale
/// one. Returns the folder.
inline std::filesystem::path prepare_flight_folder(
    const std::filesystem::path& out, int rank) {
  namespace fs = std::filesystem;
  const fs::path dir = out / "flight";
  std::error_code ec;
  fs::remove(dir / ddpkit::detail::cat("rank-", rank, ".json"), ec);
  if (rank == 0 && fs::is_directory(dir, ec)) {
    for (const auto& f : fs::directory_iterator(dir, ec)) {
      const auto name = f.path().filename().string();
      if (name.rfind("rank-", 0) == 0 || name.rfind("verdict.", 0) == 0) {
        fs::remove(f.path(), ec);
      }
    }
  }
  return dir;
}

}  // namespace ddpkit::train
