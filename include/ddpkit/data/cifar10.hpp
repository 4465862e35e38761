// SPDX-License-Identifier: BSD-3-Clause
// CIFAR-10 binary reader (`cifar-10-batches-bin`) and `ImageTensors`, the
// in-memory form every small dataset in ddpkit takes: uint8 images N×3×H×W
// and int64 labels, split reproducibly into train/validation by a seed.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/permutation.hpp"
#include "ddpkit/detail/bytes.hpp"
#include "ddpkit/detail/error.hpp"

namespace ddpkit::data {

/// A labelled image set held in memory: `images` uint8 N×3×H×W (RGB, CHW),
/// `labels` int64 N. Cheap to copy (tensors share storage). Usable directly
/// as a `Loader` dataset.
struct ImageTensors {
  torch::Tensor images;
  torch::Tensor labels;
  std::vector<std::string> classes;

  std::size_t size() const {
    return images.defined() ? static_cast<std::size_t>(images.size(0)) : 0;
  }
  std::size_t num_classes() const {
    return classes.size();
  }
  /// What a checkpoint records to notice changed data at a resume: the
  /// shape, the labels and the first and last 64 KiB of the images,
  /// hashed ("tensors:<hash>"; cheap, not every pixel).
  std::string fingerprint() const {
    if (!images.defined()) return "";
    const torch::Tensor img = images.contiguous();
    const torch::Tensor lab = labels.contiguous().to(torch::kInt64);
    const auto bytes = static_cast<std::size_t>(img.nbytes());
    const std::string_view all(static_cast<const char*>(img.data_ptr()), bytes);
    const std::size_t k = std::min<std::size_t>(bytes, 65536);
    std::uint64_t h = ddpkit::detail::fnv1a(
        ddpkit::detail::cat(img.sizes(), img.dtype().name()));
    h = ddpkit::detail::fnv1a(all.substr(0, k), h);
    h = ddpkit::detail::fnv1a(all.substr(bytes - k), h);
    h = ddpkit::detail::fnv1a(
        std::string_view(static_cast<const char*>(lab.data_ptr()),
                         static_cast<std::size_t>(lab.nbytes())),
        h);
    return "tensors:" + ddpkit::detail::hex64(h);
  }

  /// The rows `indices`, in that order (a copy).
  ImageTensors subset(const std::vector<std::size_t>& indices) const {
    auto idx =
        torch::empty({static_cast<int64_t>(indices.size())}, torch::kInt64);
    std::copy(indices.begin(), indices.end(), idx.data_ptr<int64_t>());
    return {images.index_select(0, idx), labels.index_select(0, idx), classes};
  }

