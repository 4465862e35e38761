// SPDX-License-Identifier: BSD-3-Clause
// Where a resume starts from: `--resume PATH|auto` resolved to a file and
// read whole, once, on rank 0 (the checkpoint connector's, and the
// Trainer's for `automatic` settings before the engine is built: the same
// read serves both). See Note [Checkpoint durability] (checkpoint.hpp).
#pragma once

#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/files.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/run_folder.hpp"

namespace ddpkit::train {

/// A checkpoint's bytes as read for a resume, and from where.
struct ResumeSource {
  std::filesystem::path path;
  std::string bytes;
};

/// Rank 0: the checkpoint `resume` names, read whole. "auto": last.pt, or
/// when it is missing or `check` finds it damaged, last-prev.pt (with
/// `warn`, a warning on stderr names the damaged file and why); nullopt
/// when the folder has neither (a fresh start). A named path must exist and
/// is not replaced.
inline std::optional<ResumeSource> read_resume_source(
    const std::string& resume, const std::filesystem::path& out,
    const std::function<void(const std::string&, const std::filesystem::path&)>&
        check,
    bool warn = true) {
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
  if (warn) {
    std::fprintf(stderr,
                 "warning: resume auto: cannot use %s: %s; resuming from the "
                 "checkpoint before it, %s\n",
                 last.c_str(), why.c_str(), prev.c_str());
  }
  auto src = read(prev);
  check(src.bytes, src.path);
  return src;
}

/// The precision and memory format a checkpoint was written with ("" for
/// each it does not record: checkpoints before them), and its path.
struct RecordedSettings {
  std::filesystem::path path;
  std::string precision, memory_format;
};

/// Rank 0's read of the checkpoint a resume starts from, kept so the file
/// is opened and parsed once per fit even when the Trainer needs its
/// recorded settings before the engine exists.
struct ResumeRead {
  enum class Status {
    fresh,   ///< "auto" and the folder has no checkpoint: a fresh start
    read,    ///< `bytes` hold the file at `path`
    failed,  ///< `bytes` hold the error message (a UsageError on resume)
  };
  Status status = Status::fresh;
  std::filesystem::path path;  ///< the file read (or last.pt's path)
  std::string bytes;
  /// The parsed archive, where reading it checked it (every rank parses
  /// `bytes` otherwise).
  std::optional<Checkpoint> parsed;
  std::exception_ptr error;  ///< Status::failed: what was thrown
};

/// Rank 0: reads the checkpoint `resume` (TrainerOptions::resume: a path or
/// "auto") names, as read_resume_source does, with `check` parsing and
/// checking each candidate (it returns the parsed archive and throws what
/// makes it unusable). A named file is checked too; when the check fails
/// it is still returned (Status::read, not parsed): every rank parses its
/// bytes on resume and fails alike. Any other error is returned as
/// Status::failed with its message and the exception (one process
/// rethrows it on resume), never lost. Never throws.
inline ResumeRead read_for_resume(
    const std::string& resume, const std::filesystem::path& out,
    const std::function<Checkpoint(const std::string&,
                                   const std::filesystem::path&)>& check) {
  ResumeRead r;
  r.path =
      resume == "auto" ? last_checkpoint(out) : std::filesystem::path(resume);
  try {
    auto src = read_resume_source(
        resume, out, [&](const std::string& b, const std::filesystem::path& p) {
          r.parsed = check(b, p);
        });
    if (src) {
      r.path = src->path;
      r.bytes = std::move(src->bytes);
      r.status = ResumeRead::Status::read;
      if (!r.parsed) {  // a named file: parsed here when it can be
        try {
          r.parsed = check(r.bytes, r.path);
        } catch (const std::exception&) {
          // Every rank parses the bytes on resume and fails alike there.
        }
      }
    }
  } catch (const std::exception& e) {
    r.status = ResumeRead::Status::failed;
    r.bytes = e.what();
    r.parsed.reset();
    r.error = std::current_exception();
  }
  return r;
}

}  // namespace ddpkit::train
