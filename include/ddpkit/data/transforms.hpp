// SPDX-License-Identifier: BSD-3-Clause
// Batched, vectorised image transforms on uint8 tensors (N×3×H×W): the
// CIFAR recipe (random crop + flip + colour jitter + normalise), resizing,
// random-resized-crop boxes and the fused resample + flip + normalise pass
// (`resample_normalize`) the ImageNet transforms
// (data/image_transforms.hpp, which decode files) are built on. Randomness
// comes only from the generator passed in. No image codec here.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#ifdef __SSE2__
#include <emmintrin.h>
#endif
#if defined(__x86_64__) && defined(__GNUC__)
#define DDPKIT_RESAMPLE_AVX2 1
#include <immintrin.h>
#endif

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/seed.hpp"

namespace ddpkit::data {

using Rgb = std::array<float, 3>;
inline constexpr Rgb kCifarMean{0.4914f, 0.4822f, 0.4465f};
inline constexpr Rgb kCifarStd{0.2470f, 0.2435f, 0.2616f};
inline constexpr Rgb kImageNetMean{0.485f, 0.456f, 0.406f};
inline constexpr Rgb kImageNetStd{0.229f, 0.224f, 0.225f};

using ddpkit::detail::make_generator;

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
inline torch::Tensor random_crop_flip(const torch::Tensor& batch, int64_t size,
                                      int64_t padding, double flip_p,
                                      torch::Generator& gen) {
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
/// brightness `b`, contrast `c`, saturation `s` (factors, 1: unchanged) and
/// hue `h` (a shift in turns, 0: unchanged), applied in the order `order`
/// (N×4, a permutation of 0..3 per image: brightness, contrast, saturation,
/// hue). The input is raw uint8 values, so M starts as I/255.
///
/// Why affine: brightness and saturation are linear, contrast blends with
/// the image's mean grey (linear in the image's mean RGB, which is tracked
/// through the map), and hue is a rotation of the chroma plane in YIQ (as
/// NVIDIA DALI does) rather than torchvision's HSV shift. Composing them
/// costs a few 3×3 products per image and one pass over the pixels, which is
/// what makes batched jitter fast; the price is that torchvision's clamp
/// after every step becomes one clamp at the end. Brightness, contrast and
/// saturation alone equal torchvision's `adjust_*` (grey =
/// 0.2989 R + 0.587 G + 0.114 B, as torchvision's); hue alone turns hues the
/// same way by about the same amount (measured against `adjust_hue` in
/// data_test "colour jitter follows torchvision's definitions"), but keeps
/// luma where HSV keeps the largest channel, so pixels differ.
inline std::pair<torch::Tensor, torch::Tensor> jitter_affine_with(
    const torch::Tensor& mean_rgb /* N×3, raw units */, const torch::Tensor& b,
    const torch::Tensor& c, const torch::Tensor& s, const torch::Tensor& h,
    const torch::Tensor& order) {
  const auto n = mean_rgb.size(0);
  auto f32 = torch::TensorOptions(torch::kFloat);
  auto eye = torch::eye(3, f32).expand({n, 3, 3});
  auto M = (eye / 255.0f).contiguous();
  auto t = torch::zeros({n, 3}, f32);
  auto w = torch::tensor({0.2989f, 0.587f, 0.114f});

  // Saturation: s I + (1 - s) 1 wᵀ.
  auto S = s.view({n, 1, 1}) * eye +
           (1.0f - s).view({n, 1, 1}) * torch::ones({3, 1}).mm(w.view({1, 3}));
  // Hue: YIQ⁻¹ · R(-θ) · YIQ. The minus: HSV hue runs red, green, blue,
  // which is clockwise in the I-Q plane.
  auto yiq = torch::tensor({{0.299f, 0.587f, 0.114f},
                            {0.596f, -0.274f, -0.322f},
                            {0.211f, -0.523f, 0.312f}});
  auto yiq_inv = torch::inverse(yiq);
  auto theta = h * (-2.0f * static_cast<float>(M_PI));
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
    M = torch::where(
        sel(0).view({n, 1, 1}), Mb,
        torch::where(sel(1).view({n, 1, 1}), Mc,
                     torch::where(sel(2).view({n, 1, 1}), Ms, Mh)));
    t = torch::where(sel(0).view({n, 1}), tb,
                     torch::where(sel(1).view({n, 1}), tc,
                                  torch::where(sel(2).view({n, 1}), ts, th)));
  }
  return {M, t};
}

/// `jitter_affine_with` at factors drawn as torchvision's `ColorJitter`
/// draws them (a random order per image, as torchvision draws it per call).
inline std::pair<torch::Tensor, torch::Tensor> jitter_affine(
    const torch::Tensor& mean_rgb /* N×3, raw units */,
    const ColorJitterOptions& o, torch::Generator& gen) {
  const auto n = mean_rgb.size(0);
  auto factor = [&](float v) {
    float lo = std::max(0.0f, 1.0f - v), hi = 1.0f + v;
    return torch::rand({n}, gen) * (hi - lo) + lo;
  };
  auto b = factor(o.brightness()), c = factor(o.contrast()),
       s = factor(o.saturation());
  auto h = (torch::rand({n}, gen) * 2.0f - 1.0f) * o.hue();
  auto order = std::get<1>(torch::rand({n, 4}, gen).sort(/*dim=*/1));
  return jitter_affine_with(mean_rgb, b, c, s, h, order);
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

  torch::Tensor operator()(const torch::Tensor& batch,
                           torch::Generator&) const {
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
      auto i = std::min<int64_t>(height - h,
                                 static_cast<int64_t>(u[2] * (height - h + 1)));
      auto j = std::min<int64_t>(width - w,
                                 static_cast<int64_t>(u[3] * (width - w + 1)));
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

namespace detail {

/// Fixed-width filter taps of one axis: output `o` reads source pixels
/// `start[o] .. start[o] + k - 1` with weights `w[o * k ..]`.
struct Taps {
  int64_t k = 0;
  std::vector<int64_t> start;
  std::vector<float> w;
};

/// PIL's (and torch's `antialias=True`) bilinear taps for resampling the
/// source interval `[box0, box0 + len)` (pixel-edge coordinates) of an axis
/// of `in_size` pixels to `out_size` pixels: a triangle filter widened by
/// the scale when shrinking, cut at the edge and renormalised. The edge is
/// the image's, or with `clip` the box's (rounded out to whole pixels): a
/// crop followed by a resize, as torchvision's `resized_crop` does. Every
/// output gets the same number of taps (zero-padded, the window moved
/// inside the edges), which keeps the inner loops branch-free.
inline void bilinear_taps(double box0, double len, int64_t in_size,
                          int64_t out_size, bool clip, Taps& t) {
  const double scale = len / static_cast<double>(out_size);
  const double support = std::max(scale, 1.0);  // bilinear support 1, widened
  const double inv = 1.0 / support;
  int64_t lo = 0, hi = in_size;
  if (clip) {
    lo = std::clamp<int64_t>(static_cast<int64_t>(std::floor(box0 + 1e-6)), 0,
                             in_size - 1);
    hi = std::clamp<int64_t>(static_cast<int64_t>(std::ceil(box0 + len - 1e-6)),
                             lo + 1, in_size);
  }
  // Relative to `lo` so that the truncating casts match PIL's (which works
  // on the cropped image) for integer boxes.
  auto window = [&](int64_t o, int64_t& xmin, int64_t& xmax, double& center) {
    const double c =
        box0 - static_cast<double>(lo) + (static_cast<double>(o) + 0.5) * scale;
    xmin = std::max<int64_t>(static_cast<int64_t>(c - support + 0.5), 0) + lo;
    xmax = std::min<int64_t>(static_cast<int64_t>(c + support + 0.5) + lo, hi);
    center = c + static_cast<double>(lo);
  };
  // Taps per output: the widest window (at most 2 * ceil(support) + 1).
  int64_t k = 1;
  for (int64_t o = 0; o < out_size; ++o) {
    int64_t xmin, xmax;
    double center;
    window(o, xmin, xmax, center);
    k = std::max(k, xmax - xmin);
  }
  k = std::min(k, hi - lo);
  t.k = k;
  t.start.resize(static_cast<std::size_t>(out_size));
  t.w.assign(static_cast<std::size_t>(out_size * k), 0.0f);
  thread_local std::vector<double> ws;
  ws.resize(static_cast<std::size_t>(k));
  for (int64_t o = 0; o < out_size; ++o) {
    int64_t xmin, xmax;
    double center;
    window(o, xmin, xmax, center);
    const int64_t n = std::max<int64_t>(xmax - xmin, 0);
    double total = 0.0;
    for (int64_t j = 0; j < n; ++j) {
      const double x = (static_cast<double>(j + xmin) - center + 0.5) * inv;
      ws[static_cast<std::size_t>(j)] = std::max(0.0, 1.0 - std::abs(x));
      total += ws[static_cast<std::size_t>(j)];
    }
    const int64_t st = std::max<int64_t>(lo, std::min(xmin, hi - k));
    t.start[static_cast<std::size_t>(o)] = st;
    float* w = t.w.data() + o * k;
    for (int64_t j = 0; j < n && xmin - st + j < k; ++j) {
      w[xmin - st + j] =
          total > 0.0
              ? static_cast<float>(ws[static_cast<std::size_t>(j)] / total)
              : 0.0f;
    }
  }
}

#ifdef DDPKIT_RESAMPLE_AVX2
/// The vertical pass of `resample_normalize` with AVX2 + FMA (chosen at run
/// time): `r[j] = sum_t wts[t] * rows[t][j]` for j below a multiple of 16,
/// which it returns.
__attribute__((target("avx2,fma"))) inline int64_t vertical_pass_avx2(
    const std::uint8_t* const* rows, const float* wts, int64_t taps, int64_t n,
    float* r) {
  const int64_t n16 = n & ~int64_t{15};
  for (int64_t j = 0; j < n16; j += 16) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t t = 0; t < taps; ++t) {
      const __m128i q =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[t] + j));
      const __m256 wt = _mm256_set1_ps(wts[t]);
      a0 = _mm256_fmadd_ps(wt, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)), a0);
      a1 = _mm256_fmadd_ps(
          wt, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8))),
          a1);
    }
    _mm256_storeu_ps(r + j, a0);
    _mm256_storeu_ps(r + j + 8, a1);
  }
  return n16;
}

