// ZeRO-3 (include/ddpkit/parallel/zero/zero3.hpp, nn/unit.hpp): workers and
// cases of the "parallel" suite, included by parallel_test.cpp after
// zero_cases.hpp (whose helpers they use).
#pragma once

#include "ddpkit/testing/memory_cap.hpp"

namespace {

constexpr int kZero3Steps = 20;

/// One rank's UnitNet run: `T_MODE` ddp (the user's optimizer over every
/// parameter, nn::Unit a no-op) or zero3; `T_OPT` sgd or adamw, `T_ACCUM=1`
/// two micro-batches a step, `T_CLIP=1` global norm clipped to 0.5,
/// `T_BN=1` SyncBN after the stem, `T_TIED=1` a weight tied across a unit
/// and the root, `T_KEEP=1` reshard_after_forward off. Writes `net{r}.pt`
/// (ZeRO-3: with every unit gathered), and for ZeRO-3 `mem{r}`: the bytes
/// of its shards, of the whole model's parameters, the most bytes held
/// gathered at once, the largest unit's and the root unit's bytes, and
/// whether the parameters' memory was released between steps (1/0), and
/// the gathers prefetched (`T_PREFETCH=0`: prefetch off).
template <class Net>
int zero3_run(Net net, const dist::Group& g, const std::string& mode) {
  const int r = g.rank(), w = g.size();
  const std::string kind = env_or("T_OPT", "sgd");
  const bool accum = env_or("T_ACCUM", "0") == "1";
  const bool clip = env_or("T_CLIP", "0") == "1";
  const auto dir = test::worker_dir();
  const std::string load = env_or("T_LOAD", "");
  // Half way every rank consolidates and rank 0 saves the net and the whole
  // optimizer state (half-net.pt, half-opt.pt); T_LOAD=DIR starts from
  // DIR's instead (the weights loaded before the engine is built, as the
  // Trainer's resume does; T_NOOPT=1 without the optimizer's state).
  if (!load.empty()) {
    torch::load(net, (std::filesystem::path(load) / "half-net.pt").string());
  }
  auto run = [&](auto& eng, torch::optim::Optimizer& opt, auto save_half) {
    int first = 0;
    if (!load.empty()) {
      if (env_or("T_NOOPT", "0") != "1") {
        torch::serialize::InputArchive a;
        a.load_from((std::filesystem::path(load) / "half-opt.pt").string());
        opt.load(a);
      }
      first = kZero3Steps / 2;
    }
    for (int s = first; s < kZero3Steps; ++s) {
      if (s == kZero3Steps / 2 && load.empty()) save_half();
      if constexpr (requires { eng.reset_peaks(); }) {
        // The steps' peak, not the checkpoint's (its parameters are whole
        // until the next step's forward).
        if (s == kZero3Steps / 2 + 1) eng.reset_peaks();
      }
      auto [x, y] = test::global_batch(s, w * kZeroPerRank);
      auto xr = x.narrow(0, r * kZeroPerRank, kZeroPerRank);
      auto yr = y.narrow(0, r * kZeroPerRank, kZeroPerRank);
      eng.zero_grad();
      if (accum) {
        const int64_t half = kZeroPerRank / 2;
        auto loss_half = [](const torch::Tensor& o, const torch::Tensor& t) {
          return test::ce_loss(o, t) * 0.5;
        };
        {
          auto guard = eng.no_sync();
          eng.forward_backward(xr.narrow(0, 0, half), yr.narrow(0, 0, half),
                               loss_half);
        }
        eng.forward_backward(xr.narrow(0, half, half), yr.narrow(0, half, half),
                             loss_half);
      } else {
        eng.forward_backward(xr, yr, test::ce_loss);
      }
      if (clip) {
        if constexpr (requires { eng.clip_grad_norm(0.5); }) {
          eng.clip_grad_norm(0.5);
        } else {
          // Each tensor once (a tied weight's gradient counted once).
          torch::nn::utils::clip_grad_norm_(parallel::unique_parameters(*net),
                                            0.5);
        }
      }
      opt.step();
    }
  };
  // AdamW's eps 1e-3, not 1e-8: Adam divides each step by sqrt(v) + eps,
  // so a gradient element near rounding level becomes a step near the
  // learning rate's size. DDP's all-reduce and ZeRO-3's reduce-scatter sum
  // the ranks' gradients in different orders at world 4, and with SyncBN
  // after the stem that showed as 4.1e-5 (stem.weight) on libtorch 1.13 at
  // eps 1e-8, 9.0e-7 at 1e-6, 2.8e-7 at 1e-3; SGD on the same case: 4.6e-7.
  // A dropped or misplaced gradient shard still moves the weights by the
  // gradient's own size.
  auto factory = [&](std::vector<torch::Tensor> p) {
    return zero_optimizer(kind, std::move(p), 1e-3);
  };
  const auto out = dir / ("net" + std::to_string(r) + ".pt");
  if (mode == "zero3") {
    parallel::ZeRO3Options o;
    o.reshard_after_forward(env_or("T_KEEP", "0") != "1");
    o.prefetch(env_or("T_PREFETCH", "1") == "1");
    typename parallel::ZeRO3::template engine<Net> eng(net, g, o, torch::kCPU);
    auto opt = eng.make_optimizer(factory);
    run(eng, *opt, [&] {
      eng.consolidate_optimizer();
      {
        auto whole_params = eng.whole_parameters();
        if (r == 0) {
          torch::serialize::OutputArchive a;
          opt->save(a);
          a.save_to((dir / "half-opt.pt").string());
          torch::save(net, (dir / "half-net.pt").string());
        }
      }
    });
    uint64_t whole = 0, largest = 0, root = 0;
    for (const auto& p : parallel::unique_parameters(*net)) {
      whole += p.numel() * p.element_size();
    }
    const int64_t esize = 4;
    for (const auto& [name, n] : eng.units()) {
      const uint64_t b = static_cast<uint64_t>(n) * esize;
      largest = std::max(largest, b);
      if (name.empty()) root = b;
    }
    // Between steps the parameters' memory is released.
    bool released = true;
    for (const auto& p : net->parameters()) {
      released = released && p.storage().nbytes() == 0;
    }
    std::ofstream(dir / ("mem" + std::to_string(r)))
        << eng.shard_bytes() << " " << whole << " " << eng.peak_gathered_bytes()
        << " " << largest << " " << root << " " << (released ? 1 : 0) << " "
        << eng.prefetches();
    auto whole_params = eng.whole_parameters();
    torch::save(net, out.string());
  } else {
    parallel::DDP::engine<Net> eng(net, g, {}, torch::kCPU);
    auto opt = factory(parallel::unique_parameters(*net));
    run(eng, *opt, [&] {
      if (r == 0) {
        torch::serialize::OutputArchive a;
        opt->save(a);
        a.save_to((dir / "half-opt.pt").string());
        torch::save(net, (dir / "half-net.pt").string());
      }
    });
    torch::save(net, out.string());
  }
  return 0;
}

}  // namespace

