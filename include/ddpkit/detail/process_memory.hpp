// SPDX-License-Identifier: BSD-3-Clause
// What the kernel says this process holds in memory (Linux /proc), for
// memory figures measured outside the code they describe: libtorch's CPU
// allocator sees neither the shared-memory segments the gradient buckets
// live in nor what malloc keeps after a free.
//
// Note [Measured memory]
// A rank's peak is the kernel's high-water mark of its resident set
// (VmHWM), reset at the start of each training step (writing "5" to
// /proc/self/clear_refs), read at its end, the largest kept: every page
// the rank touched, however it was allocated. Shared pages count in full in
// every process that maps them, so the resident peak alone would charge a
// DDP rank for the other ranks' shared-memory buckets it reads. The
// proportional figure corrects that: resident peak - shared resident
// (RssShmem) + the rank's proportional share of the shared pages
// (Pss_Shmem, /proc/self/smaps_rollup), the shared figures read when the fit
// ends (the segments live from the engine's start to its end). Summed over
// the ranks of one host it counts each shared page once.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace ddpkit::detail {

/// The value, in bytes, of the line `key` ("VmHWM:", "Pss_Shmem:", ...) of a
/// /proc file in "key: N kB" form; 0 when the file or line is missing.
inline uint64_t proc_kib_field(const char* file, const std::string& key) {
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.compare(0, key.size(), key) != 0) continue;
    try {
      return std::stoull(line.substr(key.size())) * 1024;
    } catch (...) {
      return 0;
    }
  }
  return 0;
}

/// The process's memory as the kernel counts it. See Note [Measured
/// memory].
struct ProcessMemory {
  /// Resets the resident-set high-water mark to the current resident set.
  /// False where the kernel refuses (then the peak runs from the process's
  /// start).
  static bool reset_peak() {
    std::ofstream f("/proc/self/clear_refs");
    f << "5";
    f.flush();
    return static_cast<bool>(f);
  }
  /// The resident set's high-water mark since the last reset (VmHWM).
  static uint64_t peak_resident() {
    return proc_kib_field("/proc/self/status", "VmHWM:");
  }
  /// Shared memory (shmem, tmpfs: /dev/shm segments) resident now, counted
  /// in full (RssShmem).
  static uint64_t shared_resident() {
    return proc_kib_field("/proc/self/status", "RssShmem:");
  }
  /// This process's proportional share of the shared memory resident now
  /// (Pss_Shmem: each page divided by the processes that map it).
  static uint64_t shared_proportional() {
    return proc_kib_field("/proc/self/smaps_rollup", "Pss_Shmem:");
  }
};

}  // namespace ddpkit::detail
