// The fuzz targets proper: CIFAR-10 records, JPEG/PNG decoding (through the
// training and evaluation transforms too), checkpoint and state-dict
// loading, and the distributed environment parser. The only translation
// unit that includes libtorch (~30 s to compile with the sanitizers).
//
// A finding is anything but a clean result or an expected error: ddpkit's
// exception types (`ddpkit::Error` and subclasses) and, where libtorch is
// involved, `c10::Error`. Invariants that are cheap to check are checked;
// a broken one prints what and aborts (libFuzzer saves the input).
#include <cxxabi.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <typeinfo>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/cifar10.hpp"
#include "ddpkit/data/image_io.hpp"
#include "ddpkit/data/image_transforms.hpp"
#include "ddpkit/data/transforms.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/distributed/env.hpp"
#include "ddpkit/nn/state_dict.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/checkpoint_connector.hpp"
#include "ddpkit/train/task.hpp"
#include "targets.hpp"

#ifdef DDPKIT_HAS_PNG
#include <png.h>
#endif

namespace ddpkit::fuzz {
namespace {

namespace fs = std::filesystem;
using Bytes = std::vector<unsigned char>;

// --------------------------------------------------------------------------
// Shared helpers

std::string demangle(const char* name) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> d(
      abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
  return status == 0 && d ? d.get() : name;
}

/// A finding: says what and aborts (libFuzzer writes the crash input).
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  const std::string msg = ddpkit::detail::cat(args...);
  std::fprintf(stderr, "\n==ddpkit-fuzz== FINDING: %s\n", msg.c_str());
  std::fflush(stderr);
  std::abort();
}

#define FUZZ_REQUIRE(cond, ...)                                          \
  do {                                                                   \
    if (!(cond))                                                         \
      fail(__FILE__, ":", __LINE__, ": ", #cond, " -- ", ##__VA_ARGS__); \
  } while (0)

/// DDPKIT_FUZZ_VERBOSE=1: print each expected error (to see what an input
/// does when run by hand: `fuzz_checkpoint -runs=1 FILE`).
bool verbose() {
  static const bool v = std::getenv("DDPKIT_FUZZ_VERBOSE") != nullptr;
  return v;
}

/// Runs `f`; true when it returned, false on an expected error (ddpkit's
/// exception types, or `c10::Error` when `torch_errors_ok`). Any other
/// exception is a finding.
template <class F>
bool expect(const char* what, F&& f, bool torch_errors_ok = true) {
  try {
    f();
    if (verbose()) std::fprintf(stderr, "[%s] ok\n", what);
    return true;
  } catch (const ddpkit::Error& e) {
    if (verbose()) std::fprintf(stderr, "[%s] %s\n", what, e.what());
    return false;
  } catch (const c10::Error& e) {
    if (verbose()) {
      std::fprintf(stderr, "[%s] c10::Error: %s\n", what,
                   e.what_without_backtrace());
    }
    if (torch_errors_ok) return false;
    fail(what, ": unexpected c10::Error: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail(what, ": unexpected exception ", demangle(typeid(e).name()), ": ",
         e.what());
  } catch (...) {
    fail(what, ": unexpected exception of a non-std type");
  }
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

/// A per-process scratch file for the paths that read files (removed at
/// exit; fuzz.sh points TMPDIR into the build folder).
class ScratchFile {
 public:
  explicit ScratchFile(const std::string& stem) {
    path_ = fs::temp_directory_path() /
            ddpkit::detail::cat("ddpkit-fuzz-", stem, "-", ::getpid());
  }
  ~ScratchFile() {
    std::error_code ec;
    fs::remove(path_, ec);
  }
  const fs::path& write(const std::uint8_t* data, std::size_t size) {
    std::FILE* f = std::fopen(path_.c_str(), "wb");
    if (!f) fail("cannot write scratch file ", path_.string());
    if (size > 0 && std::fwrite(data, 1, size, f) != size) {
      fail("cannot write scratch file ", path_.string());
    }
    std::fclose(f);
    return path_;
  }
  const fs::path& path() const {
    return path_;
  }

 private:
  fs::path path_;
};

void write_seed(const std::string& dir, const std::string& name,
                const void* data, std::size_t size) {
  fs::create_directories(dir);
  std::ofstream os(fs::path(dir) / name, std::ios::binary | std::ios::trunc);
  os.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!os) fail("cannot write seed ", dir, "/", name);
}
void write_seed(const std::string& dir, const std::string& name,
                const std::string& s) {
  write_seed(dir, name, s.data(), s.size());
}

// --------------------------------------------------------------------------
// CIFAR-10 binary records

constexpr auto kRec = static_cast<std::size_t>(data::kCifarRecordBytes);

int run_cifar10(const std::uint8_t* data, std::size_t size) {
  // What the format says about these bytes.
  const bool whole = size % kRec == 0;
  std::optional<std::size_t> bad_label;
  for (std::size_t i = 0; whole && i < size / kRec; ++i) {
    if (data[i * kRec] > 9) {
      bad_label = i;
      break;
    }
  }
  const bool valid = whole && !bad_label;

  auto parse = [&](auto&& f, std::string& err) {
    data::ImageTensors out;
    try {
      out = f();
    } catch (const UsageError& e) {
      err = e.what();
    }
    return out;
  };
  std::string err_mem, err_file;
  data::ImageTensors mem;
  expect(
      "parse_cifar10_bytes",
      [&] {
        mem = parse(
            [&] { return data::parse_cifar10_bytes(data, size, "fuzz.bin"); },
            err_mem);
      },
      /*torch_errors_ok=*/false);
  if (valid) {
    FUZZ_REQUIRE(err_mem.empty(), "valid records refused: ", err_mem);
    const auto n = static_cast<int64_t>(size / kRec);
    FUZZ_REQUIRE(mem.images.sizes() == torch::IntArrayRef({n, 3, 32, 32}));
    FUZZ_REQUIRE(mem.labels.sizes() == torch::IntArrayRef({n}));
    FUZZ_REQUIRE(mem.images.scalar_type() == torch::kUInt8);
    FUZZ_REQUIRE(mem.labels.scalar_type() == torch::kInt64);
    FUZZ_REQUIRE(mem.classes.size() == 10);
    if (n > 0) {
      FUZZ_REQUIRE(mem.labels.min().item<int64_t>() >= 0 &&
                   mem.labels.max().item<int64_t>() <= 9);
      auto raw = torch::from_blob(const_cast<std::uint8_t*>(data),
                                  {n, data::kCifarRecordBytes}, torch::kUInt8);
      FUZZ_REQUIRE(torch::equal(mem.labels, raw.select(1, 0).to(torch::kInt64)),
                   "labels differ from the label bytes");
      FUZZ_REQUIRE(
          torch::equal(mem.images.view({n, 3072}), raw.narrow(1, 1, 3072)),
          "images differ from the image bytes");
    }
  } else {
    FUZZ_REQUIRE(!err_mem.empty(), "invalid records accepted");
    FUZZ_REQUIRE(contains(err_mem, "fuzz.bin"), err_mem);
    if (bad_label) {
      FUZZ_REQUIRE(contains(err_mem, ddpkit::detail::cat("byte offset ",
                                                         *bad_label * kRec)),
                   err_mem);
    }
  }

  // The file reader on the same bytes: the same result, or the same error
  // naming the file instead.
  static ScratchFile scratch("cifar");
  const auto& path = scratch.write(data, size);
  data::ImageTensors file;
  expect(
      "read_cifar10_file",
      [&] {
        file = parse([&] { return data::read_cifar10_file(path); }, err_file);
      },
      /*torch_errors_ok=*/false);
  FUZZ_REQUIRE(err_mem.empty() == err_file.empty(), "memory: '", err_mem,
               "' file: '", err_file, "'");
  if (err_mem.empty()) {
    FUZZ_REQUIRE(torch::equal(mem.images, file.images) &&
                 torch::equal(mem.labels, file.labels));
  } else {
    std::string expected = err_mem;
    expected.replace(expected.find("fuzz.bin"), 8, path.string());
    FUZZ_REQUIRE(err_file == expected, "file reader says '", err_file,
                 "', parser says '", err_mem, "'");
  }
  return 0;
}

int seeds_cifar10(const std::string& dir) {
  std::vector<std::uint8_t> recs(3 * kRec);
  for (std::size_t i = 0; i < recs.size(); ++i) {
    recs[i] = static_cast<std::uint8_t>(i * 37 + i / 1024);
  }
  for (std::size_t r = 0; r < 3; ++r)
    recs[r * kRec] = static_cast<std::uint8_t>(r * 4);
  write_seed(dir, "one-record", recs.data(), kRec);
  write_seed(dir, "three-records", recs.data(), recs.size());
  write_seed(dir, "empty", "", 0);
  return 3;
}

// --------------------------------------------------------------------------
// JPEG and PNG decoding
//
// Input: an 8-byte control header, then the image file's bytes.
//   [0] min_side for decode_image_bytes
//   [1] bit 0: fast DCT/upsampling; bits 1-2: DCT scale 8/4/2/1 (over 8);
//       bits 3-7: the transforms' output size - 4
//   [2..5] region top, left, height, width as fractions of the image
//   [6] generator seed of the training transform; [7] unused

constexpr std::size_t kImageHeader = 8;

struct ImageControl {
  int64_t min_side = 0;
  data::JpegDecodeOptions opts;
  int64_t out_size = 4;
  std::uint8_t region[4] = {};
  std::uint64_t seed = 0;
};

ImageControl image_control(const std::uint8_t* h) {
  ImageControl c;
  c.min_side = h[0];
  c.opts.fast = (h[1] & 1) != 0;
  c.opts.scale_num = 8 >> ((h[1] >> 1) & 3);
  c.out_size = 4 + (h[1] >> 3);
  std::copy(h + 2, h + 6, c.region);
  c.seed = h[6];
  return c;
}

#ifdef DDPKIT_HAS_PNG
std::optional<data::ImageSize> png_header_size(const Bytes& bytes) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&img, bytes.data(), bytes.size()))
    return std::nullopt;
  data::ImageSize s{static_cast<int64_t>(img.height),
                    static_cast<int64_t>(img.width)};
  png_image_free(&img);
  return s;
}
#endif

