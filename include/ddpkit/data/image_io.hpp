// Image decode and encode for ImageFolder: JPEG through libjpeg-turbo's
// TurboJPEG API (with DCT-domain downscaling), PNG through libpng. Images are
// uint8 3×H×W RGB tensors.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include <torch/torch.h>

#ifdef DDPKIT_HAS_TURBOJPEG
#include <turbojpeg.h>
#endif
#ifdef DDPKIT_HAS_PNG
#include <png.h>
#endif

#include "ddpkit/detail/error.hpp"

namespace ddpkit::data {

/// The bytes of `file`; a UsageError naming it when it cannot be read.
inline std::vector<unsigned char> read_file_bytes(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw UsageError(ddpkit::detail::cat("cannot open image ", file.string()));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline bool is_jpeg(const std::vector<unsigned char>& b) {
  return b.size() > 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF;
}
inline bool is_png(const std::vector<unsigned char>& b) {
  return b.size() > 8 && b[0] == 0x89 && b[1] == 'P' && b[2] == 'N' && b[3] == 'G';
}

/// Decodes a JPEG. With `min_side > 0`, decodes at the smallest TurboJPEG
/// scaling factor (1/8, 1/4, 3/8, ... 1) whose output keeps both sides at
/// least `min_side`: an 8× smaller decode is much cheaper than a full one
/// followed by a resize, when the training size is far below the photo's.
inline torch::Tensor decode_jpeg(const std::vector<unsigned char>& bytes,
                                 int64_t min_side = 0, const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_TURBOJPEG
  tjhandle h = tjInitDecompress();
  if (!h) throw Error("decode_jpeg: tjInitDecompress failed");
  struct Guard {
    tjhandle h;
    ~Guard() { tjDestroy(h); }
  } guard{h};
  int w = 0, ht = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(h, bytes.data(), static_cast<unsigned long>(bytes.size()), &w,
                          &ht, &subsamp, &colorspace) != 0) {
    throw UsageError(ddpkit::detail::cat("not a readable JPEG: ", name, " (",
                                         tjGetErrorStr2(h), ")"));
  }
  tjscalingfactor best{1, 1};
  if (min_side > 0) {
    int n = 0;
    tjscalingfactor* f = tjGetScalingFactors(&n);
    int64_t best_w = w;
    for (int i = 0; i < n; ++i) {
      if (f[i].num > f[i].denom) continue;  // only shrink
      const int64_t sw = TJSCALED(w, f[i]), sh = TJSCALED(ht, f[i]);
      if (sw >= min_side && sh >= min_side && sw < best_w) {
        best = f[i];
        best_w = sw;
      }
    }
  }
  const int sw = TJSCALED(w, best), sh = TJSCALED(ht, best);
  auto hwc = torch::empty({sh, sw, 3}, torch::kUInt8);
  if (tjDecompress2(h, bytes.data(), static_cast<unsigned long>(bytes.size()),
                    hwc.data_ptr<std::uint8_t>(), sw, 0, sh, TJPF_RGB, 0) != 0 &&
      tjGetErrorCode(h) == TJERR_FATAL) {
    throw UsageError(ddpkit::detail::cat("corrupt JPEG: ", name, " (",
                                         tjGetErrorStr2(h), ")"));
  }
  return hwc.permute({2, 0, 1}).contiguous();
#else
  (void)bytes;
  (void)min_side;
  throw UsageError(ddpkit::detail::cat(
      "cannot decode ", name, ": ddpkit was built without libjpeg-turbo "
      "(install libturbojpeg0-dev and reconfigure)"));
#endif
}

/// Decodes a PNG (any bit depth, palette, grey or alpha) to RGB.
inline torch::Tensor decode_png(const std::vector<unsigned char>& bytes,
                                const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_PNG
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, bytes.data(), bytes.size())) {
    throw UsageError(ddpkit::detail::cat("not a readable PNG: ", name, " (",
                                         img.message, ")"));
  }
  img.format = PNG_FORMAT_RGB;
  auto hwc = torch::empty({static_cast<int64_t>(img.height),
                           static_cast<int64_t>(img.width), 3},
                          torch::kUInt8);
  if (!png_image_finish_read(&img, nullptr, hwc.data_ptr<std::uint8_t>(), 0, nullptr)) {
    std::string msg = img.message;
    png_image_free(&img);
    throw UsageError(ddpkit::detail::cat("corrupt PNG: ", name, " (", msg, ")"));
  }
  return hwc.permute({2, 0, 1}).contiguous();
