// SPDX-License-Identifier: BSD-3-Clause
// Files that are either the old version or the complete new one. Every
// file ddpkit writes for the user (checkpoints, weights, metrics, summary,
// class indices, traces) goes through `write_atomically`:
//
//   1. the bytes go to a temporary with a unique name beside the target
//      (`NAME.tmp-XXXXXX`, mkstemp), so two writers never share one;
//   2. every write(2), the fsync(2) and the close(2) are checked: a full
//      disk, an I/O error or a quota shows up here, not as a short file;
//   3. optionally the old file is kept as `keep_previous` (a hard link, so
//      the target never disappears), then the temporary is renamed over the
//      target and the folder fsynced.
//
// On any failure the temporary is removed, the old file is untouched, and
// an `IoError` names the file and the system's error text.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include "ddpkit/detail/error.hpp"

namespace ddpkit::detail {

/// "`what` FILE: <system error text>" as an IoError.
inline IoError io_error(std::string_view what, const std::filesystem::path& p,
                        int err) {
  return IoError(cat(what, " ", p.string(), ": ", std::strerror(err)));
}

/// fsync of a folder (after a rename in it). Filesystems that cannot sync a
/// folder (EINVAL) are accepted; any other failure is an IoError.
inline void fsync_directory(const std::filesystem::path& dir) {
  const std::filesystem::path d = dir.empty() ? "." : dir;
  const int fd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw io_error("cannot open folder", d, errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0 && err != EINVAL && err != EROFS) {
    throw io_error("cannot sync folder", d, err);
  }
}

/// Test hook: called between the temporary file's fsync and the rename.
inline std::function<void()>& before_rename_hook() {
  static std::function<void()> hook;
  return hook;
}

/// Writes all of `bytes` to `fd`; the errno of the failure, or 0.
inline int write_all(int fd, std::string_view bytes) {
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += static_cast<std::size_t>(n);
  }
  return 0;
}

/// Makes `to` another name of `from`'s file, atomically (a hard link made
/// as `to.tmp-link` and renamed over `to`); false, with nothing changed,
/// where the filesystem refuses hard links; IoError if the rename fails.
inline bool replace_with_link(const std::filesystem::path& from,
                              const std::filesystem::path& to) {
  const std::string link = to.string() + ".tmp-link";
  ::unlink(link.c_str());
  if (::link(from.c_str(), link.c_str()) != 0) return false;
  if (::rename(link.c_str(), to.c_str()) != 0) {
    const int err = errno;
    ::unlink(link.c_str());
    throw io_error(cat("cannot rename ", link, " to"), to, err);
  }
  return true;
}

/// A temporary beside `path` with a unique name (`NAME.tmp-XXXXXX`), open
/// for writing; removed by the destructor unless `commit`ted.
class TempFile {
 public:
  explicit TempFile(const std::filesystem::path& path) : target_(path) {
    std::string name = path.string() + ".tmp-XXXXXX";
    fd_ = ::mkostemp(name.data(), O_CLOEXEC);
    if (fd_ < 0) throw io_error("cannot create a temporary for", path, errno);
    tmp_ = name;
    ::fchmod(fd_, 0644);  // mkstemp makes 0600; outputs are readable
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!tmp_.empty()) ::unlink(tmp_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void write(std::string_view bytes) {
    if (const int err = write_all(fd_, bytes)) {
      throw io_error("cannot write", target_, err);
    }
  }

  /// fsync, close, (keep the old file as `keep_previous`,) rename over the
  /// target, fsync the folder.
  void commit(const std::filesystem::path& keep_previous = {}) {
    if (::fsync(fd_) != 0) throw io_error("cannot write", target_, errno);
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw io_error("cannot write", target_, errno);
    if (before_rename_hook()) before_rename_hook()();
    if (!keep_previous.empty()) keep_old(keep_previous);
    if (::rename(tmp_.c_str(), target_.c_str()) != 0) {
      throw io_error(cat("cannot rename ", tmp_.string(), " to"), target_,
                     errno);
    }
    tmp_.clear();
    fsync_directory(target_.parent_path());
  }

 private:
  // The target as it is now, under the name `prev` (replacing that), while
  // the target keeps its name: a hard link made beside and renamed over
  // `prev`; where hard links are refused, the target is renamed (for the
  // moment until the new one is renamed in, only `prev` exists).
  void keep_old(const std::filesystem::path& prev) {
    if (::access(target_.c_str(), F_OK) != 0) return;
    if (replace_with_link(target_, prev)) return;
    if (::rename(target_.c_str(), prev.c_str()) != 0) {
      throw io_error("cannot keep the previous file as", prev, errno);
    }
  }

  std::filesystem::path target_, tmp_;
  int fd_ = -1;
};

/// Writes `bytes` to `path` atomically and durably (see the top of this
/// file); with `keep_previous`, the file `path` held until now is kept
/// under that name.
inline void write_atomically(const std::filesystem::path& path,
                             std::string_view bytes,
                             const std::filesystem::path& keep_previous = {}) {
  TempFile tmp(path);
  tmp.write(bytes);
  tmp.commit(keep_previous);
}

/// Makes `to` name the same bytes as `from` atomically: a hard link where
/// the filesystem allows it, else a checked copy.
inline void link_or_copy_atomically(const std::filesystem::path& from,
                                    const std::filesystem::path& to) {
  if (replace_with_link(from, to)) {
    fsync_directory(to.parent_path());
    return;
  }
  // No hard links here (FAT, some network filesystems): copy.
  const int fd = ::open(from.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw io_error("cannot read", from, errno);
  std::string bytes;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      throw io_error("cannot read", from, err);
    }
    if (n == 0) break;
    bytes.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  write_atomically(to, bytes);
}

/// Removes temporaries (`*.tmp-XXXXXX`, `*.tmp-link`) a killed writer left
/// in `dir`; call only while no other writer can use the folder (under
/// the run lock).
inline void remove_stale_temporaries(const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const auto at = n.rfind(".tmp-");
    if (at == std::string::npos) continue;
    const std::string tail = n.substr(at + 5);
    if (tail.size() == 6 || tail == "link") {
      std::error_code ignored;
      fs::remove(e.path(), ignored);
    }
  }
}

}  // namespace ddpkit::detail