void check_image_tensor(const torch::Tensor& t) {
  FUZZ_REQUIRE(t.defined() && t.dim() == 3 && t.size(0) == 3, t.sizes());
  FUZZ_REQUIRE(t.size(1) > 0 && t.size(2) > 0, t.sizes());
  FUZZ_REQUIRE(t.scalar_type() == torch::kUInt8 && t.is_contiguous());
}

/// The full HWC decode and the region decode of a JPEG, at one DCT scale:
/// sizes agree with the header, the region's block lies inside the image
/// and covers the region, and on a file that decodes without a warning the
/// block's pixels are those of the full decode.
void check_jpeg_paths(const Bytes& bytes, const ImageControl& c) {
  data::ImageSize full{}, scaled{};
  std::vector<std::uint8_t> whole;
  bool clean = false;
  const bool decoded = expect("decode_jpeg_hwc", [&] {
    full = data::jpeg_size(bytes, "fuzz.jpg");
    FUZZ_REQUIRE(full.height > 0 && full.width > 0);
    scaled = data::decode_jpeg_hwc(bytes, whole, c.opts, "fuzz.jpg");
    const tjscalingfactor f{c.opts.scale_num, 8};
    FUZZ_REQUIRE(scaled.height == TJSCALED(static_cast<int>(full.height), f) &&
                     scaled.width == TJSCALED(static_cast<int>(full.width), f),
                 "decoded ", scaled.height, "x", scaled.width, " from a ",
                 full.height, "x", full.width, " header at ", c.opts.scale_num,
                 "/8");
    FUZZ_REQUIRE(whole.size() >=
                 static_cast<std::size_t>(scaled.height * scaled.width * 3));
    // TurboJPEG keeps the last call's warning flag per handle (reset at
    // the start of each call; decode_jpeg_hwc ignores most warnings).
    clean =
        tjGetErrorCode(data::detail::thread_decompressor()) != TJERR_WARNING;
  });
  if (!decoded) return;
  const double top = full.height * (c.region[0] / 256.0);
  const double left = full.width * (c.region[1] / 256.0);
  const double h = std::max(1.0, (full.height - top) * (c.region[2] / 255.0));
  const double w = std::max(1.0, (full.width - left) * (c.region[3] / 255.0));
  std::vector<std::uint8_t> part;
  data::JpegBlock b;
  bool region = false;
  expect("decode_jpeg_region", [&] {
    region = data::decode_jpeg_region(bytes, top, left, h, w, part, b, c.opts,
                                      "fuzz.jpg");
  });
  if (!region) return;
  FUZZ_REQUIRE(b.top >= 0 && b.left >= 0 && b.height > 0 && b.width > 0 &&
                   b.top + b.height <= scaled.height &&
                   b.left + b.width <= scaled.width,
               "block ", b.top, "+", b.height, ", ", b.left, "+", b.width,
               " outside ", scaled.height, "x", scaled.width);
  FUZZ_REQUIRE(
      b.stride >= b.width * 3 && b.offset >= 0 &&
          static_cast<std::size_t>(b.offset + (b.height - 1) * b.stride +
                                   b.width * 3) <= part.size(),
      "block overruns its buffer");
  const double s = c.opts.scale_num / 8.0;
  const auto want_top = std::min<int64_t>(
      static_cast<int64_t>(std::floor(top * s)), scaled.height - 1);
  const auto want_left = std::min<int64_t>(
      static_cast<int64_t>(std::floor(left * s)), scaled.width - 1);
  const auto want_bottom = std::min<int64_t>(
      static_cast<int64_t>(std::ceil((top + h) * s)), scaled.height);
  const auto want_right = std::min<int64_t>(
      static_cast<int64_t>(std::ceil((left + w) * s)), scaled.width);
  FUZZ_REQUIRE(b.top <= want_top && b.left <= want_left &&
                   b.top + b.height >= want_bottom &&
                   b.left + b.width >= want_right,
               "block does not cover the region");
  if (clean) {
    for (int64_t y = 0; y < b.height; ++y) {
      const auto* got = part.data() + b.offset + y * b.stride;
      const auto* ref =
          whole.data() + ((b.top + y) * scaled.width + b.left) * 3;
      FUZZ_REQUIRE(
          std::memcmp(got, ref, static_cast<std::size_t>(b.width) * 3) == 0,
          "region decode differs from the full decode in row ", b.top + y);
    }
  }
}

