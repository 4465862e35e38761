// SPDX-License-Identifier: BSD-3-Clause
// ImageFolder: one subfolder per class (the flower_photos layout), classes
// sorted by name, a seeded per-class train/validation split and
// class_indices.json, as the flowers recipe's `read_split_data` does.
#pragma once

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/image_io.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/bytes.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/json.hpp"

namespace ddpkit::data {

/// Throws unless `name` is safe as one path component: class names become
/// folder names (and JSON values), so "..", "." and separators are refused.
inline void check_class_name(const std::string& name) {
  if (name.empty() || name == "." || name == ".." ||
      name.find_first_of("/\\") != std::string::npos ||
      name.find('\0') != std::string::npos) {
    throw UsageError(ddpkit::detail::cat(
        "class name '", name,
        "' is not a plain folder name (no '/', '\\', '.', '..' or empty)"));
  }
}

/// One image file and its class.
struct ImageSample {
  std::filesystem::path path;
  int64_t label;
};

/// A list of image files decoded on demand: the `Loader` dataset of an
/// `ImageFolder` part. `get` yields an `ImageBatch`: the files' bytes, which
/// `ImageNetTrain` / `ImageNetEval` decode themselves (only what the crop
/// needs, fused with the resize), or which convert to uint8 3×H×W tensors
/// of varying sizes for any other transform.
class ImageFiles {
 public:
  ImageFiles() = default;
  ImageFiles(std::vector<ImageSample> samples, std::vector<std::string> classes,
             int64_t decode_min_side, bool skip_corrupt)
      : samples_(std::move(samples)),
        classes_(std::move(classes)),
        decode_min_side_(decode_min_side),
        skip_corrupt_(skip_corrupt),
        corrupt_(std::make_shared<std::atomic<std::size_t>>(0)) {}

  std::size_t size() const {
    return samples_.size();
  }
  const std::vector<ImageSample>& samples() const {
    return samples_;
  }
  /// What a checkpoint records to notice changed data at a resume: the
  /// files' names, labels and sizes, hashed, then each class's file count
  /// for the message when they differ ("files:<hash>;daisy=633;roses=641").
  std::string fingerprint() const {
    std::uint64_t h = ddpkit::detail::fnv1a("");
    std::vector<std::size_t> counts(classes_.size());
    for (const auto& s : samples_) {
      if (s.label >= 0 && static_cast<std::size_t>(s.label) < counts.size()) {
        ++counts[static_cast<std::size_t>(s.label)];
      }
      std::error_code ec;
      const auto size = std::filesystem::file_size(s.path, ec);
      h = ddpkit::detail::fnv1a(
          ddpkit::detail::cat(s.path.string(), '\n', s.label, '\n',
                              ec ? 0 : size, '\n'),
          h);
    }
    std::string fp = "files:" + ddpkit::detail::hex64(h);
    for (std::size_t c = 0; c < classes_.size(); ++c) {
      fp += ddpkit::detail::cat(';', classes_[c], '=', counts[c]);
    }
    return fp;
  }
  const std::vector<std::string>& classes() const {
    return classes_;
  }
  /// Files found corrupt while loading (only counted with `skip_corrupt`).
  std::size_t corrupt_count() const {
    return corrupt_ ? corrupt_->load() : 0;
  }

  /// Reads `indices`. Without `skip_corrupt` the files stay undecoded
  /// (the transform decodes them; a corrupt or truncated file is a
  /// UsageError naming it, raised there; a file that is neither JPEG nor
  /// PNG is one here). With `skip_corrupt` every file is
  /// decoded here, and a corrupt one is left out of the batch (and its
  /// label with it) and counted.
  std::pair<ImageBatch, torch::Tensor> get(
      const std::vector<std::size_t>& indices) const {
    std::vector<ImageBatch::Item> items;
    std::vector<int64_t> labels;
    items.reserve(indices.size());
    for (auto i : indices) {
      const auto& s = samples_.at(i);
      ImageBatch::Item item{nullptr, s.path.string(), {}, decode_min_side_};
      try {
        auto bytes = std::make_shared<std::vector<unsigned char>>(
            read_file_bytes(s.path));
        if (!is_jpeg(*bytes) && !is_png(*bytes)) {
          throw UsageError(
              ddpkit::detail::cat("not a JPEG or PNG image: ", item.name));
        }
        if (skip_corrupt_) {
          item.image = decode_image_bytes(*bytes, decode_min_side_, item.name);
        } else {
          item.bytes = std::move(bytes);
        }
      } catch (const UsageError&) {
        if (!skip_corrupt_) throw;
        corrupt_->fetch_add(1);
        continue;
      }
      items.push_back(std::move(item));
      labels.push_back(s.label);
    }
    return {ImageBatch(std::move(items)), torch::tensor(labels, torch::kInt64)};
  }

