// ZeRO-1 and ZeRO-2 (include/ddpkit/parallel/zero/): workers and cases of
// the "parallel" suite, included by parallel_test.cpp (one translation
// unit: the helpers above the include are shared).
#pragma once

// ---- ZeRO stage 1 ------------------------------------------------------

namespace {

constexpr int kZeroSteps = 50;
constexpr int kZeroPerRank = 4;

std::unique_ptr<torch::optim::Optimizer> zero_optimizer(
    const std::string& kind, std::vector<torch::Tensor> p,
    double adam_eps = 1e-8) {
  if (kind == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        p, torch::optim::AdamWOptions(1e-2).weight_decay(0.05).eps(adam_eps));
  }
  return std::make_unique<torch::optim::SGD>(
      p, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-3));
}

}  // namespace

/// 50 steps of SmallNet at world w, DDP (`T_MODE=ddp`, the user's optimizer
/// over every parameter; `ddp_fp16`: with the fp16 compression hook), ZeRO-1
/// (`zero`; `zero_fp16`: over the fp16 hook) or ZeRO-2 (`zero2`, clipping
/// through the engine's sharded norm): `T_OPT` sgd (momentum, weight
/// decay) or adamw, `T_ACCUM=1` two micro-batches per step, `T_CLIP=1`
/// global norm clipped to 0.5. Half way every rank consolidates and rank 0
/// saves the net and the whole optimizer state (`half-net.pt`,
/// `half-opt.pt`); `T_LOAD=DIR` starts from DIR's instead, at that step.
/// Writes `net{r}.pt`, the optimizer state bytes it kept (`bytes{r}`), and
/// the gradient bytes it holds after the last step next to the bytes of
/// the parameters it steps (`grads{r}`: "held own", ZeRO-2 and DDP).
/// `T_DEVICE=cuda`: model, data and optimizer state on cuda:0 (over gloo).
DDPKIT_WORKER(zero_train) {
  const auto device = worker_device();
  auto g = device.is_cuda() ? device_worker_group() : test::worker_group();
  const int r = g.rank(), w = g.size();
  const std::string kind = env_or("T_OPT", "sgd");
  const std::string mode = env_or("T_MODE", "zero");
  const bool accum = env_or("T_ACCUM", "0") == "1";
  const bool clip = env_or("T_CLIP", "0") == "1";
  const std::string load = env_or("T_LOAD", "");
  const auto dir = test::worker_dir();
  auto net = test::make_net(100 + r);
  // The weights before the engine is built (as the Trainer's resume loads
  // them in place): torch::load's set_ after DDP's construction left the
  // ranks apart (not investigated further).
  if (!load.empty()) {
    torch::load(net, (std::filesystem::path(load) / "half-net.pt").string());
  }
  auto run = [&](auto& eng, torch::optim::Optimizer& opt, auto consolidate) {
    int first = 0;
    if (!load.empty()) {
      torch::serialize::InputArchive a;
      a.load_from((std::filesystem::path(load) / "half-opt.pt").string());
      opt.load(a);
      first = kZeroSteps / 2;
    }
    for (int s = first; s < kZeroSteps; ++s) {
      if (s == kZeroSteps / 2 && load.empty()) {
        consolidate();
        if (r == 0) {
          torch::serialize::OutputArchive a;
          opt.save(a);
          a.save_to((dir / "half-opt.pt").string());
          torch::save(net, (dir / "half-net.pt").string());
        }
      }
      auto [x, y] = test::global_batch(s, w * kZeroPerRank);
      auto xr = x.narrow(0, r * kZeroPerRank, kZeroPerRank).to(device);
      auto yr = y.narrow(0, r * kZeroPerRank, kZeroPerRank).to(device);
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
          torch::nn::utils::clip_grad_norm_(net->parameters(), 0.5);
        }
      }
      opt.step();
    }
  };
  auto factory = [&](std::vector<torch::Tensor> p) {
    return zero_optimizer(kind, std::move(p));
  };
  uint64_t bytes = 0, held = 0, own = 0;
  if (mode == "zero") {
    parallel::ZeRO1::engine<test::SmallNet> eng(net, g, {}, device);
    auto opt = eng.make_optimizer(factory);
    run(eng, *opt, [&] { eng.consolidate_optimizer(); });
    bytes = eng.optimizer_state_bytes();
  } else if (mode == "zero_fp16") {  // ZeRO-1 over DDP's fp16 hook
    parallel::BasicZeRO1<parallel::Fp16Compression>::engine<test::SmallNet> eng(
        net, g, {}, device);
    auto opt = eng.make_optimizer(factory);
    run(eng, *opt, [&] { eng.consolidate_optimizer(); });
    bytes = eng.optimizer_state_bytes();
  } else if (mode == "ddp_fp16") {
    parallel::DDPFp16::engine<test::SmallNet> eng(net, g, {}, device);
    auto opt = factory(net->parameters());
    run(eng, *opt, [] {});
    bytes = parallel::optimizer_state_bytes(*opt);
  } else if (mode == "zero2") {
    parallel::ZeRO2::engine<test::SmallNet> eng(net, g, {}, device);
    auto opt = eng.make_optimizer(factory);
    run(eng, *opt, [&] { eng.consolidate_optimizer(); });
    bytes = eng.optimizer_state_bytes();
    if (eng.reducer()) held = eng.reducer()->gradient_bytes();
    for (const auto& p :
         dynamic_cast<parallel::ShardedOptimizer&>(*opt).owned(r)) {
      own += static_cast<uint64_t>(p.nbytes());
    }
  } else {
    parallel::DDP::engine<test::SmallNet> eng(net, g, {}, device);
    auto opt = factory(net->parameters());
    run(eng, *opt, [] {});
    bytes = parallel::optimizer_state_bytes(*opt);
    if (eng.reducer()) held = eng.reducer()->gradient_bytes();
    for (const auto& p : net->parameters()) own += p.nbytes();
  }
  torch::save(net, (dir / ("net" + std::to_string(r) + ".pt")).string());
  std::ofstream(dir / ("bytes" + std::to_string(r))) << bytes;
  std::ofstream(dir / ("grads" + std::to_string(r))) << held << " " << own;
  return 0;
}