/// Images the library accepts but that take too long to decode for a fuzz
/// run (~100 ms each): skipped.
constexpr int64_t kFuzzMaxPixels = int64_t{1} << 22;

/// The size the header claims, when it can be read (no limit applied).
std::optional<data::ImageSize> claimed_size(const Bytes& bytes) {
  if (data::is_jpeg(bytes)) {
    tjhandle h = data::detail::thread_decompressor();
    int w = 0, ht = 0, ss = 0, cs = 0;
    if (tjDecompressHeader3(h, bytes.data(),
                            static_cast<unsigned long>(bytes.size()), &w, &ht,
                            &ss, &cs) == 0) {
      return data::ImageSize{ht, w};
    }
  }
#ifdef DDPKIT_HAS_PNG
  if (data::is_png(bytes)) return png_header_size(bytes);
#endif
  return std::nullopt;
}

int run_image(const std::uint8_t* data, std::size_t size) {
  if (size < kImageHeader) return 0;
  const auto c = image_control(data);
  auto bytes = std::make_shared<Bytes>(data + kImageHeader, data + size);
  const bool jpeg = data::is_jpeg(*bytes), png = data::is_png(*bytes);

  // Decompression bombs are refused before anything is allocated; images
  // that are merely large are skipped.
  if (const auto claim = claimed_size(*bytes)) {
    if (data::detail::image_too_large(claim->height, claim->width)) {
      std::string err;
      try {
        (void)data::decode_image_bytes(*bytes, c.min_side, "fuzz.img");
      } catch (const UsageError& e) {
        err = e.what();
      }
      FUZZ_REQUIRE(contains(err, "more than the limit"), "a ", claim->width,
                   "x", claim->height, " image was not refused: '", err, "'");
      data::JpegBlock b;
      std::vector<std::uint8_t> out;
      err.clear();
      try {
        (void)data::decode_jpeg_region(*bytes, 0, 0, 1, 1, out, b, c.opts,
                                       "fuzz.img");
      } catch (const UsageError& e) {
        err = e.what();
      }
      FUZZ_REQUIRE(
          err.empty() || contains(err, "limit") || contains(err, "truncated"),
          err);
      FUZZ_REQUIRE(out.size() < 4096, "region decode of a bomb allocated ",
                   out.size(), " bytes");
      return 0;
    }
    if (claim->height * claim->width > kFuzzMaxPixels) return 0;
  }

  // The whole-image decode, by content.
  expect("decode_image_bytes", [&] {
    auto t = data::decode_image_bytes(*bytes, c.min_side, "fuzz.img");
    check_image_tensor(t);
    FUZZ_REQUIRE(jpeg || png, "decoded something that is neither");
    if (jpeg) {
      const auto hdr = data::jpeg_size(*bytes);
      const auto h = t.size(1), w = t.size(2);
      if (c.min_side == 0 || (h == hdr.height && w == hdr.width)) {
        FUZZ_REQUIRE(h == hdr.height && w == hdr.width, t.sizes(), " vs ",
                     hdr.height, "x", hdr.width);
      } else {
        FUZZ_REQUIRE(h >= c.min_side && w >= c.min_side && h <= hdr.height &&
                         w <= hdr.width,
                     t.sizes(), " for min_side ", c.min_side, " of ",
                     hdr.height, "x", hdr.width);
      }
    }
#ifdef DDPKIT_HAS_PNG
    if (png) {
      const auto hdr = png_header_size(*bytes);
      FUZZ_REQUIRE(hdr && t.size(1) == hdr->height && t.size(2) == hdr->width,
                   "PNG decoded to ", t.sizes());
    }
#endif
  });
  if (jpeg) check_jpeg_paths(*bytes, c);

  // The loader's path: undecoded bytes through the training transform
  // (header-only size, crop box, region or scaled decode, fused resample)
  // and the evaluation transform.
  data::ImageBatch batch(
      std::vector<data::ImageBatch::Item>{{bytes, "fuzz.img", {}, 0}});
  const auto S = c.out_size;
  auto check_out = [&](const torch::Tensor& x, const char* what) {
    FUZZ_REQUIRE(x.sizes() == torch::IntArrayRef({1, 3, S, S}), what, " ",
                 x.sizes());
    FUZZ_REQUIRE(torch::isfinite(x).all().item<bool>(), what,
                 " produced a non-finite value");
  };
  expect("ImageNetTrain", [&] {
    auto gen = data::make_generator(c.seed);
    data::ImageNetTrain train{
        data::ImageNetTrainOptions().size(S).fast_decode(c.opts.fast)};
    check_out(train(batch, gen), "ImageNetTrain");
  });
  expect("ImageNetEval", [&] {
    auto gen = data::make_generator(0);
    data::ImageNetEval eval{S};
    check_out(eval(batch, gen), "ImageNetEval");
  });
  return 0;
}