/// The horizontal pass of `resample_normalize` with AVX2 + FMA, two output
/// pixels (RGB_ each) per vector; `w2` holds per pixel pair and tap the
/// two weights, each repeated 4 times. Handles pixels below out_w & ~1.
__attribute__((target("avx2,fma"))) inline void horizontal_pass_avx2(
    const float* r, const int64_t* start, int64_t c0, const float* w2,
    int64_t kh, int64_t out_w, const float* a4, const float* b4, bool flip,
    float* o0, float* o1, float* o2) {
  const __m256 a = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(a4));
  const __m256 b = _mm256_broadcast_ps(reinterpret_cast<const __m128*>(b4));
  alignas(32) float v[8];
  for (int64_t ox = 0; ox + 1 < out_w; ox += 2) {
    const float* pa = r + (start[ox] - c0) * 3;
    const float* pb = r + (start[ox + 1] - c0) * 3;
    const float* w = w2 + (ox / 2) * kh * 8;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t k = 0; k < kh; ++k) {
      const __m256 px =
          _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(pa + 3 * k)),
                               _mm_loadu_ps(pb + 3 * k), 1);
      acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * k), px, acc);
    }
    _mm256_store_ps(v, _mm256_fmadd_ps(acc, a, b));
    const int64_t xa = flip ? out_w - 1 - ox : ox;
    const int64_t xb = flip ? xa - 1 : xa + 1;
    o0[xa] = v[0];
    o1[xa] = v[1];
    o2[xa] = v[2];
    o0[xb] = v[4];
    o1[xb] = v[5];
    o2[xb] = v[6];
  }
}

