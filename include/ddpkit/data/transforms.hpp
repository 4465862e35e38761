// Batched, vectorised image transforms on uint8 batches (N×3×H×W): the
// CIFAR recipe (random crop + flip + colour jitter + normalise) and the
// ImageNet recipe (random resized crop + flip + normalise; resize + centre
// crop for evaluation). Randomness comes only from the generator passed in.
#pragma once

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"

namespace ddpkit::data {

using Rgb = std::array<float, 3>;
inline constexpr Rgb kCifarMean{0.4914f, 0.4822f, 0.4465f};
inline constexpr Rgb kCifarStd{0.2470f, 0.2435f, 0.2616f};
inline constexpr Rgb kImageNetMean{0.485f, 0.456f, 0.406f};
inline constexpr Rgb kImageNetStd{0.229f, 0.224f, 0.225f};

/// A CPU generator seeded with `seed`: the only source of randomness the
/// transforms use, so a (seed, batch) pair always gives the same batch.
inline torch::Generator make_generator(std::uint64_t seed) {
  return at::detail::createCPUGenerator(seed);
}

/// uint8 (0..255) or float (0..1) N×3×H×W to float `(x/255 - mean) / std`.
inline torch::Tensor normalize(const torch::Tensor& batch, const Rgb& mean,
                               const Rgb& std) {
  auto x = batch.scalar_type() == torch::kUInt8
               ? batch.to(torch::kFloat).div_(255.0f)
               : batch.to(torch::kFloat, /*non_blocking=*/false, /*copy=*/true);
  auto m = torch::tensor({mean[0], mean[1], mean[2]}).view({1, 3, 1, 1});
  auto s = torch::tensor({std[0], std[1], std[2]}).view({1, 3, 1, 1});
  return x.sub_(m).div_(s);
}

/// torchvision's `RandomCrop(size, padding)` followed by
/// `RandomHorizontalFlip(flip_p)` on a whole uint8 batch: per image an
/// offset in the zero-padded image and a flip bit, drawn as three tensors;
/// the copy is a plain row loop (no padded copy, no index tensor), which is
/// several times faster than a gather.
inline torch::Tensor random_crop_flip(const torch::Tensor& batch,
                                      int64_t size, int64_t padding,
                                      double flip_p, torch::Generator& gen) {
  const auto n = batch.size(0), c = batch.size(1);
  const auto h = batch.size(2), w = batch.size(3);
  const auto hp = h + 2 * padding, wp = w + 2 * padding;
  if (hp < size || wp < size) {
    throw UsageError(ddpkit::detail::cat("random_crop_flip: crop ", size,
                                         " is larger than the padded image ",
                                         hp, "x", wp));
  }
  auto i64 = torch::TensorOptions(torch::kInt64);
  auto oy = torch::randint(0, hp - size + 1, {n}, gen, i64);
  auto ox = torch::randint(0, wp - size + 1, {n}, gen, i64);
  auto flip = (torch::rand({n}, gen) < flip_p).to(torch::kUInt8);
  auto src = batch.to(torch::kUInt8).contiguous();
  auto out = torch::zeros({n, c, size, size}, torch::kUInt8);
  const auto* in = src.data_ptr<std::uint8_t>();
  auto* dst = out.data_ptr<std::uint8_t>();
  const auto* py = oy.data_ptr<int64_t>();
  const auto* px = ox.data_ptr<int64_t>();
  const auto* pf = flip.data_ptr<std::uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      // Source column range inside the real image for this crop.
      const int64_t x0 = px[i] - padding;  // source x of output column 0
      const int64_t lo = std::max<int64_t>(0, -x0);
      const int64_t hi = std::min<int64_t>(size, w - x0);
      for (int64_t ch = 0; ch < c; ++ch) {
        for (int64_t y = 0; y < size; ++y) {
          const int64_t sy = py[i] + y - padding;
          if (sy < 0 || sy >= h || hi <= lo) continue;
          const std::uint8_t* s = in + ((i * c + ch) * h + sy) * w + x0;
          std::uint8_t* d = dst + ((i * c + ch) * size + y) * size;
          if (pf[i]) {
            for (int64_t x = lo; x < hi; ++x) d[size - 1 - x] = s[x];
          } else {
            std::memcpy(d + lo, s + lo, static_cast<std::size_t>(hi - lo));
          }
        }
      }
    }
  });
  return out;
}

/// Options of `ColorJitter`, torchvision's meaning: a factor is drawn in
/// `[max(0, 1 - v), 1 + v]` (hue: a shift in `[-hue, hue]` turns).
struct ColorJitterOptions {
  TORCH_ARG(float, brightness) = 0.2f;
  TORCH_ARG(float, contrast) = 0.2f;
  TORCH_ARG(float, saturation) = 0.2f;
  TORCH_ARG(float, hue) = 0.1f;
};