Bytes with_control(const Bytes& image,
                   std::array<std::uint8_t, kImageHeader> h) {
  Bytes out(h.begin(), h.end());
  out.insert(out.end(), image.begin(), image.end());
  return out;
}

torch::Tensor seed_picture(int64_t h, int64_t w) {
  // Smooth gradients plus a few edges: content JPEG does not flatten.
  auto y = torch::arange(h, torch::kFloat).view({1, h, 1});
  auto x = torch::arange(w, torch::kFloat).view({1, 1, w});
  auto c = torch::arange(3, torch::kFloat).view({3, 1, 1});
  auto img = (y * 5 + x * 3 + c * 70).remainder(256);
  img = img + (x.gt(w / 2).to(torch::kFloat) * 90);
  return img.remainder(256).to(torch::kUInt8).contiguous();
}

#ifdef DDPKIT_HAS_TURBOJPEG
Bytes tj_compress(const torch::Tensor& chw, int subsamp, int flags,
                  int quality) {
  auto hwc = chw.permute({1, 2, 0}).contiguous();
  tjhandle h = tjInitCompress();
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const bool grey = subsamp == TJSAMP_GRAY;
  if (tjCompress2(h, hwc.data_ptr<std::uint8_t>(),
                  static_cast<int>(hwc.size(1)), 0,
                  static_cast<int>(hwc.size(0)), TJPF_RGB, &buf, &size,
                  grey ? TJSAMP_GRAY : subsamp, quality, flags) != 0) {
    fail("tjCompress2: ", tjGetErrorStr2(h));
  }
  Bytes out(buf, buf + size);
  tjFree(buf);
  tjDestroy(h);
  return out;
}
#endif