DDPKIT_WORKER(zero3_train) {
  auto g = test::worker_group();
  const bool bn = env_or("T_BN", "0") == "1";
  const bool tied = env_or("T_TIED", "0") == "1";
  auto net = test::make_unit_net(300 + g.rank(), bn, tied);
  if (bn) nn::SyncBN::apply(*net, g);
  return zero3_run(net, g, env_or("T_MODE", "zero3"));
}

TEST_SUITE("parallel") {
  TEST_CASE(
      "ZeRO-3 equals DDP over 20 steps (SGD with momentum and AdamW; with "
      "accumulation and clipping; nested units, a weight tied across a unit "
      "and the root, SyncBN; world 2 and 4), keeps 1/world of the "
      "parameters between steps with their memory released, and gathers at "
      "most the root and two nested units at once") {
    struct Case {
      int world;
      const char* opt;
      bool accum, clip, bn, tied, keep, prefetch;
    };
    for (const Case& c :
         {Case{2, "sgd", false, false, false, false, false, false},
          Case{2, "adamw", true, true, false, true, false, true},
          Case{2, "sgd", false, true, true, false, true, true},
          Case{4, "adamw", true, false, true, true, false, true}}) {
      CAPTURE(c.world);
      CAPTURE(c.opt);
      CAPTURE(c.accum);
      CAPTURE(c.clip);
      CAPTURE(c.bn);
      CAPTURE(c.tied);
      CAPTURE(c.keep);
      CAPTURE(c.prefetch);
      TempDir ddp, zero3;
      std::vector<std::pair<std::string, std::string>> env{
          {"T_OPT", c.opt},
          {"T_ACCUM", c.accum ? "1" : "0"},
          {"T_CLIP", c.clip ? "1" : "0"},
          {"T_BN", c.bn ? "1" : "0"},
          {"T_TIED", c.tied ? "1" : "0"},
          {"T_KEEP", c.keep ? "1" : "0"},
          {"T_PREFETCH", c.prefetch ? "1" : "0"}};
      auto with = [&](const char* mode) {
        auto e = env;
        e.emplace_back("T_MODE", mode);
        return e;
      };
      REQUIRE(run_workers("zero3_train", c.world, ddp.str(), with("ddp")).ok());
      REQUIRE(
          run_workers("zero3_train", c.world, zero3.str(), with("zero3")).ok());
      auto load = [&](const std::filesystem::path& p) {
        auto net = test::make_unit_net(0, c.bn, c.tied);
        torch::load(net, p.string());
        return net;
      };
      auto want = load(ddp / "net0.pt");
      // The runs moved the weights (a comparison of untouched weights
      // would pass whatever the engine did).
      CHECK(test::max_state_diff(
                *want, *test::make_unit_net(300, c.bn, c.tied)) > 1e-3);
      uint64_t total = 0, whole = 0;
      for (int r = 0; r < c.world; ++r) {
        CAPTURE(r);
        auto got = load(zero3 / ("net" + std::to_string(r) + ".pt"));
        const double d = test::max_state_diff(*got, *want);
        uint64_t shard = 0, peak = 0, largest = 0, root = 0, released = 0,
                 prefetched = 0;
        std::ifstream(zero3 / ("mem" + std::to_string(r))) >> shard >> whole >>
            peak >> largest >> root >> released >> prefetched;
        MESSAGE("ZeRO-3 ", std::string(c.opt),
                std::string(c.accum ? " accumulate" : ""),
                std::string(c.clip ? " clip" : ""),
                std::string(c.bn ? " SyncBN" : ""),
                std::string(c.tied ? " tied" : ""),
                std::string(c.keep ? " keep-after-forward" : ""),
                std::string(c.prefetch ? " prefetch" : ""), " world ", c.world,
                " rank ", r, ": max relative difference from DDP ", d,
                "; shard ", shard, " of ", whole,
                " parameter bytes; most gathered at once ", peak,
                " (largest unit ", largest, ", root ", root, "); ", prefetched,
                " gathers prefetched");
        CHECK(d <= 1e-6);
        CHECK(released == 1);
        // From the second step on, each unit but the first of a phase.
        CHECK((prefetched > 0) == c.prefetch);
        total += shard;
        // Padding: at most world - 1 elements a unit.
        CHECK(shard <= whole / c.world + 4 * 4 * c.world);
        // Never the whole model at once: the root and at most two nested
        // units (block and its inner Linear).
        if (!c.keep) {
          CHECK(peak < whole);
          CHECK(peak <= root + 2 * largest + 4 * 4 * c.world);
        }
      }
      CHECK(total >= whole);
    }
  }
}

