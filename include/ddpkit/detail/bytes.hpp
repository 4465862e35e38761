// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's byte-order helpers, one of each: read an unsigned little- or
// big-endian integer of up to 8 bytes, append one little-endian; the zip
// format's CRC-32. Pickle opcodes, zip records and TensorBoard's event
// files use them.
#pragma once

#include <array>
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

/// CRC-32 (IEEE 802.3, as zip stores it) of `b`, slice-by-4: a few
/// hundred MB/s, checked once per checkpoint read.
inline std::uint32_t crc32(std::string_view b) {
  static const auto tables = [] {
    std::array<std::array<std::uint32_t, 256>, 4> t{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 4; ++s) {
        t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
      }
    }
    return t;
  }();
  std::uint32_t c = 0xFFFFFFFFu;
  const auto* p = reinterpret_cast<const unsigned char*>(b.data());
  std::size_t n = b.size();
  for (; n >= 4; n -= 4, p += 4) {
    c ^= static_cast<std::uint32_t>(p[0]) |
         static_cast<std::uint32_t>(p[1]) << 8 |
         static_cast<std::uint32_t>(p[2]) << 16 |
         static_cast<std::uint32_t>(p[3]) << 24;
    c = tables[3][c & 0xFF] ^ tables[2][(c >> 8) & 0xFF] ^
        tables[1][(c >> 16) & 0xFF] ^ tables[0][c >> 24];
  }
  for (; n > 0; --n, ++p) c = tables[0][(c ^ *p) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

/// 64-bit FNV-1a of `b`, continuing from `h`: a cheap fingerprint (of a
/// dataset's file list, say), not a checksum against tampering.
inline std::uint64_t fnv1a(std::string_view b,
                           std::uint64_t h = 0xcbf29ce484222325ull) {
  for (unsigned char c : b) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  return h;
}

/// `h` as 16 hex digits.
inline std::string hex64(std::uint64_t h) {
  std::string s(16, '0');
  for (int i = 15; i >= 0; --i, h >>= 4) s[i] = "0123456789abcdef"[h & 15];
  return s;
}

}  // namespace ddpkit::detail