/// Whether to take the AVX2 + FMA paths: the CPU has them and
/// DDPKIT_NO_AVX2 is not set (to test or compare the SSE2 path).
inline bool cpu_has_avx2_fma() {
  static const bool yes = __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma") &&
                          std::getenv("DDPKIT_NO_AVX2") == nullptr;
  return yes;
}
#endif

}  // namespace detail

/// Resamples the box `(y0, x0, box_h, box_w)` (pixel-edge coordinates, so
/// fractional boxes work) of an RGB HWC uint8 image (`in_h`×`in_w`, rows
/// `stride` bytes apart) to
/// `out_h`×`out_w` with PIL's antialiased bilinear filter, and writes float
/// CHW `(v / 255 - mean) / std` to `out` (3 planes of `out_h * out_w`),
/// mirrored left-right when `flip`. With `clip` the filter reads only
/// inside the box (rounded out to whole pixels), as a crop then a resize
/// does; without, it reads neighbours outside the box too, as a resize then
/// a crop does. One vertical pass (source rows ->
/// a float row, contiguous and vectorised) and one horizontal pass (4-wide
/// RGB_ vectors) per output row; normalise and flip ride on the last store,
/// so the image is touched once and nothing else is allocated.
inline void resample_normalize(const std::uint8_t* src, int64_t in_h,
                               int64_t in_w, int64_t stride, double y0,
                               double x0, double box_h, double box_w,
                               int64_t out_h, int64_t out_w, bool flip,
                               const Rgb& mean, const Rgb& std, float* out,
                               bool clip = true) {
  typedef float v4 __attribute__((vector_size(16)));
  thread_local detail::Taps th, tv;
  thread_local std::vector<float> row, wts;
  thread_local std::vector<const std::uint8_t*> rows;
  detail::bilinear_taps(x0, box_w, in_w, out_w, clip, th);
  detail::bilinear_taps(y0, box_h, in_h, out_h, clip, tv);
  const int64_t c0 = th.start.front(), c1 = th.start.back() + th.k;
  const int64_t n = (c1 - c0) * 3;
  row.resize(static_cast<std::size_t>(n + 4));
  wts.resize(static_cast<std::size_t>(tv.k));
  rows.resize(static_cast<std::size_t>(tv.k));
  float* r = row.data();
  const v4 a{1.0f / (255.0f * std[0]), 1.0f / (255.0f * std[1]),
             1.0f / (255.0f * std[2]), 0.0f};
  const v4 b{-mean[0] / std[0], -mean[1] / std[1], -mean[2] / std[2], 0.0f};
  const int64_t plane = out_h * out_w, kh = th.k, kv = tv.k;
#ifdef DDPKIT_RESAMPLE_AVX2
  const bool avx2 = detail::cpu_has_avx2_fma();
  thread_local std::vector<float> w2;
  if (avx2) {
    w2.resize(static_cast<std::size_t>((out_w / 2) * kh * 8));
    for (int64_t p = 0; p < out_w / 2; ++p) {
      for (int64_t k = 0; k < kh; ++k) {
        float* d = w2.data() + (p * kh + k) * 8;
        const float wa = th.w[static_cast<std::size_t>(2 * p * kh + k)];
        const float wb = th.w[static_cast<std::size_t>((2 * p + 1) * kh + k)];
        for (int i = 0; i < 4; ++i) d[i] = wa, d[4 + i] = wb;
      }
    }
  }
  const float a4[4] = {a[0], a[1], a[2], a[3]},
              b4[4] = {b[0], b[1], b[2], b[3]};
#endif
  for (int64_t oy = 0; oy < out_h; ++oy) {
    // Vertical: r = sum_k wv[k] * source row (start + k), columns c0..c1.
    const float* wv = tv.w.data() + oy * kv;
    const std::uint8_t* base =
        src + tv.start[static_cast<std::size_t>(oy)] * stride + c0 * 3;
    int64_t taps = 0;
    for (int64_t k = 0; k < kv; ++k) {
      if (wv[k] == 0.0f) continue;
      rows[static_cast<std::size_t>(taps)] = base + k * stride;
      wts[static_cast<std::size_t>(taps++)] = wv[k];
    }
    int64_t done = 0;
#ifdef DDPKIT_RESAMPLE_AVX2
    if (avx2)
      done = detail::vertical_pass_avx2(rows.data(), wts.data(), taps, n, r);
#endif
#ifdef __SSE2__
    // 16 bytes per step: widened to four float vectors, every tap summed
    // in registers, one store per vector.
    const int64_t n4 = n & ~int64_t{15};
    const __m128i zero = _mm_setzero_si128();
    for (int64_t j = done; j < n4; j += 16) {
      __m128 a0 = _mm_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t t = 0; t < taps; ++t) {
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
            rows[static_cast<std::size_t>(t)] + j));
        const __m128 wt = _mm_set1_ps(wts[static_cast<std::size_t>(t)]);
        const __m128i lo = _mm_unpacklo_epi8(q, zero),
                      hi = _mm_unpackhi_epi8(q, zero);
        a0 = _mm_add_ps(
            a0, _mm_mul_ps(wt, _mm_cvtepi32_ps(_mm_unpacklo_epi16(lo, zero))));
        a1 = _mm_add_ps(
            a1, _mm_mul_ps(wt, _mm_cvtepi32_ps(_mm_unpackhi_epi16(lo, zero))));
        a2 = _mm_add_ps(
            a2, _mm_mul_ps(wt, _mm_cvtepi32_ps(_mm_unpacklo_epi16(hi, zero))));
        a3 = _mm_add_ps(
            a3, _mm_mul_ps(wt, _mm_cvtepi32_ps(_mm_unpackhi_epi16(hi, zero))));
      }
      _mm_storeu_ps(r + j, a0);
      _mm_storeu_ps(r + j + 4, a1);
      _mm_storeu_ps(r + j + 8, a2);
      _mm_storeu_ps(r + j + 12, a3);
    }
