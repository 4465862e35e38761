// SPDX-License-Identifier: BSD-3-Clause
// A procedurally drawn, learnable stand-in for CIFAR-10: ten classes of
// shapes and textures on noisy backgrounds, 32×32 RGB, deterministic from a
// seed. Tests, examples and benchmarks use it so nothing is ever downloaded.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/cifar10.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/seed.hpp"

namespace ddpkit::testing {

namespace detail {

/// HSV (h in turns) to RGB in [0, 1].
inline std::array<float, 3> hsv_to_rgb(float h, float s, float v) {
  h = h - std::floor(h);
  float r = std::clamp(std::fabs(h * 6.0f - 3.0f) - 1.0f, 0.0f, 1.0f);
  float g = std::clamp(2.0f - std::fabs(h * 6.0f - 2.0f), 0.0f, 1.0f);
  float b = std::clamp(2.0f - std::fabs(h * 6.0f - 4.0f), 0.0f, 1.0f);
  return {v * (1 - s + s * r), v * (1 - s + s * g), v * (1 - s + s * b)};
}

/// Is pixel (x, y) (shape coordinates, about [-1, 1]) foreground for class c.
inline bool synthetic_mask(int c, float x, float y, float freq) {
  const float r = std::sqrt(x * x + y * y);
  switch (c) {
    case 0: return r < 0.85f;                                     // disc
    case 1: return std::max(std::fabs(x), std::fabs(y)) < 0.75f;  // square
    case 2:
      return y < 0.7f && y > -0.8f &&
             std::fabs(x) < (y + 0.8f) * 0.55f;                  // triangle
    case 3: return std::sin(y * freq) > 0.0f;                    // h stripes
    case 4: return std::sin(x * freq) > 0.0f;                    // v stripes
    case 5: return std::sin(x * freq) * std::sin(y * freq) > 0;  // checker
    case 6: return r < 0.9f && r > 0.55f;                        // ring
    case 7:
      return (std::fabs(x) < 0.28f && std::fabs(y) < 0.9f) ||
             (std::fabs(y) < 0.28f && std::fabs(x) < 0.9f);  // cross
    case 8: return std::sin((x + y) * freq * 0.7f) > 0.0f;   // diagonal
    default: return std::sin(x * freq) * std::sin(y * freq) > 0.45f;  // dots
  }
}

}  // namespace detail

/// Names of the synthetic classes, in label order.
inline std::vector<std::string> synthetic_classes() {
  return {"disc",    "square", "triangle", "hstripes", "vstripes",
          "checker", "ring",   "cross",    "diagonal", "dots"};
}

/// Options of `make_synthetic`.
struct SyntheticOptions {
  explicit SyntheticOptions(std::size_t size = 1000) : size_(size) {}
  /// Number of images.
  TORCH_ARG(std::size_t, size);
  /// Seed: the same seed gives the same images, bit for bit.
  TORCH_ARG(std::uint64_t, seed) = 0;
  /// Standard deviation of the per-pixel Gaussian noise (in [0, 1] units).
  TORCH_ARG(float, noise) = 0.06f;
  /// Side of the square images.
  TORCH_ARG(int, image_size) = 32;
};

/// Draws a learnable 10-class dataset: class `i mod 10` for image `i`, a
/// shape or texture whose foreground hue leans to the class (36° apart,
/// ±25° jitter) but whose position, size, rotation, background and noise
/// are random, so a CNN must look at shape as well as colour.
///
/// Example:
/// ```
/// auto train = ddpkit::testing::make_synthetic(
///     ddpkit::testing::SyntheticOptions(5000).seed(1));
/// // train.images: uint8 5000×3×32×32, train.labels: int64 in 0..9
/// ```
inline data::ImageTensors make_synthetic(const SyntheticOptions& opts) {
  const auto n = static_cast<int64_t>(opts.size());
  const int s = opts.image_size();
  data::ImageTensors out;
  out.images = torch::empty({n, 3, s, s}, torch::kUInt8);
  out.labels = torch::empty({n}, torch::kInt64);
  out.classes = synthetic_classes();
  std::uint8_t* img = out.images.data_ptr<std::uint8_t>();
  int64_t* lab = out.labels.data_ptr<int64_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      ddpkit::detail::SplitMix rng{ddpkit::detail::mix_seed(
          {opts.seed(), static_cast<std::uint64_t>(i)})};
      const int c = static_cast<int>(i % 10);
      lab[i] = c;
      const float hue = c / 10.0f + rng.uniform(-0.07f, 0.07f);
      auto fg = detail::hsv_to_rgb(hue, rng.uniform(0.55f, 1.0f),
                                   rng.uniform(0.6f, 1.0f));
      auto bg = detail::hsv_to_rgb(rng.uniform(), rng.uniform(0.0f, 0.4f),
                                   rng.uniform(0.05f, 0.45f));
      const float cx = rng.uniform(-0.25f, 0.25f),
                  cy = rng.uniform(-0.25f, 0.25f);
      const float scale = rng.uniform(0.55f, 0.95f);
      const bool texture = c == 3 || c == 4 || c == 5 || c == 8 || c == 9;
      const float angle = texture ? 0.0f : rng.uniform(-0.5f, 0.5f);
      const float ca = std::cos(angle), sa = std::sin(angle);
      const float freq = rng.uniform(9.0f, 14.0f);
      std::uint8_t* p = img + i * 3 * s * s;
      for (int yy = 0; yy < s; ++yy) {
        for (int xx = 0; xx < s; ++xx) {
          float u = (2.0f * xx + 1.0f) / s - 1.0f - cx;
          float v = (2.0f * yy + 1.0f) / s - 1.0f - cy;
          float x = (ca * u + sa * v) / scale, y = (-sa * u + ca * v) / scale;
          const bool on = detail::synthetic_mask(c, x, y, freq * scale);
          const auto& col = on ? fg : bg;
          for (int ch = 0; ch < 3; ++ch) {
            float val = col[ch] + opts.noise() * rng.normal();
            p[ch * s * s + yy * s + xx] = static_cast<std::uint8_t>(
                std::lround(std::clamp(val, 0.0f, 1.0f) * 255.0f));
          }
        }
      }
    }
  });
  return out;
}

