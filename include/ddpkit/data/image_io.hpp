// SPDX-License-Identifier: BSD-3-Clause
// Image decode and encode for ImageFolder: JPEG through libjpeg-turbo's
// TurboJPEG API (with DCT-domain downscaling), PNG through libpng. Images are
// uint8 3×H×W RGB tensors.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#ifdef DDPKIT_HAS_TURBOJPEG
#include <turbojpeg.h>
// Region decode through libjpeg's own API (see `decode_jpeg_region`).
// ddpkit's CMake asks for it (DDPKIT_HAS_JPEG_REGION) or opts out
// (DDPKIT_NO_JPEG_REGION); without either, it is used where it is found.
#if defined(DDPKIT_HAS_JPEG_REGION) && !__has_include(<jpeglib.h>)
#error \
    "DDPKIT_HAS_JPEG_REGION is set but jpeglib.h is missing: install libjpeg62-turbo-dev or define DDPKIT_NO_JPEG_REGION"
#endif
#if __has_include(<jpeglib.h>) && __has_include(<dlfcn.h>) && !defined(DDPKIT_NO_JPEG_REGION)
#define DDPKIT_JPEG_REGION 1
#include <dlfcn.h>

#include <csetjmp>
#include <cstdio>  // jpeglib.h needs FILE
#include <type_traits>

#include <jerror.h>
#include <jpeglib.h>
// jmorecfg.h's generic macro names, not needed past the declarations.
#undef LOCAL
#undef GLOBAL
#undef EXTERN
#undef METHODDEF
#undef JMETHOD
#undef FAR
#undef JPP
#endif
#endif
#if defined(DDPKIT_HAS_JPEG_REGION) && defined(DDPKIT_HAS_TURBOJPEG) && \
    !defined(DDPKIT_JPEG_REGION) && !defined(DDPKIT_NO_JPEG_REGION)
#error \
    "DDPKIT_HAS_JPEG_REGION is set but the JPEG region decode is not available (no <dlfcn.h>?)"
#endif
#ifdef DDPKIT_HAS_PNG
#include <png.h>
#endif

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/files.hpp"
#include "ddpkit/detail/scope_guard.hpp"