TEST_SUITE("parallel") {
  TEST_CASE(
      "a ZeRO-3 checkpoint (model and optimizer state written half way at "
      "world 2, SGD with momentum and AdamW) is DDP's format: it resumes "
      "under ZeRO-3 and DDP at world 2 as the run that did not stop, and "
      "at world 1 and 4 the same under ZeRO-3 as under DDP (SGD)") {
    for (const char* opt : {"sgd", "adamw"}) {
      CAPTURE(opt);
      auto env = [&](const char* mode, const std::string& load,
                     bool noopt = false) {
        std::vector<std::pair<std::string, std::string>> e{
            {"T_OPT", opt}, {"T_MODE", mode}, {"T_TIED", "1"}};
        if (!load.empty()) e.emplace_back("T_LOAD", load);
        if (noopt) e.emplace_back("T_NOOPT", "1");
        return e;
      };
      auto load = [](const std::filesystem::path& p) {
        auto net = test::make_unit_net(0, false, true);
        torch::load(net, p.string());
        return net;
      };
      TempDir whole;
      REQUIRE(
          run_workers("zero3_train", 2, whole.str(), env("zero3", "")).ok());
      auto want = load(whole / "net0.pt");
      // It trained (a run that changed nothing would resume anywhere).
      CHECK(test::max_state_diff(*load(whole / "half-net.pt"), *want) > 1e-3);
      // The same world: both engines continue as if never stopped.
      for (const char* mode : {"zero3", "ddp"}) {
        CAPTURE(mode);
        TempDir resumed;
        REQUIRE(
            run_workers("zero3_train", 2, resumed.str(), env(mode, whole.str()))
                .ok());
        const double d =
            test::max_state_diff(*load(resumed / "net0.pt"), *want);
        MESSAGE(std::string(opt), ": ZeRO-3 world 2 checkpoint resumed under ",
                std::string(mode), " at world 2: max relative difference ", d);
        CHECK(d <= 1e-6);
      }
      // (CI time: the rest once, with SGD.)
      if (std::string(opt) != "sgd") continue;
      // Without the optimizer's state the run goes elsewhere (so the state
      // carried above mattered).
      TempDir fresh;
      REQUIRE(run_workers("zero3_train", 2, fresh.str(),
                          env("zero3", whole.str(), true))
                  .ok());
      CHECK(test::max_state_diff(*load(fresh / "net0.pt"), *want) > 1e-4);
      // Other world sizes: ZeRO-3 and DDP from the same checkpoint agree.
      for (int to : {1, 4}) {
        CAPTURE(to);
        TempDir z, d;
        REQUIRE(
            run_workers("zero3_train", to, z.str(), env("zero3", whole.str()))
                .ok());
        REQUIRE(run_workers("zero3_train", to, d.str(), env("ddp", whole.str()))
                    .ok());
        const double diff =
            test::max_state_diff(*load(z / "net0.pt"), *load(d / "net0.pt"));
        MESSAGE(std::string(opt), ": resumed at world ", to,
                ", ZeRO-3 vs DDP: max relative difference ", diff);
        CHECK(diff <= 1e-6);
      }
    }
  }
}

