#include "../support.hpp"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>

#include <png.h>

#include "ddpkit/data.hpp"
#include "ddpkit/image.hpp"
#include "ddpkit/testing.hpp"

namespace fs = std::filesystem;
using namespace ddpkit::data;
using namespace ddpkit::testing;

namespace {

/// The first row (of the image) where block `b` of a region decode `part`
/// differs from the same pixels of the full RGB decode `full`, `width`
/// pixels wide; -1 when every row is the same.
int64_t first_differing_row(const std::vector<uint8_t>& part,
                            const JpegBlock& b,
                            const std::vector<uint8_t>& full, int64_t width) {
  for (int64_t r = 0; r < b.height; ++r) {
    if (std::memcmp(part.data() + b.offset + r * b.stride,
                    full.data() + ((b.top + r) * width + b.left) * 3,
                    static_cast<std::size_t>(b.width) * 3) != 0) {
      return b.top + r;
    }
  }
  return -1;
}

/// Where a baseline JPEG's SOF0 marker starts (its height and width are at
/// +5 and +7, big-endian); jpg.size() when there is none.
std::size_t sof0_offset(const std::vector<unsigned char>& jpg) {
  std::size_t sof = 0;
  while (sof + 9 < jpg.size() && !(jpg[sof] == 0xFF && jpg[sof + 1] == 0xC0))
    ++sof;
  return sof + 9 < jpg.size() ? sof : jpg.size();
}

/// A random 16x16 JPEG written to dir/small.jpg, with its bytes and the
/// offset of its SOF0 marker, for tests that patch the header.
struct SmallJpeg {
  torch::Tensor image;
  std::vector<unsigned char> bytes;
  std::size_t sof;
};
SmallJpeg small_jpeg(const std::filesystem::path& dir) {
  SmallJpeg j;
  j.image = torch::randint(0, 256, {3, 16, 16}, torch::kUInt8);
  write_jpeg(dir / "small.jpg", j.image);
  j.bytes = read_file_bytes(dir / "small.jpg");
  j.sof = sof0_offset(j.bytes);
  REQUIRE(j.sof + 9 < j.bytes.size());
  return j;
}

std::string usage_error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const ddpkit::UsageError& e) {
    return e.what();
  }
  return "<no UsageError>";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_SUITE("data") {
  TEST_CASE("make_synthetic is deterministic and balanced") {
    auto a = make_synthetic(SyntheticOptions(200).seed(3));
    auto b = make_synthetic(SyntheticOptions(200).seed(3));
    auto c = make_synthetic(SyntheticOptions(200).seed(4));
    CHECK(a.images.sizes() == torch::IntArrayRef({200, 3, 32, 32}));
    CHECK((a.images.scalar_type() == torch::kUInt8));
    CHECK((a.labels.scalar_type() == torch::kInt64));
    CHECK(torch::equal(a.images, b.images));
    CHECK(torch::equal(a.labels, b.labels));
    CHECK_FALSE(torch::equal(a.images, c.images));
    CHECK(torch::bincount(a.labels).eq(20).all().item<bool>());
    CHECK(a.classes.size() == 10);
  }

  TEST_CASE("load_cifar10 round-trips files written by write_cifar_binary") {
    ddpkit::test::TempDir tmp;
    auto train = make_synthetic(SyntheticOptions(103).seed(1));
    auto test = make_synthetic(SyntheticOptions(17).seed(2));
    write_cifar_binary(tmp / "cifar-10-batches-bin", train, test);
    CHECK(fs::file_size(tmp / "cifar-10-batches-bin" / "data_batch_1.bin") ==
          20 * 3073);

    SUBCASE("parent folder or the batches folder itself") {
      for (auto dir : {tmp.path(), tmp / "cifar-10-batches-bin"}) {
        auto c = load_cifar10(dir, Cifar10Options().val_ratio(0.0));
        CHECK(torch::equal(c.train.images, train.images));
        CHECK(torch::equal(c.train.labels, train.labels));
        CHECK(torch::equal(c.test.images, test.images));
        CHECK(c.val.size() == 0);
        CHECK(c.test.classes == synthetic_classes());
      }
    }
    SUBCASE("seeded split is reproducible and disjoint") {
      auto a = load_cifar10(tmp.path(), Cifar10Options().split_seed(5));
      auto b = load_cifar10(tmp.path(), Cifar10Options().split_seed(5));
      auto c = load_cifar10(tmp.path(), Cifar10Options().split_seed(6));
      CHECK(a.val.size() == 10);  // floor(103 * 0.1)
      CHECK(a.train.size() == 93);
      CHECK(torch::equal(a.val.images, b.val.images));
      CHECK_FALSE(torch::equal(a.val.images, c.val.images));
      // Every image lands in exactly one part.
      auto all = torch::cat({a.train.images, a.val.images})
                     .view({103, -1})
                     .to(torch::kInt64)
                     .sum(1);
      all = std::get<0>(all.sort());
      auto ref = std::get<0>(
          train.images.view({103, -1}).to(torch::kInt64).sum(1).sort());
      CHECK(torch::equal(all, ref));
    }
  }

  TEST_CASE("load_cifar10 errors name the file and the problem") {
    ddpkit::test::TempDir tmp;
    auto set = make_synthetic(SyntheticOptions(10).seed(1));
    write_cifar_binary(tmp.path(), set, set);

    SUBCASE("missing file") {
      fs::remove(tmp / "data_batch_3.bin");
      auto msg = usage_error_of([&] { load_cifar10(tmp.path()); });
      CHECK(contains(msg, "missing file"));
      CHECK(contains(msg, "data_batch_3.bin"));
    }
    SUBCASE("size not a multiple of 3073") {
      std::ofstream(tmp / "test_batch.bin", std::ios::app) << "xyz";
      auto msg = usage_error_of([&] { load_cifar10(tmp.path()); });
      CHECK(contains(msg, "test_batch.bin"));
      CHECK(contains(msg, std::to_string(10 * 3073 + 3)));
      CHECK(contains(msg, "3073"));
    }
    SUBCASE("label out of range") {
      {
        std::fstream f(tmp / "test_batch.bin",
                       std::ios::in | std::ios::out | std::ios::binary);
        f.seekp(2 * 3073);
        f.put(static_cast<char>(42));
      }
      auto msg = usage_error_of([&] { load_cifar10(tmp.path()); });
      CHECK(contains(msg, "test_batch.bin"));
      CHECK(contains(msg, "label 42"));
      CHECK(contains(msg, "byte offset 6146"));
    }
  }

  TEST_CASE("parse_cifar10_bytes: the file reader's results and errors") {
    ddpkit::test::TempDir tmp;
    auto set = make_synthetic(SyntheticOptions(10).seed(1));
    write_cifar_binary(tmp.path(), set, set);
    auto bytes = ddpkit::test::file_bytes(tmp / "test_batch.bin");
    auto mem = parse_cifar10_bytes(bytes.data(), bytes.size(), "mem.bin");
    auto file = read_cifar10_file(tmp / "test_batch.bin");
    CHECK(torch::equal(mem.images, file.images));
    CHECK(torch::equal(mem.labels, file.labels));
    CHECK(parse_cifar10_bytes(nullptr, 0).size() == 0);
    auto msg = usage_error_of([&] {
      parse_cifar10_bytes(bytes.data(), bytes.size() - 1, "mem.bin");
    });
    CHECK(contains(msg, "mem.bin"));
    CHECK(contains(msg, std::to_string(10 * 3073 - 1)));
    bytes[3 * 3073] = 10;
    msg = usage_error_of(
        [&] { parse_cifar10_bytes(bytes.data(), bytes.size(), "mem.bin"); });
    CHECK(contains(msg, "label 10 at byte offset 9219"));
  }

  TEST_CASE("a JPEG header claiming zero width is a usage error") {
    // Found by fuzzing (tests/fuzz/regressions/image/zero-width-header):
    // jpeg_size returned a 0-pixel-wide size instead of refusing the file.
    ddpkit::test::TempDir tmp;
    auto [img, jpg, sof] = small_jpeg(tmp.path());
    jpg[sof + 7] = 0, jpg[sof + 8] = 0;  // width 0
    auto msg = usage_error_of([&] { jpeg_size(jpg, "zero.jpg"); });
    CHECK(contains(msg, "zero.jpg"));
    ddpkit::test::write_file_bytes(tmp / "zero.jpg", jpg);
    CHECK(contains(usage_error_of([&] { decode_image(tmp / "zero.jpg"); }),
                   "zero.jpg"));
    CHECK_FALSE(image_header_ok(tmp / "zero.jpg"));
    // The thread's decoder must still work: a failed header read used to
    // leave it mid-stream, and every later JPEG on the thread failed with
    // "Bogus marker length".
    auto good = decode_image(tmp / "small.jpg");
    CHECK(good.size(0) == 3);
    CHECK(good.size(1) == 16);
  }

  TEST_CASE(
      "decompression bombs: a tiny file claiming 60000x60000 is refused") {
    // Found by fuzzing (tests/fuzz): decoding allocated width * height * 3
    // bytes from the header (10.8 GB here) before reading any pixel.
    ddpkit::test::TempDir tmp;
    auto [img, jpg, sof] = small_jpeg(tmp.path());
    for (int k : {5, 7}) {  // height, width (big-endian)
      jpg[sof + k] = 60000 >> 8;
      jpg[sof + k + 1] = 60000 & 0xFF;
    }
    ddpkit::test::write_file_bytes(tmp / "bomb.jpg", jpg);
    auto msg = usage_error_of([&] { decode_image(tmp / "bomb.jpg"); });
    CHECK(contains(msg, "bomb.jpg"));
    CHECK(contains(msg, "60000x60000"));
    CHECK(contains(msg, "limit"));
    std::vector<uint8_t> out;
    JpegBlock block;
    msg = usage_error_of([&] {
      decode_jpeg_region(jpg, 0, 0, 8, 8, out, block, {}, "bomb.jpg");
    });
#if defined(DDPKIT_JPEG_REGION)
    CHECK(contains(msg, "bomb.jpg"));
    CHECK(contains(msg, "limit"));
#else
    // Built without the region decode: the path declines, nothing throws.
    CHECK(msg == "<no UsageError>");
#endif
    CHECK(out.size() < 4096);
    CHECK_FALSE(image_header_ok(tmp / "bomb.jpg"));

    // The same for PNG: IHDR's width and height, and its CRC.
    png_image p{};
    p.version = PNG_IMAGE_VERSION;
    p.width = p.height = 16;
    p.format = PNG_FORMAT_RGB;
    auto hwc = img.permute({1, 2, 0}).contiguous();
    png_alloc_size_t size = 0;
    REQUIRE(png_image_write_to_memory(&p, nullptr, &size, 0,
                                      hwc.data_ptr<uint8_t>(), 0, nullptr));
    std::vector<unsigned char> png(size);
    REQUIRE(png_image_write_to_memory(&p, png.data(), &size, 0,
                                      hwc.data_ptr<uint8_t>(), 0, nullptr));
    REQUIRE(std::string(png.begin() + 12, png.begin() + 16) == "IHDR");
    for (int k : {16, 20}) {
      png[k] = 0, png[k + 1] = 0, png[k + 2] = 60000 >> 8,
      png[k + 3] = 60000 & 0xFF;
    }
    std::uint32_t crc = 0xFFFFFFFFu;  // CRC-32 of the chunk type and data
    for (int i = 12; i < 29; ++i) {
      crc ^= png[i];
      for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0xEDB88320u & -(crc & 1));
    }
    crc ^= 0xFFFFFFFFu;
    for (int k = 0; k < 4; ++k) png[29 + k] = (crc >> (24 - 8 * k)) & 0xFF;
    ddpkit::test::write_file_bytes(tmp / "bomb.png", png);
    msg = usage_error_of([&] { decode_image(tmp / "bomb.png"); });
    CHECK(contains(msg, "bomb.png"));
    CHECK(contains(msg, "limit"));
    CHECK_FALSE(image_header_ok(tmp / "bomb.png"));
  }

  TEST_CASE("ImageFolder: split, class_indices.json, decode") {
    ddpkit::test::TempDir tmp;
    const auto root = tmp / "flowers";
    make_jpeg_folder(
        root, JpegFolderOptions().images_per_class(11).short_side(40).seed(3));
    // A PNG in one class, and a stray non-image file that must be ignored.
    {
      auto img = torch::randint(0, 256, {3, 20, 30}, torch::kUInt8);
      auto hwc = img.permute({1, 2, 0}).contiguous();
      png_image p{};
      p.version = PNG_IMAGE_VERSION;
      p.width = 30;
      p.height = 20;
      p.format = PNG_FORMAT_RGB;
      REQUIRE(png_image_write_to_file(&p,
                                      (root / "tulips" / "extra.PNG").c_str(),
                                      0, hwc.data_ptr<uint8_t>(), 0, nullptr));
      CHECK(torch::equal(decode_image(root / "tulips" / "extra.PNG"), img));
      std::ofstream(root / "roses" / "notes.txt") << "not an image";
    }
    const auto json = tmp / "class_indices.json";
    auto opts = ImageFolderOptions().class_indices_json(json).seed(1);
    auto a = read_image_folder(root, opts);
    CHECK(a.classes == std::vector<std::string>{"daisy", "dandelion", "roses",
                                                "sunflowers", "tulips"});
    CHECK(a.train.size() == 4 * 9 + 10);  // 11 -> 2 val; tulips 12 -> 2 val
    CHECK(a.val.size() == 10);
    std::ifstream js(json);
    std::string text((std::istreambuf_iterator<char>(js)),
                     std::istreambuf_iterator<char>());
    CHECK(text ==
          "{\n    \"0\": \"daisy\",\n    \"1\": \"dandelion\",\n    \"2\": "
          "\"roses\",\n"
          "    \"3\": \"sunflowers\",\n    \"4\": \"tulips\"\n}");

    SUBCASE("the split is reproducible and seed-dependent") {
      auto b = read_image_folder(root, opts);
      auto c = read_image_folder(
          root, ImageFolderOptions().class_indices_json(json).seed(2));
      auto paths = [](const ImageFiles& f) {
        std::vector<std::string> p;
        for (const auto& s : f.samples()) p.push_back(s.path.string());
        return p;
      };
      CHECK(paths(a.val) == paths(b.val));
      CHECK(paths(a.val) != paths(c.val));
      for (const auto& s : a.val.samples())
        CHECK(s.path.parent_path().filename() == a.classes[s.label]);
    }
    SUBCASE(
        "decode, scaled decode, and the ImageNet pipeline through the loader") {
      auto [imgs, labels] = a.train.get({0, 1});
      CHECK(imgs[0].size(0) == 3);
      CHECK(std::min(imgs[0].size(1), imgs[0].size(2)) == 40);
      auto full = decode_image(a.train.samples()[0].path);
      auto small =
          decode_image(a.train.samples()[0].path, 10);  // 1/4 scale: 10 >= 10
      CHECK(std::min(small.size(1), small.size(2)) == 10);
      CHECK(small.size(1) == (full.size(1) + 3) / 4);  // TJSCALED rounds up
      Loader l1(a.train, ImageNetTrain{ImageNetTrainOptions().size(32)},
                LoaderOptions(8).workers(1));
      Loader l3(a.train, ImageNetTrain{ImageNetTrainOptions().size(32)},
                LoaderOptions(8).workers(3));
      std::vector<size_t> idx(a.train.size());
      std::iota(idx.begin(), idx.end(), 0);
      auto e1 = l1.epoch(idx, 0);
      auto e3 = l3.epoch(idx, 0);
      for (auto b1 = e1.next(), b3 = e3.next(); b1;
           b1 = e1.next(), b3 = e3.next()) {
        CHECK(b1->data.sizes() ==
              torch::IntArrayRef({b1->target.size(0), 3, 32, 32}));
        CHECK(torch::equal(b1->data, b3->data));
      }
    }
    SUBCASE("a corrupt file is an error naming it, or skipped and counted") {
      std::ofstream(root / "daisy" / "broken.jpg") << "definitely not a jpeg";
      auto f = read_image_folder(
          root, ImageFolderOptions().class_indices_json("").val_ratio(0.5));
      std::vector<size_t> all(f.train.size());
      std::iota(all.begin(), all.end(), 0);
      std::vector<size_t> v(f.val.size());
      std::iota(v.begin(), v.end(), 0);
      auto msg = usage_error_of([&] {
        f.train.get(all);
        f.val.get(v);
      });
      CHECK(contains(msg, "broken.jpg"));
      auto g = read_image_folder(
          root, ImageFolderOptions().class_indices_json("").skip_corrupt(true));
      REQUIRE(g.skipped.size() == 1);
      CHECK(g.skipped[0].filename() == "broken.jpg");
      CHECK(g.train.size() + g.val.size() == 56);
    }
    SUBCASE("empty class folder and empty split are errors") {
      fs::create_directories(root / "zinnia");
      CHECK(contains(usage_error_of([&] { read_image_folder(root, opts); }),
                     "zinnia"));
      fs::remove(root / "zinnia");
      auto msg = usage_error_of([&] {
        read_image_folder(
            root, ImageFolderOptions().class_indices_json("").val_ratio(0.05));
      });
      CHECK(contains(msg, "0 validation"));
      CHECK(
          contains(usage_error_of([&] { read_image_folder(tmp / "nowhere"); }),
                   "nowhere"));
    }
    SUBCASE("class names cannot escape folders") {
      CHECK_THROWS_AS(check_class_name(".."), ddpkit::UsageError);
      CHECK_THROWS_AS(check_class_name("a/b"), ddpkit::UsageError);
      CHECK_THROWS_AS(make_jpeg_folder(tmp / "x", JpegFolderOptions().classes(
                                                      {"ok", "../evil"})),
                      ddpkit::UsageError);
      CHECK_FALSE(fs::exists(tmp / "evil"));
    }
  }

  TEST_CASE("JPEG region decode equals the same region of a full decode") {
    ddpkit::test::TempDir tmp;
    torch::manual_seed(3);
    // Smooth content plus noise, 4:2:0 (write_jpeg's subsampling).
    auto img = (torch::rand({3, 20, 26}) * 255).to(torch::kUInt8);
    img = torch::nn::functional::interpolate(
              img.to(torch::kFloat).unsqueeze(0),
              torch::nn::functional::InterpolateFuncOptions()
                  .size(std::vector<int64_t>{203, 259})
                  .mode(torch::kBilinear)
                  .align_corners(false))
              .squeeze(0)
              .add_(torch::randn({3, 203, 259}) * 8)
              .clamp_(0, 255)
              .to(torch::kUInt8);
    write_jpeg(tmp / "r.jpg", img, 90);
    const auto bytes = read_file_bytes(tmp / "r.jpg");
    for (int num : {8, 4, 2}) {
      for (bool fast : {false, true}) {
        CAPTURE(num);
        CAPTURE(fast);
        JpegDecodeOptions o;
        o.scale_num = num;
        o.fast = fast;
        std::vector<uint8_t> full, part;
        const auto fs = decode_jpeg_hwc(bytes, full, o);
        auto full_t = torch::from_blob(full.data(), {fs.height, fs.width, 3},
                                       torch::kUInt8);
        JpegBlock block;
        // Region in original pixels; deliberately not MCU-aligned.
        const double top = 37, left = 53, h = 101, w = 90;
        if (!decode_jpeg_region(bytes, top, left, h, w, part, block, o)) {
#if defined(DDPKIT_HAS_JPEG_REGION)
          FAIL(
              "the build asked for the JPEG region decode "
              "(DDPKIT_HAS_JPEG_REGION), but it declined: is libjpeg.so.62 "
              "missing at run time?");
#else
          DDPKIT_SKIP(
              "built with -DDDPKIT_JPEG_REGION=OFF: region decode not "
              "tested");
#endif
        }
        const double s = num / 8.0;
        CHECK(block.top <= static_cast<int64_t>(top * s));
        CHECK(block.left <= static_cast<int64_t>(left * s));
        CHECK(block.top + block.height >= static_cast<int64_t>((top + h) * s));
        CHECK(block.left + block.width >= static_cast<int64_t>((left + w) * s));
        auto part_t = torch::from_blob(part.data() + block.offset,
                                       {block.height, block.width, 3},
                                       {block.stride, 3, 1}, torch::kUInt8);
        auto ref = full_t.narrow(0, block.top, block.height)
                       .narrow(1, block.left, block.width);
        auto diff = (part_t.to(torch::kInt32) - ref.to(torch::kInt32)).abs();
        // The same decoder on the same coefficients: the same pixels.
        CHECK(diff.max().item<int>() == 0);
      }
    }
    SUBCASE("images under 8 pixels a side, at every scale") {
      // The fuzz finding tests/fuzz/regressions/image/jpeg-3x1-scale-collision:
      // TurboJPEG takes an output size, not a factor, and a 3x1 image is 1x1
      // at 1/8 and at 1/4, so it decoded at 1/4 while the region decode used
      // 1/8: different pixels. Both must now use the same factor.
      for (auto [h, w] : {std::pair<int64_t, int64_t>{1, 3},
                          {2, 5},
                          {3, 7},
                          {7, 2},
                          {5, 5}}) {
        auto tiny = (torch::rand({3, h, w}) * 255).to(torch::kUInt8);
        write_jpeg(tmp / "tiny.jpg", tiny, 90);
        const auto tb = read_file_bytes(tmp / "tiny.jpg");
        for (int num : {8, 4, 2, 1}) {
          for (bool fast : {false, true}) {
            CAPTURE(h);
            CAPTURE(w);
            CAPTURE(num);
            CAPTURE(fast);
            JpegDecodeOptions o;
            o.scale_num = num;
            o.fast = fast;
            std::vector<uint8_t> full, part;
            const auto fs = decode_jpeg_hwc(tb, full, o);
            JpegBlock block;
            if (!decode_jpeg_region(tb, 0, 0, static_cast<double>(h),
                                    static_cast<double>(w), part, block, o)) {
#if defined(DDPKIT_HAS_JPEG_REGION)
              FAIL("the region decode declined a tiny image");
#endif
              continue;
            }
            REQUIRE(block.height == fs.height);
            REQUIRE(block.width == fs.width);
            CHECK(first_differing_row(part, block, full, fs.width) == -1);
          }
        }
      }
    }
    SUBCASE("narrow regions at the edges and iMCU boundaries") {
      // The fuzz finding tests/fuzz/regressions/image/jpeg-420-crop-two-
      // columns: a 1-pixel-wide region at the left edge made a 2-pixel crop,
      // and libjpeg-turbo's 4:2:0 triangle upsampling then gave other chroma
      // than a full decode from the second iMCU row on.
      for (int num : {8, 4, 2, 1}) {
        for (bool fast : {false, true}) {
          JpegDecodeOptions o;
          o.scale_num = num;
          o.fast = fast;
          std::vector<uint8_t> full, part;
          const auto fs = decode_jpeg_hwc(bytes, full, o);
          const double inv = 8.0 / num;  // one output pixel, in originals
          int bad = 0;
          for (int64_t x :
               {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{15},
                int64_t{16}, int64_t{17}, fs.width - 2, fs.width - 1}) {
            for (int64_t w : {1, 2, 3}) {
              for (int64_t y :
                   {int64_t{0}, int64_t{15}, int64_t{16}, fs.height - 1}) {
                if (x < 0 || y < 0) continue;
                JpegBlock b;
                REQUIRE(decode_jpeg_region(
                    bytes, static_cast<double>(y) * inv,
                    static_cast<double>(x) * inv, 3 * inv,
                    static_cast<double>(w) * inv, part, b, o));
                const int64_t row =
                    first_differing_row(part, b, full, fs.width);
                if (row >= 0 && ++bad <= 3) {
                  MESSAGE("scale ", num, "/8 fast ", fast, ": region at (", y,
                          ", ", x, ") width ", w, " differs in row ", row);
                }
              }
            }
          }
          CAPTURE(num);
          CAPTURE(fast);
          CHECK(bad == 0);
        }
      }
    }
    SUBCASE("progressive files: complete ones by region, unfinished ones not") {
      // The fuzz finding tests/fuzz/regressions/image/jpeg-progressive-
      // unfinished: a progressive file that ends (EOI) before its refinement
      // scans is legal, and libjpeg decodes it with block smoothing, which
      // reads neighbouring blocks: a crop's pixels differ from a full
      // decode's. Such a file must be left to the full decode.
      auto hwc = img.permute({1, 2, 0}).contiguous();
      tjhandle th = tjInitCompress();
      unsigned char* buf = nullptr;
      unsigned long n = 0;
      REQUIRE(tjCompress2(th, hwc.data_ptr<uint8_t>(),
                          static_cast<int>(hwc.size(1)), 0,
                          static_cast<int>(hwc.size(0)), TJPF_RGB, &buf, &n,
                          TJSAMP_420, 90, TJFLAG_PROGRESSIVE) == 0);
      const std::vector<unsigned char> prog(buf, buf + n);
      tjFree(buf);
      tjDestroy(th);
      // The first scan (DC only), then EOI: cut at the second SOS marker
      // (FF DA never occurs inside entropy-coded data).
      std::vector<std::size_t> sos;
      for (std::size_t i = 0; i + 1 < prog.size(); ++i) {
        if (prog[i] == 0xFF && prog[i + 1] == 0xDA) sos.push_back(i);
      }
      REQUIRE(sos.size() >= 3);
      std::vector<unsigned char> dc_only(prog.begin(), prog.begin() + sos[1]);
      dc_only.push_back(0xFF);
      dc_only.push_back(0xD9);
      for (int num : {8, 4, 2}) {
        CAPTURE(num);
        JpegDecodeOptions o;
        o.scale_num = num;
        const double top = 37, left = 53, h = 101, w = 90;
        auto same_as_full = [&](const std::vector<unsigned char>& file) {
          std::vector<uint8_t> full, part;
          const auto fs = decode_jpeg_hwc(file, full, o);
          JpegBlock b;
          if (!decode_jpeg_region(file, top, left, h, w, part, b, o)) return -1;
          return first_differing_row(part, b, full, fs.width) < 0 ? 1 : 0;
        };
        CHECK(same_as_full(prog) == 1);     // decoded by region, equal
        CHECK(same_as_full(dc_only) != 0);  // equal, or declined
      }
    }
    SUBCASE("a truncated file is an error whatever the region") {
      std::vector<unsigned char> cut(bytes.begin(),
                                     bytes.begin() + bytes.size() * 2 / 3);
      std::vector<uint8_t> out;
      JpegBlock block;
      // Top rows only: this region is intact, but the file is not.
      bool region = true;
      auto msg = usage_error_of([&] {
        region =
            decode_jpeg_region(cut, 0, 0, 16, 16, out, block, {}, "cut.jpg");
        if (!region) decode_jpeg_hwc(cut, out, {}, "cut.jpg");
      });
      CHECK(contains(msg, "cut.jpg"));
      CHECK(contains(msg, "truncated"));
    }
  }

  TEST_CASE(
      "a truncated JPEG is a UsageError naming it, or skipped and counted") {
    ddpkit::test::TempDir tmp;
    const auto root = tmp / "flowers";
    make_jpeg_folder(
        root, JpegFolderOptions().images_per_class(4).short_side(64).seed(1));
    const auto victim = root / "roses" / "roses_0.jpg";
    {
      auto bytes = read_file_bytes(victim);
      std::ofstream(victim, std::ios::binary | std::ios::trunc)
          .write(reinterpret_cast<const char*>(bytes.data()),
                 static_cast<std::streamsize>(bytes.size() / 2));
    }
    auto msg = usage_error_of([&] { decode_image(victim); });
    CHECK(contains(msg, "roses_0.jpg"));
    CHECK(contains(msg, "truncated"));
    // The header is intact, so scanning keeps the file; the error comes when
    // the pixels are decoded, through the loader as anywhere else.
    auto f = read_image_folder(
        root, ImageFolderOptions().class_indices_json("").val_ratio(0.25));
    std::vector<size_t> all(f.train.size());
    std::iota(all.begin(), all.end(), 0);
    std::vector<size_t> v(f.val.size());
    std::iota(v.begin(), v.end(), 0);
    auto through_loader = [&](const ImageFiles& files,
                              std::vector<size_t> idx) {
      Loader loader(files, ImageNetTrain{ImageNetTrainOptions().size(32)},
                    LoaderOptions(64).workers(1));
      for (Batch b : loader.epoch(idx, 0)) (void)b;
    };
    msg = usage_error_of([&] {
      through_loader(f.train, all);
      through_loader(f.val, v);
    });
    CHECK(contains(msg, "roses_0.jpg"));
    CHECK(contains(msg, "Premature end"));
    auto eg = make_generator(0);
    msg = usage_error_of([&] {
      ImageNetEval{32}(f.train.get(all).first, eg);
      ImageNetEval{32}(f.val.get(v).first, eg);
    });
    CHECK(contains(msg, "roses_0.jpg"));

    auto g = read_image_folder(root, ImageFolderOptions()
                                         .class_indices_json("")
                                         .val_ratio(0.25)
                                         .skip_corrupt(true));
    CHECK(g.skipped.empty());
    std::vector<size_t> gall(g.train.size());
    std::iota(gall.begin(), gall.end(), 0);
    std::vector<size_t> gv(g.val.size());
    std::iota(gv.begin(), gv.end(), 0);
    auto [ti, tl] = g.train.get(gall);
    auto [vi, vl] = g.val.get(gv);
    CHECK(ti.size() + vi.size() == 19);
    CHECK(tl.size(0) + vl.size(0) == 19);
    CHECK(g.train.corrupt_count() + g.val.corrupt_count() == 1);
  }

  TEST_CASE("PNG: palette and greyscale files decode to RGB") {
    ddpkit::test::TempDir tmp;
    // Greyscale: every channel equals the grey value.
    auto grey = torch::randint(0, 256, {13, 17}, torch::kUInt8);
    {
      png_image p{};
      p.version = PNG_IMAGE_VERSION;
      p.width = 17;
      p.height = 13;
      p.format = PNG_FORMAT_GRAY;
      REQUIRE(png_image_write_to_file(&p, (tmp / "grey.png").c_str(), 0,
                                      grey.data_ptr<uint8_t>(), 0, nullptr));
    }
    auto g = decode_image(tmp / "grey.png");
    REQUIRE(g.sizes() == torch::IntArrayRef({3, 13, 17}));
    for (int c = 0; c < 3; ++c) CHECK(torch::equal(g[c], grey));
    // Palette: indices into a 4-colour RGB colormap.
    const uint8_t colormap[4 * 3] = {255, 0, 0,   0,  255, 0,
                                     0,   0, 255, 10, 20,  30};
    auto index = torch::randint(0, 4, {9, 11}, torch::kUInt8);
    {
      png_image p{};
      p.version = PNG_IMAGE_VERSION;
      p.width = 11;
      p.height = 9;
      p.format = PNG_FORMAT_RGB_COLORMAP;
      p.colormap_entries = 4;
      REQUIRE(png_image_write_to_file(&p, (tmp / "palette.png").c_str(), 0,
                                      index.data_ptr<uint8_t>(), 0, colormap));
    }
    auto pal = decode_image(tmp / "palette.png");
    REQUIRE(pal.sizes() == torch::IntArrayRef({3, 9, 11}));
    auto cmap =
        torch::from_blob(const_cast<uint8_t*>(colormap), {4, 3}, torch::kUInt8);
    auto expect = cmap.index_select(0, index.view({-1}).to(torch::kInt64))
                      .view({9, 11, 3})
                      .permute({2, 0, 1});
    CHECK(torch::equal(pal, expect));
    // Through the fused transforms as well (PNG bytes decode there too).
    ImageBatch lazy(std::vector<ImageBatch::Item>{
        {std::make_shared<std::vector<unsigned char>>(
             read_file_bytes(tmp / "palette.png")),
         "palette.png",
         {},
         0}});
    auto gen = make_generator(0), gen2 = make_generator(0);
    CHECK(torch::equal(
        ImageNetTrain{ImageNetTrainOptions().size(8)}(lazy, gen),
        ImageNetTrain{ImageNetTrainOptions().size(8)}(std::vector{pal}, gen2)));
  }

}  // TEST_SUITE("data")