namespace ddpkit::data {

/// The bytes of `file`; a UsageError naming it when it cannot be read.
inline std::vector<unsigned char> read_file_bytes(
    const std::filesystem::path& file) {
  return ddpkit::detail::read_whole_file<std::vector<unsigned char>>(file,
                                                                     "image");
}

/// The most pixels an image may have (PIL's `DecompressionBombError`
/// threshold, 2 × `Image.MAX_IMAGE_PIXELS`): decoding allocates from the
/// header's size before reading any pixel data, so a file of a few hundred
/// bytes claiming 60000×60000 would otherwise cost 10 GB.
inline constexpr std::int64_t kMaxImagePixels = 178956970;

namespace detail {

inline bool image_too_large(std::int64_t height, std::int64_t width) {
  return height > 0 && width > kMaxImagePixels / height;
}

/// A UsageError naming `name` when `height`×`width` is above
/// `kMaxImagePixels`.
inline void check_image_pixels(std::int64_t height, std::int64_t width,
                               const std::string& name) {
  if (height <= 0 || width <= 0) {
    throw UsageError(ddpkit::detail::cat("image ", name, " claims ", width, "x",
                                         height, " pixels (a damaged header)"));
  }
  if (image_too_large(height, width)) {
    throw UsageError(ddpkit::detail::cat(
        "image ", name, " claims ", width, "x", height, " = ", width * height,
        " pixels, more than the limit of ", kMaxImagePixels,
        " (a damaged file or a decompression bomb?)"));
  }
}

}  // namespace detail

inline bool is_jpeg(const std::vector<unsigned char>& b) {
  return b.size() > 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF;
}
inline bool is_png(const std::vector<unsigned char>& b) {
  return b.size() > 8 && b[0] == 0x89 && b[1] == 'P' && b[2] == 'N' &&
         b[3] == 'G';
}

namespace detail {

#ifdef DDPKIT_HAS_TURBOJPEG
/// One TurboJPEG decompressor per thread, reused across images (creating
/// one allocates the decoder's state each time).
struct TjHandle {
  tjhandle h = tjInitDecompress();
  ~TjHandle() {
    if (h) tjDestroy(h);
  }
};
inline TjHandle& thread_tj_handle() {
  thread_local TjHandle handle;
  return handle;
}
inline tjhandle thread_decompressor() {
  auto& t = thread_tj_handle();
  if (!t.h) throw Error("decode_jpeg: tjInitDecompress failed");
  return t.h;
}
/// The scaling factor TurboJPEG really decodes a `width`×`height` JPEG at
/// when asked for `scale_num`/8: tjDecompress2 takes an output size, not a
/// factor, and uses the first (largest) factor whose output fits. Below 8
/// pixels a side several factors give the same size (a 3×1 image is 1×1 at
/// 1/8 and at 1/4), and it then decodes at the larger one. The region
/// decode uses the same factor, so both paths give the same pixels.
inline tjscalingfactor tj_effective_scale(int64_t width, int64_t height,
                                          int scale_num) {
  const tjscalingfactor want{scale_num, 8};
  const int sw = TJSCALED(static_cast<int>(width), want);
  const int sh = TJSCALED(static_cast<int>(height), want);
  int n = 0;
  const tjscalingfactor* f = tjGetScalingFactors(&n);
  for (int i = 0; f != nullptr && i < n; ++i) {
    if (TJSCALED(static_cast<int>(width), f[i]) <= sw &&
        TJSCALED(static_cast<int>(height), f[i]) <= sh) {
      return f[i];
    }
  }
  return want;
}
/// A failed header read can leave the decompressor mid-stream, and every
/// later image on this thread then fails ("Bogus marker length"): after
/// any failure, start a fresh one.
inline void reset_thread_decompressor() {
  auto& t = thread_tj_handle();
  if (t.h) tjDestroy(t.h);
  t.h = tjInitDecompress();
}
/// Resets the thread's decompressor when the scope is left by an exception.
struct ResetDecompressorOnThrow : ddpkit::detail::ScopeFail<void (*)()> {
  ResetDecompressorOnThrow()
      : ddpkit::detail::ScopeFail<void (*)()>(&reset_thread_decompressor) {}
};
#endif

}  // namespace detail

/// A JPEG's size from its header, without decoding pixels.
struct ImageSize {
  int64_t height = 0, width = 0;
};

/// The size of a JPEG (header only); a UsageError naming `name` when the
/// header is unreadable or the image has more than `kMaxImagePixels`.
inline ImageSize jpeg_size(const std::vector<unsigned char>& bytes,
                           const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_TURBOJPEG
  detail::ResetDecompressorOnThrow reset_on_error;
  tjhandle h = detail::thread_decompressor();
  int w = 0, ht = 0, subsamp = 0, colorspace = 0;
  if (tjDecompressHeader3(h, bytes.data(),
                          static_cast<unsigned long>(bytes.size()), &w, &ht,
                          &subsamp, &colorspace) != 0) {
    throw UsageError(ddpkit::detail::cat("not a readable JPEG: ", name, " (",
                                         tjGetErrorStr2(h), ")"));
  }
  detail::check_image_pixels(ht, w, name);
  return {ht, w};
#else
  (void)bytes;
  throw UsageError(
      ddpkit::detail::cat("cannot decode ", name,
                          ": ddpkit was built without libjpeg-turbo "
                          "(install libturbojpeg0-dev and reconfigure)"));
#endif
}

/// How to decode a JPEG into an HWC buffer.
struct JpegDecodeOptions {
  /// DCT-domain downscale `scale_num / 8` (8: full size; libjpeg-turbo
  /// accelerates 8, 4, 2 and 1 with SIMD, the others are slower than 8).
  /// An image under 8 pixels a side may be decoded at a larger factor with
  /// the same output size (what TurboJPEG does; `detail::tj_effective_scale`).
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
  detail::ResetDecompressorOnThrow reset_on_error;
  const auto size = jpeg_size(bytes, name);
  tjhandle h = detail::thread_decompressor();
  const tjscalingfactor f{opts.scale_num, 8};
  const int sw = TJSCALED(static_cast<int>(size.width), f);
  const int sh = TJSCALED(static_cast<int>(size.height), f);
  out.resize(static_cast<std::size_t>(sw) * sh * 3 + 16);
  const int flags = opts.fast ? (TJFLAG_FASTDCT | TJFLAG_FASTUPSAMPLE) : 0;
  if (tjDecompress2(h, bytes.data(), static_cast<unsigned long>(bytes.size()),
                    out.data(), sw, 0, sh, TJPF_RGB, flags) != 0) {
    const std::string msg = tjGetErrorStr2(h);
    if (tjGetErrorCode(h) == TJERR_FATAL) {
      throw UsageError(
          ddpkit::detail::cat("corrupt JPEG: ", name, " (", msg, ")"));
    }
    if (msg.find("Premature end") != std::string::npos) {
      throw UsageError(
          ddpkit::detail::cat("truncated JPEG: ", name, " (", msg, ")"));
    }
  }
  return {sh, sw};
#else
  (void)bytes;
  (void)out;
  (void)opts;
  throw UsageError(
      ddpkit::detail::cat("cannot decode ", name,
                          ": ddpkit was built without libjpeg-turbo "
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

/// Where a region decode put its pixels: a block of `height`×`width` RGB
/// pixels, rows `stride` bytes apart starting `offset` bytes into the
/// buffer, whose first pixel is at (`top`, `left`) of the scaled image (the
/// block covers the asked region, widened to the iMCU grid horizontally).
struct JpegBlock {
  int64_t height = 0, width = 0, top = 0, left = 0;
  int64_t stride = 0, offset = 0;
};

#ifdef DDPKIT_JPEG_REGION
namespace detail {

/// libjpeg's API, resolved at run time from libjpeg.so.62 (libjpeg-turbo's
/// libjpeg ABI; Debian's libtorch already loads it, and libturbojpeg does
/// not export it). Empty when the library cannot be loaded.
struct LibJpeg {
  decltype(&jpeg_std_error) std_error = nullptr;
  decltype(&jpeg_CreateDecompress) create = nullptr;
  decltype(&jpeg_mem_src) mem_src = nullptr;
  decltype(&jpeg_read_header) read_header = nullptr;
  decltype(&jpeg_start_decompress) start = nullptr;
  decltype(&jpeg_crop_scanline) crop = nullptr;
  decltype(&jpeg_skip_scanlines) skip = nullptr;
  decltype(&jpeg_read_scanlines) read = nullptr;
  decltype(&jpeg_abort_decompress) abort = nullptr;
  decltype(&jpeg_destroy_decompress) destroy = nullptr;
  bool ok = false;
};

inline const LibJpeg& libjpeg() {
  static const LibJpeg lib = [] {
    LibJpeg l;
    if (std::getenv("DDPKIT_NO_JPEG_REGION")) return l;
    void* h = dlopen("libjpeg.so.62", RTLD_NOW | RTLD_LOCAL);
    if (!h) return l;
    auto sym = [h](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(
          dlsym(h, name));
      return f != nullptr;
    };
    l.ok = sym(l.std_error, "jpeg_std_error") &&
           sym(l.create, "jpeg_CreateDecompress") &&
           sym(l.mem_src, "jpeg_mem_src") &&
           sym(l.read_header, "jpeg_read_header") &&
           sym(l.start, "jpeg_start_decompress") &&
           sym(l.crop, "jpeg_crop_scanline") &&
           sym(l.skip, "jpeg_skip_scanlines") &&
           sym(l.read, "jpeg_read_scanlines") &&
           sym(l.abort, "jpeg_abort_decompress") &&
           sym(l.destroy, "jpeg_destroy_decompress");
    return l;
  }();
  return lib;
}

struct JpegErr {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  int kind;  // 1: fatal error, 2: truncated, 3: too many pixels
  char msg[JMSG_LENGTH_MAX];
};

extern "C" inline void ddpkit_jpeg_error_exit(j_common_ptr c) {
  auto* e = reinterpret_cast<JpegErr*>(c->err);
  e->kind = 1;
  (*c->err->format_message)(c, e->msg);
  std::longjmp(e->jump, 1);
}

/// Warnings are ignored (as PIL does) except a premature end of data.
extern "C" inline void ddpkit_jpeg_emit_message(j_common_ptr c, int level) {
  auto* e = reinterpret_cast<JpegErr*>(c->err);
  if (level < 0 && c->err->msg_code == JWRN_JPEG_EOF) {
    e->kind = 2;
    (*c->err->format_message)(c, e->msg);
    std::longjmp(e->jump, 1);
  }
}

/// The region decode proper; only trivially destructible locals live
/// across the setjmp. Returns 0; 4 when the file needs the full decode
/// (see the block smoothing below); or the JpegErr kind with `err.msg` set.
inline int jpeg_region_raw(const LibJpeg& lib, const unsigned char* data,
                           unsigned long size, double top, double left,
                           double height, double width,
                           const JpegDecodeOptions& opts,
                           std::vector<std::uint8_t>& out, JpegBlock& block,
                           JpegErr& err) {
  jpeg_decompress_struct cinfo;
  cinfo.err = lib.std_error(&err.pub);
  err.pub.error_exit = ddpkit_jpeg_error_exit;
  err.pub.emit_message = ddpkit_jpeg_emit_message;
  err.kind = 0;
  err.msg[0] = '\0';
  if (setjmp(err.jump)) {
    lib.destroy(&cinfo);
    return err.kind;
  }
  lib.create(&cinfo, JPEG_LIB_VERSION, sizeof(cinfo));
  lib.mem_src(&cinfo, data, size);
  lib.read_header(&cinfo, 1);
  if (image_too_large(cinfo.image_height, cinfo.image_width)) {
    lib.destroy(&cinfo);
    std::snprintf(err.msg, sizeof err.msg, "%ux%u",
                  static_cast<unsigned>(cinfo.image_width),
                  static_cast<unsigned>(cinfo.image_height));
    return 3;
  }
  cinfo.out_color_space = JCS_RGB;
#ifdef DDPKIT_HAS_TURBOJPEG
  // The factor the full decode (TurboJPEG) really uses; see there.
  const tjscalingfactor f =
      tj_effective_scale(cinfo.image_width, cinfo.image_height, opts.scale_num);
  cinfo.scale_num = static_cast<unsigned>(f.num);
  cinfo.scale_denom = static_cast<unsigned>(f.denom);
#else
  cinfo.scale_num = static_cast<unsigned>(opts.scale_num);
  cinfo.scale_denom = 8;
#endif
  if (opts.fast) {
    cinfo.dct_method = JDCT_IFAST;
    cinfo.do_fancy_upsampling = 0;
  }
  lib.start(&cinfo);
  // A progressive file whose scans leave low-frequency coefficients
  // unfinished (legal: e.g. only the first scans, then EOI) is decoded with
  // block smoothing, which reads neighbouring blocks; a crop's edges are not
  // the image's, so its pixels would differ from a full decode's (fuzz
  // finding tests/fuzz/regressions/image/jpeg-progressive-unfinished).
  // libjpeg has read every scan by now: such files take the full decode.
  if (cinfo.progressive_mode && cinfo.do_block_smoothing &&
      cinfo.coef_bits != nullptr) {
    for (int c = 0; c < cinfo.num_components; ++c) {
      for (int k = 0; k < 10; ++k) {  // those libjpeg-turbo smooths from
        if (cinfo.coef_bits[c][k] != 0) {
          lib.abort(&cinfo);
          lib.destroy(&cinfo);
          return 4;
        }
      }
    }
  }
  const double s = opts.scale_num / 8.0;
  const auto W = static_cast<int64_t>(cinfo.output_width);
  const auto H = static_cast<int64_t>(cinfo.output_height);
  // One column of margin each side: fancy (triangle) chroma upsampling
  // treats the cut as an image edge, so the block's first and last columns
  // differ from a full decode's; they are dropped below.
  int64_t x0 = std::clamp<int64_t>(
      static_cast<int64_t>(std::floor(left * s)) - 1, 0, W - 1);
  int64_t x1 = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil((left + width) * s)) + 1, x0 + 1, W);
  // At least one iMCU column plus one pixel wide. libjpeg-turbo 2.1.5's
  // 4:2:0 triangle upsampling goes wrong when a crop is 2 pixels wide (one
  // chroma sample): the chroma of every row from the second iMCU row on
  // differs from a full decode's (fuzz finding
  // tests/fuzz/regressions/image/jpeg-420-crop-two-columns). A wider crop
  // costs at most one more block column per component.
#if JPEG_LIB_VERSION >= 70
  const int64_t imcu_w =
      int64_t{cinfo.max_h_samp_factor} * cinfo.min_DCT_h_scaled_size;
#else
  const int64_t imcu_w =
      int64_t{cinfo.max_h_samp_factor} * cinfo.min_DCT_scaled_size;
#endif
  const int64_t min_w = std::min<int64_t>(W, imcu_w + 1);
  if (x1 - x0 < min_w) {
    x1 = std::min<int64_t>(W, x0 + min_w);
    x0 = x1 - min_w;
  }
  const int64_t y0 =
      std::clamp<int64_t>(static_cast<int64_t>(std::floor(top * s)), 0, H - 1);
  const int64_t y1 = std::clamp<int64_t>(
      static_cast<int64_t>(std::ceil((top + height) * s)), y0 + 1, H);
  JDIMENSION xoff = static_cast<JDIMENSION>(x0),
             cw = static_cast<JDIMENSION>(x1 - x0);
  if (cw < cinfo.output_width) lib.crop(&cinfo, &xoff, &cw);
  if (y0 > 0) lib.skip(&cinfo, static_cast<JDIMENSION>(y0));
  const std::size_t row_bytes = static_cast<std::size_t>(cw) * 3;
  out.resize(row_bytes * static_cast<std::size_t>(y1 - y0) + 16);
  JSAMPROW rows[16];
  while (static_cast<int64_t>(cinfo.output_scanline) < y1) {
    const auto at = static_cast<int64_t>(cinfo.output_scanline);
    const int64_t n = std::min<int64_t>(16, y1 - at);
    for (int64_t i = 0; i < n; ++i) {
      rows[i] = out.data() + static_cast<std::size_t>(at - y0 + i) * row_bytes;
    }
    lib.read(&cinfo, rows, static_cast<JDIMENSION>(n));
  }
  lib.abort(&cinfo);
  lib.destroy(&cinfo);
  block = {y1 - y0,
           static_cast<int64_t>(cw),
           y0,
           static_cast<int64_t>(xoff),
           static_cast<int64_t>(row_bytes),
           0};
  if (block.left > 0 && block.width > 1) {
    block.left += 1;
    block.width -= 1;
    block.offset = 3;
  }
  if (block.left + block.width < W && block.width > 1) block.width -= 1;
  return 0;
}

}  // namespace detail
#endif

/// Decodes only the region (`top`, `left`, `height`, `width`, in original
/// pixels) of a JPEG at DCT scale `opts.scale_num / 8`, to RGB HWC uint8 in
/// `out`: rows above the region are skipped (entropy-decoded only), rows
/// below are never read, and columns outside the iMCU columns the region
/// touches are not decoded at all (libjpeg's `jpeg_crop_scanline` and
/// `jpeg_skip_scanlines`). Returns false, leaving the work to a full
/// decode, when libjpeg's API is not available, when the file does not end
/// in an EOI marker (maybe truncated, or trailing data), when it is a
/// progressive file with unfinished coefficients (block smoothing), or when
/// libjpeg cannot handle it (e.g. CMYK); a truncated file, or one of more than
/// `kMaxImagePixels`, is a UsageError naming `name`.
inline bool decode_jpeg_region(const std::vector<unsigned char>& bytes,
                               double top, double left, double height,
                               double width, std::vector<std::uint8_t>& out,
                               JpegBlock& block,
                               const JpegDecodeOptions& opts = {},
                               const std::string& name = "<memory>") {
#ifdef DDPKIT_JPEG_REGION
  const auto& lib = detail::libjpeg();
  if (!lib.ok) return false;
  // A file that does not end in EOI (FF D9; trailing zeros allowed) may be
  // truncated: leave it to the full decode, which reports that whatever
  // the region (a region above the cut would decode fine here).
  std::size_t end = bytes.size();
  while (end > 2 && bytes[end - 1] == 0) --end;
  if (end < 4 || bytes[end - 2] != 0xFF || bytes[end - 1] != 0xD9) return false;
  detail::JpegErr err;
  const int rc = detail::jpeg_region_raw(
      lib, bytes.data(), static_cast<unsigned long>(bytes.size()), top, left,
      height, width, opts, out, block, err);
  if (rc == 2) {
    throw UsageError(
        ddpkit::detail::cat("truncated JPEG: ", name, " (", err.msg, ")"));
  }
  if (rc == 3) {
    throw UsageError(ddpkit::detail::cat(
        "image ", name, " claims ", err.msg, " pixels, more than the limit of ",
        kMaxImagePixels, " (a damaged file or a decompression bomb?)"));
  }
  return rc == 0;
#else
  (void)bytes, (void)top, (void)left, (void)height, (void)width, (void)out,
      (void)block;
  (void)opts, (void)name;
  return false;
#endif
}

/// Decodes a JPEG. With `min_side > 0`, decodes at the smallest TurboJPEG
/// scaling factor (1/8, 1/4, 3/8, ... 1) whose output keeps both sides at
/// least `min_side`: an 8× smaller decode is much cheaper than a full one
/// followed by a resize, when the training size is far below the photo's.
inline torch::Tensor decode_jpeg(const std::vector<unsigned char>& bytes,
                                 int64_t min_side = 0,
                                 const std::string& name = "<memory>") {
#ifdef DDPKIT_HAS_TURBOJPEG
  const auto size = jpeg_size(bytes, name);
  tjscalingfactor best{1, 1};
  if (min_side > 0) {
    int n = 0;
    tjscalingfactor* f = tjGetScalingFactors(&n);
    int64_t best_w = size.width;
    for (int i = 0; i < n; ++i) {
      if (f[i].num > f[i].denom) continue;  // only shrink
      const int64_t sw = TJSCALED(size.width, f[i]),
                    sh = TJSCALED(size.height, f[i]);
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
  auto hwc =
      torch::from_blob(buf.data(), {s.height, s.width, 3}, torch::kUInt8);
  return hwc.permute({2, 0, 1}).contiguous();
#else
  (void)bytes;
  (void)min_side;
  throw UsageError(
      ddpkit::detail::cat("cannot decode ", name,
                          ": ddpkit was built without libjpeg-turbo "
                          "(install libturbojpeg0-dev and reconfigure)"));
#endif
}

/// Decodes a PNG (any bit depth, palette, grey or alpha) to RGB HWC uint8
/// into `out` and returns its size; a UsageError naming `name` when it is
/// unreadable or has more than `kMaxImagePixels`.
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
  if (detail::image_too_large(img.height, img.width)) {
    png_image_free(&img);
    detail::check_image_pixels(img.height, img.width, name);
  }
  img.format = PNG_FORMAT_RGB;
  out.resize(static_cast<std::size_t>(img.height) * img.width * 3 + 16);
  if (!png_image_finish_read(&img, nullptr, out.data(), 0, nullptr)) {
    std::string msg = img.message;
    png_image_free(&img);
    throw UsageError(
        ddpkit::detail::cat("corrupt PNG: ", name, " (", msg, ")"));
  }
  return {static_cast<int64_t>(img.height), static_cast<int64_t>(img.width)};
#else
  (void)bytes;
  (void)out;
  throw UsageError(ddpkit::detail::cat("cannot decode ", name,
                                       ": ddpkit was built without libpng"));
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
                                        int64_t min_side,
                                        const std::string& name) {
  if (is_jpeg(bytes)) return decode_jpeg(bytes, min_side, name);
  if (is_png(bytes)) return decode_png(bytes, name);
  throw UsageError(ddpkit::detail::cat("not a JPEG or PNG image: ", name));
}

/// Decodes a JPEG or PNG file (by content, not extension) to uint8 3×H×W.
/// `min_side` asks for a scaled JPEG decode (see `decode_jpeg`).
inline torch::Tensor decode_image(const std::filesystem::path& file,
                                  int64_t min_side = 0) {
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

    bool decoded() const {
      return image.defined();
    }
    /// The uint8 3×H×W image (decoding the bytes if needed).
    torch::Tensor tensor() const {
      return decoded() ? image : decode_image_bytes(*bytes, min_side, name);
    }
  };

  ImageBatch() = default;
  explicit ImageBatch(std::vector<Item> items) : items_(std::move(items)) {}
  /// Already decoded images.
  ImageBatch(const std::vector<torch::Tensor>& images) {  // NOLINT: implicit
    for (const auto& im : images)
      items_.push_back({nullptr, "<tensor>", im, 0});
  }
  /// A uint8 N×3×H×W batch, image by image.
  explicit ImageBatch(const torch::Tensor& batch) {
    for (const auto& im : batch.unbind(0))
      items_.push_back({nullptr, "<tensor>", im, 0});
  }

  std::size_t size() const {
    return items_.size();
  }
  bool empty() const {
    return items_.empty();
  }
  const std::vector<Item>& items() const {
    return items_;
  }
  /// Image `i` as a uint8 3×H×W tensor (decoded on each call).
  torch::Tensor operator[](std::size_t i) const {
    return items_.at(i).tensor();
  }
  /// All images, decoded.
  std::vector<torch::Tensor> tensors() const {
    std::vector<torch::Tensor> out;
    out.reserve(items_.size());
    for (const auto& it : items_) out.push_back(it.tensor());
    return out;
  }
  operator std::vector<torch::Tensor>() const {
    return tensors();
  }  // NOLINT: implicit

 private:
  std::vector<Item> items_;
};

/// Does the file look decodable (magic bytes and a valid header of at most
/// `kMaxImagePixels`), without decoding the pixels.
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
    int w = 0, ht = 0, s = 0, c = 0;
    const bool ok =
        tjDecompressHeader3(h, bytes.data(),
                            static_cast<unsigned long>(bytes.size()), &w, &ht,
                            &s, &c) == 0 &&
        w > 0 && ht > 0 && !detail::image_too_large(ht, w);
    if (!ok) detail::reset_thread_decompressor();
    return ok;
  }
#endif
#ifdef DDPKIT_HAS_PNG
  if (is_png(bytes)) {
    png_image img{};
    img.version = PNG_IMAGE_VERSION;
    bool ok =
        png_image_begin_read_from_memory(&img, bytes.data(), bytes.size()) &&
        !detail::image_too_large(img.height, img.width);
    png_image_free(&img);
    return ok;
  }
#endif
  return false;
}

