// Image decode and encode for ImageFolder: JPEG through libjpeg-turbo's
// TurboJPEG API (with DCT-domain downscaling), PNG through libpng. Images are
// uint8 3×H×W RGB tensors.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
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

namespace detail {

#ifdef DDPKIT_HAS_TURBOJPEG
/// One TurboJPEG decompressor per thread, reused across images (creating
/// one allocates the decoder's state each time).
inline tjhandle thread_decompressor() {
  struct Handle {
    tjhandle h = tjInitDecompress();
    ~Handle() {
      if (h) tjDestroy(h);
    }
  };
  thread_local Handle handle;
  if (!handle.h) throw Error("decode_jpeg: tjInitDecompress failed");
  return handle.h;
}
#endif

}  // namespace detail

/// A JPEG's size from its header, without decoding pixels.
struct ImageSize {
  int64_t height = 0, width = 0;
};

/// The size of a JPEG (header only); a UsageError naming `name` when the
/// header is unreadable.
inline ImageSize jpeg_size(const std::vector<unsigned char>& bytes,
                           const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_TURBOJPEG
  tjhandle h = detail::thread_decompressor();
  int w = 0, ht = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(h, bytes.data(), static_cast<unsigned long>(bytes.size()), &w,
                          &ht, &subsamp, &colorspace) != 0) {
    throw UsageError(ddpkit::detail::cat("not a readable JPEG: ", name, " (",
                                         tjGetErrorStr2(h), ")"));
  }
  return {ht, w};
#else
  (void)bytes;
  throw UsageError(ddpkit::detail::cat(
      "cannot decode ", name, ": ddpkit was built without libjpeg-turbo "
      "(install libturbojpeg0-dev and reconfigure)"));
#endif
}

/// How to decode a JPEG into an HWC buffer.
struct JpegDecodeOptions {
  /// DCT-domain downscale `scale_num / 8` (8: full size; libjpeg-turbo
  /// accelerates 8, 4, 2 and 1 with SIMD, the others are slower than 8).
  int scale_num = 8;
  /// TJFLAG_FASTDCT | TJFLAG_FASTUPSAMPLE: the integer "IFAST" IDCT and
  /// nearest-neighbour chroma upsampling instead of libjpeg's default
  /// ("ISLOW" IDCT, triangle-filtered chroma, which PIL uses). About 10-15%
  /// faster; pixel values differ by a few levels, most near colour edges.
  bool fast = false;
};

/// Decodes a JPEG to RGB HWC uint8 into `out` (resized as needed; reusing
/// one buffer avoids an allocation per image) and returns its size. A
/// truncated file ("Premature end of JPEG file") or any fatal libjpeg error
/// is a UsageError naming `name`; other libjpeg warnings (such as
/// extraneous bytes before a marker, common in photo collections) are
/// ignored, as PIL ignores them.
inline ImageSize decode_jpeg_hwc(const std::vector<unsigned char>& bytes,
                                 std::vector<std::uint8_t>& out,
                                 const JpegDecodeOptions& opts = {},
                                 const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_TURBOJPEG
  const auto size = jpeg_size(bytes, name);
  tjhandle h = detail::thread_decompressor();
  const tjscalingfactor f{opts.scale_num, 8};
  const int sw = TJSCALED(static_cast<int>(size.width), f);
  const int sh = TJSCALED(static_cast<int>(size.height), f);
  out.resize(static_cast<std::size_t>(sw) * sh * 3 + 16);
  const int flags = opts.fast ? (TJFLAG_FASTDCT | TJFLAG_FASTUPSAMPLE) : 0;
  if (tjDecompress2(h, bytes.data(), static_cast<unsigned long>(bytes.size()), out.data(),
                    sw, 0, sh, TJPF_RGB, flags) != 0) {
    const std::string msg = tjGetErrorStr2(h);
    if (tjGetErrorCode(h) == TJERR_FATAL) {
      throw UsageError(ddpkit::detail::cat("corrupt JPEG: ", name, " (", msg, ")"));
    }
    if (msg.find("Premature end") != std::string::npos) {
      throw UsageError(ddpkit::detail::cat("truncated JPEG: ", name, " (", msg, ")"));
    }
  }
  return {sh, sw};
#else
  (void)bytes;
  (void)out;
  (void)opts;
  throw UsageError(ddpkit::detail::cat(
      "cannot decode ", name, ": ddpkit was built without libjpeg-turbo "
      "(install libturbojpeg0-dev and reconfigure)"));
#endif
}

/// The DCT scale numerator (over 8) for decoding a `height`×`width` JPEG so
/// that both sides stay at least `min_side`, among the SIMD-accelerated
/// 1/8, 1/4, 1/2 and 1 (7/8..5/8 exist but decode slower than full size).
inline int jpeg_scale_for(int64_t height, int64_t width, double min_side) {
  for (int num : {1, 2, 4}) {
    if (std::min(height, width) * num >= min_side * 8) return num;
  }
  return 8;
}

