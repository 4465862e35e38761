// SPDX-License-Identifier: BSD-3-Clause
// Files that are either the old version or the complete new one: written to
// `path.tmp`, fsynced, renamed over `path`, and the folder fsynced. Every
// file ddpkit writes for the user (checkpoints, metrics, summary, weights)
// goes through here.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <string_view>

#include "ddpkit/detail/error.hpp"

namespace ddpkit::detail {

inline void fsync_path(const std::filesystem::path& p, bool directory) {
  int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

/// Test hook: called between the temporary file's fsync and the rename.
inline std::function<void()>& before_rename_hook() {
  static std::function<void()> hook;
  return hook;
}

/// Moves the fully written `tmp` over `path`: fsync, rename, fsync folder.
inline void commit_file(const std::filesystem::path& tmp,
                        const std::filesystem::path& path) {
  fsync_path(tmp, false);
  if (before_rename_hook()) before_rename_hook()();
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    throw UsageError(cat("cannot rename ", tmp.string(), " to ", path.string(),
                         ": ", ec.message()));
  }
  fsync_path(path.parent_path(), true);
}

/// Writes `bytes` to `path` atomically (through `path.tmp`).
inline void write_atomically(const std::filesystem::path& path,
                             std::string_view bytes) {
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) {
      throw UsageError(cat("cannot write ", tmp.string(),
                           " (is the output folder writable?)"));
    }
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) throw UsageError(cat("writing ", tmp.string(), " failed"));
  }
  commit_file(tmp, path);
}

}  // namespace ddpkit::detail
