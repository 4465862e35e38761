// SPDX-License-Identifier: BSD-3-Clause
// Seeded permutations shared by the samplers and the dataset splits (kept
// apart from samplers.hpp so the readers need no sampler machinery; C++17
// clean, as the fuzz targets compile it as C++17: see tests/fuzz).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

namespace ddpkit::data::detail {

/// A permutation of [0, n) equal to Python's
/// `g = torch.Generator(); g.manual_seed(seed); torch.randperm(n,
/// generator=g)`.
inline std::vector<std::size_t> seeded_permutation(std::size_t n,
                                                   std::uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto perm = torch::randperm(static_cast<int64_t>(n), gen,
                              torch::TensorOptions(torch::kInt64));
  const int64_t* p = perm.data_ptr<int64_t>();
  return std::vector<std::size_t>(p, p + n);
}

}  // namespace ddpkit::data::detail
