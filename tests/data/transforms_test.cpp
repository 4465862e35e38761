#include "../support.hpp"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "ddpkit/data.hpp"
#include "ddpkit/image.hpp"
#include "ddpkit/testing.hpp"

using namespace ddpkit::data;
using namespace ddpkit::testing;

TEST_SUITE("data") {
  TEST_CASE("random_crop_flip matches a per-image crop and flip") {
    auto x = torch::randint(0, 256, {6, 3, 32, 32}, torch::kUInt8);
    auto gen = make_generator(1);
    auto out = random_crop_flip(x, 32, 4, 0.5, gen);
    CHECK(out.sizes() == x.sizes());
    CHECK((out.scalar_type() == torch::kUInt8));
    // Re-draw the same offsets and flips, then build the reference by hand.
    auto g2 = make_generator(1);
    auto oy = torch::randint(0, 9, {6}, g2, torch::kInt64);
    auto ox = torch::randint(0, 9, {6}, g2, torch::kInt64);
    auto flip = torch::rand({6}, g2) < 0.5;
    auto padded = torch::constant_pad_nd(x, {4, 4, 4, 4}, 0);
    for (int64_t i = 0; i < 6; ++i) {
      auto ref = padded[i]
                     .narrow(1, oy[i].item<int64_t>(), 32)
                     .narrow(2, ox[i].item<int64_t>(), 32);
      if (flip[i].item<bool>()) ref = ref.flip(2);
      CHECK(torch::equal(out[i], ref));
    }
  }

  TEST_CASE("CIFAR transforms: shapes, ranges, determinism") {
    auto set = make_synthetic(SyntheticOptions(64).seed(2));
    CifarTrain train;
    CifarEval eval;
    auto g1 = make_generator(9), g2 = make_generator(9),
         g3 = make_generator(10);
    auto a = train(set.images, g1);
    auto b = train(set.images, g2);
    auto c = train(set.images, g3);
    CHECK(a.sizes() == torch::IntArrayRef({64, 3, 32, 32}));
    CHECK((a.scalar_type() == torch::kFloat));
    CHECK(torch::equal(a, b));
    CHECK_FALSE(torch::equal(a, c));
    // Normalised [0, 1] values: within [-mean/std, (1-mean)/std].
    CHECK(a.min().item<float>() >= -0.4914f / 0.2470f - 1e-4f);
    CHECK(a.max().item<float>() <= (1 - 0.4822f) / 0.2435f + 1e-4f);

    auto e = eval(set.images, g1);
    auto ref = (set.images.to(torch::kFloat) / 255 -
                torch::tensor({0.4914f, 0.4822f, 0.4465f}).view({1, 3, 1, 1})) /
               torch::tensor({0.2470f, 0.2435f, 0.2616f}).view({1, 3, 1, 1});
    CHECK(torch::allclose(e, ref, 1e-5, 1e-5));

    SUBCASE("jitter with zero strength is the identity colour map") {
      CifarTrainOptions o;
      o.color_jitter(
          ColorJitterOptions().brightness(0).contrast(0).saturation(0).hue(0));
      o.padding(0).flip(0.0);
      auto g = make_generator(1);
      auto z = CifarTrain{o}(set.images, g);
      CHECK(torch::allclose(z, ref, 1e-4, 1e-4));
    }
    SUBCASE("brightness alone scales the image") {
      CifarTrainOptions o;
      o.color_jitter(
          ColorJitterOptions().brightness(0.5).contrast(0).saturation(0).hue(
              0));
      o.padding(0).flip(0.0);
      auto g = make_generator(1);
      auto z = CifarTrain{o}(set.images, g);
      auto raw =
          z * torch::tensor({0.2470f, 0.2435f, 0.2616f}).view({1, 3, 1, 1}) +
          torch::tensor({0.4914f, 0.4822f, 0.4465f}).view({1, 3, 1, 1});
      auto x = set.images.to(torch::kFloat) / 255;
      // Per image, raw = clamp(b x): check on pixels far from saturation.
      auto ratio =
          (raw / x.clamp_min(1e-3)).masked_fill((x < 0.1) | (raw > 0.99), -1);
      for (int64_t i = 0; i < 4; ++i) {
        auto r = ratio[i].masked_select(ratio[i] > 0);
        CHECK((r.max() - r.min()).item<float>() < 0.02f);
        CHECK(r.mean().item<float>() >= 0.5f - 0.01f);
        CHECK(r.mean().item<float>() <= 1.5f + 0.01f);
      }
    }
  }

  TEST_CASE("ImageNet transforms: sizes and determinism") {
    std::vector<torch::Tensor> images{
        torch::randint(0, 256, {3, 60, 80}, torch::kUInt8),
        torch::randint(0, 256, {3, 90, 50}, torch::kUInt8)};
    ImageNetTrain train{ImageNetTrainOptions().size(48)};
    ImageNetEval eval{48};
    auto g1 = make_generator(3), g2 = make_generator(3);
    auto a = train(images, g1), b = train(images, g2);
    CHECK(a.sizes() == torch::IntArrayRef({2, 3, 48, 48}));
    CHECK(torch::equal(a, b));
    auto e = eval(images, g1);
    CHECK(e.sizes() == torch::IntArrayRef({2, 3, 48, 48}));
    CHECK(e.min().item<float>() >= -0.485f / 0.229f - 1e-3f);
    CHECK(e.max().item<float>() <= (1 - 0.406f) / 0.225f + 1e-3f);

    SUBCASE("crop boxes stay inside the image and follow the ratio bounds") {
      auto u = torch::rand({200, 40}, g1);
      for (int64_t k = 0; k < 200; ++k) {
        auto box = random_resized_crop_box(
            60, 80, {0.08, 1.0}, {3.0 / 4, 4.0 / 3}, u[k].data_ptr<float>());
        CHECK(box.top >= 0);
        CHECK(box.left >= 0);
        CHECK(box.top + box.height <= 60);
        CHECK(box.left + box.width <= 80);
      }
    }
    SUBCASE("crop boxes keep torchvision's scale and ratio bounds") {
      // A large image, so rounding the sides to whole pixels moves the area
      // and the ratio by well under 1%.
      const int64_t H = 600, W = 800;
      const double A = static_cast<double>(H * W);
      for (auto [scale, ratio] :
           {std::pair<std::array<double, 2>, std::array<double, 2>>{
                {0.08, 1.0}, {3.0 / 4, 4.0 / 3}},
            {{0.5, 0.6}, {1.5, 2.0}}}) {
        CAPTURE(scale[0]);
        CAPTURE(ratio[0]);
        auto u = torch::rand({2000, 40}, g1);
        double lo_s = 1e9, hi_s = 0, lo_r = 1e9, hi_r = 0;
        for (int64_t k = 0; k < 2000; ++k) {
          auto b = random_resized_crop_box(H, W, scale, ratio,
                                           u[k].data_ptr<float>());
          const double s = static_cast<double>(b.height * b.width) / A;
          const double r = static_cast<double>(b.width) / b.height;
          // Rounding each side by up to half a pixel.
          const double tol = 0.5 / b.height + 0.5 / b.width;
          CHECK(s >= scale[0] * (1 - tol));
          CHECK(s <= scale[1] * (1 + tol));
          CHECK(r >= ratio[0] * (1 - tol));
          CHECK(r <= ratio[1] * (1 + tol));
          lo_s = std::min(lo_s, s), hi_s = std::max(hi_s, s);
          lo_r = std::min(lo_r, r), hi_r = std::max(hi_r, r);
        }
        // And they use the range (not, say, always the full image).
        const double span_s = scale[1] - scale[0];
        CHECK(lo_s < scale[0] + 0.05 * span_s);
        CHECK(hi_s > scale[1] - 0.05 * span_s);
        CHECK(lo_r < ratio[0] * 1.03);
        CHECK(hi_r > ratio[1] / 1.03);
      }
      // No try fits a 10x300 strip at ratio <= 4/3: torchvision's fallback,
      // the centre crop at the nearest allowed ratio.
      auto u = torch::rand({40}, g1);
      auto b = random_resized_crop_box(10, 300, {0.08, 1.0}, {3.0 / 4, 4.0 / 3},
                                       u.data_ptr<float>());
      CHECK(b.height == 10);
      CHECK(b.width == 13);
      CHECK(b.top == 0);
      CHECK(b.left == (300 - 13) / 2);
    }
  }

  TEST_CASE("colour jitter follows torchvision's definitions") {
    // Each of brightness, contrast, saturation and hue alone, at the
    // recipe's strengths (0.2, 0.2, 0.2, 0.1) both ways, against
    // torchvision's own functional ops on the same image and factors.
    torch::manual_seed(5);
    auto img = torch::nn::functional::interpolate(
                   torch::rand({1, 3, 6, 6}),
                   torch::nn::functional::InterpolateFuncOptions()
                       .size(std::vector<int64_t>{24, 24})
                       .mode(torch::kBilinear)
                       .align_corners(false))
                   .mul(255)
                   .round()
                   .to(torch::kUInt8);
    // Rows: brightness 0.8, 1.2; contrast 0.8, 1.2; saturation 0.8, 1.2;
    // hue -0.1, +0.1.
    const int64_t n = 8;
    auto b = torch::ones({n}), c = torch::ones({n}), s = torch::ones({n}),
         h = torch::zeros({n});
    for (int k = 0; k < 2; ++k) {
      const float f = k == 0 ? 0.8f : 1.2f;
      b[k] = f, c[2 + k] = f, s[4 + k] = f;
      h[6 + k] = k == 0 ? -0.1f : 0.1f;
    }
    auto order = torch::arange(4).repeat({n, 1});
    auto x = img.expand({n, 3, 24, 24}).to(torch::kFloat).reshape({n, 3, -1});
    auto [M, t] =
        ddpkit::data::detail::jitter_affine_with(x.mean(2), b, c, s, h, order);
    auto y =
        torch::baddbmm(t.unsqueeze(2), M, x).clamp_(0, 1).view({n, 3, 24, 24});
    ddpkit::test::TempDir tmp;
    ddpkit::test::save_tensors(tmp / "jitter.pt", {{"x", img.squeeze(0)},
                                                   {"y", y},
                                                   {"b", b},
                                                   {"c", c},
                                                   {"s", s},
                                                   {"h", h}});
    const int rc = ddpkit::test::run_python_check(tmp.path(), R"PY(
import sys, torch
import torchvision.transforms.functional as TF
from torchvision.transforms import _functional_tensor as FT
d = torch.load(sys.argv[1] + "/jitter.pt")
x = d["x"].float() / 255
y = d["y"]
ok = True
for k, (name, fn, f) in enumerate(
        [("brightness", TF.adjust_brightness, d["b"][0]), ("brightness", TF.adjust_brightness, d["b"][1]),
         ("contrast", TF.adjust_contrast, d["c"][2]), ("contrast", TF.adjust_contrast, d["c"][3]),
         ("saturation", TF.adjust_saturation, d["s"][4]), ("saturation", TF.adjust_saturation, d["s"][5])]):
    ref = fn(x, float(f))
    err = (y[k] - ref).abs().max().item()
    moved = (ref - x).abs().mean().item()
    print(f"{name} {float(f):.1f}: max |ddpkit - torchvision| {err:.2e}, torchvision moved pixels by {moved:.3f} on average")
    ok &= err < 1e-5 and moved > 0.01
# Hue: ddpkit rotates chroma in YIQ where torchvision shifts HSV hue, so
# pixels differ; the hue itself must turn the same way by about as much.
def hue(t): return FT._rgb2hsv(t)[0]
def turn(a, b): return ((a - b + 0.5) % 1) - 0.5
hsv = FT._rgb2hsv(x)
mask = (hsv[1] > 0.2) & (hsv[2] > 0.2)
for k in (6, 7):
    f = float(d["h"][k])
    ref = TF.adjust_hue(x, f)
    ours = turn(hue(y[k]), hue(x))[mask]
    err = turn(hue(y[k]), hue(ref))[mask].abs()
    luma = torch.tensor([0.299, 0.587, 0.114]).view(3, 1, 1)
    dluma = ((y[k] - x) * luma).sum(0).abs().max().item()
    print(f"hue {f:+.1f}: mean turn {ours.mean().item():+.4f} (torchvision {turn(hue(ref), hue(x))[mask].mean().item():+.4f}), "
          f"max |hue - torchvision's| {err.max().item():.4f} turns, max luma change {dluma:.4f}, {int(mask.sum())} pixels")
    ok &= abs(ours.mean().item() - f) < 0.02 and err.max().item() < 0.05
sys.exit(0 if ok else 1)
)PY",
                                                  tmp.str());
    if (rc == -1) return;
    CHECK(rc == 0);
  }

  namespace {

  /// torch's antialiased bilinear resize (PIL's filter) of a uint8 3×H×W crop,
  /// in 0..1 units: the reference for `resample_normalize`.
  torch::Tensor torch_resize01(const torch::Tensor& crop, int64_t oh,
                               int64_t ow) {
    namespace F = torch::nn::functional;
    return F::interpolate(crop.to(torch::kFloat).unsqueeze(0),
                          F::InterpolateFuncOptions()
                              .size(std::vector<int64_t>{oh, ow})
                              .mode(torch::kBilinear)
                              .align_corners(false)
                              .antialias(true))
               .squeeze(0) /
           255.0f;
  }

  /// `resample_normalize` of the integer box of a uint8 3×H×W image, with
  /// mean 0 and std 1 (so 0..1 units).
  torch::Tensor fused01(const torch::Tensor& img, int64_t top, int64_t left,
                        int64_t h, int64_t w, int64_t oh, int64_t ow,
                        bool flip = false) {
    auto hwc = img.permute({1, 2, 0}).contiguous();
    auto out = torch::empty({3, oh, ow});
    resample_normalize(hwc.data_ptr<uint8_t>(), img.size(1), img.size(2),
                       img.size(2) * 3, top, left, h, w, oh, ow, flip,
                       {0, 0, 0}, {1, 1, 1}, out.data_ptr<float>());
    return out;
  }

  }  // namespace

  TEST_CASE(
      "resample_normalize matches torch's antialiased bilinear interpolate") {
    torch::manual_seed(0);
    // Smooth-ish content plus noise, so both filter shape and edges matter.
    auto img = (torch::rand({3, 97, 131}) * 255).to(torch::kUInt8);
    struct Case {
      int64_t top, left, h, w, oh, ow;
    };
    for (auto c :
         {Case{0, 0, 97, 131, 48, 64},    // shrink ~2x
          Case{10, 20, 60, 90, 41, 37},   // shrink, odd ratios
          Case{5, 7, 30, 25, 64, 80},     // enlarge
          Case{0, 0, 97, 131, 97, 131},   // identity
          Case{50, 100, 47, 31, 9, 200},  // shrink one way, enlarge the other
          Case{0, 0, 97, 131, 7, 5}}) {   // strong shrink (wide filter)
      CAPTURE(c.oh);
      CAPTURE(c.ow);
      auto crop = img.narrow(1, c.top, c.h).narrow(2, c.left, c.w);
      auto ref = torch_resize01(crop, c.oh, c.ow);
      auto got = fused01(img, c.top, c.left, c.h, c.w, c.oh, c.ow);
      CHECK((got - ref).abs().max().item<float>() < 1e-4f);
      auto flipped = fused01(img, c.top, c.left, c.h, c.w, c.oh, c.ow, true);
      CHECK((flipped - ref.flip(2)).abs().max().item<float>() < 1e-4f);
    }
    SUBCASE("normalisation is (x - mean) / std per channel") {
      auto hwc = img.permute({1, 2, 0}).contiguous();
      auto out = torch::empty({3, 40, 50});
      resample_normalize(hwc.data_ptr<uint8_t>(), 97, 131, 131 * 3, 0, 0, 97,
                         131, 40, 50, false, kImageNetMean, kImageNetStd,
                         out.data_ptr<float>());
      auto ref = (torch_resize01(img, 40, 50) -
                  torch::tensor({0.485f, 0.456f, 0.406f}).view({3, 1, 1})) /
                 torch::tensor({0.229f, 0.224f, 0.225f}).view({3, 1, 1});
      CHECK((out - ref).abs().max().item<float>() < 1e-3f);
    }
    SUBCASE("a fractional box equals the integer box of a 2x larger image") {
      // Nearest-neighbour 2x upsampling: pixel edges of the small image are
      // exactly at even coordinates of the big one, so the box (y, x, h, w)
      // of the big image is (y/2, x/2, h/2, w/2) of the small one when the
      // filter is wider than the duplication (shrinking by >= 2).
      auto big = img.repeat_interleave(2, 1).repeat_interleave(2, 2);
      auto a = fused01(big, 10, 14, 120, 160, 30, 40);
      auto hwc = img.permute({1, 2, 0}).contiguous();
      auto b = torch::empty({3, 30, 40});
      resample_normalize(hwc.data_ptr<uint8_t>(), 97, 131, 131 * 3, 5.0, 7.0,
                         60.0, 80.0, 30, 40, false, {0, 0, 0}, {1, 1, 1},
                         b.data_ptr<float>());
      // Not bit-equal (the filters differ slightly), but close.
      CHECK((a - b).abs().mean().item<float>() < 0.01f);
    }
  }

  TEST_CASE(
      "ImageNet transforms: ranges, and the same output from bytes or "
      "tensors") {
    ddpkit::test::TempDir tmp;
    std::vector<torch::Tensor> images;
    std::vector<ImageBatch::Item> items;
    for (int i = 0; i < 4; ++i) {
      auto img =
          (torch::rand({3, 120 + 10 * i, 150 - 7 * i}) * 255).to(torch::kUInt8);
      auto file = tmp / ("im" + std::to_string(i) + ".jpg");
      write_jpeg(file, img, 90);
      images.push_back(decode_image(file));
      items.push_back(
          {std::make_shared<std::vector<unsigned char>>(read_file_bytes(file)),
           file.string(),
           {},
           0});
    }
    ImageBatch lazy(items);
    ImageNetTrain train{ImageNetTrainOptions().size(80)};
    auto g1 = make_generator(5), g2 = make_generator(5), g3 = make_generator(6);
    auto a = train(lazy, g1);
    auto b = train(images, g2);
    auto c = train(lazy, g3);
    CHECK(a.sizes() == torch::IntArrayRef({4, 3, 80, 80}));
    // Crops below 2 x 80 decode at full size: the same pixels either way.
    CHECK(torch::equal(a, b));
    CHECK_FALSE(torch::equal(a, c));
    CHECK(a.min().item<float>() >= -0.485f / 0.229f - 1e-3f);
    CHECK(a.max().item<float>() <= (1 - 0.406f) / 0.225f + 1e-3f);
    CHECK(lazy[1].sizes() == images[1].sizes());

    SUBCASE(
        "small outputs decode at a reduced DCT scale, close to the full "
        "decode") {
      ImageNetTrain tiny{ImageNetTrainOptions().size(16).flip(0.0)};
      auto ga = make_generator(1), gb = make_generator(1);
      auto x = tiny(lazy, ga);    // 1/2..1/8 scale decode of the crop
      auto y = tiny(images, gb);  // full decode
      CHECK(x.sizes() == y.sizes());
      // Random-noise images are the worst case for DCT downscaling; still
      // the same picture on average.
      CHECK((x - y).abs().mean().item<float>() < 0.35f);
    }
    SUBCASE("fast decode stays close to the accurate one") {
      ImageNetTrain fast{ImageNetTrainOptions().size(80).fast_decode(true)};
      auto g = make_generator(5);
      auto f = fast(lazy, g);
      // Random noise is the worst case (chroma at full resolution); smooth
      // photos differ far less (see the benchmark notes).
      CHECK((f - a).abs().mean().item<float>() < 0.2f);
    }
    SUBCASE("eval: one fused resample equals resize + centre crop") {
      ImageNetEval eval{48};
      auto e1 = eval(lazy, g1);    // short sides >= 2 x 54: 1/2-scale decode
      auto e2 = eval(images, g1);  // full-size pixels
      CHECK(e1.sizes() == e2.sizes());
      CHECK((e1 - e2).abs().mean().item<float>() < 0.35f);
      for (int64_t k = 0; k < 4; ++k) {
        const auto h = images[k].size(1), w = images[k].size(2);
        const int64_t resize = 48 * 256 / 224;
        const int64_t oh = h <= w ? resize : resize * h / w;
        const int64_t ow = h <= w ? resize * w / h : resize;
        const auto top = std::lround((oh - 48) / 2.0),
                   left = std::lround((ow - 48) / 2.0);
        auto ref = torch_resize01(images[k], oh, ow)
                       .narrow(1, top, 48)
                       .narrow(2, left, 48);
        ref = (ref - torch::tensor({0.485f, 0.456f, 0.406f}).view({3, 1, 1})) /
              torch::tensor({0.229f, 0.224f, 0.225f}).view({3, 1, 1});
        CHECK((e2[k] - ref).abs().max().item<float>() < 1e-3f);
      }
    }
  }

  TEST_CASE("Loader batches are identical whatever the number of workers") {
    auto set = make_synthetic(SyntheticOptions(203).seed(5));
    RandomSampling sampler(set.size(), {.seed = 11});
    sampler.set_epoch(2);
    auto collect = [&](int workers) {
      Loader loader(set, CifarTrain{},
                    LoaderOptions(32).workers(workers).seed(7).prefetch(2));
      std::vector<Batch> out;
      for (Batch b : loader.epoch(sampler.indices(), 2)) out.push_back(b);
      return out;
    };
    auto one = collect(1), three = collect(3), inline_ = collect(0);
    REQUIRE(one.size() == 7);
    REQUIRE(three.size() == 7);
    REQUIRE(inline_.size() == 7);
    for (size_t i = 0; i < one.size(); ++i) {
      CHECK(torch::equal(one[i].data, three[i].data));
      CHECK(torch::equal(one[i].data, inline_[i].data));
      CHECK(torch::equal(one[i].target, three[i].target));
    }
    CHECK(one.back().data.size(0) == 203 - 6 * 32);
    CHECK(one[0].data.sizes() == torch::IntArrayRef({32, 3, 32, 32}));
    // Targets follow the sampler's order.
    CHECK(one[0].target[0].item<int64_t>() ==
          set.labels[sampler.indices()[0]].item<int64_t>());

    SUBCASE(
        "rank and epoch change the augmentation, drop_last drops the tail") {
      Loader l0(set, CifarTrain{},
                LoaderOptions(32).workers(2).seed(7).rank(0).drop_last(true));
      Loader l1(set, CifarTrain{},
                LoaderOptions(32).workers(2).seed(7).rank(1));
      auto e0 = l0.epoch(sampler.indices(), 2);
      CHECK(e0.size() == 6);
      auto b0 = *e0.next();
      auto b1 = *l1.epoch(sampler.indices(), 2).next();
      CHECK(torch::equal(b0.target, b1.target));
      CHECK_FALSE(torch::equal(b0.data, b1.data));
      CHECK(torch::equal(b0.data, one[0].data));
    }
    SUBCASE("an exception in a worker reaches the consumer") {
      struct Bad {
        size_t size() const {
          return 10;
        }
        std::pair<torch::Tensor, torch::Tensor> get(
            const std::vector<size_t>&) const {
          throw ddpkit::UsageError("broken sample");
        }
      };
      Loader loader(Bad{}, CifarEval{}, LoaderOptions(4).workers(2));
      auto epoch = loader.epoch({0, 1, 2, 3, 4}, 0);
      CHECK_THROWS_WITH_AS(epoch.next(), "broken sample", ddpkit::UsageError);
    }
    SUBCASE("abandoning an epoch midway stops its workers") {
      // Worker threads are named "ddpkit-loader"; count them in /proc.
      auto workers = [] {
        int n = 0;
        for (const auto& t :
             std::filesystem::directory_iterator("/proc/self/task")) {
          std::ifstream comm(t.path() / "comm");
          std::string name;
          std::getline(comm, name);
          n += name == "ddpkit-loader";
        }
        return n;
      };
      REQUIRE(workers() == 0);
      Loader loader(set, CifarTrain{}, LoaderOptions(8).workers(3).prefetch(2));
      {
        auto epoch = loader.epoch(sampler.indices(), 0);
        CHECK(epoch.next().has_value());
        // At least the 3 workers (a thread a worker starts, e.g. an OpenMP
        // team for a parallel op, inherits the name).
        CHECK(workers() >= 3);
      }
      // Gone when the epoch is, not merely idle. A thread a worker started
      // (OpenMP's team) carries the name too and ends just after the worker
      // is joined: allow it 2 s. Workers left blocked stay counted.
      int left = workers();
      for (int i = 0; i < 200 && left > 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
        left = workers();
      }
      CHECK(left == 0);
    }
  }

}  // TEST_SUITE("data")
