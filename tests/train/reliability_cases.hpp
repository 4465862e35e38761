// Nothing lost, whatever the disk, the numbers or a second run do: a full
// disk during a write keeps the old file and names the error; one run per
// output folder; a fresh run does not silently write over an earlier one;
// a non-finite step stops every rank (or is skipped) before its update;
// a damaged last.pt is survived through last-prev.pt. (Doctest suite
// "reliability"; included at the end of task_test.cpp, in a namespace of
// its own, to save a translation unit's compile time in CI.)
#pragma once
#include <sys/mount.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "../support.hpp"
#include "ddpkit/ddpkit.hpp"
#include "ddpkit/image.hpp"
#include "ddpkit/testing.hpp"

namespace reliability_cases {

using namespace ddpkit;
using ddpkit::test::run_workers;
using ddpkit::test::TempDir;
namespace fs = std::filesystem;

namespace {

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> n;
  for (const auto& e : fs::directory_iterator(dir)) {
    n.push_back(e.path().filename().string());
  }
  std::sort(n.begin(), n.end());
  return n;
}

/// A tmpfs of `kib` KiB mounted at `dir` for the test's lifetime (root
/// only); `ok()` false where mounting is not allowed.
class SmallDisk {
 public:
  SmallDisk(const fs::path& dir, int kib) : dir_(dir) {
    fs::create_directories(dir);
    const std::string opts = "size=" + std::to_string(kib) + "k";
    mounted_ = ::mount("tmpfs", dir.c_str(), "tmpfs", 0, opts.c_str()) == 0;
  }
  ~SmallDisk() {
    if (mounted_) ::umount(dir_.c_str());
  }
  bool ok() const {
    return mounted_;
  }