  /// Loader interface: the uint8 images and int64 labels of `indices`.
  std::pair<torch::Tensor, torch::Tensor> get(
      const std::vector<std::size_t>& indices) const {
    auto s = subset(indices);
    return {s.images, s.labels};
  }
};

/// A train/validation split of one set.
struct Split {
  ImageTensors train;
  ImageTensors val;
};

/// Splits `set` into train and validation: `floor(n * val_ratio)` samples go
/// to validation, chosen by `randperm(n)` seeded with `seed` (the same split
/// on every run and every rank). Each part keeps the original order.
inline Split split_train_val(const ImageTensors& set, double val_ratio,
                             std::uint64_t seed) {
  if (!(val_ratio >= 0.0 && val_ratio < 1.0)) {
    throw UsageError(ddpkit::detail::cat("split_train_val: val_ratio ",
                                         val_ratio, " must be in [0, 1)"));
  }
  const auto n = set.size();
  const auto n_val =
      static_cast<std::size_t>(static_cast<double>(n) * val_ratio);
  auto perm = detail::seeded_permutation(n, seed);
  std::vector<std::size_t> val(perm.begin(), perm.begin() + n_val);
  std::vector<std::size_t> train(perm.begin() + n_val, perm.end());
  std::sort(val.begin(), val.end());
  std::sort(train.begin(), train.end());
  return {set.subset(train), set.subset(val)};
}

/// The ten class names, in label order.
inline std::vector<std::string> cifar10_classes() {
  return {"airplane", "automobile", "bird",  "cat",  "deer",
          "dog",      "frog",       "horse", "ship", "truck"};
}

/// Options of `load_cifar10`.
struct Cifar10Options {
  /// Fraction of the training files held out for validation (the recipe's
  /// `val_ratio`).
  TORCH_ARG(double, val_ratio) = 0.1;
  /// Seed of the train/validation split.
  TORCH_ARG(std::uint64_t, split_seed) = 0;
  /// Read the five training files (false: only the test file, train empty).
  TORCH_ARG(bool, load_train) = true;
};

/// The CIFAR-10 sets: `train` and `val` come from data_batch_1..5.bin,
/// `test` from test_batch.bin.
struct Cifar10 {
  ImageTensors train;
  ImageTensors val;
  ImageTensors test;
};

inline constexpr std::int64_t kCifarRecordBytes = 1 + 3 * 32 * 32;

/// Accepts either the folder holding `data_batch_1.bin` or its parent (the
/// folder that holds `cifar-10-batches-bin`), as `--data DIR` does.
inline std::filesystem::path resolve_cifar10_dir(
    const std::filesystem::path& dir) {
  namespace fs = std::filesystem;
  if (fs::is_directory(dir / "cifar-10-batches-bin"))
    return dir / "cifar-10-batches-bin";
  return dir;
}

namespace detail {

/// The number of records in `bytes` bytes of CIFAR-10 data; a UsageError
/// naming `name` when it is not a whole number of records.
inline std::int64_t cifar10_record_count(std::int64_t bytes,
                                         const std::string& name) {
  if (bytes % kCifarRecordBytes != 0) {
    throw UsageError(ddpkit::detail::cat(
        "CIFAR-10: ", name, " has ", bytes,
        " bytes, not a multiple of the record size ", kCifarRecordBytes,
        " (1 label byte + 3072 image bytes)"));
  }
  return bytes / kCifarRecordBytes;
}

/// Checks the labels of `raw` (uint8 N×3073 records) and splits it into
/// images and labels; errors name `name` and the byte offset.
inline ImageTensors cifar10_from_records(const torch::Tensor& raw,
                                         const std::string& name) {
  const auto n = raw.size(0);
  const std::uint8_t* p = raw.data_ptr<std::uint8_t>();
  for (std::int64_t i = 0; i < n; ++i) {
    if (p[i * kCifarRecordBytes] > 9) {
      throw UsageError(ddpkit::detail::cat(
          "CIFAR-10: ", name, " has label ", int(p[i * kCifarRecordBytes]),
          " at byte offset ", i * kCifarRecordBytes, " (record ", i,
          "); labels must be 0..9 — is this CIFAR-100 or a damaged file?"));
    }
  }
  ImageTensors out;
  out.labels = raw.select(1, 0).to(torch::kInt64);
  out.images = raw.narrow(1, 1, 3072).reshape({n, 3, 32, 32}).contiguous();
  out.classes = cifar10_classes();
  return out;
}

}  // namespace detail

/// Parses CIFAR-10 binary data held in memory (the bytes of one
/// `cifar-10-batches-bin` file); errors name `name` and the byte offset,
/// as `read_cifar10_file`'s do.
inline ImageTensors parse_cifar10_bytes(const void* data, std::size_t size,
                                        const std::string& name = "<memory>") {
  const auto n =
      detail::cifar10_record_count(static_cast<std::int64_t>(size), name);
  auto raw = torch::empty({n, kCifarRecordBytes}, torch::kUInt8);
  if (size > 0) std::memcpy(raw.data_ptr<std::uint8_t>(), data, size);
  return detail::cifar10_from_records(raw, name);
}

/// Reads one CIFAR-10 binary file: records of 1 label byte + 3072 image
/// bytes (R, G, B planes of 32×32).
inline ImageTensors read_cifar10_file(const std::filesystem::path& file) {
  namespace fs = std::filesystem;
  if (!fs::is_regular_file(file)) {
    throw UsageError(ddpkit::detail::cat(
        "CIFAR-10: missing file ", file.string(),
        " (expected the cifar-10-batches-bin layout: data_batch_1..5.bin, "
        "test_batch.bin)"));
  }
  const auto bytes = static_cast<std::int64_t>(fs::file_size(file));
  const auto n = detail::cifar10_record_count(bytes, file.string());
  // Read straight into the records tensor (no second copy).
  auto raw = torch::empty({n, kCifarRecordBytes}, torch::kUInt8);
  std::ifstream in(file, std::ios::binary);
  in.read(reinterpret_cast<char*>(raw.data_ptr<std::uint8_t>()), bytes);
  if (!in) {
    throw UsageError(
        ddpkit::detail::cat("CIFAR-10: could not read ", file.string()));
  }
  return detail::cifar10_from_records(raw, file.string());
}

/// Concatenates several files' records in order.
inline ImageTensors read_cifar10_files(
    const std::vector<std::filesystem::path>& files) {
  std::vector<torch::Tensor> images, labels;
  for (const auto& f : files) {
    auto part = read_cifar10_file(f);
    images.push_back(part.images);
    labels.push_back(part.labels);
  }
  if (images.empty())
    return {torch::empty({0, 3, 32, 32}, torch::kUInt8),
            torch::empty({0}, torch::kInt64), cifar10_classes()};
  return {torch::cat(images), torch::cat(labels), cifar10_classes()};
}

/// Reads class names from batches.meta.txt (one per line), or the standard
/// names when the file is absent.
inline std::vector<std::string> read_cifar10_meta(
    const std::filesystem::path& dir) {
  std::ifstream in(dir / "batches.meta.txt");
  if (!in) return cifar10_classes();
  std::vector<std::string> names;
  for (std::string line; std::getline(in, line);) {
    while (!line.empty() && (line.back() == '\r' || line.back() == ' '))
      line.pop_back();
    if (!line.empty()) names.push_back(line);
  }
  return names.size() == 10 ? names : cifar10_classes();
}

/// Loads CIFAR-10 from `dir` (or `dir/cifar-10-batches-bin`) and splits the
/// training files into train/validation.
///
/// Example:
/// ```
/// auto cifar = ddpkit::data::load_cifar10("data", {});
/// // cifar.train.images: uint8 45000×3×32×32, cifar.val: 5000, cifar.test:
/// 10000
/// ```
inline Cifar10 load_cifar10(const std::filesystem::path& dir,
                            Cifar10Options opts = {}) {
  const auto root = resolve_cifar10_dir(dir);
  Cifar10 out;
  out.test = read_cifar10_file(root / "test_batch.bin");
  const auto names = read_cifar10_meta(root);
  out.test.classes = names;
  if (opts.load_train()) {
    std::vector<std::filesystem::path> files;
    for (int i = 1; i <= 5; ++i)
      files.push_back(root / ddpkit::detail::cat("data_batch_", i, ".bin"));
    auto all = read_cifar10_files(files);
    all.classes = names;
    auto split = split_train_val(all, opts.val_ratio(), opts.split_seed());
    out.train = std::move(split.train);
    out.val = std::move(split.val);
  }
  return out;
}

}  // namespace ddpkit::data
