// SPDX-License-Identifier: BSD-3-Clause
// Writes a small synthetic ImageFolder of JPEGs (flower_photos layout) with
// learnable classes, so tests, demos and benchmarks of the JPEG pipeline
// never download anything.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/image_folder.hpp"
#include "ddpkit/data/image_io.hpp"
#include "ddpkit/data/transforms.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/testing/synthetic.hpp"

namespace ddpkit::testing {

/// Options of `make_jpeg_folder`.
struct JpegFolderOptions {
  /// Class folder names (at most 10: class k draws synthetic class k). The
  /// default is flower_photos' five.
  TORCH_ARG(std::vector<std::string>, classes) = {
    "daisy",
    "dandelion",
    "roses",
    "sunflowers",
    "tulips"
  };
  TORCH_ARG(std::size_t, images_per_class) = 20;
  /// The shorter side; the longer one is 1–1.5× it, drawn per image.
  TORCH_ARG(int64_t, short_side) = 96;
  TORCH_ARG(int, quality) = 90;
  TORCH_ARG(std::uint64_t, seed) = 0;
};

/// Writes `root/<class>/<class>_<k>.jpg` for every class and returns the
/// class names. Images are the synthetic set's shapes drawn at 32×32 and
/// scaled up to a random landscape or portrait size.
///
/// Example:
/// ```
/// ddpkit::testing::make_jpeg_folder("/tmp/flowers",
///     ddpkit::testing::JpegFolderOptions().images_per_class(50));
/// auto folder = ddpkit::data::read_image_folder("/tmp/flowers");
/// ```
inline std::vector<std::string> make_jpeg_folder(
    const std::filesystem::path& root, const JpegFolderOptions& opts = {}) {
  namespace fs = std::filesystem;
  const auto& classes = opts.classes();
  if (classes.empty() || classes.size() > 10) {
    throw UsageError(ddpkit::detail::cat("make_jpeg_folder: ", classes.size(),
                                         " classes; expected 1 to 10"));
  }
  for (const auto& c : classes) data::check_class_name(c);
  const auto per = opts.images_per_class();
  auto set = make_synthetic(SyntheticOptions(10 * per).seed(opts.seed()));
  ddpkit::detail::SplitMix rng{
      ddpkit::detail::mix_seed({opts.seed(), 0xF01DE5ull})};
  const int64_t* lab = set.labels.data_ptr<int64_t>();
  std::vector<std::size_t> written(classes.size(), 0);
  for (std::size_t i = 0; i < set.size(); ++i) {
    const auto c = static_cast<std::size_t>(lab[i]);
    if (c >= classes.size()) continue;
    fs::create_directories(root / classes[c]);
    const float aspect = rng.uniform(1.0f, 1.5f);
    int64_t h = opts.short_side(),
            w = static_cast<int64_t>(opts.short_side() * aspect);
    if (rng.uniform() < 0.5f) std::swap(h, w);
    auto img = data::resize_image(set.images[static_cast<int64_t>(i)], h, w)
                   .round_()
                   .clamp_(0, 255)
                   .to(torch::kUInt8);
    data::write_jpeg(
        root / classes[c] /
            ddpkit::detail::cat(classes[c], "_", written[c]++, ".jpg"),
        img, opts.quality());
  }
  return classes;
}

}  // namespace ddpkit::testing
