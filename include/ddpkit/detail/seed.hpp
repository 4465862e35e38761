// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's one seed mixer and small generator: splitmix64 (Steele, Lea and
// Flood, "Fast splittable pseudorandom number generators", 2014). Every
// derived seed in ddpkit (batch augmentation, dropout per epoch and rank,
// PowerSGD's projections, synthetic data) goes through `splitmix64` or
// `mix_seed`, so neighbouring inputs give unrelated streams; a torch
// generator from a seed is `make_generator`.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

namespace ddpkit::detail {

inline constexpr std::uint64_t kGoldenGamma = 0x9E3779B97F4A7C15ull;

/// One splitmix64 step of state `z`: a bijection of 64-bit values whose
/// outputs for neighbouring inputs look unrelated.
constexpr std::uint64_t splitmix64(std::uint64_t z) {
  z += kGoldenGamma;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// A seed that depends on every one of `parts`, in order:
/// `mix_seed({seed, epoch, rank})`.
constexpr std::uint64_t mix_seed(std::initializer_list<std::uint64_t> parts) {
  std::uint64_t h = 0;  // the first part's mix is splitmix64(0 ^ part)
  for (auto p : parts) h = splitmix64(h ^ p);
  return h;
}

/// A tiny counter-based generator, so draw `i` of seed `s` is the same
/// whatever the thread that makes it.
struct SplitMix {
  std::uint64_t state;
  std::uint64_t next() {
    const auto z = state;
    state += kGoldenGamma;
    return splitmix64(z);
  }
  /// Uniform in [0, 1).
  float uniform() {
    return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
  }
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * uniform();
  }
  /// Standard normal (Box–Muller; one value per call keeps it stateless).
  float normal() {
    float u1 = std::max(uniform(), 1e-7f), u2 = uniform();
    return std::sqrt(-2.0f * std::log(u1)) * std::cos(6.2831853f * u2);
  }
};

/// A CPU generator seeded with `seed`: the only source of randomness the
/// data transforms use, so a (seed, batch) pair always gives the same batch.
inline torch::Generator make_generator(std::uint64_t seed) {
  return at::detail::createCPUGenerator(seed);
}

}  // namespace ddpkit::detail