#else
    const int64_t n4 = done;
#endif
    for (int64_t j = n4; j < n; ++j) {
      float acc = 0.0f;
      for (int64_t t = 0; t < taps; ++t) {
        acc += wts[static_cast<std::size_t>(t)] *
               rows[static_cast<std::size_t>(t)][j];
      }
      r[j] = acc;
    }
    // Horizontal, then normalise and store (mirrored when flipping).
    float* o0 = out + oy * out_w;
    float* o1 = o0 + plane;
    float* o2 = o1 + plane;
    int64_t ox0 = 0;
#ifdef DDPKIT_RESAMPLE_AVX2
    if (avx2) {
      detail::horizontal_pass_avx2(r, th.start.data(), c0, w2.data(), kh, out_w,
                                   a4, b4, flip, o0, o1, o2);
      ox0 = out_w & ~int64_t{1};
    }
#endif
    for (int64_t ox = ox0; ox < out_w; ++ox) {
      const float* px = r + (th.start[static_cast<std::size_t>(ox)] - c0) * 3;
      const float* wh = th.w.data() + ox * kh;
      v4 acc{0.0f, 0.0f, 0.0f, 0.0f};
      for (int64_t k = 0; k < kh; ++k) {
        v4 v;
        std::memcpy(&v, px + 3 * k, sizeof v);
        acc += wh[k] * v;
      }
      acc = acc * a + b;
      const int64_t x = flip ? out_w - 1 - ox : ox;
      o0[x] = acc[0];
      o1[x] = acc[1];
      o2[x] = acc[2];
    }
  }
}

}  // namespace ddpkit::data