namespace detail {

/// Per image, the affine colour map `x -> M x + t` (M: N×3×3, t: N×3) of
/// brightness, contrast, saturation and hue applied in a random order per
/// image (as torchvision draws the order per call). The input is raw uint8
/// values, so M starts as I/255.
///
/// Why affine: brightness and saturation are linear, contrast blends with
/// the image's mean grey (linear in the image's mean RGB, which is tracked
/// through the map), and hue is a rotation of the chroma plane in YIQ (as
/// NVIDIA DALI does) rather than torchvision's HSV shift. Composing them
/// costs a few 3×3 products per image and one pass over the pixels, which is
/// what makes batched jitter fast; the price is that torchvision's clamp
/// after every step becomes one clamp at the end.
inline std::pair<torch::Tensor, torch::Tensor> jitter_affine(
    const torch::Tensor& mean_rgb /* N×3, raw units */,
    const ColorJitterOptions& o, torch::Generator& gen) {
  const auto n = mean_rgb.size(0);
  auto f32 = torch::TensorOptions(torch::kFloat);
  auto eye = torch::eye(3, f32).expand({n, 3, 3});
  auto M = (eye / 255.0f).contiguous();
  auto t = torch::zeros({n, 3}, f32);
  auto w = torch::tensor({0.299f, 0.587f, 0.114f});
  auto factor = [&](float v) {
    float lo = std::max(0.0f, 1.0f - v), hi = 1.0f + v;
    return torch::rand({n}, gen) * (hi - lo) + lo;
  };
  auto b = factor(o.brightness()), c = factor(o.contrast()),
       s = factor(o.saturation());
  auto h = (torch::rand({n}, gen) * 2.0f - 1.0f) * o.hue();
  auto order = std::get<1>(torch::rand({n, 4}, gen).sort(/*dim=*/1));

  // Saturation: s I + (1 - s) 1 wᵀ.
  auto S = s.view({n, 1, 1}) * eye +
           (1.0f - s).view({n, 1, 1}) * torch::ones({3, 1}).mm(w.view({1, 3}));
  // Hue: YIQ⁻¹ · R(θ) · YIQ.
  auto yiq = torch::tensor({{0.299f, 0.587f, 0.114f},
                            {0.596f, -0.274f, -0.322f},
                            {0.211f, -0.523f, 0.312f}});
  auto yiq_inv = torch::inverse(yiq);
  auto theta = h * (2.0f * static_cast<float>(M_PI));
  auto cos_t = theta.cos(), sin_t = theta.sin();
  auto R = torch::zeros({n, 3, 3}, f32);
  R.select(1, 0).select(1, 0).fill_(1.0f);
  R.select(1, 1).select(1, 1).copy_(cos_t);
  R.select(1, 1).select(1, 2).copy_(-sin_t);
  R.select(1, 2).select(1, 1).copy_(sin_t);
  R.select(1, 2).select(1, 2).copy_(cos_t);
  auto H = yiq_inv.matmul(R).matmul(yiq);

  for (int k = 0; k < 4; ++k) {
    auto op = order.select(1, k);
    // brightness: b (M, t)
    auto Mb = b.view({n, 1, 1}) * M, tb = b.view({n, 1}) * t;
    // contrast: c (M, t) + (1 - c) grey_mean 1
    auto grey = (M.bmm(mean_rgb.unsqueeze(2)).squeeze(2) + t).matmul(w);
    auto Mc = c.view({n, 1, 1}) * M;
    auto tc = c.view({n, 1}) * t + ((1.0f - c) * grey).view({n, 1});
    // saturation and hue: left-multiply
    auto Ms = S.bmm(M), ts = S.bmm(t.unsqueeze(2)).squeeze(2);
    auto Mh = H.bmm(M), th = H.bmm(t.unsqueeze(2)).squeeze(2);
    auto sel = [&](int j) { return (op == j); };
    M = torch::where(sel(0).view({n, 1, 1}), Mb,
        torch::where(sel(1).view({n, 1, 1}), Mc,
        torch::where(sel(2).view({n, 1, 1}), Ms, Mh)));
    t = torch::where(sel(0).view({n, 1}), tb,
        torch::where(sel(1).view({n, 1}), tc,
        torch::where(sel(2).view({n, 1}), ts, th)));
  }
  return {M, t};
}

inline torch::Tensor rgb_tensor(const Rgb& v) {
  return torch::tensor({v[0], v[1], v[2]});
}

}  // namespace detail

