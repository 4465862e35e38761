// SPDX-License-Identifier: BSD-3-Clause
// One run per output folder: an advisory lock (flock(2)) on `OUT/.lock`,
// held while the run trains. A second run on the same folder is refused at
// once, naming the process that holds it; the kernel drops the lock when
// its holder exits however it exits (kill -9 included), so a killed run
// never blocks the next. On NFS, Linux maps flock to the server's POSIX
// locks (untested here).
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>
#include <utility>

#include "ddpkit/detail/error.hpp"

namespace ddpkit::detail {

class RunLock {
 public:
  RunLock() = default;
  /// Locks `dir` (which must exist) or throws a UsageError naming the
  /// process that holds it.
  explicit RunLock(const std::filesystem::path& dir) {
    const auto path = dir / ".lock";
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      throw UsageError(cat("cannot open the run lock ", path.string(), ": ",
                           std::strerror(errno),
                           " (is the output folder writable?)"));
    }
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      std::string holder(256, '\0');
      const ssize_t n = ::pread(fd_, holder.data(), holder.size(), 0);
      holder.resize(n > 0 ? static_cast<std::size_t>(n) : 0);
      while (!holder.empty() && (holder.back() == '\n' || holder.back() == 0)) {
        holder.pop_back();
      }
      ::close(fd_);
      fd_ = -1;
      if (err == EWOULDBLOCK) {
        throw UsageError(
            cat("output folder ", dir.string(), " is in use by another run (",
                holder.empty() ? std::string("holder unknown") : holder,
                "); wait for it to end, stop it, or choose another output "
                "folder"));
      }
      throw UsageError(
          cat("cannot lock ", path.string(), ": ", std::strerror(err)));
    }
    char host[256] = "?";
    ::gethostname(host, sizeof host - 1);
    const std::string who =
        cat("pid ", ::getpid(), " on host ", host, ", since ",
            static_cast<long long>(::time(nullptr)), "\n");
    if (::ftruncate(fd_, 0) == 0) {
      [[maybe_unused]] auto n = ::pwrite(fd_, who.data(), who.size(), 0);
    }
  }
  ~RunLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  RunLock(RunLock&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  RunLock& operator=(RunLock&& o) noexcept {
    if (this != &o) {
      if (fd_ >= 0) ::close(fd_);
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  RunLock(const RunLock&) = delete;
  RunLock& operator=(const RunLock&) = delete;

  bool held() const {
    return fd_ >= 0;
  }

 private:
  int fd_ = -1;
};

}  // namespace ddpkit::detail