 private:
  fs::path dir_;
  bool mounted_ = false;
};

/// A small disk, or a CI failure / loud skip where it cannot be mounted.
bool small_disk_or_skip(const SmallDisk& d) {
  if (d.ok()) return true;
  test::skip_case(
      "cannot mount a tmpfs (needs root with CAP_SYS_ADMIN) for the "
      "disk-full tests");
  return false;
}

// A regression: 4 features, one target.
struct Set {
  torch::Tensor x, y;
  std::size_t size() const {
    return static_cast<std::size_t>(x.size(0));
  }
  data::Example get(std::size_t i) const {
    const auto k = static_cast<int64_t>(i);
    return {x[k], y[k]};
  }
};

Set make_set(int64_t n, std::uint64_t seed) {
  auto gen = ddpkit::detail::make_generator(seed);
  auto x = torch::randn({n, 4}, gen, torch::kFloat32);
  auto y = x.matmul(torch::tensor({0.5, -1.0, 2.0, 0.25})).unsqueeze(1);
  return {x, y};
}

/// A linear model that, in training, multiplies its output by NaN on rank
/// `nan_rank` at its `nan_at`-th forward (1-based; 0: never). With
/// `in_backward`, the output stays finite there and its gradient does not:
/// sqrt(out - out) adds 0 forward, and its derivative at 0 is infinite
/// (0 * inf = NaN in backward), as a custom autograd function or an
/// overflow in backward would.
struct FlakyImpl : torch::nn::Cloneable<FlakyImpl> {
  FlakyImpl(int nan_rank = -1, int nan_at = 0, bool in_backward = false)
      : nan_rank(nan_rank), nan_at(nan_at), in_backward(in_backward) {
    reset();
  }
  void reset() override {
    fc = register_module("fc", torch::nn::Linear(4, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto out = fc(x);
    if (is_training() && ++calls == nan_at && rank == nan_rank) {
      out = in_backward ? out + torch::sqrt(out - out)
                        : out * std::numeric_limits<float>::quiet_NaN();
    }
    return out;
  }
  torch::nn::Linear fc{nullptr};
  int nan_rank, nan_at;
  bool in_backward;
  int calls = 0, rank = 0;
};
TORCH_MODULE(Flaky);

train::TrainerOptions options(const fs::path& out, int epochs) {
  return train::TrainerOptions()
      .epochs(epochs)
      .lr(0.05)
      .out_dir(out.string())
      .seed(3)
      .verbose(false)
      .tensorboard(false)
      .run_name("reliability");
}

train::OptimizerFactory sgd() {
  return [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.05).momentum(0.9));
  };
}

torch::Tensor weights_of(const fs::path& ckpt) {
  auto archive = train::open_checkpoint(ckpt);
  c10::IValue v;
  archive.read("model", v);
  auto d = v.toGenericDict();
  return torch::cat({d.at("fc.weight").toTensor().flatten(),
                     d.at("fc.bias").toTensor().flatten()});
}

torch::Tensor weights_of(Flaky& m) {
  return torch::cat(
             {m->fc->weight.detach().flatten(), m->fc->bias.detach().flatten()})
      .clone();
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

}  // namespace

/// DDP world 2 with 4 steps per epoch; rank NAN_RANK's NAN_AT-th forward
/// is NaN (NAN_IN_BACKWARD=1: finite, and its gradient NaN); SKIP
/// non-finite steps allowed; checkpoint after every step. Writes the error
/// (if any) and the weights in memory at the end.
DDPKIT_WORKER(reliability_nonfinite) {
  auto g = test::worker_group();
  torch::manual_seed(5);
  Flaky model(env_int("NAN_RANK", -1), env_int("NAN_AT", 0),
              env_int("NAN_IN_BACKWARD", 0) == 1);
  model->rank = g.rank();
  auto train_set = make_set(40, 1), val_set = make_set(8, 2);
  DDPTrainer<Flaky, PlainBN, NoScaling, ShardedEval, Regression> trainer(
      model, sgd(),
      options(test::worker_dir() / "out", 2)
          .checkpoint_every_n_steps(1)
          .skip_nonfinite(env_int("SKIP", 0)),
      g);
  const auto tag = std::to_string(g.rank());
  int code = 0;
  try {
    trainer.fit(train_set, val_set, data::LoaderOptions(5).workers(0));
  } catch (const NonFiniteError& e) {
    std::ofstream(test::worker_dir() / ("error" + tag)) << e.what();
    code = 3;
  }
  test::save_tensor(weights_of(model),
                    test::worker_dir() / ("weights" + tag + ".pt"));
  return code;
}

/// DDP world 2, EPOCHS epochs, resume auto, into worker_dir()/out.
DDPKIT_WORKER(reliability_resume) {
  auto g = test::worker_group();
  torch::manual_seed(5);
  Flaky model;
  auto train_set = make_set(40, 1), val_set = make_set(8, 2);
  DDPTrainer<Flaky, PlainBN, NoScaling, ShardedEval, Regression> trainer(
      model, sgd(),
      options(test::worker_dir() / "out", env_int("EPOCHS", 1)).resume("auto"),
      g);
  trainer.fit(train_set, val_set, data::LoaderOptions(5).workers(0));
  return 0;
}

TEST_SUITE("reliability") {
  TEST_CASE(
      "a full disk during a write keeps the old file, leaves no temporary "
      "and names the file and the system's error") {
    TempDir dir;
    SmallDisk disk(dir / "disk", 256);
    if (!small_disk_or_skip(disk)) return;
    const auto f = dir / "disk" / "last.pt";
    const std::string old(100 * 1024, 'a');
    ddpkit::detail::write_atomically(f, old);
    CHECK_THROWS_WITH_AS(
        ddpkit::detail::write_atomically(f, std::string(200 * 1024, 'b'),
                                         dir / "disk" / "last-prev.pt"),
        doctest::Contains((f.string() + ": No space left on device").c_str()),
        IoError);
    CHECK(read_file(f) == old);
    CHECK(names_in(dir / "disk") == std::vector<std::string>{"last.pt"});
    // A write that fits keeps the old file as last-prev.pt.
    ddpkit::detail::write_atomically(f, std::string(60 * 1024, 'c'),
                                     dir / "disk" / "last-prev.pt");
    CHECK(read_file(dir / "disk" / "last-prev.pt") == old);
    CHECK(read_file(f) == std::string(60 * 1024, 'c'));

    // TensorBoard: a flush that does not fit is cut back to whole records.
    fs::remove(f);
    fs::remove(dir / "disk" / "last-prev.pt");
    train::TensorBoardWriter tb(dir / "disk" / "tb");
    tb.add_scalar("a", 1.0, 1);
    tb.flush();
    const auto whole = fs::file_size(tb.path());
    ddpkit::detail::write_atomically(dir / "disk" / "filler",
                                     std::string(240 * 1024, 'x'));
    for (int i = 0; i < 2000; ++i) tb.add_text("t", std::string(100, 'y'), i);
    CHECK_THROWS_WITH_AS(tb.flush(),
                         doctest::Contains("No space left on device"), IoError);
    CHECK(fs::file_size(tb.path()) == whole);
  }

  TEST_CASE(
      "one run per output folder: a second is refused naming the first's "
      "process; a fresh run does not write over an earlier one") {
    TempDir dir;
    {
      ddpkit::detail::RunLock first(dir.path());
      CHECK_THROWS_WITH_AS(
          ddpkit::detail::RunLock(dir.path()),
          doctest::Contains(
              (" is in use by another run (pid " + std::to_string(::getpid()))
                  .c_str()),
          UsageError);
    }
    ddpkit::detail::RunLock again(dir.path());  // released with its holder
    CHECK(again.held());
  }

  TEST_CASE(
      "a fresh run into a folder with an earlier run is refused unless "
      "overwrite; resume auto without a checkpoint but with outputs too") {
    TempDir dir;
    auto train_set = make_set(20, 1), val_set = make_set(8, 2);
    auto fit = [&](train::TrainerOptions o) {
      torch::manual_seed(5);
      SingleDeviceTrainer<Flaky, RankZeroEval, Regression> t(Flaky(), sgd(), o);
      return t.fit(train_set, val_set, data::LoaderOptions(5).workers(0));
    };
    fit(options(dir.path(), 1));
    CHECK(fs::exists(dir / "checkpoints" / "last.pt"));
    CHECK_THROWS_WITH_AS(
        fit(options(dir.path(), 1)),
        doctest::Contains("holds an earlier run (checkpoints/last.pt, "
                          "metrics.jsonl); continue it with resume"),
        UsageError);
    // overwrite: starts over (epoch 1 again).
    auto r = fit(options(dir.path(), 1).overwrite(true));
    CHECK(r.history.size() == 1);
    // Outputs without a checkpoint: resume auto says so.
    fs::remove(dir / "checkpoints" / "last.pt");
    CHECK_THROWS_WITH_AS(
        fit(options(dir.path(), 1).resume("auto")),
        doctest::Contains("holds an earlier run (metrics.jsonl) but no "
                          "checkpoint to resume from"),
        UsageError);
    // An empty folder: resume auto starts fresh.
    TempDir empty;
    CHECK(fit(options(empty.path(), 1).resume("auto")).history.size() == 1);
  }

  TEST_CASE(
      "a NaN at step 3 on rank 1 of 2 stops both ranks before the update, "
      "naming the rank and the step; last.pt holds the last good weights") {
    TempDir dir;
    auto res = run_workers("reliability_nonfinite", 2, dir.str(),
                           {{"NAN_RANK", "1"}, {"NAN_AT", "3"}});
    CAPTURE(res.message);
    CHECK_FALSE(res.ok());
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      const auto err = read_file(dir / ("error" + std::to_string(r)));
      CHECK(err.find("non-finite loss on rank 1 (the first rank whose loss "
                     "was not finite) at step 3 (epoch 1, batch 3 of 4)") !=
            std::string::npos);
      // The step was not taken: the weights in memory are finite and those
      // of the checkpoint written after step 2.
      const auto w =
          test::load_tensor(dir / ("weights" + std::to_string(r) + ".pt"));
      CHECK(torch::isfinite(w).all().item<bool>());
      CHECK(torch::equal(w, weights_of(dir / "out/checkpoints/last.pt")));
    }
    auto archive = train::open_checkpoint(dir / "out/checkpoints/last.pt");
    const auto state = train::TrainingState::load(
        archive, "last.pt", train::metric_columns<Regression>(),
        Regression::num_sums);
    CHECK(state.global_step == 2);
  }

