// SPDX-License-Identifier: BSD-3-Clause
// What this CPU can do fast, read from /proc/cpuinfo (Linux; elsewhere
// nothing is known).
#pragma once

#include <fstream>
#include <sstream>
#include <string>

namespace ddpkit::detail {

/// True when the CPU has bfloat16 arithmetic in hardware: AVX512-BF16
/// (`avx512_bf16`) or AMX (`amx_bf16`), which oneDNN uses for convolutions
/// and matrix products under bfloat16 autocast. Without either, bfloat16
/// is emulated and usually slower than float32.
inline bool cpu_has_bf16() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    std::string w;
    while (words >> w) {
      if (w == "avx512_bf16" || w == "amx_bf16") return true;
    }
    return false;
  }
  return false;
}

}  // namespace ddpkit::detail