namespace {
// Eight equal layers: at world 4 each rank owns two, and with buckets
// capped at one layer each bucket is one layer.
struct ChainImpl : torch::nn::Module {
  ChainImpl() {
    for (int i = 0; i < 8; ++i) {
      layers.push_back(
          register_module("l" + std::to_string(i), torch::nn::Linear(32, 32)));
    }
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(l(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
};
TORCH_MODULE(Chain);
constexpr int64_t kLayerBytes = (32 * 32 + 32) * 4;
}  // namespace

/// Five SGD steps of Chain at world w with one bucket per layer, DDP
/// (`T_MODE=ddp`) or ZeRO-2 (`zero2`, at most `T_INFLIGHT` others' buckets
/// held): writes `net{r}.pt` and the most gradient bytes held (`peak{r}`).
DDPKIT_WORKER(zero2_peak) {
  auto g = test::worker_group();
  const int r = g.rank();
  torch::manual_seed(7 + r);
  Chain net;
  auto opts = parallel::DDPOptions().reducer(
      parallel::ReducerOptions()
          .bucket_cap_bytes(kLayerBytes)
          .first_bucket_cap_bytes(kLayerBytes)
          .last_bucket_cap_bytes(kLayerBytes)
          .unowned_buckets_in_flight(std::stoi(env_or("T_INFLIGHT", "2"))));
  auto sgd = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.1).momentum(0.9));
  };
  auto run = [&](auto& eng, torch::optim::Optimizer& opt) {
    for (int s = 0; s < 5; ++s) {
      torch::manual_seed(1000 * s + r);
      auto x = torch::randn({4, 32});
      eng.zero_grad();
      eng.forward_backward(x, x,
                           [](const torch::Tensor& o, const torch::Tensor& t) {
                             return (o - t.flip(1)).pow(2).mean();
                           });
      opt.step();
    }
    return eng.peak_gradient_bytes();
  };
  uint64_t peak = 0;
  if (env_or("T_MODE", "zero2") == "zero2") {
    parallel::ZeRO2::engine<Chain> eng(net, g, opts, torch::kCPU);
    auto opt = eng.make_optimizer(sgd);
    peak = run(eng, *opt);
  } else {
    parallel::DDP::engine<Chain> eng(net, g, opts, torch::kCPU);
    auto opt = sgd(net->parameters());
    peak = run(eng, *opt);
  }
  torch::save(
      net, (test::worker_dir() / ("net" + std::to_string(r) + ".pt")).string());
  std::ofstream(test::worker_dir() / ("peak" + std::to_string(r))) << peak;
  return 0;
}