/// Encodes uint8 3×H×W RGB as a JPEG file (4:2:0, `quality` 1..100).
inline void write_jpeg(const std::filesystem::path& file,
                       const torch::Tensor& image, int quality = 90) {
#ifdef DDPKIT_HAS_TURBOJPEG
  auto hwc = image.to(torch::kUInt8).permute({1, 2, 0}).contiguous();
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  int rc = tjCompress2(h, hwc.data_ptr<std::uint8_t>(),
                       static_cast<int>(hwc.size(1)), 0,
                       static_cast<int>(hwc.size(0)), TJPF_RGB, &buf, &size,
                       TJSAMP_420, quality, 0);
  std::string err = rc != 0 ? tjGetErrorStr2(h) : "";
  tjDestroy(h);
  if (rc != 0) {
    tjFree(buf);
    throw Error(ddpkit::detail::cat("write_jpeg: ", file.string(), ": ", err));
  }
  std::ofstream os(file, std::ios::binary);
  os.write(reinterpret_cast<const char*>(buf),
           static_cast<std::streamsize>(size));
  tjFree(buf);
  if (!os)
    throw UsageError(
        ddpkit::detail::cat("write_jpeg: cannot write ", file.string()));
#else
  (void)image;
  (void)quality;
  throw UsageError(
      ddpkit::detail::cat("cannot write ", file.string(),
                          ": ddpkit was built without libjpeg-turbo"));
#endif
}

}  // namespace ddpkit::data
