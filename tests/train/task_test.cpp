// Tasks other than classification, and datasets of samples: a regression
// model through DDP equals one process on the joined batch (weights and
// every metric, so metrics must be summed across ranks); variable-length
// sequences padded by a collate step count only their real tokens; a
// monitored metric must exist and say its direction.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../support.hpp"
#include "ddpkit/ddpkit.hpp"

using namespace ddpkit;
using ddpkit::test::run_workers;
using ddpkit::test::TempDir;
namespace fs = std::filesystem;

namespace {

/// y = x · w + 0.1 sin(3 x0): 4 features, one target, a sample at a time
/// (each `delay` late: a straggling rank's data).
struct RegressionSet {
  torch::Tensor x, y;
  std::chrono::milliseconds delay{0};
  std::size_t size() const {
    return static_cast<std::size_t>(x.size(0));
  }
  data::Example get(std::size_t i) const {
    if (delay.count() > 0) std::this_thread::sleep_for(delay);
    const auto k = static_cast<int64_t>(i);
    return {x[k], y[k]};
  }
};

RegressionSet make_regression(int64_t n, std::uint64_t seed) {
  auto gen = ddpkit::detail::make_generator(seed);
  auto x = torch::randn({n, 4}, gen, torch::kFloat32);
  auto w = torch::tensor({0.5, -1.0, 2.0, 0.25}, torch::kFloat32);
  auto y = (x.matmul(w) + 0.1 * torch::sin(3 * x.select(1, 0))).unsqueeze(1);
  return {x, y, {}};
}

struct RegressorImpl : torch::nn::Cloneable<RegressorImpl> {
  RegressorImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(4, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (skip_forward > 0 && --skip_forward == 0) {
      // A batch "skipped": an output that does not come from the
      // parameters, so backward launches none of their all-reduces.
      std::ofstream(test::worker_dir() / "skipped")
          << dist::FlightRecorder::now_us() << "\n";
      return torch::zeros({x.size(0), 1}, torch::requires_grad());
    }
    return fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  /// > 0: the forward call that many calls from now skips the batch (the
  /// desync test's rank 1).
  static inline int skip_forward = 0;
};
TORCH_MODULE(Regressor);

constexpr int kEpochs = 3;

TrainerOptions regression_options(const fs::path& out) {
  return TrainerOptions()
      .epochs(kEpochs)
      .lr(0.05)
      .out_dir(out.string())
      .seed(7)
      .verbose(false)
      .tensorboard(false)
      .run_name("regression");
}

train::OptimizerFactory sgd_momentum() {
  return [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.05).momentum(0.9));
  };
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  return std::string((std::istreambuf_iterator<char>(in)), {});
}

c10::Dict<c10::IValue, c10::IValue> model_of(const fs::path& ckpt) {
  auto archive = train::open_checkpoint(ckpt);
  c10::IValue v;
  archive.read("model", v);
  return v.toGenericDict();
}

/// The history as "name value" lines, in order.
std::string history_text(const train::FitResult& r) {
  std::ostringstream os;
  os.precision(17);
  for (const auto& m : r.history) {
    for (const auto& [k, v] : m.task) os << k << " " << v << "\n";
  }
  return os.str();
}

std::vector<std::pair<std::string, double>> parse_history(
    const std::string& text) {
  std::vector<std::pair<std::string, double>> out;
  std::istringstream in(text);
  std::string k;
  double v;
  while (in >> k >> v) out.emplace_back(k, v);
  return out;
}

}  // namespace

/// A model of two inputs: forward(x, g), the second gating the hidden
/// layer; its samples' input is a tuple of the two tensors.
struct TwoInputSet {
  torch::Tensor x, g, y;
  struct Sample {
    std::tuple<torch::Tensor, torch::Tensor> input;
    torch::Tensor target;
  };
  std::size_t size() const {
    return static_cast<std::size_t>(x.size(0));
  }
  Sample get(std::size_t i) const {
    const auto k = static_cast<int64_t>(i);
    return {{x[k], g[k]}, y[k]};
  }
};

TwoInputSet make_two_input(int64_t n, std::uint64_t seed) {
  auto base = make_regression(n, seed);
  auto gen = ddpkit::detail::make_generator(seed + 100);
  auto g = torch::randn({n, 2}, gen, torch::kFloat32);
  return {base.x, g, base.y + 0.5 * g.select(1, 0).unsqueeze(1)};
}

