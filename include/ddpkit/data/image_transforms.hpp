// SPDX-License-Identifier: BSD-3-Clause
// The ImageNet recipe's transforms (random resized crop + flip + normalise
// for training; resize + centre crop for evaluation) over `ImageFolder`'s
// undecoded files: each decodes only the crop (at a reduced DCT scale when it
// allows) straight into the fused resample + flip + normalise pass of
// data/transforms.hpp. They also take decoded uint8 3×H×W tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/image_io.hpp"
#include "ddpkit/data/transforms.hpp"
#include "ddpkit/detail/error.hpp"

namespace ddpkit::data {

namespace detail {

/// Per-thread scratch for decoding.
inline std::vector<std::uint8_t>& decode_buffer() {
  thread_local std::vector<std::uint8_t> buf;
  return buf;
}

/// An image ready for `resample_normalize`: HWC uint8 pixels, their size,
/// the factor from the original image's coordinates to the decoded
/// (scaled) image's, and where these pixels start in the decoded image
/// (non-zero after a region decode).
struct HwcImage {
  const std::uint8_t* data = nullptr;
  int64_t height = 0, width = 0;
  double scale = 1.0;
  torch::Tensor keep;  // owns `data` when it comes from a tensor
  int64_t top = 0, left = 0;
  int64_t stride = 0;  // bytes per row; 0: width * 3
  int64_t row_bytes() const {
    return stride ? stride : width * 3;
  }
};

/// The original size of an item (header only for undecoded JPEGs).
inline ImageSize item_size(const ImageBatch::Item& it,
                           std::vector<std::uint8_t>& buf, HwcImage& decoded) {
  if (it.decoded()) return {it.image.size(1), it.image.size(2)};
  if (is_jpeg(*it.bytes)) return jpeg_size(*it.bytes, it.name);
  if (is_png(*it.bytes)) {  // no cheaper header path worth having: decode now
    const auto s = decode_png_hwc(*it.bytes, buf, it.name);
    decoded = {buf.data(), s.height, s.width, 1.0, {}};
    return s;
  }
  throw UsageError(ddpkit::detail::cat("not a JPEG or PNG image: ", it.name));
}

/// Decodes `it` (unless `item_size` already did) so that sides of
/// `min_side` original pixels keep at least `out_side` pixels: JPEGs at the
/// largest SIMD DCT reduction (1/2, 1/4, 1/8) that allows it, and with a
/// `region` (top, left, height, width in original pixels) only that region
/// (`decode_jpeg_region`) when libjpeg's API is available.
inline HwcImage item_pixels(const ImageBatch::Item& it, const ImageSize& size,
                            double min_side, double out_side, bool fast,
                            std::vector<std::uint8_t>& buf, HwcImage decoded,
                            const CropBox* region = nullptr) {
  if (decoded.data) return decoded;
  if (it.decoded()) {
    auto hwc = it.image.permute({1, 2, 0}).contiguous();
    return {hwc.data_ptr<std::uint8_t>(), size.height, size.width, 1.0, hwc};
  }
  JpegDecodeOptions o;
  o.fast = fast;
  o.scale_num = jpeg_scale_for(static_cast<int64_t>(min_side),
                               static_cast<int64_t>(min_side), out_side);
  JpegBlock block;
  if (region && decode_jpeg_region(*it.bytes, static_cast<double>(region->top),
                                   static_cast<double>(region->left),
                                   static_cast<double>(region->height),
                                   static_cast<double>(region->width), buf,
                                   block, o, it.name)) {
    return {buf.data() + block.offset,
            block.height,
            block.width,
            o.scale_num / 8.0,
            {},
            block.top,
            block.left,
            block.stride};
  }
  const auto s = decode_jpeg_hwc(*it.bytes, buf, o, it.name);
  return {buf.data(), s.height, s.width, o.scale_num / 8.0, {}};
}

}  // namespace detail

/// A closed interval `{lo, hi}`.
using Interval = std::array<double, 2>;

/// Options of `ImageNetTrain` (torchvision's `RandomResizedCrop(size)`,
/// `RandomHorizontalFlip()`, ImageNet mean/std).
struct ImageNetTrainOptions {
  TORCH_ARG(int64_t, size) = 224;
  TORCH_ARG(Interval, scale) = { 0.08, 1.0 };
  TORCH_ARG(Interval, ratio) = { 3.0 / 4.0, 4.0 / 3.0 };
  TORCH_ARG(double, flip) = 0.5;
  TORCH_ARG(Rgb, mean) = kImageNetMean;
  TORCH_ARG(Rgb, std) = kImageNetStd;
  /// Decode JPEGs with libjpeg-turbo's fast integer IDCT and plain chroma
  /// upsampling (`JpegDecodeOptions::fast`): faster, a few levels off
  /// libjpeg's default (PIL's) decode.
  TORCH_ARG(bool, fast_decode) = false;
  /// false: no random crop or flip, the evaluation transform instead
  /// (`ImageNetEval`: resize to size·256/224, centre crop): training without
  /// augmentation, deterministic whatever the rank or the generator.
  TORCH_ARG(bool, augment) = true;
};

namespace detail {

/// `(x / 255 - mean) / std` of one float 3×H×W image in 0..255 units
/// (possibly flipped) into `dst`: the path for non-uint8 inputs.
inline void store_normalized(torch::Tensor img, bool flip, const Rgb& mean,
                             const Rgb& std, float* dst) {
  if (flip) img = img.flip(2);
  auto t = torch::from_blob(dst, img.sizes(), torch::kFloat);
  t.copy_(img.div(255.0f)
              .sub_(rgb_tensor(mean).view({3, 1, 1}))
              .div_(rgb_tensor(std).view({3, 1, 1})));
}

}  // namespace detail

/// The flowers/ImageNet recipe's training transform on images of any size
/// (an `ImageBatch` from `ImageFolder`, a vector of uint8 3×H×W, or a uint8
/// batch): float N×3×size×size.
///
/// Per image: the crop box is drawn from the original size (JPEG header
/// only), the JPEG is decoded at the largest SIMD DCT reduction (1/2, 1/4,
/// 1/8) that keeps the crop at least `size` pixels, and
/// `resample_normalize` resizes the crop with PIL's antialiased bilinear
/// filter, flips and normalises in one pass. The draws (40 uniforms and a
/// flip per image, from `gen`) are the same whatever the input form.
///
/// Example:
/// ```
/// ddpkit::data::ImageNetTrain
/// aug{ddpkit::data::ImageNetTrainOptions().size(224)}; auto gen =
/// ddpkit::data::make_generator(0); torch::Tensor x = aug(images, gen);  //
/// N×3×224×224
/// ```
struct ImageNetTrain {
  ImageNetTrainOptions options{};