#ifdef DDPKIT_HAS_PNG
Bytes png_encode(const torch::Tensor& pixels, png_uint_32 format, int64_t h,
                 int64_t w, const void* colormap = nullptr, int entries = 0) {
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = static_cast<png_uint_32>(w);
  img.height = static_cast<png_uint_32>(h);
  img.format = format;
  img.colormap_entries = static_cast<png_uint_32>(entries);
  png_alloc_size_t size = 0;
  if (!png_image_write_to_memory(&img, nullptr, &size, 0, pixels.data_ptr(), 0,
                                 colormap)) {
    fail("png_image_write_to_memory (size): ", img.message);
  }
  Bytes out(size);
  if (!png_image_write_to_memory(&img, out.data(), &size, 0, pixels.data_ptr(),
                                 0, colormap)) {
    fail("png_image_write_to_memory: ", img.message);
  }
  out.resize(size);
  return out;
}
#endif

int seeds_image(const std::string& dir) {
  int n = 0;
  auto put = [&](const std::string& name, const Bytes& b) {
    write_seed(dir, name, b.data(), b.size());
    ++n;
  };
  // Control headers: full decode; scaled decode with a region; fast path.
  const std::array<std::uint8_t, kImageHeader> h_full{0,   8 * 8, 0, 0,
                                                      255, 255,   1, 0},
      h_region{20, 2 + 8 * 12, 60, 90, 128, 100, 2, 0},
      h_fast{9, 1 + 4 + 8 * 4, 200, 10, 255, 40, 3, 0};
  const auto pic = seed_picture(37, 45);
  // ddpkit's own writer (4:2:0) through a file, as ImageFolder reads it.
  {
    const auto tmp = fs::path(dir) / ".seed.jpg";
    fs::create_directories(dir);
    data::write_jpeg(tmp, pic, 90);
    const auto jpg = data::read_file_bytes(tmp);
    fs::remove(tmp);
    put("jpeg420-full", with_control(jpg, h_full));
    put("jpeg420-region", with_control(jpg, h_region));
    put("jpeg420-fast", with_control(jpg, h_fast));
  }
#ifdef DDPKIT_HAS_TURBOJPEG
  put("jpeg444", with_control(tj_compress(pic, TJSAMP_444, 0, 80), h_region));
  put("jpeg422", with_control(tj_compress(pic, TJSAMP_422, 0, 75), h_fast));
  put("jpeg-grey",
      with_control(tj_compress(pic, TJSAMP_GRAY, 0, 85), h_region));
  put("jpeg-progressive",
      with_control(tj_compress(pic, TJSAMP_420, TJFLAG_PROGRESSIVE, 85),
                   h_region));
  put("jpeg-tiny",
      with_control(tj_compress(seed_picture(1, 3), TJSAMP_420, 0, 50), h_full));
#endif
#ifdef DDPKIT_HAS_PNG
  auto hwc = pic.permute({1, 2, 0}).contiguous();
  put("png-rgb", with_control(png_encode(hwc, PNG_FORMAT_RGB, 37, 45), h_full));
  auto rgba = torch::cat({hwc, torch::full({37, 45, 1}, 200, torch::kUInt8)}, 2)
                  .contiguous();
  put("png-rgba",
      with_control(png_encode(rgba, PNG_FORMAT_RGBA, 37, 45), h_region));
  auto grey = hwc.select(2, 1).contiguous();
  put("png-grey",
      with_control(png_encode(grey, PNG_FORMAT_GRAY, 37, 45), h_fast));
  const std::uint8_t cmap[4 * 3] = {255, 0, 0,   0,  255, 0,
                                    0,   0, 255, 10, 20,  30};
  auto index = grey.remainder(4).contiguous();
  put("png-palette",
      with_control(png_encode(index, PNG_FORMAT_RGB_COLORMAP, 37, 45, cmap, 4),
                   h_full));
  auto wide = (hwc.to(torch::kInt32) * 257).to(torch::kInt16).contiguous();
  put("png-16bit",
      with_control(png_encode(wide, PNG_FORMAT_LINEAR_RGB, 37, 45), h_region));
#endif
  return n;
}

