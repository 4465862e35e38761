// Data pipeline throughput: CIFAR batched augmentation (images/s on one
// thread) and the JPEG folder pipeline (decode + random resized crop + flip
// + normalise at 224, images/s per worker thread). Compare the JPEG number
// with torchvision side by side, on the same generated folder:
//   DDPKIT_BENCH_JPEG_DIR=/tmp/jpeg ./ddpkit_data_bench --benchmark_filter=Eval
//   .venv/bin/python3 scripts/bench_torchvision_loader.py /tmp/jpeg
//       --ours ./ddpkit_data_bench --repeats 3      (one command)
//
// glibc's malloc moves its mmap and trim thresholds with the process's
// allocation history, and a batch of CIFAR images (1.5 MB as float) sits
// near them: the same transform code ran at 0.55x in one build only from
// page faults (an mmap per batch). This benchmark pins both thresholds
// (64 MiB and 128 MiB, as GLIBC_TUNABLES would) so it measures the
// transforms; GLIBC_TUNABLES set in the environment wins.
#include <benchmark/benchmark.h>
#include <malloc.h>

#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <numeric>
#include <string>

#include <ddpkit/ddpkit.hpp>
#include <ddpkit/image.hpp>
#include <ddpkit/testing.hpp>

namespace dd = ddpkit::data;
namespace ddt = ddpkit::testing;

namespace {

[[maybe_unused]] const bool kMallocPinned = [] {
  if (std::getenv("GLIBC_TUNABLES") != nullptr) return false;
  mallopt(M_MMAP_THRESHOLD, 64 << 20);
  mallopt(M_TRIM_THRESHOLD, 128 << 20);
  return true;
}();

/// CPU seconds used by this process so far: on a shared machine images per
/// CPU second is the steadier per-core measure (the Python twin reports the
/// same, from time.process_time()).
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

/// The folder the JPEG benchmarks read: $DDPKIT_BENCH_JPEG_DIR if set (so
/// the Python script can read the same files), else a temp folder written
/// once: 5 classes × 40 images, short side 375 like flower_photos.
const std::filesystem::path& jpeg_dir() {
  static const std::filesystem::path dir = [] {
    const char* env = std::getenv("DDPKIT_BENCH_JPEG_DIR");
    std::filesystem::path d =
        env ? env
            : std::filesystem::temp_directory_path() / "ddpkit-bench-jpeg";
    if (!std::filesystem::exists(d / "daisy")) {
      ddt::make_jpeg_folder(
          d, ddt::JpegFolderOptions().images_per_class(40).short_side(375));
    }
    return d;
  }();
  return dir;
}

void BM_CifarTrainAugment(benchmark::State& state) {
  torch::set_num_threads(1);
  const auto batch = state.range(0);
  auto set = ddt::make_synthetic(ddt::SyntheticOptions(batch).seed(1));
  dd::CifarTrain aug;
  std::uint64_t seed = 0;
  for (auto _ : state) {
    auto gen = dd::make_generator(seed++);
    benchmark::DoNotOptimize(aug(set.images, gen));
  }
  state.SetItemsProcessed(state.iterations() * batch);
  state.counters["images/s"] = benchmark::Counter(
      double(state.iterations() * batch), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_CifarTrainAugment)
    ->Arg(128)
    ->Arg(256)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

/// One worker thread's pipeline: read + decode + random resized crop 224 +
/// flip + normalise, batches of 32, made synchronously on this thread (the
/// work of one loader worker). Arg: fast_decode (libjpeg-turbo's fast IDCT
/// and chroma upsampling). Compare with scripts/bench_torchvision_loader.py,
/// which runs this benchmark and torchvision's loader on the same folder.
void BM_JpegFolderPipeline(benchmark::State& state) {
  torch::set_num_threads(1);
  auto folder = dd::read_image_folder(
      jpeg_dir(),
      dd::ImageFolderOptions().class_indices_json("").val_ratio(0.1));
  dd::ImageNetTrain aug{
      dd::ImageNetTrainOptions().fast_decode(state.range(0) != 0)};
  dd::Loader loader(folder.train, aug, dd::LoaderOptions(32).workers(0));
  std::vector<std::size_t> idx(folder.train.size());
  std::iota(idx.begin(), idx.end(), 0);
  const auto nb = loader.num_batches(idx.size());
  std::size_t b = 0, images = 0;
  const double cpu0 = process_cpu_seconds();
  for (auto _ : state) {
    auto batch = loader.make_batch(idx, 0, b++ % nb);
    images += batch.target.size(0);
    benchmark::DoNotOptimize(batch.data);
  }
  const double cpu = process_cpu_seconds() - cpu0;
  state.SetItemsProcessed(images);
  state.counters["images/s"] =
      benchmark::Counter(double(images), benchmark::Counter::kIsRate);
  state.counters["images/cpu_s"] = double(images) / cpu;
}
BENCHMARK(BM_JpegFolderPipeline)
    ->Arg(0)
    ->Arg(1)
    ->ArgName("fast_decode")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(2.0);

/// The evaluation transform (decode + resize 256 + centre crop 224 +
/// normalise) on the same folder, one thread.
void BM_JpegFolderEval(benchmark::State& state) {
  torch::set_num_threads(1);
  auto folder = dd::read_image_folder(
      jpeg_dir(),
      dd::ImageFolderOptions().class_indices_json("").val_ratio(0.1));
  dd::Loader loader(folder.train, dd::ImageNetEval{},
                    dd::LoaderOptions(32).workers(0));
  std::vector<std::size_t> idx(folder.train.size());
  std::iota(idx.begin(), idx.end(), 0);
  const auto nb = loader.num_batches(idx.size());
  std::size_t b = 0, images = 0;
  for (auto _ : state) {
    auto batch = loader.make_batch(idx, 0, b++ % nb);
    images += batch.target.size(0);
    benchmark::DoNotOptimize(batch.data);
  }
  state.counters["images/s"] =
      benchmark::Counter(double(images), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_JpegFolderEval)->Unit(benchmark::kMillisecond)->UseRealTime();

/// The same pipeline through the prefetching loader with N worker threads
/// (images/s overall; divide by N for per-worker).
void BM_JpegFolderLoader(benchmark::State& state) {
  torch::set_num_threads(1);
  const int workers = static_cast<int>(state.range(0));
  auto folder = dd::read_image_folder(
      jpeg_dir(),
      dd::ImageFolderOptions().class_indices_json("").val_ratio(0.1));
  dd::Loader loader(
      folder.train, dd::ImageNetTrain{},
      dd::LoaderOptions(32).workers(workers).prefetch(2 * workers));
  std::vector<std::size_t> idx(folder.train.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::size_t images = 0, epoch = 0;
  for (auto _ : state) {
    for (dd::Batch b : loader.epoch(idx, epoch++)) images += b.target.size(0);
  }
  state.counters["images/s"] =
      benchmark::Counter(double(images), benchmark::Counter::kIsRate);
  state.counters["images/s/worker"] =
      benchmark::Counter(double(images) / workers, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_JpegFolderLoader)
    ->Arg(1)
    ->Arg(2)
    ->ArgName("workers")
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