namespace {
// Twelve equal layers whose gradients arrive out of registration order:
// an input layer whose weight is tied to the output head (one module
// registered twice, as a language model ties its embedding and head: its
// gradient arrives last), then two branches that run their layers in the
// reverse of their registration order.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl() {
    for (int i = 0; i < 12; ++i) {
      layers.push_back(
          register_module("l" + std::to_string(i), torch::nn::Linear(32, 32)));
    }
    head = register_module("head", layers[0]);
  }
  torch::Tensor forward(torch::Tensor x) {
    auto e = torch::tanh(layers[0](x));
    auto a = e, b = e;
    for (int i : {10, 8, 6, 4, 2}) a = torch::tanh(layers[i](a));
    for (int i : {11, 9, 7, 5, 3}) b = torch::tanh(layers[i](b));
    return head(torch::tanh(layers[1](a + b)));
  }
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Branchy);
}  // namespace

/// Five SGD steps of Branchy at world 2 with one bucket per layer, DDP
/// (`T_MODE=ddp`) or ZeRO-2 (`zero2`, `T_INFLIGHT` others' buckets in
/// flight): writes `net{r}.pt` and, per step, the most other ranks'
/// buckets held at once (`held{r}`).
DDPKIT_WORKER(zero2_out_of_order) {
  auto g = test::worker_group();
  const int r = g.rank();
  torch::manual_seed(7);
  Branchy net;
  auto opts = parallel::DDPOptions().reducer(
      parallel::ReducerOptions()
          .bucket_cap_bytes(kLayerBytes)
          .first_bucket_cap_bytes(kLayerBytes)
          .last_bucket_cap_bytes(kLayerBytes)
          .unowned_buckets_in_flight(std::stoi(env_or("T_INFLIGHT", "2"))));
  auto sgd = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.1).momentum(0.9));
  };
  std::ofstream held(test::worker_dir() / ("held" + std::to_string(r)));
  auto run = [&](auto& eng, torch::optim::Optimizer& opt) {
    for (int s = 0; s < 5; ++s) {
      torch::manual_seed(1000 * s + r);
      auto x = torch::randn({4, 32});
      eng.zero_grad();
      eng.forward_backward(x, x,
                           [](const torch::Tensor& o, const torch::Tensor& t) {
                             return (o - t.flip(1)).pow(2).mean();
                           });
      opt.step();
      held << eng.reducer()->last_step_unowned_buckets_held() << " ";
    }
  };
  if (env_or("T_MODE", "zero2") == "zero2") {
    parallel::ZeRO2::engine<Branchy> eng(net, g, opts, torch::kCPU);
    auto opt = eng.make_optimizer(sgd);
    run(eng, *opt);
  } else {
    parallel::DDP::engine<Branchy> eng(net, g, opts, torch::kCPU);
    // Each tensor once (parameters() lists the tied weight twice).
    auto opt = sgd(parallel::unique_parameters(*net));
    run(eng, *opt);
  }
  torch::save(
      net, (test::worker_dir() / ("net" + std::to_string(r) + ".pt")).string());
  return 0;
}