 private:
  std::vector<ImageSample> samples_;
  std::vector<std::string> classes_;
  int64_t decode_min_side_ = 0;
  bool skip_corrupt_ = false;
  std::shared_ptr<std::atomic<std::size_t>> corrupt_;
};

/// Options of `read_image_folder`.
struct ImageFolderOptions {
  /// Fraction of each class held out for validation (the recipe's 0.2).
  TORCH_ARG(double, val_ratio) = 0.2;
  /// Seed of the split (the recipe seeds Python's `random` with 0).
  TORCH_ARG(std::uint64_t, seed) = 0;
  /// File extensions taken, compared case-insensitively.
  TORCH_ARG(std::vector<std::string>, extensions) = { ".jpg", ".jpeg", ".png" };
  /// Where to write class_indices.json (`{"0": "daisy", ...}`, atomically);
  /// empty (default): don't. (The recipe writes it to the current folder;
  /// the flowers example writes it into its output folder, rank 0 only.)
  TORCH_ARG(std::filesystem::path, class_indices_json) = "";
  /// When images are decoded to tensors (`ImageBatch::tensors()`, or
  /// with `skip_corrupt`): decode JPEGs scaled down so both sides stay >=
  /// this (0: full size). `ImageNetTrain` / `ImageNetEval` ignore it on
  /// undecoded files: they pick the DCT scale from the crop and output
  /// size themselves.
  TORCH_ARG(int64_t, decode_min_side) = 0;
  /// Check every file's header while scanning and leave out (and count) the
  /// unreadable ones; also drop corrupt files from batches instead of
  /// throwing. Off: a corrupt file is a UsageError naming it.
  TORCH_ARG(bool, skip_corrupt) = false;
};

/// The two parts of an ImageFolder.
struct ImageFolder {
  ImageFiles train;
  ImageFiles val;
  std::vector<std::string> classes;
  /// Files left out by `skip_corrupt` while scanning.
  std::vector<std::filesystem::path> skipped;
};

/// `{"0": "daisy", ...}` with json.dumps(indent=4)'s layout.
inline std::string class_indices_json(const std::vector<std::string>& classes) {
  ddpkit::detail::JsonObject j;
  for (std::size_t i = 0; i < classes.size(); ++i) {
    j.add(std::to_string(i), classes[i]);
  }
  return j.indented(4);
}

/// Scans `root` (one subfolder per class, sorted by name), splits each class
/// by a seeded choice of `floor(n * val_ratio)` validation images (the
/// recipe's `random.sample`, though not Python's exact draw), and writes
/// class_indices.json. Fails when `root` has no class folder, a class
/// folder has no image, or either part ends up empty.
///
/// Example:
/// ```
/// auto flowers = ddpkit::data::read_image_folder("flower_photos");
/// ddpkit::data::Loader loader(flowers.train, ddpkit::data::ImageNetTrain{},
///                             ddpkit::data::LoaderOptions(16).workers(4));
/// ```
inline ImageFolder read_image_folder(const std::filesystem::path& root,
                                     const ImageFolderOptions& opts = {}) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(root)) {
    throw UsageError(ddpkit::detail::cat("ImageFolder: ", root.string(),
                                         " is not a folder"));
  }
  if (!(opts.val_ratio() >= 0.0 && opts.val_ratio() < 1.0)) {
    throw UsageError(ddpkit::detail::cat(
        "ImageFolder: val_ratio ", opts.val_ratio(), " must be in [0, 1)"));
  }
  ImageFolder out;
  for (const auto& e : fs::directory_iterator(root)) {
    if (e.is_directory()) out.classes.push_back(e.path().filename().string());
  }
  std::sort(out.classes.begin(), out.classes.end());
  if (out.classes.empty()) {
    throw UsageError(ddpkit::detail::cat(
        "ImageFolder: ", root.string(),
        " has no class folders (expected one subfolder of images per class)"));
  }
  auto lower = [](std::string s) {
    for (auto& c : s)
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  std::vector<std::string> exts;
  for (const auto& x : opts.extensions()) exts.push_back(lower(x));
  std::vector<ImageSample> train, val;
  for (std::size_t c = 0; c < out.classes.size(); ++c) {
    check_class_name(out.classes[c]);
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(root / out.classes[c])) {
      if (!e.is_regular_file()) continue;
      const auto ext = lower(e.path().extension().string());
      if (std::find(exts.begin(), exts.end(), ext) == exts.end()) continue;
      if (opts.skip_corrupt() && !image_header_ok(e.path())) {
        out.skipped.push_back(e.path());
        continue;
      }
      files.push_back(e.path());
    }
    if (files.empty()) {
      throw UsageError(ddpkit::detail::cat("ImageFolder: class folder ",
                                           (root / out.classes[c]).string(),
                                           " has no images"));
    }
    std::sort(files.begin(), files.end());
    const auto n_val = static_cast<std::size_t>(
        static_cast<double>(files.size()) * opts.val_ratio());
    auto perm = detail::seeded_permutation(files.size(), opts.seed() + c);
    std::vector<bool> is_val(files.size(), false);
    for (std::size_t k = 0; k < n_val; ++k) is_val[perm[k]] = true;
    for (std::size_t k = 0; k < files.size(); ++k) {
      (is_val[k] ? val : train).push_back({files[k], static_cast<int64_t>(c)});
    }
  }
  if (train.empty() || val.empty()) {
    throw UsageError(ddpkit::detail::cat(
        "ImageFolder: ", root.string(), " split into ", train.size(),
        " training and ", val.size(),
        " validation images; both must be non-empty (more images per class or "
        "another val_ratio than ",
        opts.val_ratio(), ")"));
  }
  if (!opts.class_indices_json().empty()) {
    ddpkit::detail::write_atomically(opts.class_indices_json(),
                                     class_indices_json(out.classes));
  }
  out.train = ImageFiles(std::move(train), out.classes, opts.decode_min_side(),
                         opts.skip_corrupt());
  out.val = ImageFiles(std::move(val), out.classes, opts.decode_min_side(),
                       opts.skip_corrupt());
  return out;
}

}  // namespace ddpkit::data