namespace {

/// Eight 512-wide Linear units: 8.4 MB of parameters, small activations
/// (the state, not the batch, is what does not fit).
struct WideNetImpl : torch::nn::Module {
  WideNetImpl() {
    for (int i = 0; i < 8; ++i) {
      layers.emplace_back(register_module("l" + std::to_string(i),
                                          torch::nn::Linear(512, 512)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l(x));
    return x;
  }
  std::vector<nn::Unit<torch::nn::Linear>> layers;
};
TORCH_MODULE(WideNet);

/// Under a cap of `T_CAP` bytes on the CPU allocator (installed before the
/// model exists), `T_MODE` ddp or zero3 trains WideNet with AdamW for 3
/// steps; writes `outcome{r}`: "trained PEAK" or "failed: WHAT".
DDPKIT_WORKER(zero3_capped) {
  auto& meter = testing::MeteredCpuAllocator::install();
  meter.set_cap(std::stoll(env_or("T_CAP", "0")));
  meter.reset_peak();
  auto g = test::worker_group();
  const int r = g.rank();
  std::string outcome;
  try {
    torch::manual_seed(7);
    WideNet net;
    auto factory = [](std::vector<torch::Tensor> p) {
      return std::make_unique<torch::optim::AdamW>(
          p, torch::optim::AdamWOptions(1e-3));
    };
    auto run = [&](auto& eng, torch::optim::Optimizer& opt) {
      for (int s = 0; s < 3; ++s) {
        auto x = torch::randn({4, 512});
        eng.zero_grad();
        eng.forward_backward(
            x, x, [](const torch::Tensor& o, const torch::Tensor& t) {
              return (o - t).pow(2).mean();
            });
        opt.step();
      }
    };
    if (env_or("T_MODE", "zero3") == "zero3") {
      parallel::ZeRO3::engine<WideNet> eng(net, g, {}, torch::kCPU);
      auto opt = eng.make_optimizer(factory);
      run(eng, *opt);
    } else {
      parallel::DDP::engine<WideNet> eng(net, g, {}, torch::kCPU);
      auto opt = factory(parallel::unique_parameters(*net));
      run(eng, *opt);
    }
    outcome = "trained " + std::to_string(meter.peak());
  } catch (const std::exception& e) {
    outcome = std::string("failed: ") + e.what();
  }
  std::ofstream(test::worker_dir() / ("outcome" + std::to_string(r)))
      << outcome;
  return 0;
}

}  // namespace

TEST_SUITE("parallel") {
  TEST_CASE(
      "a model whose state does not fit a rank's memory (a 14 MiB cap on "
      "libtorch's CPU allocator; 8.4 MB of parameters, AdamW: 34 MB under "
      "DDP) trains at world 4 under ZeRO-3 and fails under DDP, naming the "
      "cap") {
    const int64_t cap = int64_t{14} << 20;
    for (const char* mode : {"zero3", "ddp"}) {
      CAPTURE(mode);
      TempDir dir;
      REQUIRE(run_workers("zero3_capped", 4, dir.str(),
                          {{"T_MODE", mode}, {"T_CAP", std::to_string(cap)}})
                  .ok());
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        std::ifstream in(dir / ("outcome" + std::to_string(r)));
        std::string outcome((std::istreambuf_iterator<char>(in)), {});
        MESSAGE(std::string(mode), " rank ", r, ": ", outcome.substr(0, 300));
        if (std::string(mode) == "zero3") {
          REQUIRE(outcome.rfind("trained ", 0) == 0);
          const int64_t peak = std::stoll(outcome.substr(8));
          CHECK(peak <= cap);
          CHECK(peak > (int64_t{4} << 20));  // it did hold its state
        } else {
          CHECK(outcome.rfind("failed: ", 0) == 0);
          CHECK(outcome.find("over the cap of") != std::string::npos);
        }
      }
    }
  }
}