/// Colour jitter + normalise of a uint8 batch in one pass over the pixels:
/// float N×3×H×W, `(clamp(jitter(x/255), 0, 1) - mean) / std`.
inline torch::Tensor color_jitter_normalize(const torch::Tensor& batch,
                                            const ColorJitterOptions& o,
                                            const Rgb& mean, const Rgb& std,
                                            torch::Generator& gen) {
  const auto n = batch.size(0), hw = batch.size(2) * batch.size(3);
  auto x = batch.to(torch::kFloat).view({n, 3, hw});
  auto [M, t] = detail::jitter_affine(x.mean(2), o, gen);
  auto y = torch::baddbmm(t.unsqueeze(2), M, x).clamp_(0.0f, 1.0f);
  y.sub_(detail::rgb_tensor(mean).view({1, 3, 1}))
      .div_(detail::rgb_tensor(std).view({1, 3, 1}));
  return y.view(batch.sizes());
}

/// Options of `CifarTrain`, defaults from the CIFAR-10 recipe
/// (`RandomCrop(32, padding=4)`, `RandomHorizontalFlip()`,
/// `ColorJitter(0.2, 0.2, 0.2, 0.1)`, CIFAR mean/std).
struct CifarTrainOptions {
  TORCH_ARG(int64_t, crop) = 32;
  TORCH_ARG(int64_t, padding) = 4;
  /// Probability of a horizontal flip (0 disables it).
  TORCH_ARG(double, flip) = 0.5;
  /// Apply colour jitter at all.
  TORCH_ARG(bool, jitter) = true;
  TORCH_ARG(ColorJitterOptions, color_jitter) = {};
  TORCH_ARG(Rgb, mean) = kCifarMean;
  TORCH_ARG(Rgb, std) = kCifarStd;
};

/// The CIFAR recipe's training transform on a uint8 batch.
///
/// Example:
/// ```
/// ddpkit::data::CifarTrain aug;
/// auto gen = ddpkit::data::make_generator(42);
/// torch::Tensor x = aug(images_u8 /*N×3×32×32*/, gen);  // float, normalised
/// ```
struct CifarTrain {
  CifarTrainOptions options{};

  torch::Tensor operator()(const torch::Tensor& batch,
                           torch::Generator& gen) const {
    const auto& o = options;
    auto x = random_crop_flip(batch, o.crop(), o.padding(), o.flip(), gen);
    if (!o.jitter()) return normalize(x, o.mean(), o.std());
    return color_jitter_normalize(x, o.color_jitter(), o.mean(), o.std(), gen);
  }
  torch::Tensor operator()(const std::vector<torch::Tensor>& images,
                           torch::Generator& gen) const {
    return (*this)(torch::stack(images), gen);
  }
};

/// The CIFAR recipe's evaluation transform: normalise only.
struct CifarEval {
  Rgb mean = kCifarMean;
  Rgb std = kCifarStd;

  torch::Tensor operator()(const torch::Tensor& batch, torch::Generator&) const {
    return normalize(batch, mean, std);
  }
  torch::Tensor operator()(const std::vector<torch::Tensor>& images,
                           torch::Generator& gen) const {
    return (*this)(torch::stack(images), gen);
  }
};

/// A crop box: top, left, height, width.
struct CropBox {
  int64_t top, left, height, width;
};