/// Decodes a JPEG. With `min_side > 0`, decodes at the smallest TurboJPEG
/// scaling factor (1/8, 1/4, 3/8, ... 1) whose output keeps both sides at
/// least `min_side`: an 8× smaller decode is much cheaper than a full one
/// followed by a resize, when the training size is far below the photo's.
inline torch::Tensor decode_jpeg(const std::vector<unsigned char>& bytes,
                                 int64_t min_side = 0, const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_TURBOJPEG
  const auto size = jpeg_size(bytes, name);
  tjscalingfactor best{1, 1};
  if (min_side > 0) {
    int n = 0;
    tjscalingfactor* f = tjGetScalingFactors(&n);
    int64_t best_w = size.width;
    for (int i = 0; i < n; ++i) {
      if (f[i].num > f[i].denom) continue;  // only shrink
      const int64_t sw = TJSCALED(size.width, f[i]), sh = TJSCALED(size.height, f[i]);
      if (sw >= min_side && sh >= min_side && sw < best_w) {
        best = f[i];
        best_w = sw;
      }
    }
  }
  JpegDecodeOptions o;
  o.scale_num = best.num * 8 / best.denom;
  std::vector<std::uint8_t> buf;
  const auto s = decode_jpeg_hwc(bytes, buf, o, name);
  auto hwc = torch::from_blob(buf.data(), {s.height, s.width, 3}, torch::kUInt8);
  return hwc.permute({2, 0, 1}).contiguous();
#else
  (void)bytes;
  (void)min_side;
  throw UsageError(ddpkit::detail::cat(
      "cannot decode ", name, ": ddpkit was built without libjpeg-turbo "
      "(install libturbojpeg0-dev and reconfigure)"));
#endif
}

/// Decodes a PNG (any bit depth, palette, grey or alpha) to RGB HWC uint8
/// into `out` and returns its size.
inline ImageSize decode_png_hwc(const std::vector<unsigned char>& bytes,
                                std::vector<std::uint8_t>& out,
                                const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_PNG
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, bytes.data(), bytes.size())) {
    throw UsageError(ddpkit::detail::cat("not a readable PNG: ", name, " (",
                                         img.message, ")"));
  }
  img.format = PNG_FORMAT_RGB;
  out.resize(static_cast<std::size_t>(img.height) * img.width * 3 + 16);
  if (!png_image_finish_read(&img, nullptr, out.data(), 0, nullptr)) {
    std::string msg = img.message;
    png_image_free(&img);
    throw UsageError(ddpkit::detail::cat("corrupt PNG: ", name, " (", msg, ")"));
  }
  return {static_cast<int64_t>(img.height), static_cast<int64_t>(img.width)};
#else
  (void)bytes;
  (void)out;
  throw UsageError(ddpkit::detail::cat(
      "cannot decode ", name, ": ddpkit was built without libpng"));
#endif
}

/// Decodes a PNG (any bit depth, palette, grey or alpha) to RGB.
inline torch::Tensor decode_png(const std::vector<unsigned char>& bytes,
                                const std::string& name = "<memory>") {
  std::vector<std::uint8_t> buf;
  const auto s = decode_png_hwc(bytes, buf, name);
  return torch::from_blob(buf.data(), {s.height, s.width, 3}, torch::kUInt8)
      .permute({2, 0, 1})
      .contiguous();
}

/// Decodes JPEG or PNG bytes (by content) to uint8 3×H×W; `min_side` asks
/// for a scaled JPEG decode (see `decode_jpeg`).
inline torch::Tensor decode_image_bytes(const std::vector<unsigned char>& bytes,
                                        int64_t min_side, const std::string& name) {
  if (is_jpeg(bytes)) return decode_jpeg(bytes, min_side, name);
  if (is_png(bytes)) return decode_png(bytes, name);
  throw UsageError(ddpkit::detail::cat("not a JPEG or PNG image: ", name));
}

/// Decodes a JPEG or PNG file (by content, not extension) to uint8 3×H×W.
/// `min_side` asks for a scaled JPEG decode (see `decode_jpeg`).
inline torch::Tensor decode_image(const std::filesystem::path& file, int64_t min_side = 0) {
  return decode_image_bytes(read_file_bytes(file), min_side, file.string());
}

/// The images of one batch as `ImageFiles::get` yields them: each one is
/// either a file's undecoded bytes or an already decoded uint8 3×H×W
/// tensor. `ImageNetTrain` and `ImageNetEval` decode the bytes themselves,
/// straight into their fused resize (and, for JPEGs, at a reduced DCT scale
/// when the crop allows); any other transform taking
/// `const std::vector<torch::Tensor>&` gets decoded tensors through the
/// implicit conversion.
class ImageBatch {
 public:
  struct Item {
    /// The file's bytes (null when `image` is set).
    std::shared_ptr<const std::vector<unsigned char>> bytes;
    /// The file name, for error messages.
    std::string name;
    /// The decoded image when decoding already happened.
    torch::Tensor image;
    /// `decode_min_side` for decoding to a tensor (see `decode_jpeg`).
    int64_t min_side = 0;

    bool decoded() const { return image.defined(); }
    /// The uint8 3×H×W image (decoding the bytes if needed).
    torch::Tensor tensor() const {
      return decoded() ? image : decode_image_bytes(*bytes, min_side, name);
    }
  };

  ImageBatch() = default;
  explicit ImageBatch(std::vector<Item> items) : items_(std::move(items)) {}
  /// Already decoded images.
  ImageBatch(const std::vector<torch::Tensor>& images) {  // NOLINT: implicit
    for (const auto& im : images) items_.push_back({nullptr, "<tensor>", im, 0});
  }

  std::size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  const std::vector<Item>& items() const { return items_; }
  /// Image `i` as a uint8 3×H×W tensor (decoded on each call).
  torch::Tensor operator[](std::size_t i) const { return items_.at(i).tensor(); }
  /// All images, decoded.
  std::vector<torch::Tensor> tensors() const {
    std::vector<torch::Tensor> out;
    out.reserve(items_.size());
    for (const auto& it : items_) out.push_back(it.tensor());
    return out;
  }
  operator std::vector<torch::Tensor>() const { return tensors(); }  // NOLINT: implicit

 private:
  std::vector<Item> items_;
};

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
    tjhandle h = detail::thread_decompressor();
    int w, ht, s, c;
    return tjDecompressHeader3(h, bytes.data(), static_cast<unsigned long>(bytes.size()),
                               &w, &ht, &s, &c) == 0;
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