// --------------------------------------------------------------------------
// Checkpoints and state dicts, loaded into a small model

struct FuzzNetImpl : torch::nn::Module {
  FuzzNetImpl() {
    conv = register_module(
        "conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3)));
    bn = register_module("bn", torch::nn::BatchNorm2d(4));
    fc = register_module("fc", torch::nn::Linear(4, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn(conv(x)));
    return fc(x.mean({2, 3}));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(FuzzNet);

std::vector<std::pair<std::string, std::vector<int64_t>>> shapes_of(
    const torch::nn::Module& m) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  for (const auto& p : m.named_parameters())
    out.emplace_back(p.key(), p.value().sizes().vec());
  for (const auto& b : m.named_buffers())
    out.emplace_back(b.key(), b.value().sizes().vec());
  return out;
}

/// Every tensor `v` reaches lies inside its storage (what the loaders
/// promise after their checks).
void require_in_bounds(const c10::IValue& v, const std::string& what) {
  if (v.isTensor()) {
    const auto p = ddpkit::detail::loaded_tensor_problem(v.toTensor());
    FUZZ_REQUIRE(p.empty(), what, " passed the loader's checks but ", p);
  } else if (v.isGenericDict()) {
    for (const auto& kv : v.toGenericDict())
      require_in_bounds(kv.value(), what);
  }
}

int run_checkpoint(const std::uint8_t* data, std::size_t size) {
  static FuzzNet net;
  static const auto shapes = shapes_of(*net);
  static ScratchFile scratch("checkpoint");
  const auto& path = scratch.write(data, size);

  // What Trainer's resume reads: the model, the optimizer, the scalars.
  // open_checkpoint and load_module_checked promise errors that name the
  // file (UsageError), so a c10::Error from them is a finding too.
  std::optional<train::Checkpoint> archive;
  expect(
      "open_checkpoint", [&] { archive.emplace(train::open_checkpoint(path)); },
      /*torch_errors_ok=*/false);
  if (archive) {
    for (const auto& key : archive->keys()) {
      c10::IValue v;
      if (archive->try_read(key, v)) require_in_bounds(v, key);
    }
    expect(
        "load_module_checked",
        [&] { train::load_module_checked(*net, *archive, "model", path); },
        /*torch_errors_ok=*/false);
    expect(
        "load_optimizer_checked",
        [&] {
          torch::optim::SGD sgd(net->parameters(),
                                torch::optim::SGDOptions(0.1).momentum(0.9));
          train::load_optimizer_checked(sgd, *archive, path);
        },
        /*torch_errors_ok=*/false);
    expect(
        "TrainingState::load",
        [&] {
          const auto r = train::TrainingState::load(
              *archive, path, train::metric_columns<train::Classification>(),
              train::Classification::num_sums);
          FUZZ_REQUIRE(r.epochs_done >= 0 && r.bad_epochs >= 0 &&
                       r.best_epoch >= -1);
          for (const auto& m : r.history) FUZZ_REQUIRE(m.epoch >= 0);
        },
        /*torch_errors_ok=*/false);
  }
  FUZZ_REQUIRE(shapes_of(*net) == shapes, "loading changed the model's shapes");

  // A state-dict file (nn::save_state_dict / Python's torch.save(dict)).
  std::optional<c10::Dict<std::string, torch::Tensor>> sd;
  expect(
      "read_state_dict", [&] { sd.emplace(nn::read_state_dict(path)); },
      /*torch_errors_ok=*/false);
  if (sd) {
    require_in_bounds(c10::IValue(*sd), "state dict");
    expect(
        "load_state_dict",
        [&] {
          auto report = nn::load_state_dict(
              *net, *sd,
              nn::LoadStateDictOptions().strict(false).skip_mismatched(true),
              path.string());
          FUZZ_REQUIRE(report.loaded.size() + report.skipped_shape.size() +
                               report.missing.size() ==
                           shapes.size(),
                       "load report does not account for every entry");
          FUZZ_REQUIRE(report.loaded.size() + report.skipped_shape.size() +
                               report.unexpected.size() ==
                           sd->size(),
                       "load report does not account for every file entry");
          nn::load_state_dict(*net, *sd, {}, path.string());
        },
        /*torch_errors_ok=*/false);
  }
  FUZZ_REQUIRE(shapes_of(*net) == shapes, "loading changed the model's shapes");
  return 0;
}

int seeds_checkpoint(const std::string& dir) {
  fs::create_directories(dir);
  torch::manual_seed(0);
  FuzzNet net;
  // One optimizer step, so that the optimizer has per-parameter state.
  torch::optim::SGD sgd(net->parameters(),
                        torch::optim::SGDOptions(0.1).momentum(0.9));
  net->forward(torch::randn({2, 3, 6, 6})).sum().backward();
  sgd.step();
  auto scalar = [](double v) { return torch::tensor({v}, torch::kFloat64); };
  auto save = [&](const std::string& name,
                  const c10::Dict<std::string, torch::Tensor>& sd, bool full) {
    train::Checkpoint archive;
    archive.write("model", c10::IValue(sd));
    if (full) {  // what Trainer::save_checkpoint writes
      archive.write("format", std::string(train::kCheckpointFormat));
      archive.write("format_version", train::kCheckpointVersion);
      archive.write_optimizer(sgd);
      archive.write("epochs_done", int64_t{2});
      archive.write("best_val_acc", 0.5);
      archive.write("best_epoch", int64_t{1});
      archive.write("bad_epochs", int64_t{1});
      archive.write("world_size", int64_t{1});
      archive.write("seed", int64_t{0});
      archive.write("loss_scale", scalar(1));
      archive.write("history",
                    torch::rand({2, 5 + train::EpochMetrics::kTimingFields},
                                torch::kFloat64));
      archive.write("rng_cpu",
                    at::detail::getDefaultCPUGenerator().get_state());
    }
    train::atomic_save(archive, fs::path(dir) / name);
  };
  // Like Trainer::save_checkpoint; model only; a model of other shapes.
  save("checkpoint-full", nn::state_dict(*net), true);
  save("checkpoint-model", nn::state_dict(*net), false);
  auto other = nn::state_dict(*net);
  other.insert_or_assign("fc.weight", torch::zeros({5, 4}));
  save("checkpoint-shapes", other, false);
  nn::save_state_dict(*net, fs::path(dir) / "state-dict");
  return 4;
}

// --------------------------------------------------------------------------
// The distributed environment
//
// Input: lines `NAME=VALUE` (the last one of a name wins); a line without
// `=` sets NAME to the empty string.

std::map<std::string, std::string, std::less<>> parse_env_lines(
    const std::uint8_t* data, std::size_t size) {
  std::map<std::string, std::string, std::less<>> vars;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  while (!text.empty()) {
    const auto nl = text.find('\n');
    const auto line = text.substr(0, nl);
    const auto eq = line.find('=');
    vars[std::string(line.substr(0, eq))] =
        eq == std::string_view::npos ? "" : std::string(line.substr(eq + 1));
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  return vars;
}

int run_env(const std::uint8_t* data, std::size_t size) {
  const auto vars = parse_env_lines(data, size);
  auto has = [&](std::string_view n) { return vars.find(n) != vars.end(); };
  dist::EnvLookup lookup =
      [&](std::string_view n) -> std::optional<std::string> {
    auto it = vars.find(n);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
  dist::DistEnv e;
  // Only ddpkit's own errors are expected here: nothing in env.hpp uses
  // libtorch.
  if (!expect(
          "read_env", [&] { e = dist::read_env(lookup); },
          /*torch_errors_ok=*/false)) {
    return 0;
  }
  FUZZ_REQUIRE(e.rank >= 0 && e.rank < e.world_size, e.rank, "/", e.world_size);
  FUZZ_REQUIRE(e.local_rank >= 0 && e.local_rank < e.local_world_size &&
                   e.local_world_size <= e.world_size,
               e.local_rank, "/", e.local_world_size, "/", e.world_size);
  FUZZ_REQUIRE(e.master_port >= 1 && e.master_port <= 65535, e.master_port);
  FUZZ_REQUIRE(!e.master_addr.empty());
  auto value_of = [&](const char* name) {
    int v = -1;
    const auto& s = vars.find(name)->second;
    std::from_chars(s.data(), s.data() + s.size(), v);
    return v;
  };
  using dist::LaunchSource;
  if (has("RANK") || has("WORLD_SIZE")) {
    FUZZ_REQUIRE(e.source == LaunchSource::torchrun);
    FUZZ_REQUIRE(e.rank == value_of("RANK") &&
                 e.world_size == value_of("WORLD_SIZE"));
  } else if (has("SLURM_PROCID") && has("SLURM_NTASKS")) {
    FUZZ_REQUIRE(e.source == LaunchSource::slurm);
    FUZZ_REQUIRE(e.rank == value_of("SLURM_PROCID") &&
                 e.world_size == value_of("SLURM_NTASKS"));
  } else if (has("OMPI_COMM_WORLD_RANK") || has("OMPI_COMM_WORLD_SIZE")) {
    FUZZ_REQUIRE(e.source == LaunchSource::openmpi);
    FUZZ_REQUIRE(e.rank == value_of("OMPI_COMM_WORLD_RANK") &&
                 e.world_size == value_of("OMPI_COMM_WORLD_SIZE"));
  } else {
    FUZZ_REQUIRE(e.source == LaunchSource::single && e.world_size == 1 &&
                 e.rank == 0);
  }
  if (e.source != LaunchSource::single) {
    if (has("MASTER_ADDR")) {
      FUZZ_REQUIRE(e.master_addr == vars.find("MASTER_ADDR")->second);
    }
    if (has("MASTER_PORT"))
      FUZZ_REQUIRE(e.master_port == value_of("MASTER_PORT"));
  }
  // What read_env accepts, explicit_env accepts too.
  const bool accepted = expect(
      "explicit_env",
      [&] {
        (void)dist::explicit_env(e.rank, e.world_size, e.master_addr,
                                 e.master_port, e.local_rank,
                                 e.local_world_size);
      },
      /*torch_errors_ok=*/false);
  FUZZ_REQUIRE(accepted, "explicit_env refused what read_env accepted");
  return 0;
}

int seeds_env(const std::string& dir) {
  const std::pair<const char*, const char*> seeds[] = {
      {"torchrun",
       "RANK=1\nWORLD_SIZE=4\nLOCAL_RANK=1\nLOCAL_WORLD_SIZE=2\n"
       "MASTER_ADDR=10.0.0.1\nMASTER_PORT=29500\n"},
      {"torchrun-minimal", "RANK=0\nWORLD_SIZE=1\n"},
      {"slurm",
       "SLURM_PROCID=3\nSLURM_NTASKS=8\nSLURM_LOCALID=1\n"
       "SLURM_NTASKS_PER_NODE=4(x2)\nSLURM_LAUNCH_NODE_IPADDR=192.168.1.2\n"
       "MASTER_PORT=12345\n"},
      {"slurm-no-per-node",
       "SLURM_PROCID=0\nSLURM_NTASKS=2\nSLURM_LOCALID=0\nMASTER_ADDR=node0\n"},
      {"openmpi",
       "OMPI_COMM_WORLD_RANK=2\nOMPI_COMM_WORLD_SIZE=4\n"
       "OMPI_COMM_WORLD_LOCAL_RANK=0\nOMPI_COMM_WORLD_LOCAL_SIZE=2\n"
       "MASTER_ADDR=node0\nMASTER_PORT=29501\n"},
      {"single", "PATH=/usr/bin\nHOME=/root\n"},
  };
  for (const auto& [name, text] : seeds) write_seed(dir, name, text);
  return static_cast<int>(std::size(seeds));
}

}  // namespace

Target cifar10_target() {
  return {"cifar10", run_cifar10, seeds_cifar10};
}
Target image_target() {
  return {"image", run_image, seeds_image};
}
Target checkpoint_target() {
  return {"checkpoint", run_checkpoint, seeds_checkpoint};
}
Target env_target() {
  return {"env", run_env, seeds_env};
}

void initialize(const Target& t, int* argc, char*** argv) {
  torch::set_num_threads(1);
  // Torch's warnings (e.g. on odd archives) are not findings; keep the log
  // readable.
  static ddpkit::compat::QuietWarnings quiet;
  ddpkit::compat::set_warning_handler(&quiet);
  // A mutated archive would almost always fail its CRC-32 first; off, the
  // fuzzer reaches the zip, pickle and tensor checks behind it.
  ddpkit::detail::verify_zip_checksums() = false;
  const std::string flag = "-ddpkit_write_seeds=";
  for (int i = 1; i < *argc; ++i) {
    const std::string arg = (*argv)[i];
    if (arg.rfind(flag, 0) == 0) {
      const auto dir = arg.substr(flag.size());
      try {
        const int n = t.write_seeds(dir);
        std::printf("%s: wrote %d seeds to %s\n", t.name, n, dir.c_str());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "%s: writing seeds failed: %s\n", t.name,
                     e.what());
        std::exit(1);
      }
      std::exit(0);
    }
  }
}

}  // namespace ddpkit::fuzz
