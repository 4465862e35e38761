// SPDX-License-Identifier: BSD-3-Clause
// Reading a whole file, once: checkpoints, state dicts and images all go
// through `read_whole_file`. (Writing goes through atomic_file.hpp.)
#pragma once

#include <filesystem>
#include <fstream>
#include <string>

#include "ddpkit/detail/error.hpp"

namespace ddpkit::detail {

/// The whole file at `path` (as a std::string, or any contiguous container
/// of bytes); a UsageError "WHAT: cannot open/read PATH" when it cannot be
/// read.
template <class Bytes = std::string>
Bytes read_whole_file(const std::filesystem::path& path,
                      const std::string& what) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) throw UsageError(cat(what, ": cannot open ", path.string()));
  const auto size = static_cast<std::streamoff>(in.tellg());
  if (size < 0) throw UsageError(cat(what, ": cannot read ", path.string()));
  Bytes bytes(static_cast<std::size_t>(size), {});
  in.seekg(0);
  if (!in.read(reinterpret_cast<char*>(bytes.data()),
               static_cast<std::streamsize>(bytes.size()))) {
    throw UsageError(cat(what, ": cannot read ", path.string()));
  }
  return bytes;
}

}  // namespace ddpkit::detail