  torch::Tensor operator()(const ImageBatch& images,
                           torch::Generator& gen) const;
  torch::Tensor operator()(const std::vector<torch::Tensor>& images,
                           torch::Generator& gen) const {
    return (*this)(ImageBatch(images), gen);
  }
  torch::Tensor operator()(const torch::Tensor& batch,
                           torch::Generator& gen) const {
    return (*this)(ImageBatch(batch), gen);
  }
};

/// torchvision's `Resize(size * 256 / 224)` + `CenterCrop(size)` +
/// normalise: the evaluation transform of the flowers/ImageNet recipe, as
/// one fused resample of the centre window (JPEGs decoded at a 1/2, 1/4 or
/// 1/8 DCT scale when the resized short side allows).
struct ImageNetEval {
  int64_t size = 224;
  Rgb mean = kImageNetMean;
  Rgb std = kImageNetStd;
  /// See `ImageNetTrainOptions::fast_decode`; off for evaluation.
  bool fast_decode = false;

  torch::Tensor operator()(const ImageBatch& images, torch::Generator&) const {
    const auto n = static_cast<int64_t>(images.size());
    const int64_t resize = size * 256 / 224;
    auto out = torch::empty({n, 3, size, size});
    float* po = out.data_ptr<float>();
    auto& buf = detail::decode_buffer();
    for (int64_t k = 0; k < n; ++k) {
      const auto& it = images.items()[static_cast<std::size_t>(k)];
      float* dst = po + k * 3 * size * size;
      detail::HwcImage pre;
      const auto sz = detail::item_size(it, buf, pre);
      const auto h = sz.height, w = sz.width;
      // Shorter side to `resize`, the longer one scaled and truncated.
      const int64_t oh = h <= w ? resize : resize * h / w;
      const int64_t ow = h <= w ? resize * w / h : resize;
      const auto top = static_cast<int64_t>(std::lround((oh - size) / 2.0));
      const auto left = static_cast<int64_t>(std::lround((ow - size) / 2.0));
      if (it.decoded() && it.image.scalar_type() != torch::kUInt8) {
        auto r = resize_image(it.image, oh, ow)
                     .narrow(1, top, size)
                     .narrow(2, left, size);
        detail::store_normalized(r, false, mean, std, dst);
        continue;
      }
      const auto px = detail::item_pixels(
          it, sz, static_cast<double>(std::min(h, w)),
          static_cast<double>(resize), fast_decode, buf, pre);
      // The window [top, top + size) of the resized image, in source pixels.
      const double fy = static_cast<double>(h) / oh * px.scale;
      const double fx = static_cast<double>(w) / ow * px.scale;
      resample_normalize(px.data, px.height, px.width, px.row_bytes(), top * fy,
                         left * fx, size * fy, size * fx, size, size, false,
                         mean, std, dst,
                         /*clip=*/false);
    }
    return out;
  }
  torch::Tensor operator()(const std::vector<torch::Tensor>& images,
                           torch::Generator& gen) const {
    return (*this)(ImageBatch(images), gen);
  }
  torch::Tensor operator()(const torch::Tensor& batch,
                           torch::Generator& gen) const {
    return (*this)(ImageBatch(batch), gen);
  }
};

inline torch::Tensor ImageNetTrain::operator()(const ImageBatch& images,
                                               torch::Generator& gen) const {
  const auto& o = options;
  if (!o.augment()) {
    return ImageNetEval{o.size(), o.mean(), o.std(), o.fast_decode()}(images,
                                                                      gen);
  }
  const auto n = static_cast<int64_t>(images.size());
  const int64_t S = o.size();
  auto u = torch::rand({n, 40}, gen);
  auto flip = torch::rand({n}, gen) < o.flip();
  auto out = torch::empty({n, 3, S, S});
  const float* pu = u.data_ptr<float>();
  const bool* pf = flip.data_ptr<bool>();
  float* po = out.data_ptr<float>();
  auto& buf = detail::decode_buffer();
  for (int64_t k = 0; k < n; ++k) {
    const auto& it = images.items()[static_cast<std::size_t>(k)];
    float* dst = po + k * 3 * S * S;
    detail::HwcImage pre;
    const auto size = detail::item_size(it, buf, pre);
    const auto box = random_resized_crop_box(size.height, size.width, o.scale(),
                                             o.ratio(), pu + k * 40);
    if (it.decoded() && it.image.scalar_type() != torch::kUInt8) {
      auto crop = it.image.narrow(1, box.top, box.height)
                      .narrow(2, box.left, box.width);
      detail::store_normalized(resize_image(crop, S, S), pf[k], o.mean(),
                               o.std(), dst);
      continue;
    }
    const auto px = detail::item_pixels(
        it, size, static_cast<double>(std::min(box.height, box.width)),
        static_cast<double>(S), o.fast_decode(), buf, pre, &box);
    const double s = px.scale;
    resample_normalize(px.data, px.height, px.width, px.row_bytes(),
                       box.top * s - px.top, box.left * s - px.left,
                       box.height * s, box.width * s, S, S, pf[k], o.mean(),
                       o.std(), dst);
  }
  return out;
}

}  // namespace ddpkit::data
