// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's byte-order helpers, one of each: read an unsigned little- or
// big-endian integer of up to 8 bytes, append one little-endian. Pickle
// opcodes, zip records and TensorBoard's event files use them.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>

namespace ddpkit::detail {

/// The unsigned little-endian integer in `b` (at most 8 bytes).
inline std::uint64_t read_le(std::string_view b) {
  std::uint64_t v = 0;
  for (std::size_t k = b.size(); k-- > 0;) {
    v = (v << 8) | static_cast<unsigned char>(b[k]);
  }
  return v;
}

/// The unsigned big-endian integer in `b` (at most 8 bytes).
inline std::uint64_t read_be(std::string_view b) {
  std::uint64_t v = 0;
  for (char c : b) v = (v << 8) | static_cast<unsigned char>(c);
  return v;
}

/// Appends `v`'s bytes to `out`, least significant first.
template <class T>
  requires std::is_trivially_copyable_v<T>
void append_le(std::string& out, T v) {
  static_assert(std::endian::native == std::endian::little,
                "ddpkit writes little-endian files from a little-endian host "
                "only (x86-64, aarch64)");
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

}  // namespace ddpkit::detail