/// torchvision's `RandomResizedCrop.get_params`: ten tries at an area in
/// `scale` and a log-uniform aspect ratio in `ratio`, then a centre crop
/// clamped to the ratio range. `u` holds 40 uniforms in [0, 1).
inline CropBox random_resized_crop_box(int64_t height, int64_t width,
                                       std::array<double, 2> scale,
                                       std::array<double, 2> ratio,
                                       const float* u) {
  const double area = static_cast<double>(height * width);
  const double lr0 = std::log(ratio[0]), lr1 = std::log(ratio[1]);
  for (int k = 0; k < 10; ++k, u += 4) {
    double target = area * (scale[0] + (scale[1] - scale[0]) * u[0]);
    double aspect = std::exp(lr0 + (lr1 - lr0) * u[1]);
    auto w = static_cast<int64_t>(std::lround(std::sqrt(target * aspect)));
    auto h = static_cast<int64_t>(std::lround(std::sqrt(target / aspect)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      auto i = std::min<int64_t>(height - h, static_cast<int64_t>(u[2] * (height - h + 1)));
      auto j = std::min<int64_t>(width - w, static_cast<int64_t>(u[3] * (width - w + 1)));
      return {i, j, h, w};
    }
  }
  const double in_ratio = static_cast<double>(width) / height;
  int64_t w = width, h = height;
  if (in_ratio < ratio[0]) {
    h = std::lround(w / ratio[0]);
  } else if (in_ratio > ratio[1]) {
    w = std::lround(h * ratio[1]);
  }
  return {(height - h) / 2, (width - w) / 2, h, w};
}

/// Resizes one uint8 or float 3×H×W image to float 3×oh×ow (0..255 units),
/// bilinear, antialiased when shrinking (as PIL does).
inline torch::Tensor resize_image(const torch::Tensor& image, int64_t oh,
                                  int64_t ow) {
  namespace F = torch::nn::functional;
  auto x = image.to(torch::kFloat).unsqueeze(0);
  if (x.size(2) == oh && x.size(3) == ow) return x.squeeze(0);
  const bool shrink = x.size(2) > oh || x.size(3) > ow;
  return F::interpolate(x, F::InterpolateFuncOptions()
                               .size(std::vector<int64_t>{oh, ow})
                               .mode(torch::kBilinear)
                               .align_corners(false)
                               .antialias(shrink))
      .squeeze(0);
}

/// A closed interval `{lo, hi}`.
using Interval = std::array<double, 2>;

/// Options of `ImageNetTrain` (torchvision's `RandomResizedCrop(size)`,
/// `RandomHorizontalFlip()`, ImageNet mean/std).
struct ImageNetTrainOptions {
  TORCH_ARG(int64_t, size) = 224;
  TORCH_ARG(Interval, scale) = {0.08, 1.0};
  TORCH_ARG(Interval, ratio) = {3.0 / 4.0, 4.0 / 3.0};
  TORCH_ARG(double, flip) = 0.5;
  TORCH_ARG(Rgb, mean) = kImageNetMean;
  TORCH_ARG(Rgb, std) = kImageNetStd;
};

/// The flowers/ImageNet recipe's training transform on images of any size
/// (a vector of uint8 3×H×W, as `ImageFolder` yields) or a uint8 batch:
/// float N×3×size×size.
///
/// Example:
/// ```
/// ddpkit::data::ImageNetTrain aug{ddpkit::data::ImageNetTrainOptions().size(224)};
/// auto gen = ddpkit::data::make_generator(0);
/// torch::Tensor x = aug(images, gen);  // N×3×224×224
/// ```
struct ImageNetTrain {
  ImageNetTrainOptions options{};

  torch::Tensor operator()(const std::vector<torch::Tensor>& images,
                           torch::Generator& gen) const {
    const auto& o = options;
    const auto n = static_cast<int64_t>(images.size());
    auto u = torch::rand({n, 40}, gen);
    auto flip = torch::rand({n}, gen) < o.flip();
    auto out = torch::empty({n, 3, o.size(), o.size()});
    for (int64_t k = 0; k < n; ++k) {
      const auto& img = images[k];
      auto box = random_resized_crop_box(img.size(1), img.size(2), o.scale(),
                                         o.ratio(), u[k].data_ptr<float>());
      auto crop = img.narrow(1, box.top, box.height).narrow(2, box.left, box.width);
      out[k].copy_(resize_image(crop, o.size(), o.size()));
    }
    out = torch::where(flip.view({n, 1, 1, 1}), out.flip(3), out);
    return normalize(out.div_(255.0f), o.mean(), o.std());
  }
  torch::Tensor operator()(const torch::Tensor& batch,
                           torch::Generator& gen) const {
    auto v = batch.unbind(0);
    return (*this)(std::vector<torch::Tensor>(v.begin(), v.end()), gen);
  }
};

/// torchvision's `Resize(size * 256 / 224)` + `CenterCrop(size)` +
/// normalise: the evaluation transform of the flowers/ImageNet recipe.
struct ImageNetEval {
  int64_t size = 224;
  Rgb mean = kImageNetMean;
  Rgb std = kImageNetStd;

  torch::Tensor operator()(const std::vector<torch::Tensor>& images,
                           torch::Generator&) const {
    const auto n = static_cast<int64_t>(images.size());
    const int64_t resize = size * 256 / 224;
    auto out = torch::empty({n, 3, size, size});
    for (int64_t k = 0; k < n; ++k) {
      const auto& img = images[k];
      const auto h = img.size(1), w = img.size(2);
      // Shorter side to `resize`, the longer one scaled and truncated.
      int64_t oh = h <= w ? resize : resize * h / w;
      int64_t ow = h <= w ? resize * w / h : resize;
      auto r = resize_image(img, oh, ow);
      auto top = static_cast<int64_t>(std::lround((oh - size) / 2.0));
      auto left = static_cast<int64_t>(std::lround((ow - size) / 2.0));
      out[k].copy_(r.narrow(1, top, size).narrow(2, left, size));
    }
    return normalize(out.div_(255.0f), mean, std);
  }
  torch::Tensor operator()(const torch::Tensor& batch,
                           torch::Generator& gen) const {
    auto v = batch.unbind(0);
    return (*this)(std::vector<torch::Tensor>(v.begin(), v.end()), gen);
  }
};

}  // namespace ddpkit::data
