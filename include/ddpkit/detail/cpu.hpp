// SPDX-License-Identifier: BSD-3-Clause
// What this CPU can do fast, read from /proc/cpuinfo (Linux; elsewhere
// nothing is known).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace ddpkit::detail {

/// True when /proc/cpuinfo's first "flags" line lists `flag` (e.g.
/// "amx_bf16"); false where there is no such file.
inline bool cpu_has_flag(const std::string& flag) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::string w;
    while (words >> w) {
      if (w == flag) return true;
    }
    return false;
  }
  return false;
}

/// True when the CPU has bfloat16 arithmetic in hardware: AVX512-BF16
/// (`avx512_bf16`) or AMX (`amx_bf16`), which oneDNN uses for convolutions
/// and matrix products under bfloat16 autocast. Without either, bfloat16
/// is emulated and usually slower than float32.
inline bool cpu_has_bf16() {
  return cpu_has_flag("avx512_bf16") || cpu_has_flag("amx_bf16");
}

}  // namespace ddpkit::detail