  TEST_CASE(
      "a finite loss whose gradient is NaN on rank 1 of 2 at step 3 (0 * inf "
      "in backward) stops both ranks before the update, naming the step; "
      "last.pt holds the last good weights") {
    TempDir dir;
    auto res = run_workers(
        "reliability_nonfinite", 2, dir.str(),
        {{"NAN_RANK", "1"}, {"NAN_AT", "3"}, {"NAN_IN_BACKWARD", "1"}});
    CAPTURE(res.message);
    CHECK_FALSE(res.ok());
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      // The averaged gradients are NaN on every rank alike: which rank's
      // own gradient was would cost a collective before the average.
      const auto err = read_file(dir / ("error" + std::to_string(r)));
      CAPTURE(err);
      CHECK(err.find("non-finite gradients (averaged over the ranks; every "
                     "rank's loss was finite) at step 3 (epoch 1, batch 3 "
                     "of 4); the step was not taken") != std::string::npos);
      const auto w =
          test::load_tensor(dir / ("weights" + std::to_string(r) + ".pt"));
      CHECK(torch::isfinite(w).all().item<bool>());
      CHECK(torch::equal(w, weights_of(dir / "out/checkpoints/last.pt")));
    }
    auto archive = train::open_checkpoint(dir / "out/checkpoints/last.pt");
    const auto state = train::TrainingState::load(
        archive, "last.pt", train::metric_columns<Regression>(),
        Regression::num_sums);
    CHECK(state.global_step == 2);
  }

  TEST_CASE("skip_nonfinite: the NaN step is skipped and training goes on") {
    TempDir dir;
    auto res = run_workers("reliability_nonfinite", 2, dir.str(),
                           {{"NAN_RANK", "1"}, {"NAN_AT", "3"}, {"SKIP", "1"}});
    CAPTURE(res.message);
    REQUIRE(res.ok());
    CHECK_FALSE(fs::exists(dir / "error0"));
    const auto w = test::load_tensor(dir / "weights0.pt");
    CHECK(torch::isfinite(w).all().item<bool>());
    CHECK(torch::equal(w, test::load_tensor(dir / "weights1.pt")));
    const auto jsonl = read_file(dir / "out/metrics.jsonl");
    CHECK(jsonl.find("NaN") == std::string::npos);
    CHECK(jsonl.find("nan") == std::string::npos);
  }

  TEST_CASE(
      "a truncated or bit-flipped last.pt: resume auto (DDP, world 2) falls "
      "back to last-prev.pt and ends equal to an uninterrupted run") {
    TempDir whole;
    auto ref =
        run_workers("reliability_resume", 2, whole.str(), {{"EPOCHS", "3"}});
    REQUIRE(ref.ok());
    const auto want = weights_of(whole / "out/checkpoints/last.pt");
    for (const bool truncate : {true, false}) {
      CAPTURE(truncate);
      TempDir dir;
      REQUIRE(run_workers("reliability_resume", 2, dir.str(), {{"EPOCHS", "2"}})
                  .ok());
      const auto last = dir / "out/checkpoints/last.pt";
      REQUIRE(fs::exists(dir / "out/checkpoints/last-prev.pt"));
      std::string bytes = read_file(last);
      if (truncate) {
        bytes.resize(bytes.size() / 2);
      } else {
        // One bit inside the largest tensor record.
        std::string problem;
        const auto entries = ddpkit::detail::read_zip_entries(bytes, problem);
        REQUIRE(problem.empty());
        const ddpkit::detail::ZipEntry* big = nullptr;
        for (const auto& e : entries) {
          if (e.name.find("/data/") != std::string::npos &&
              (!big || e.size > big->size)) {
            big = &e;
          }
        }
        REQUIRE(big);
        bytes[big->offset + big->size / 2] ^= 0x10;
      }
      std::ofstream(last, std::ios::binary | std::ios::trunc) << bytes;
      auto res =
          run_workers("reliability_resume", 2, dir.str(), {{"EPOCHS", "3"}});
      CAPTURE(res.message);
      REQUIRE(res.ok());
      const auto got = weights_of(last);
      CHECK(torch::allclose(got, want, 0, 1e-6));
    }
  }

  TEST_CASE(
      "an image folder's fingerprint: a file added, replaced or a class "
      "renamed changes it; the difference names the classes") {
    TempDir dir;
    const auto root = dir / "flowers";
    testing::make_jpeg_folder(
        root, testing::JpegFolderOptions().images_per_class(6).classes(
                  {"daisy", "roses"}));
    auto opts = data::ImageFolderOptions().val_ratio(0.2);
    auto fp = [&] {
      return data::read_image_folder(root, opts).train.fingerprint();
    };
    const auto first = data::read_image_folder(root, opts).train;
    const auto before = first.fingerprint();
    CHECK(before.rfind("files:", 0) == 0);
    CHECK(before.find(";daisy=5;roses=5") != std::string::npos);
    CHECK(fp() == before);  // read again: the same
    // 10 images in daisy: 8 train, 2 validation.
    for (int k = 0; k < 4; ++k) {
      fs::copy_file(root / "daisy" / "daisy_0.jpg",
                    root / "daisy" / ("extra" + std::to_string(k) + ".jpg"));
    }
    const auto added = fp();
    CHECK(train::fingerprint_identity(added) !=
          train::fingerprint_identity(before));
    CHECK(train::fingerprint_difference(before, added) ==
          "class 'daisy' 5 -> 8 files");
    // Same count, other contents: a training file grown.
    for (int k = 0; k < 4; ++k) {
      fs::remove(root / "daisy" / ("extra" + std::to_string(k) + ".jpg"));
    }
    std::ofstream(first.samples().at(0).path, std::ios::app) << "tail";
    const auto replaced = fp();
    CHECK(train::fingerprint_identity(replaced) !=
          train::fingerprint_identity(before));
    CHECK(train::fingerprint_difference(before, replaced).empty());
    fs::rename(root / "roses", root / "tulips");
    CHECK(train::fingerprint_difference(before, fp()) ==
          "class 'roses' gone (had 5 files), class 'tulips' new (5 files)");
    // An identity alone (a checkpoint from before the per-class counts)
    // still compares by its hash and describes nothing.
    CHECK(train::fingerprint_difference("files:0123", before).empty());
    CHECK(train::fingerprint_identity("files:0123") == "files:0123");
  }

  TEST_CASE("a checksum mismatch inside a checkpoint is named") {
    TempDir dir;
    train::Checkpoint c;
    c.write("v", torch::arange(1000, torch::kFloat32));
    train::atomic_save(c, dir / "c.pt");
    std::string bytes = read_file(dir / "c.pt");
    // Flip one bit of the tensor's data (its 4000 bytes are the largest
    // stretch of the file).
    const auto at = bytes.find(std::string("\x00\x00\x80\x3f", 4));  // 1.0f
    REQUIRE(at != std::string::npos);
    bytes[at + 3] ^= 0x01;
    std::ofstream(dir / "c.pt", std::ios::binary | std::ios::trunc) << bytes;
    CHECK_THROWS_WITH_AS(train::open_checkpoint(dir / "c.pt"),
                         doctest::Contains("whose bytes do not match its "
                                           "checksum"),
                         UsageError);
  }
}

}  // namespace reliability_cases