struct TwoInputImpl : torch::nn::Cloneable<TwoInputImpl> {
  TwoInputImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(4, 16));
    gate = register_module("gate", torch::nn::Linear(2, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 1));
  }
  torch::Tensor forward(torch::Tensor x, torch::Tensor g) {
    return fc2(torch::tanh(fc1(x)) * torch::sigmoid(gate(g)));
  }
  torch::nn::Linear fc1{nullptr}, gate{nullptr}, fc2{nullptr};
};
TORCH_MODULE(TwoInput);

/// DDP at world 2 where rank 1 reads its samples 25 ms late each (4 per
/// step: 0.1 s a step later than rank 0).
DDPKIT_WORKER(task_straggler_ddp) {
  auto g = test::worker_group();
  torch::manual_seed(1);
  RegressionSet train_set = make_regression(40, 1);
  if (g.rank() == 1) train_set.delay = std::chrono::milliseconds(25);
  const RegressionSet val_set = make_regression(9, 2);
  DDPTrainer<Regressor, PlainBN, NoScaling, ShardedEval, Regression> trainer(
      Regressor(), sgd_momentum(),
      regression_options(test::worker_dir() / "out").epochs(2), g);
  const auto r =
      trainer.fit(train_set, val_set, data::LoaderOptions(4).workers(0));
  std::ofstream(test::worker_dir() / ("slowest" + std::to_string(g.rank())))
      << r.slowest_rank << " " << r.rank_wait_seconds.size();
  return 0;
}

/// The liveness watch in a real DDP fit. `T_FAULT=skip`: rank 1 skips its
/// third batch (its gradient all-reduces never start). `T_FAULT=slow-write`:
/// rank 0 sleeps 10 s inside its first checkpoint write (between the
/// temporary file's fsync and the rename) while rank 1 waits for it.
/// `T_FAULT=slow-data`: rank 1's loader takes 7 s for the one epoch's one
/// batch (0.7 s a sample) while rank 0 waits for it.
DDPKIT_WORKER(task_liveness_fault) {
  auto g = test::worker_group();
  const std::string fault = std::getenv("T_FAULT");
  const auto out = test::worker_dir() / "out";
  if (fault == "skip" && g.rank() == 1) RegressorImpl::skip_forward = 3;
  if (fault == "slow-write" && g.rank() == 0) {
    train::before_rename_hook() = [out, slept = false]() mutable {
      std::error_code ec;
      for (const auto& f : fs::directory_iterator(out / "checkpoints", ec)) {
        const auto name = f.path().filename().string();
        if (!slept && name.rfind("last.pt.tmp-", 0) == 0) {
          slept = true;
          std::ofstream(test::worker_dir() / "slept");
          std::this_thread::sleep_for(std::chrono::seconds(10));
          return;
        }
      }
    };
  }
  torch::manual_seed(1);
  RegressionSet train_set = make_regression(20, 1);
  const RegressionSet val_set = make_regression(9, 2);
  const bool slow_data = fault == "slow-data";
  if (slow_data && g.rank() == 1) {
    train_set.delay = std::chrono::milliseconds(700);
  }
  DDPTrainer<Regressor, PlainBN, NoScaling, ShardedEval, Regression> trainer(
      Regressor(), sgd_momentum(),
      regression_options(out).epochs(slow_data ? 1 : 2), g);
  const auto r = trainer.fit(
      train_set, val_set, data::LoaderOptions(slow_data ? 10 : 2).workers(0));
  return r.history.size() == (slow_data ? 1u : 2u) ? 0 : 1;
}

/// DDP at world 2 on `Model` and the sets `make(n, seed)` gives, 10
/// samples per rank per step (one step per epoch), regression with sharded
/// evaluation; each rank writes its history.
template <class Model, class Policy = DDP, class MakeSet>
int regression_ddp_worker(MakeSet make) {
  auto g = test::worker_group();
  torch::manual_seed(1);
  auto train_set = make(20, 1), val_set = make(9, 2);
  Trainer<Model, Policy, DistributedSampling, PlainBN, NoScaling, ShardedEval,
          Regression>
      trainer(Model(), sgd_momentum(),
              regression_options(test::worker_dir() / "out"), g);
  auto r = trainer.fit(train_set, val_set, data::LoaderOptions(10).workers(0));
  std::ofstream(test::worker_dir() / ("history" + std::to_string(g.rank())))
      << history_text(r);
  return 0;
}