/// Writes `train` and `test` as CIFAR-10 binary files into `dir`
/// (data_batch_1..5.bin with the train records split as evenly as possible,
/// test_batch.bin, batches.meta.txt), so the real reader can be exercised.
/// Images must be 3×32×32 uint8 with labels 0..9.
inline void write_cifar_binary(const std::filesystem::path& dir,
                               const data::ImageTensors& train,
                               const data::ImageTensors& test) {
  namespace fs = std::filesystem;
  fs::create_directories(dir);
  auto write = [](const fs::path& file, const data::ImageTensors& set,
                  int64_t begin, int64_t end) {
    if (set.size() > 0 &&
        (set.images.size(1) != 3 || set.images.size(2) != 32 ||
         set.images.size(3) != 32)) {
      throw UsageError(ddpkit::detail::cat(
          "write_cifar_binary: images must be N×3×32×32, got ",
          set.images.sizes()));
    }
    std::ofstream os(file, std::ios::binary);
    if (!os) {
      throw UsageError(ddpkit::detail::cat("write_cifar_binary: cannot write ",
                                           file.string()));
    }
    if (end <= begin) return;
    auto images = set.images.narrow(0, begin, end - begin).contiguous();
    auto labels = set.labels.narrow(0, begin, end - begin).to(torch::kUInt8);
    auto rec =
        torch::cat({labels.unsqueeze(1), images.reshape({end - begin, 3072})},
                   1)
            .contiguous();
    os.write(reinterpret_cast<const char*>(rec.data_ptr<std::uint8_t>()),
             rec.numel());
  };
  const auto n = static_cast<int64_t>(train.size());
  for (int64_t k = 0; k < 5; ++k) {
    write(dir / ddpkit::detail::cat("data_batch_", k + 1, ".bin"), train,
          n * k / 5, n * (k + 1) / 5);
  }
  write(dir / "test_batch.bin", test, 0, static_cast<int64_t>(test.size()));
  std::ofstream meta(dir / "batches.meta.txt");
  for (const auto& name :
       train.classes.empty() ? data::cifar10_classes() : train.classes)
    meta << name << "\n";
}

}  // namespace ddpkit::testing