#else
  (void)bytes;
  throw UsageError(ddpkit::detail::cat(
      "cannot decode ", name, ": ddpkit was built without libpng"));
#endif
}

/// Decodes a JPEG or PNG file (by content, not extension) to uint8 3×H×W.
/// `min_side` asks for a scaled JPEG decode (see `decode_jpeg`).
inline torch::Tensor decode_image(const std::filesystem::path& file, int64_t min_side = 0) {
  const auto bytes = read_file_bytes(file);
  if (is_jpeg(bytes)) return decode_jpeg(bytes, min_side, file.string());
  if (is_png(bytes)) return decode_png(bytes, file.string());
  throw UsageError(ddpkit::detail::cat("not a JPEG or PNG image: ", file.string()));
}

/// Does the file look decodable (magic bytes and a valid header), without
/// decoding the pixels.
inline bool image_header_ok(const std::filesystem::path& file) {
  std::vector<unsigned char> bytes;
  try {
    bytes = read_file_bytes(file);
  } catch (const UsageError&) {
    return false;
  }
#ifdef DDPKIT_HAS_TURBOJPEG
  if (is_jpeg(bytes)) {
    tjhandle h = tjInitDecompress();
    int w, ht, s, c;
    bool ok = tjDecompressHeader3(h, bytes.data(), static_cast<unsigned long>(bytes.size()),
                                  &w, &ht, &s, &c) == 0;
    tjDestroy(h);
    return ok;
  }
#endif
#ifdef DDPKIT_HAS_PNG
  if (is_png(bytes)) {
    png_image img{};
    img.version = PNG_IMAGE_VERSION;
    bool ok = png_image_begin_read_from_memory(&img, bytes.data(), bytes.size());
    png_image_free(&img);
    return ok;
  }
#endif
  return false;
}

/// Encodes uint8 3×H×W RGB as a JPEG file (4:2:0, `quality` 1..100).
inline void write_jpeg(const std::filesystem::path& file, const torch::Tensor& image,
                       int quality = 90) {
#ifdef DDPKIT_HAS_TURBOJPEG
  auto hwc = image.to(torch::kUInt8).permute({1, 2, 0}).contiguous();
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  int rc = tjCompress2(h, hwc.data_ptr<std::uint8_t>(), static_cast<int>(hwc.size(1)), 0,
                       static_cast<int>(hwc.size(0)), TJPF_RGB, &buf, &size, TJSAMP_420,
                       quality, 0);
  std::string err = rc != 0 ? tjGetErrorStr2(h) : "";
  tjDestroy(h);
  if (rc != 0) {
    tjFree(buf);
    throw Error(ddpkit::detail::cat("write_jpeg: ", file.string(), ": ", err));
  }
  std::ofstream os(file, std::ios::binary);
  os.write(reinterpret_cast<const char*>(buf), static_cast<std::streamsize>(size));
  tjFree(buf);
  if (!os) throw UsageError(ddpkit::detail::cat("write_jpeg: cannot write ", file.string()));
#else
  (void)image;
  (void)quality;
  throw UsageError(ddpkit::detail::cat("cannot write ", file.string(),
                                       ": ddpkit was built without libjpeg-turbo"));
#endif
}

}  // namespace ddpkit::data