DDPKIT_WORKER(task_regression_ddp) {
  return regression_ddp_worker<Regressor>(make_regression);
}
// ZeRO-1: the optimizer state sharded, consolidated on rank 0 for each
// epoch's checkpoint.
DDPKIT_WORKER(task_regression_zero) {
  return regression_ddp_worker<Regressor, ZeRO1>(make_regression);
}
// ZeRO-2: gradients sharded too (each rank holds its own after a step).
DDPKIT_WORKER(task_regression_zero2) {
  return regression_ddp_worker<Regressor, ZeRO2>(make_regression);
}
DDPKIT_WORKER(task_two_inputs_ddp) {
  return regression_ddp_worker<TwoInput>(make_two_input);
}

TEST_SUITE("train") {
  TEST_CASE(
      "TrainerOptions::sampling reaches DistributedSampling: shuffle(false) "
      "trains in the dataset's order") {
    struct Recorded {
      RegressionSet base;
      std::shared_ptr<std::vector<std::size_t>> seen =
          std::make_shared<std::vector<std::size_t>>();
      std::size_t size() const {
        return base.size();
      }
      data::Example get(std::size_t i) const {
        seen->push_back(i);
        return base.get(i);
      }
    };
    auto order = [](bool shuffle) {
      TempDir out;
      Recorded train_set{make_regression(12, 1)},
          val_set{make_regression(4, 2)};
      auto opts = regression_options(out.path()).epochs(1);
      if (!shuffle)
        opts.sampling(data::DistributedSamplingOptions().shuffle(false));
      opts.run_name(TrainerOptions().run_name());  // the default
      DDPTrainer<Regressor, PlainBN, NoScaling, ShardedEval, Regression> t(
          Regressor(), sgd_momentum(), opts);
      t.fit(train_set, val_set, data::LoaderOptions(4).workers(0));
      // summary.json names no example for a run that named none.
      const auto summary = read_file(out.path() / "summary.json");
      CHECK(summary.find("\"run_name\": \"ddpkit\"") != std::string::npos);
      CHECK(summary.find("\"example\"") == std::string::npos);
      return *train_set.seen;
    };
    std::vector<std::size_t> in_order(12);
    std::iota(in_order.begin(), in_order.end(), std::size_t{0});
    CHECK(order(false) == in_order);
    CHECK(order(true) != in_order);  // the default shuffles
    CHECK_THROWS_WITH_AS(
        check_options(TrainerOptions().sampling(
            data::DistributedSamplingOptions().evaluation(true))),
        doctest::Contains("sampling().evaluation() is true"), UsageError);
  }
  TEST_CASE(
      "Regression through DDP (and ZeRO-1, ZeRO-2) at world 2 equals one "
      "process on "
      "the joined batch: weights and every metric (train and validation sums "
      "reduced "
      "across ranks)") {
    TempDir single;
    torch::manual_seed(1);
    auto train_set = make_regression(20, 1), val_set = make_regression(9, 2);
    SingleDeviceTrainer<Regressor, RankZeroEval, Regression> t(
        Regressor(), sgd_momentum(), regression_options(single.path()));
    const auto ref =
        t.fit(train_set, val_set, data::LoaderOptions(20).workers(0));
    REQUIRE(ref.history.size() == kEpochs);
    CHECK(ref.monitor.name == "val_loss");
    CHECK(ref.monitor.goal == train::Goal::min);
    // It learns: the validation loss falls.
    CHECK(ref.history.back().val_loss() < ref.history.front().val_loss());
    // metrics.jsonl names the task's metrics.
    const auto jsonl = read_file(single / "metrics.jsonl");
    CHECK(jsonl.find("\"train_mae\":") != std::string::npos);
    CHECK(jsonl.find("\"val_mae\":") != std::string::npos);
    CHECK(jsonl.find("acc") == std::string::npos);
    const auto summary = read_file(single / "summary.json");
    CHECK(summary.find("\"task\": \"regression\"") != std::string::npos);
    CHECK(summary.find("\"best_val_loss\":") != std::string::npos);
    // No batch norm in the model: no BN policy to name.
    CHECK(summary.find("\"bn\": \"none\"") != std::string::npos);

    // summary.json's measured memory per rank: "key":[a,b] in its
    // memory_bytes_per_rank object.
    auto memory = [](const std::string& summary, const std::string& key) {
      std::vector<double> v;
      const auto at = summary.find("\"" + key + "\":[");
      if (at == std::string::npos) return v;
      std::istringstream in(summary.substr(at + key.size() + 4));
      double x = 0;
      char sep = ',';
      while (sep == ',' && in >> x >> sep) v.push_back(x);
      return v;
    };
    std::vector<double> ddp_state, ddp_grads;
    for (const char* worker : {"task_regression_ddp", "task_regression_zero",
                               "task_regression_zero2"}) {
      CAPTURE(worker);
      TempDir dir;
      auto res = run_workers(worker, 2, dir.str());
      CAPTURE(res.message);
      REQUIRE(res.ok());
      const auto want = parse_history(history_text(ref));
      for (int rank = 0; rank < 2; ++rank) {
        CAPTURE(rank);
        const auto got =
            parse_history(read_file(dir / ("history" + std::to_string(rank))));
        REQUIRE(got.size() == want.size());
        for (std::size_t i = 0; i < got.size(); ++i) {
          CAPTURE(got[i].first);
          CHECK(got[i].first == want[i].first);
          CHECK(std::abs(got[i].second - want[i].second) <=
                1e-5 * std::abs(want[i].second));
        }
      }
      // Memory per rank, measured: ZeRO splits the optimizer state (and
      // ZeRO-2 the gradients) that DDP keeps whole on every rank.
      const auto summary = read_file(dir / "out/summary.json");
      const auto state = memory(summary, "optimizer_state");
      const auto grads = memory(summary, "gradients_peak");
      MESSAGE(std::string(worker), ": optimizer state ", state[0], " + ",
              state[1], " bytes, gradients ", grads[0], " / ", grads[1]);
      REQUIRE(state.size() == 2);
      REQUIRE(grads.size() == 2);
      if (std::string(worker) == "task_regression_ddp") {
        ddp_state = state;
        ddp_grads = grads;
        CHECK(state[0] > 0);
        CHECK(state[0] == state[1]);
      } else {
        CHECK(state[0] + state[1] == ddp_state[0]);
        CHECK(std::max(state[0], state[1]) < ddp_state[0]);
      }
      // (A model this small has two gradient buckets, one per owner, and
      // ZeRO-2 holds up to two others' while backward runs: its peak is
      // DDP's here. The parallel suite measures the bound on a deeper
      // model.)
      CHECK(std::max(grads[0], grads[1]) <= ddp_grads[0]);
      auto a = model_of(single / "checkpoints/last.pt");
      auto b = model_of(dir / "out/checkpoints/last.pt");
      for (auto& kv : a) {
        CAPTURE(kv.key().toStringRef());
        auto x = kv.value().toTensor(), y = b.at(kv.key()).toTensor();
        CHECK(((x - y).abs().max() / x.abs().max()).item<double>() < 1e-5);
      }
    }
  }

  TEST_CASE(
      "variable-length sequences: PadSequences pads to the longest, and "
      "LanguageModel counts only real tokens in loss, accuracy and "
      "perplexity") {
    // Three sequences of 2, 4 and 3 tokens over a vocabulary of 5.
    std::vector<data::Example> samples;
    for (int64_t len : {2, 4, 3}) {
      auto x = torch::arange(len, torch::kInt64).remainder(5);
      samples.push_back({x, (x + 1).remainder(5)});
    }
    torch::Generator gen = ddpkit::detail::make_generator(0);
    const data::Batch b = data::PadSequences{}(samples, gen);
    REQUIRE(b.data.sizes() == torch::IntArrayRef({3, 4}));
    CHECK(b.target[0][2].item<int64_t>() == -100);
    CHECK(b.target[0][3].item<int64_t>() == -100);
    CHECK(b.data[0][3].item<int64_t>() == 0);
    CHECK(b.target[1][3].item<int64_t>() == 4);

    // Logits that put weight 2 on the right token of every real position.
    auto logits = torch::zeros({3, 4, 5});
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t t = 0; t < 4; ++t) {
        const auto y = b.target[i][t].item<int64_t>();
        if (y >= 0) logits[i][t][y] = 2.0;
      }
    }
    // Padded positions get garbage that must not count.
    logits.select(1, 3).index_put_({0}, torch::full({5}, 50.0));
    const train::LanguageModel task;
    const double per_token = -std::log(std::exp(2.0) / (std::exp(2.0) + 4));
    const double loss = task.loss(logits, b.target).item<double>();
    CHECK(loss == doctest::Approx(per_token).epsilon(1e-6));
    const auto s = task.sums(logits, b.target, loss);
    CHECK(s[2] == 9);  // 2 + 4 + 3 real tokens
    CHECK(s[1] == 9);  // all right
    const auto e = train::evaluation_sums(task, logits, b.target);
    CHECK(e[0] == doctest::Approx(9 * per_token).epsilon(1e-6));
    const auto m = task.finish(e);
    CHECK(m[0] == doctest::Approx(per_token).epsilon(1e-6));
    CHECK(m[1] == doctest::Approx(std::exp(per_token)).epsilon(1e-6));
    CHECK(m[2] == 1.0);
    // A model whose output does not fit the target is named.
    CHECK_THROWS_WITH_AS(task.loss(torch::zeros({3, 5}), b.target),
                         doctest::Contains("LanguageModel: the model's output "
                                           "has shape [3, 5]"),
                         UsageError);
  }

  TEST_CASE(
      "liveness in a DDP fit: a rank that skips a batch is told as a desync "
      "within 10 s at the default settings, both collectives named; rank 0 "
      "writing a checkpoint or rank 1's loader stalled longer than the "
      "silence limit is no false alarm") {
    DDPKIT_REQUIRE_BUILD(dist::compat::can_clone_store,
                         "libtorch < 2.5 cannot clone a store: no liveness "
                         "watch");
    SUBCASE("a skipped batch") {
      TempDir dir;
      auto [res, secs] = test::timed_run_workers(
          "task_liveness_fault", 2, dir.str(),
          {{"T_FAULT", "skip"}, {"DDPKIT_DOCTOR", test::doctor_script()}});
      CHECK(res.exit_code == kPeerFailureExitCode);
      long long skipped_us = 0;
      std::ifstream(dir / "skipped") >> skipped_us;
      REQUIRE(skipped_us > 0);
      for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        const auto path =
            dir / "out" / "flight" / ("rank-" + std::to_string(r) + ".json");
        REQUIRE(fs::exists(path));
        const auto record = read_file(path);
        const auto reason = record.substr(0, record.find("\"time_us\""));
        CAPTURE(reason);
        CHECK(reason.find("\"reason\": \"desync at collective #") !=
              std::string::npos);
        // Rank 1 went on to the step's agreement while rank 0 waits in the
        // gradients' all-reduce.
        CHECK(reason.find("rank 1 all_reduce") != std::string::npos);
        CHECK(reason.find("(step agreement)") != std::string::npos);
        CHECK(reason.find("(bucket 0)") != std::string::npos);
        const auto at = record.find("\"time_us\": ");
        REQUIRE(at != std::string::npos);
        const double took =
            static_cast<double>(std::stoll(record.substr(at + 11)) -
                                skipped_us) /
            1e6;
        MESSAGE("rank ", r, " told of the desync ", took,
                " s after rank 1 skipped its batch");
        CHECK(took < 10);
      }
      // One of the ranks ran ddpkit-doctor on both records (and printed
      // the first line).
      const auto verdict = dir / "out" / "flight" / "verdict.txt";
      REQUIRE(fs::exists(verdict));
      const auto report = read_file(verdict);
      CAPTURE(report);
      CHECK(report.rfind("fault: collective #", 0) == 0);
    }
    SUBCASE("a data loader stalled 7 s on one rank (silence limit 3 s)") {
      TempDir dir;
      auto res = run_workers(
          "task_liveness_fault", 2, dir.str(),
          {{"T_FAULT", "slow-data"}, {"DDPKIT_LIVENESS_TIMEOUT", "3"}});
      CHECK(res.ok());
      CHECK(res.message == "");
    }
    SUBCASE("a checkpoint write of 10 s (silence limit 3 s)") {
      TempDir dir;
      auto res = run_workers(
          "task_liveness_fault", 2, dir.str(),
          {{"T_FAULT", "slow-write"}, {"DDPKIT_LIVENESS_TIMEOUT", "3"}});
      CHECK(res.ok());
      CHECK(res.message == "");
      CHECK(fs::exists(dir / "slept"));
      CHECK(fs::exists(dir / "out" / "checkpoints" / "last.pt"));
    }
  }

  TEST_CASE(
      "the loader collates samples: Stack by default, a given collate step "
      "otherwise, with the same batches for any number of workers") {
    auto set = make_regression(10, 3);
    data::Loader stack(set, data::Stack{}, data::LoaderOptions(4).workers(2));
    std::vector<data::Batch> got;
    for (data::Batch b : stack.epoch({9, 8, 7, 6, 5, 4, 3, 2, 1, 0}, 0)) {
      got.push_back(b);
    }
    REQUIRE(got.size() == 3);
    CHECK(got[0].data.sizes() == torch::IntArrayRef({4, 4}));
    CHECK(got[2].target.sizes() == torch::IntArrayRef({2, 1}));
    CHECK(torch::equal(got[0].data[1], set.x[8]));
    CHECK(torch::equal(got[2].target[1], set.y[0]));
  }

  TEST_CASE(
      "the monitored metric: any column of the task, its direction said or "
      "implied; anything else is refused naming the columns") {
    TempDir dir;
    auto make = [&](const std::string& name, const std::string& mode) {
      SingleDeviceTrainer<Regressor, RankZeroEval, Regression> t(
          Regressor(), sgd_momentum(),
          regression_options(dir.path())
              .monitor(name)
              .monitor_mode(mode)
              .overwrite(true));  // one folder for every try
      return t
          .fit(make_regression(8, 1), make_regression(4, 2),
               data::LoaderOptions(4).workers(0))
          .monitor;
    };
    CHECK_THROWS_WITH_AS(
        make("val_acc", ""),
        doctest::Contains("monitor 'val_acc': the task regression has "
                          "train_loss, train_mae, val_loss, val_mae"),
        UsageError);
    CHECK_THROWS_WITH_AS(make("val_mae", ""),
                         doctest::Contains("say whether lower or higher"),
                         UsageError);
    CHECK_THROWS_WITH_AS(make("val_mae", "down"),
                         doctest::Contains("expected min or max"), UsageError);
    const auto m = make("val_mae", "min");
    CHECK(m.name == "val_mae");
    CHECK(m.goal == train::Goal::min);
    CHECK(make("train_loss", "").goal == train::Goal::min);
  }

  TEST_CASE(
      "a model of two inputs (forward(x, g), samples with a tuple input): "
      "DDP at world 2 and DataParallel over 2 replicas equal one process on "
      "the joined batch; collate stacks each input; counts that do not fit "
      "are named") {
    // The collate step stacks input by input into data and extra.
    auto set = make_two_input(6, 3);
    std::vector<TwoInputSet::Sample> samples{set.get(0), set.get(4)};
    torch::Generator gen = ddpkit::detail::make_generator(0);
    const data::Batch b = data::Stack{}(samples, gen);
    REQUIRE(b.extra.size() == 1);
    CHECK(torch::equal(b.data[1], set.x[4]));
    CHECK(torch::equal(b.extra[0][1], set.g[4]));
    CHECK(b.inputs().size() == 2);
    // Samples with different numbers of inputs are refused, naming both.
    std::vector<std::pair<data::Inputs, torch::Tensor>> mixed{
        {data::Inputs{set.x[0], set.g[0]}, set.y[0]},
        {data::Inputs(set.x[1]), set.y[1]}};
    CHECK_THROWS_WITH_AS(
        data::Stack{}(mixed, gen),
        doctest::Contains("sample 1 of the batch has 1 input tensor(s), the "
                          "first has 2"),
        UsageError);
    // A count the model's forward does not take is named.
    TwoInput net;
    CHECK_THROWS_WITH_AS(
        data::forward_inputs(net, data::Inputs{b.data, b.extra[0], b.data}),
        doctest::Contains("called with 3 input tensor(s)"), UsageError);
    CHECK_THROWS_WITH_AS(
        data::forward_inputs(net,
                             data::Inputs{b.data, b.extra[0].narrow(0, 0, 1)}),
        doctest::Contains("differ in their first (batch) dimension"),
        UsageError);

    TempDir single;
    torch::manual_seed(1);
    auto train_set = make_two_input(20, 1), val_set = make_two_input(9, 2);
    // One replica: one process on the joined batch (the same Trainer type
    // as the two-replica run below, one compilation fewer).
    DataParallelTrainer<TwoInput, RankZeroEval, Regression> t(
        TwoInput(), sgd_momentum(), regression_options(single.path()), {},
        parallel::DataParallelOptions().replicas(1), torch::kCPU);
    const auto ref =
        t.fit(train_set, val_set, data::LoaderOptions(20).workers(0));
    REQUIRE(ref.history.size() == kEpochs);
    CHECK(ref.history.back().val_loss() < ref.history.front().val_loss());
    const auto want = parse_history(history_text(ref));
    auto same_history = [&](const std::string& text) {
      const auto got = parse_history(text);
      REQUIRE(got.size() == want.size());
      for (std::size_t i = 0; i < got.size(); ++i) {
        CAPTURE(got[i].first);
        CHECK(got[i].first == want[i].first);
        CHECK(std::abs(got[i].second - want[i].second) <=
              1e-5 * std::abs(want[i].second));
      }
    };
    auto same_weights = [&](const fs::path& ckpt) {
      auto a = model_of(single / "checkpoints/last.pt");
      auto w = model_of(ckpt);
      for (auto& kv : a) {
        CAPTURE(kv.key().toStringRef());
        auto x = kv.value().toTensor(), y = w.at(kv.key()).toTensor();
        CHECK(((x - y).abs().max() / x.abs().max()).item<double>() < 1e-5);
      }
    };

    SUBCASE("DataParallel, 2 replicas on the CPU") {
      TempDir dp;
      torch::manual_seed(1);
      DataParallelTrainer<TwoInput, RankZeroEval, Regression> d(
          TwoInput(), sgd_momentum(), regression_options(dp.path()), {},
          parallel::DataParallelOptions().replicas(2), torch::kCPU);
      const auto r =
          d.fit(train_set, val_set, data::LoaderOptions(20).workers(0));
      CHECK(d.engine().last_split() == std::vector<int64_t>{10, 10});
      same_history(history_text(r));
      same_weights(dp / "checkpoints/last.pt");
    }
    SUBCASE("DDP at world 2") {
      TempDir dir;
      auto res = run_workers("task_two_inputs_ddp", 2, dir.str());
      CAPTURE(res.message);
      REQUIRE(res.ok());
      for (int rank = 0; rank < 2; ++rank) {
        CAPTURE(rank);
        same_history(read_file(dir / ("history" + std::to_string(rank))));
      }
      same_weights(dir / "out/checkpoints/last.pt");
    }
  }

  TEST_CASE(
      "stragglers: each rank's wait for the others per epoch is in "
      "metrics.jsonl, and the summary names the rank the others waited for "
      "(rank 1 of 2 reads its data 0.1 s a step late)") {
    TempDir dir;
    auto res = run_workers("task_straggler_ddp", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    const auto jsonl = read_file(dir / "out/metrics.jsonl");
    CAPTURE(jsonl);
    std::istringstream lines(jsonl);
    std::string line;
    int rows = 0;
    while (std::getline(lines, line)) {
      ++rows;
      const auto at = line.find("\"wait_seconds\":[");
      REQUIRE(at != std::string::npos);
      double w0 = 0, w1 = 0;
      char comma = 0;
      std::istringstream(line.substr(at + 16)) >> w0 >> comma >> w1;
      // 5 steps an epoch, each 0.1 s late on rank 1: rank 0 waits for it.
      CHECK(w0 > 0.3);
      CHECK(w1 < w0 / 3);
      CHECK(line.find("\"slowest_rank\":1") != std::string::npos);
    }
    CHECK(rows == 2);
    const auto summary = read_file(dir / "out/summary.json");
    CAPTURE(summary);
    CHECK(summary.find("\"slowest_rank\": 1") != std::string::npos);
    CHECK(summary.find("\"wait_seconds_per_rank\": [") != std::string::npos);
    // Every rank holds the same verdict.
    CHECK(read_file(dir / "slowest0") == "1 2");
    CHECK(read_file(dir / "slowest1") == "1 2");
  }
}

// The "reliability" suite, in this translation unit (see its header).
#include "reliability_cases.hpp"  // NOLINT(build/include)
