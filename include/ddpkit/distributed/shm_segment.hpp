// SPDX-License-Identifier: BSD-3-Clause
// Shared-memory segments every rank of a host maps (ShmSegment), and the
// per-rank regions in one (ShmArena): what the shared-memory channel
// (shm.hpp) reduces in. See Note [The shared-memory channel].
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/distributed/topology.hpp"

namespace ddpkit::dist {

// Note [Shared memory between ranks on one host]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Shared memory between ranks on one host (`distributed/shm.hpp`). gloo sends
// CPU tensors over TCP even on loopback (0.6 GB/s here); when every rank
// shares the host, `Group::init` maps one segment and `all_reduce_async`
// sends sums and means of contiguous CPU float/double/int/long tensors
// through it: double-buffered 2 MiB slots per rank, reduce-scatter then
// gather, futex waits (no spinning on an oversubscribed machine), a channel
// thread so the call stays asynchronous. Each element is summed by one rank
// and copied to all, so every rank has the same bits. A mean
// (`all_reduce_mean_async`, what DDP's gradients use) scales each rank's
// slice while it is in cache instead of dividing the whole bucket first: one
// pass over 45 MB per step less for ResNet-18. A rank that dies is noticed
// from its pid within ~0.1 s (zombies count as dead). Max/min, other types,
// all-gathers and broadcasts use gloo; `DDPKIT_SHM=0` turns it off.

/// A segment mapped by every rank of a host, made by a collective over the
/// store: rank 0 creates it (fully allocated: a full /dev/shm fails here,
/// not later with SIGBUS), every rank maps it, and its name is removed as
/// soon as all have, so a crash leaves nothing behind. Null on every rank
/// unless every rank mapped it.
class ShmSegment {
 public:
  /// Byte ranges [offset, offset + length) of the segment.
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;

  /// Collective: a segment of `bytes` every rank maps, or null on every
  /// rank. Rank 0 creates the file at its full size without allocating it;
  /// each rank then allocates `mine`, the parts it writes first (its own
  /// region or slots), so on a multi-socket host their pages come from its
  /// own NUMA node (first touch), not all from rank 0's. A rank that cannot
  /// allocate its part (/dev/shm too small) makes every rank give up.
  static std::shared_ptr<ShmSegment> create(const compat::StorePtr& store,
                                            const std::string& key, int rank,
                                            int world, std::size_t bytes,
                                            const Ranges& mine) {
    using ddpkit::detail::cat;
    std::string path;
    if (rank == 0) {
      std::random_device rd;
      path = cat("/dev/shm/ddpkit-", ::getpid(), "-", rd());
      int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd < 0 || ::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        if (fd >= 0) ::close(fd);
        ::unlink(path.c_str());
        path.clear();  // tells the others: no segment
      } else {
        ::close(fd);
      }
      store->set(key + "path", detail::to_bytes(path.empty() ? "-" : path));
    } else {
      path = detail::from_bytes(store->get(key + "path"));
      if (path == "-") path.clear();
    }
    std::shared_ptr<ShmSegment> seg;
    if (!path.empty()) {
      int fd = ::open(path.c_str(), O_RDWR);
      bool allocated = fd >= 0;
      for (const auto& [offset, length] : mine) {
        allocated = allocated && offset + length <= bytes &&
                    ::posix_fallocate(fd, static_cast<off_t>(offset),
                                      static_cast<off_t>(length)) == 0;
      }
      if (allocated) {
        void* base =
            ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (base != MAP_FAILED) {
          seg.reset(new ShmSegment(static_cast<char*>(base), bytes));
        }
      }
      if (fd >= 0) ::close(fd);
    }
    // Everyone reports; the segment is used only if every rank mapped it.
    const bool all_ok = detail::all_ranks_say(store, key + "ok/", rank, world,
                                              seg ? "1" : "0") &&
                        seg;
    // Every rank has opened the file (or given up): its name can go.
    auto left = store->add(key + "attached", 1);
    if (rank == 0 && !path.empty()) {
      while (left < world) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        left = store->add(key + "attached", 0);
      }
      ::unlink(path.c_str());
    }
    return all_ok ? seg : nullptr;
  }

  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment() {
    ::munmap(base_, bytes_);
  }
  char* data() const {
    return base_;
  }

 private:
  ShmSegment(char* base, std::size_t bytes) : base_(base), bytes_(bytes) {}
  char* base_;
  std::size_t bytes_;
};

/// Buffers every rank of a host can read: one region per rank, equal in
/// size, in one shared segment. Tensors allocated here (`ShmChannel::
/// shared_buffer`) are reduced in place: each rank sums its slice straight
/// from the others' regions and copies the others' reduced slices, so the
/// data is not copied into the channel and back out.
class ShmArena {
 public:
  ShmArena(std::shared_ptr<ShmSegment> seg, std::size_t region_bytes, int rank)
      : seg_(std::move(seg)), region_bytes_(region_bytes), rank_(rank) {}
  char* region(int r) const {
    return seg_->data() + static_cast<std::size_t>(r) * region_bytes_;
  }
  /// Whether [p, p + n) lies in this rank's region; its offset there.
  bool holds(const void* p, std::size_t n, std::size_t* offset) const {
    auto* c = static_cast<const char*>(p);
    const char* mine = region(rank_);
    if (c < mine || c + n > mine + region_bytes_) return false;
    *offset = static_cast<std::size_t>(c - mine);
    return true;
  }

 private:
  std::shared_ptr<ShmSegment> seg_;
  std::size_t region_bytes_;
  int rank_;
};

}  // namespace ddpkit::dist