TEST_SUITE("parallel") {
  TEST_CASE(
      "ZeRO-2's bucket cap: 4 MiB unless one is set, and a set one kept") {
    using parallel::ReducerOptions;
    using parallel::ZeRO2;
    CHECK(ZeRO2::bucket_cap(ReducerOptions()) == ZeRO2::kBucketCapBytes);
    CHECK(ZeRO2::bucket_cap(ReducerOptions().bucket_cap_bytes(1 << 20)) ==
          1 << 20);
    // Set to DDP's own default: kept (it was replaced by 4 MiB before).
    CHECK(ZeRO2::bucket_cap(ReducerOptions().bucket_cap_bytes(
              ReducerOptions::kDefaultBucketCapBytes)) ==
          ReducerOptions::kDefaultBucketCapBytes);
    CHECK(ReducerOptions().bucket_cap_bytes() ==
          ReducerOptions::kDefaultBucketCapBytes);
    CHECK_FALSE(ReducerOptions().bucket_cap_set());
  }
  TEST_CASE(
      "ZeRO-2 holds at most unowned_buckets_in_flight other ranks' buckets "
      "from the second step on when gradients arrive out of registration "
      "order (branches run in reverse, a tied weight), more in the first "
      "step (before the rebuild in arrival order); equal to DDP") {
    TempDir ddp;
    REQUIRE(run_workers("zero2_out_of_order", 2, ddp.str(), {{"T_MODE", "ddp"}})
                .ok());
    Branchy want;
    torch::load(want, (ddp / "net0.pt").string());
    for (int inflight : {1, 2}) {
      CAPTURE(inflight);
      TempDir z;
      REQUIRE(run_workers("zero2_out_of_order", 2, z.str(),
                          {{"T_MODE", "zero2"},
                           {"T_INFLIGHT", std::to_string(inflight)}})
                  .ok());
      for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        std::ifstream in(z / ("held" + std::to_string(r)));
        std::vector<std::size_t> held;
        for (std::size_t h = 0; in >> h;) held.push_back(h);
        REQUIRE(held.size() == 5);
        Branchy got;
        torch::load(got, (z / ("net" + std::to_string(r) + ".pt")).string());
        const double d = test::max_state_diff(*got, *want);
        MESSAGE("ZeRO-2 world 2, ", inflight, " in flight, rank ", r,
                ": others' buckets held per step ", held[0], " ", held[1], " ",
                held[2], " ", held[3], " ", held[4], "; difference from DDP ",
                d);
        CHECK(d <= 1e-6);
        // The first step's order is not the buckets': more are held (the
        // case the bound's statement excludes, shown to happen here).
        CHECK(held[0] > static_cast<std::size_t>(inflight));
        // After the rebuild in arrival order: the bound.
        for (std::size_t s = 1; s < held.size(); ++s) {
          CAPTURE(s);
          CHECK(held[s] >= 1);
          CHECK(held[s] <= static_cast<std::size_t>(inflight));
        }
      }
    }
  }

  TEST_CASE(
      "ZeRO-1 and ZeRO-2 equal DDP (SGD with momentum and weight decay, "
      "AdamW; with accumulation and clipping; world 2 and 4), keep about "
      "1/world of the optimizer state (and ZeRO-2 of the gradients) per "
      "rank, and their checkpoints resume at another world size") {
    struct Case {
      int world;
      const char* opt;
      bool accum, clip;
    };
    auto read_bytes = [](const TempDir& d, int r) {
      uint64_t n = 0;
      std::ifstream(d / ("bytes" + std::to_string(r))) >> n;
      return n;
    };
    // "held own": gradient bytes held after the last step, and bytes of
    // the parameters this rank steps.
    auto read_grads = [](const TempDir& d, int r) {
      std::pair<uint64_t, uint64_t> v{0, 0};
      std::ifstream(d / ("grads" + std::to_string(r))) >> v.first >> v.second;
      return v;
    };
    for (const Case& c :
         {Case{2, "sgd", false, false}, Case{2, "adamw", true, true},
          Case{4, "adamw", false, false}}) {
      CAPTURE(c.world);
      CAPTURE(c.opt);
      CAPTURE(c.accum);
      TempDir ddp, zero, zero2;
      std::vector<std::pair<std::string, std::string>> env{
          {"T_OPT", c.opt},
          {"T_ACCUM", c.accum ? "1" : "0"},
          {"T_CLIP", c.clip ? "1" : "0"}};
      auto with = [&](const char* mode) {
        auto e = env;
        e.emplace_back("T_MODE", mode);
        return e;
      };
      REQUIRE(run_workers("zero_train", c.world, ddp.str(), with("ddp")).ok());
      REQUIRE(
          run_workers("zero_train", c.world, zero.str(), with("zero")).ok());
      REQUIRE(
          run_workers("zero_train", c.world, zero2.str(), with("zero2")).ok());
      auto want = load_net(ddp / "net0.pt", false);
      const uint64_t whole = read_bytes(ddp, 0);
      const uint64_t whole_grads = read_grads(ddp, 0).first;
      // The largest parameter's state (fc1's or conv2's weight), the most
      // one rank can hold above an even share.
      uint64_t largest = 0;
      for (const auto& p : want->parameters()) {
        largest = std::max<uint64_t>(largest, p.nbytes());
      }
      const uint64_t largest_state =
          largest * (std::string(c.opt) == "adamw" ? 2 : 1);
      for (const auto* run : {&zero, &zero2}) {
        const char* name = run == &zero ? "ZeRO-1" : "ZeRO-2";
        CAPTURE(name);
        uint64_t total = 0, total_grads = 0;
        for (int r = 0; r < c.world; ++r) {
          CAPTURE(r);
          auto got =
              load_net(*run / ("net" + std::to_string(r) + ".pt"), false);
          const double d = test::max_state_diff(*got, *want);
          const auto [held, own] = read_grads(*run, r);
          MESSAGE(std::string(name), " ", std::string(c.opt),
                  std::string(c.accum ? " accumulate+clip" : ""), " world ",
                  c.world, " rank ", r, ": max relative difference from DDP ",
                  d, "; state ", read_bytes(*run, r), " of ", whole,
                  " bytes; gradients held ", held, " of ", whole_grads,
                  " bytes");
          CHECK(d <= 1e-6);
          const uint64_t mine = read_bytes(*run, r);
          CHECK(mine <= whole / static_cast<uint64_t>(c.world) + largest_state);
          total += mine;
          if (run == &zero2) {
            // Between steps a rank holds exactly the gradients of the
            // parameters it steps.
            CHECK(held == own);
            total_grads += held;
          }
        }
        CHECK(whole > 0);
        CHECK(total == whole);  // every parameter's state on exactly one rank
        if (run == &zero2) CHECK(total_grads == whole_grads);
      }

      // The whole optimizer state each ZeRO run consolidated half way
      // (half-opt.pt, written by rank 0) equals the one DDP's plain
      // optimizer saved at the same step.
      auto state_tensors = [&](const TempDir& d) {
        auto net = load_net(d / "half-net.pt", false);
        auto opt = zero_optimizer(c.opt, net->parameters());
        torch::serialize::InputArchive a;
        a.load_from((d / "half-opt.pt").string());
        opt->load(a);
        std::vector<torch::Tensor> out;
        for (const auto& p : net->parameters()) {
          auto it = opt->state().find(compat::optimizer_state_key(p));
          REQUIRE(it != opt->state().end());
          const auto* st = it->second.get();
          if (const auto* sgd =
                  dynamic_cast<const torch::optim::SGDParamState*>(st)) {
            out.push_back(sgd->momentum_buffer());
          } else if (const auto* adamw =
                         dynamic_cast<const torch::optim::AdamWParamState*>(
                             st)) {
            out.push_back(adamw->exp_avg());
            out.push_back(adamw->exp_avg_sq());
          }
        }
        return out;
      };
      const auto ddp_state = state_tensors(ddp);
      for (const auto* run : {&zero, &zero2}) {
        const auto got = state_tensors(*run);
        REQUIRE(got.size() == ddp_state.size());
        double worst = 0;
        for (std::size_t k = 0; k < got.size(); ++k) {
          worst = test::worse(worst, test::rel_diff(got[k], ddp_state[k]));
        }
        CHECK(worst <= 1e-6);
      }

      if (c.accum) continue;
      // The state saved half way (consolidated on rank 0: a plain
      // optimizer's) resumes ZeRO-1 and ZeRO-2 at another world size (4
      // from 2; 2 and 1 from 4) as it resumes DDP there.
      std::vector<int> targets =
          c.world == 2 ? std::vector<int>{4} : std::vector<int>{2, 1};
      for (int to : targets) {
        CAPTURE(to);
        TempDir ddp_to, zero_to, zero2_to;
        auto from = [&](const char* mode, const TempDir& src) {
          auto e = with(mode);
          e.emplace_back("T_LOAD", src.str());
          return e;
        };
        REQUIRE(run_workers("zero_train", to, ddp_to.str(), from("ddp", zero))
                    .ok());
        REQUIRE(run_workers("zero_train", to, zero_to.str(), from("zero", zero))
                    .ok());
        REQUIRE(
            run_workers("zero_train", to, zero2_to.str(), from("zero2", zero2))
                .ok());
        auto want_to = load_net(ddp_to / "net0.pt", false);
        for (const auto* run : {&zero_to, &zero2_to}) {
          for (int r = 0; r < to; ++r) {
            auto got =
                load_net(*run / ("net" + std::to_string(r) + ".pt"), false);
            const double d = test::max_state_diff(*got, *want_to);
            const char* name = run == &zero_to ? "ZeRO-1" : "ZeRO-2";
            MESSAGE(std::string(name), " resumed at world ", to, " from world ",
                    c.world, ": rank ", r, " ", d);
            CHECK(d <= 1e-6);
          }
        }
        // And the resumed runs moved on from the loaded state: not the
        // uninterrupted run's result.
        CHECK(test::max_state_diff(*want_to, *want) > 1e-3);
      }
    }
  }

  TEST_CASE(
      "ZeRO-2 holds at most its own gradients and the buckets in flight "
      "(world 4, a bucket per layer; 1 and 2 buckets of others' at once; "
      "gloo's reduce and the shared-memory channel) and equals DDP") {
    auto peak_of = [](const TempDir& d, int r) {
      uint64_t n = 0;
      std::ifstream(d / ("peak" + std::to_string(r))) >> n;
      return n;
    };
    TempDir ddp;
    REQUIRE(run_workers("zero2_peak", 4, ddp.str(), {{"T_MODE", "ddp"}}).ok());
    Chain want;
    torch::load(want, (ddp / "net0.pt").string());
    const uint64_t whole = peak_of(ddp, 0);
    CHECK(whole == 8 * kLayerBytes);
    for (int inflight : {1, 2}) {
      CAPTURE(inflight);
      TempDir z;
      // One in flight over gloo's reduce (the shared-memory channel off),
      // two through the channel.
      REQUIRE(run_workers("zero2_peak", 4, z.str(),
                          {{"T_MODE", "zero2"},
                           {"T_INFLIGHT", std::to_string(inflight)},
                           {"DDPKIT_SHM", inflight == 1 ? "0" : "1"}})
                  .ok());
      for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        Chain got;
        torch::load(got, (z / ("net" + std::to_string(r) + ".pt")).string());
        const double d = test::max_state_diff(*got, *want);
        const uint64_t peak = peak_of(z, r);
        MESSAGE("ZeRO-2 world 4, ", inflight, " in flight, rank ", r,
                ": peak gradient bytes ", peak, " (DDP ", whole,
                "); difference from DDP ", d);
        CHECK(d <= 1e-6);
        // Two layers of its own, and `inflight` others' buckets.
        CHECK(peak <= (2 + static_cast<uint64_t>(inflight)) * kLayerBytes);
      }
    }
  }

  TEST_CASE(
      "ZeRO-1 and ZeRO-2 equal DDP with tied weights (the tensor listed "
      "twice by parameters() is owned, stepped and holds state once) and "
      "with unused parameters (used on one rank, on none, only under "
      "no_sync; find_unused_parameters)") {
    auto bytes_of = [](const TempDir& d, int r) {
      uint64_t n = 0;
      std::ifstream(d / ("bytes" + std::to_string(r))) >> n;
      return n;
    };
    TempDir tied_ddp, unused_ddp;
    REQUIRE(
        run_workers("zero_tied", 2, tied_ddp.str(), {{"T_MODE", "ddp"}}).ok());
    REQUIRE(
        run_workers("unused_pattern", 2, unused_ddp.str(), {{"T_MODE", "ddp"}})
            .ok());
    auto tied_want = make_tied(0);
    torch::load(tied_want, (tied_ddp / "tied0.pt").string());
    PatternNet unused_want;
    torch::load(unused_want, (unused_ddp / "pattern0.pt").string());
    const uint64_t whole = bytes_of(tied_ddp, 0);
    CHECK(whole == 77 * 4);  // momentum of 36 + 6 + 30 + 5 elements
    for (const char* mode : {"zero1", "zero2"}) {
      CAPTURE(mode);
      TempDir tied, unused;
      REQUIRE(run_workers("zero_tied", 2, tied.str(), {{"T_MODE", mode}}).ok());
      REQUIRE(run_workers("unused_pattern", 2, unused.str(), {{"T_MODE", mode}})
                  .ok());
      uint64_t total = 0;
      for (int r = 0; r < 2; ++r) {
        CAPTURE(r);
        const auto rs = std::to_string(r);
        auto t = make_tied(0);
        torch::load(t, (tied / ("tied" + rs + ".pt")).string());
        PatternNet u;
        torch::load(u, (unused / ("pattern" + rs + ".pt")).string());
        const double dt = test::max_state_diff(*t, *tied_want);
        const double du = test::max_state_diff(*u, *unused_want);
        MESSAGE(std::string(mode), " rank ", r, ": tied weights ", dt,
                ", unused parameters ", du,
                " (max relative difference from DDP); optimizer state ",
                bytes_of(tied, r), " of ", whole, " bytes");
        CHECK(dt <= 1e-6);
        CHECK(du <= 1e-6);
        total += bytes_of(tied, r);
      }
      CHECK(total == whole);  // the tied tensor's momentum once
    }
    // A tied weight large enough that counting it twice would move the
    // partition's cut: the reducer's gradient owners and the optimizer's
    // shards must still agree.
    TempDir big_ddp;
    REQUIRE(run_workers("zero_tied", 2, big_ddp.str(),
                        {{"T_MODE", "ddp"}, {"T_NET", "big"}})
                .ok());
    BigTied big_want;
    torch::load(big_want, (big_ddp / "tied0.pt").string());
    const uint64_t big_whole = bytes_of(big_ddp, 0);
    CHECK(big_whole == (4096 + 64 + 4096 + 64 + 320 + 5) * 4);
    for (const char* mode : {"zero1", "zero2"}) {
      CAPTURE(mode);
      TempDir big;
      REQUIRE(run_workers("zero_tied", 2, big.str(),
                          {{"T_MODE", mode}, {"T_NET", "big"}})
                  .ok());
      uint64_t total = 0;
      for (int r = 0; r < 2; ++r) {
        BigTied got;
        torch::load(got, (big / ("tied" + std::to_string(r) + ".pt")).string());
        const double d = test::max_state_diff(*got, *big_want);
        MESSAGE(std::string(mode), " rank ", r, ": large tied weight ", d,
                " from DDP; optimizer state ", bytes_of(big, r), " of ",
                big_whole, " bytes");
        CHECK(d <= 1e-6);
        total += bytes_of(big, r);
      }
      CHECK(total == big_whole);
    }
  }

  TEST_CASE(
      "ZeRO-1 with a compression hook (BasicZeRO1<Fp16Compression>) equals "
      "DDP with the same hook, which differs from plain DDP") {
    TempDir plain, ddp16, zero16;
    REQUIRE(
        run_workers("zero_train", 2, plain.str(), {{"T_MODE", "ddp"}}).ok());
    REQUIRE(run_workers("zero_train", 2, ddp16.str(), {{"T_MODE", "ddp_fp16"}})
                .ok());
    REQUIRE(
        run_workers("zero_train", 2, zero16.str(), {{"T_MODE", "zero_fp16"}})
            .ok());
    auto want = load_net(ddp16 / "net0.pt", false);
    const double hook_effect =
        test::max_state_diff(*load_net(plain / "net0.pt", false), *want);
    for (int r = 0; r < 2; ++r) {
      auto got = load_net(zero16 / ("net" + std::to_string(r) + ".pt"), false);
      const double d = test::max_state_diff(*got, *want);
      MESSAGE("rank ", r, ": ZeRO-1 + fp16 hook against DDP + fp16 hook ", d,
              "; DDP + fp16 hook against plain DDP ", hook_effect);
      CHECK(d <= 1e-6);
    }
    CHECK(hook_effect > 1e-6);  // the hook was in effect
  }

  TEST_CASE(
      "ZeRO2 refuses what it cannot do, naming the setting: a stage other "
      "than 1 or 2, a compression hook") {
    auto make = [](parallel::ZeROOptions o) {
      auto net = test::make_net(1);
      parallel::ZeRO2::engine<test::SmallNet> eng(net, dist::Group(), o,
                                                  torch::kCPU);
    };
    CHECK_THROWS_WITH_AS(make(parallel::ZeROOptions().stage(3)),
                         doctest::Contains("ZeROOptions::stage is 3"),
                         UsageError);
    for (int stage : {1, 2}) {
      parallel::ZeROOptions o;
      o.stage(stage);
      o.comm().kind(parallel::CommKind::powersgd);
      CHECK_THROWS_WITH_AS(
          make(o), doctest::Contains("comm().kind() is powersgd"), UsageError);
    }
    CHECK_NOTHROW(make(parallel::ZeROOptions()));
  }

  TEST_CASE(
      "model_state_bytes gives the ZeRO paper's table: 7.5B parameters at "
      "64 ranks, mixed precision (K = 12)") {
    // Rajbhandari et al., SC'20, Figure 1 / Table 1: 120 GB (DDP), 31.4 GB
    // (stage 1), 16.6 GB (stage 2), 1.88 GB (stage 3).
    const double paper[] = {120, 31.4, 16.6, 1.88};
    for (int stage = 0; stage <= 3; ++stage) {
      const auto b = parallel::model_state_bytes(7.5e9, 64, stage, 2, 2, 12);
      const double gb = b.total() / 1e9;
      MESSAGE("stage ", stage, ": parameters ", b.parameters / 1e9,
              " GB, gradients ", b.gradients / 1e9, " GB, optimizer state ",
              b.optimizer_state / 1e9, " GB; total ", gb, " GB (paper ",
              paper[stage], ")");
      CHECK(std::abs(gb - paper[stage]) <= 0.05 * paper[stage]);
    }
    // float32 Adam (4 + 4 + 8 bytes a parameter), 1B at 8 ranks.
    CHECK(parallel::model_state_bytes(1e9, 8, 0).total() ==
          doctest::Approx(16e9));
    CHECK(parallel::model_state_bytes(1e9, 8, 2).total() ==
          doctest::Approx(4e9 + 0.5e9 + 1e9));
    CHECK_THROWS_AS(parallel::model_state_bytes(1e9, 8, 4), UsageError);
  }

}  // TEST_SUITE("parallel")
