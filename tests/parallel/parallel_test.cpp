// The parallel engine against single-process references, with real
// processes over gloo on loopback.
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <type_traits>

#include "../support.hpp"
#include "ddpkit/data.hpp"
#include "ddpkit/nn/activation_checkpoint.hpp"
#include "ddpkit/nn/bn_policies.hpp"
#include "ddpkit/parallel.hpp"
#include "nets.hpp"

using namespace ddpkit;
using ddpkit::test::run_workers;
using ddpkit::test::TempDir;

namespace {

constexpr int kSteps = 5;
constexpr int64_t kPerRank = 4;

std::string env_or(const char* name, const char* dflt) {
  const char* v = std::getenv(name);
  return v ? v : dflt;
}

/// T_DEVICE=cuda runs a worker's model and data on cuda:0 (every rank on
/// the one GPU of a test machine), over gloo, which reduces CUDA tensors.
torch::Device worker_device() {
  return env_or("T_DEVICE", "cpu") == "cuda" ? torch::Device(torch::kCUDA, 0)
                                             : torch::Device(torch::kCPU);
}
dist::Group device_worker_group() {
  auto opts = test::test_group_options();
  if (worker_device().is_cuda()) opts.backend(dist::BackendKind::gloo);
  return dist::Group::init(dist::read_env(), opts);
}

/// Single process, batch world·B, the same samples and steps. With
/// `accumulate`, each step is one on the joined two micro-batches.
test::SmallNet reference(int world, bool bn, int64_t per_rank = kPerRank) {
  auto net = test::make_net(100, bn);
  auto opt = test::make_sgd(*net);
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = test::global_batch(s, world * per_rank);
    opt.zero_grad();
    test::ce_loss(net->forward(x), y).backward();
    opt.step();
  }
  return net;
}

/// Whether every gradient lies inside one of the reducer's buckets (the
/// averaged gradients were not copied out).
template <class Reducer>
bool grads_are_bucket_views(Reducer& reducer, torch::nn::Module& net) {
  for (auto& p : net.parameters()) {
    if (!p.grad().defined()) return false;
    auto* at = static_cast<const char*>(p.grad().data_ptr());
    bool inside = false;
    for (const auto& b : reducer.buckets()) {
      auto* lo = static_cast<const char*>(b.flat.data_ptr());
      inside |= at >= lo && at < lo + b.flat.nbytes();
    }
    if (!inside) return false;
  }
  return true;
}

/// The "write your own hook" example of grad_comm.hpp (Note [Communication hooks]),
/// verbatim: fp16 on the wire.
struct Float16Wire {
  static constexpr const char* name = "my_fp16";
  std::vector<torch::Tensor> wire;  // state: one buffer per bucket
  ddpkit::parallel::CommFuture run(const ddpkit::dist::Group& g,
                                   ddpkit::parallel::GradBucket& b) {
    if (wire.size() <= b.index) wire.resize(b.index + 1);
    wire[b.index] = b.buffer.div(g.size()).to(torch::kHalf);
    auto half = wire[b.index];
    return ddpkit::parallel::CommFuture(ddpkit::dist::all_reduce_async(g, half))
        .then([buf = b.buffer, half]() mutable {
          buf.copy_(half);                         // the mean, back in place
          return ddpkit::dist::compat::WorkPtr();  // nothing more to send
        });
  }
};
using MyDDP = ddpkit::parallel::BasicDDP<Float16Wire>;

/// The plain mean, sent from a copy taken when the bucket is launched (the
/// shared-memory all-reduce reads the bucket only when waited for, which
/// would hide a bucket launched before its last gradient came in).
struct CopyAtLaunch {
  static constexpr const char* name = "copy_at_launch";
  ddpkit::parallel::CommFuture run(const ddpkit::dist::Group& g,
                                   ddpkit::parallel::GradBucket& b) {
    auto sent = b.buffer.div(g.size());
    return ddpkit::parallel::CommFuture(ddpkit::dist::all_reduce_async(g, sent))
        .then([buf = b.buffer, sent]() mutable {
          buf.copy_(sent);
          return ddpkit::dist::compat::WorkPtr();
        });
  }
};
using CopyAtLaunchDDP = ddpkit::parallel::BasicDDP<CopyAtLaunch>;

template <class Policy>
int train_ddp_worker(parallel::DDPOptions opts, bool bn, bool nosync) {
  auto g = device_worker_group();
  const int r = g.rank(), w = g.size();
  const auto device = worker_device();
  // Each rank starts from a different init: DDP must make them identical.
  auto net = test::make_net(100 + r, bn);
  if (bn) nn::SyncBN::apply(*net, g);
  typename Policy::template engine<test::SmallNet> eng(net, g, opts, device);
  // Check the broadcast: every rank now holds rank 0's (seed 100) weights.
  auto fresh = test::make_net(100, bn);
  fresh->to(device);
  if (test::max_state_diff(*net, *fresh) != 0) {
    std::fprintf(stderr, "rank %d: not identical after construction\n", r);
    return 10;
  }
  // With every rank on this host the buckets live in shared memory (unless
  // turned off), so their all-reduces run in place; CUDA buckets live on
  // the GPU and go through the backend.
  const bool host_buckets = !device.is_cuda();
  if (eng.reducer()) {
    const bool want =
        g.shm() && opts.reducer().shared_buckets() && host_buckets;
    for (const auto& b : eng.reducer()->buckets()) {
      if ((g.shm() && g.shm()->in_shared_buffer(b.flat)) != want) {
        std::fprintf(stderr, "rank %d: bucket %s shared memory\n", r,
                     want ? "not in" : "in");
        return 12;
      }
    }
  }
  if constexpr (requires { eng.reducer()->comm_hook().compressing(); }) {
    std::ofstream(test::worker_dir() / ("wire" + std::to_string(r)))
        << eng.reducer()->comm_hook().compressing();
  }
  auto opt = test::make_sgd(*net);
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = test::global_batch(s, w * kPerRank);
    auto xr = x.narrow(0, r * kPerRank, kPerRank).to(device);
    auto yr = y.narrow(0, r * kPerRank, kPerRank).to(device);
    // How gradients are zeroed must not matter: in place by the optimizer
    // (libtorch 1.13's default), set to None (2.x's default), or by the
    // reducer (one fill per bucket).
    const auto zero = env_or("T_ZERO", "opt");
    if (zero == "none") {
      net->zero_grad(/*set_to_none=*/true);
    } else if (zero == "reducer" && eng.reducer()) {
      eng.reducer()->zero_grad();
    } else {
      opt.zero_grad();
    }
    if (nosync) {
      // Two micro-batches of half the rank's batch; the loss of each is
      // halved so the accumulated gradient is the joined batch's mean.
      auto half = kPerRank / 2;
      auto loss_half = [](const torch::Tensor& o, const torch::Tensor& t) {
        return test::ce_loss(o, t) / 2;
      };
      // Averaging is linear, so the weights cannot tell a no_sync that
      // communicates from one that does not: count the collectives.
      const auto before = g.collectives_started();
      const auto buckets = eng.reducer() ? eng.reducer()->buckets().size() : 0;
      const auto rebuilds = eng.reducer() ? eng.reducer()->rebuilds() : 0;
      {
        auto guard = eng.no_sync();
        eng.forward_backward(xr.narrow(0, 0, half), yr.narrow(0, 0, half),
                             loss_half);
      }
      const auto during = g.collectives_started() - before;
      eng.forward_backward(xr.narrow(0, half, half), yr.narrow(0, half, half),
                           loss_half);
      const auto synced = g.collectives_started() - before - during;
      // The step that rebuilds the buckets also broadcasts rank 0's order.
      const auto rebuilt =
          eng.reducer() ? eng.reducer()->rebuilds() - rebuilds : 0;
      if (during != 0 || synced != buckets + rebuilt) {
        std::fprintf(stderr,
                     "rank %d: %llu collective(s) under no_sync (want 0), %llu "
                     "in the synced backward (want one per bucket, %zu, + %zu "
                     "for the rebuild)\n",
                     r, static_cast<unsigned long long>(during),
                     static_cast<unsigned long long>(synced), buckets, rebuilt);
        return 13;
      }
    } else {
      // On one host every bucket goes through the shared-memory channel,
      // half-precision ones included (not gloo's TCP).
      const auto via_shm = [&] {
        return g.shm() ? g.shm()->operations_started() : 0;
      };
      const auto shm_before = via_shm();
      const auto buckets = eng.reducer() ? eng.reducer()->buckets().size() : 0;
      eng.forward_backward(xr, yr, test::ce_loss);
      if (g.shm() && host_buckets && via_shm() - shm_before < buckets) {
        std::fprintf(stderr,
                     "rank %d: %llu of %zu buckets went through shared "
                     "memory\n",
                     r, static_cast<unsigned long long>(via_shm() - shm_before),
                     buckets);
        return 14;
      }
    }
    if (eng.reducer() && !grads_are_bucket_views(*eng.reducer(), *net)) {
      std::fprintf(stderr, "rank %d: a gradient is not a bucket view\n", r);
      return 11;
    }
    opt.step();
  }
  net->to(torch::kCPU);
  torch::save(
      net, (test::worker_dir() / ("net" + std::to_string(r) + ".pt")).string());
  return 0;
}

test::SmallNet load_net(const std::filesystem::path& p, bool bn) {
  auto net = test::make_net(0, bn);
  torch::load(net, p.string());
  return net;
}

}  // namespace

DDPKIT_WORKER(ddp_train) {
  bool bn = env_or("T_BN", "0") == "1";
  bool nosync = env_or("T_NOSYNC", "0") == "1";
  auto comm = env_or("T_COMM", "mean");
  parallel::DDPOptions opts;
  opts.reducer().bucket_cap_bytes(std::stoll(env_or("T_BUCKET", "26214400")));
  opts.reducer().first_bucket_cap_bytes(
      std::min<int64_t>(opts.reducer().bucket_cap_bytes(), 1 << 20));
  opts.trace_path(env_or("T_TRACE", ""));
  opts.reducer().shared_buckets(env_or("T_SHARED", "1") == "1");
  if (comm == "fp16")
    return train_ddp_worker<parallel::DDPFp16>(opts, bn, nosync);
  if (comm == "bf16")
    return train_ddp_worker<parallel::DDPBf16>(opts, bn, nosync);
  if (comm == "my_fp16") return train_ddp_worker<MyDDP>(opts, bn, nosync);
  if (comm == "powersgd_full" || comm == "powersgd_r1") {
    // Full rank: every matrix compressed (no minimum rate) at a rank no
    // smaller than its sides, from the first step.
    const bool full = comm == "powersgd_full";
    opts.comm().powersgd(parallel::PowerSGDOptions()
                             .rank(full ? 1000 : 1)
                             .start_step(0)
                             .min_compression_rate(full ? 0 : 2));
    return train_ddp_worker<parallel::DDPPowerSGD>(opts, bn, nosync);
  }
  return train_ddp_worker<parallel::DDP>(opts, bn, nosync);
}

/// PowerSGD at rank 1 with error feedback, plain SGD: every rank saves its
/// own gradients summed over the steps (computed apart from DDP, at the
/// weights of each step), the error the hook carries at the end, and the
/// weights before and after; and the bytes one plain and one compressed
/// step carried.
DDPKIT_WORKER(powersgd_feedback) {
  auto g = test::worker_group();
  const int r = g.rank(), w = g.size();
  auto net = test::make_net(100);
  parallel::DDPOptions opts;
  const int64_t start = 2, steps = 6;
  opts.comm().powersgd(parallel::PowerSGDOptions().rank(1).start_step(start));
  parallel::DDPPowerSGD::engine<test::SmallNet> eng(net, g, opts, torch::kCPU);
  auto params = net->parameters();
  std::vector<torch::Tensor> w0, sum_g;
  for (auto& p : params) {
    w0.push_back(p.detach().clone());
    sum_g.push_back(torch::zeros_like(p));
  }
  torch::optim::SGD opt(params, torch::optim::SGDOptions(0.1));
  uint64_t bytes_plain = 0, bytes_compressed = 0;
  for (int64_t s = 0; s < steps; ++s) {
    auto [x, y] = test::global_batch(static_cast<int>(s), w * kPerRank);
    auto xr = x.narrow(0, r * kPerRank, kPerRank);
    auto yr = y.narrow(0, r * kPerRank, kPerRank);
    // This rank's gradient at these weights, without DDP (autograd::grad
    // runs no AccumulateGrad, so no reducer hook).
    auto local =
        torch::autograd::grad({test::ce_loss(net->forward(xr), yr)}, params);
    for (std::size_t i = 0; i < params.size(); ++i) sum_g[i] += local[i];
    eng.zero_grad();
    const auto before = g.bytes_started();
    eng.forward_backward(xr, yr, test::ce_loss);
    if (s == start - 1) bytes_plain = g.bytes_started() - before;
    if (s == start) bytes_compressed = g.bytes_started() - before;
    opt.step();
  }
  auto& hook = eng.reducer()->comm_hook();
  std::vector<torch::Tensor> error;
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto e = hook.error_of(i);
    error.push_back(e.defined() ? e.view(params[i].sizes())
                                : torch::zeros_like(params[i]));
  }
  std::vector<torch::Tensor> w1;
  for (auto& p : params) w1.push_back(p.detach().clone());
  auto dir = test::worker_dir();
  auto tag = std::to_string(r);
  torch::save(w0, (dir / ("w0_" + tag + ".pt")).string());
  torch::save(w1, (dir / ("w1_" + tag + ".pt")).string());
  torch::save(sum_g, (dir / ("g_" + tag + ".pt")).string());
  torch::save(error, (dir / ("e_" + tag + ".pt")).string());
  std::ofstream(dir / ("stats" + tag)) << bytes_plain << " " << bytes_compressed
                                       << " " << hook.compressed_last_step();
  return 0;
}

constexpr int64_t kWarmSteps = 6;

/// The mean gradient of the warm-start test, 6×10: U·diag(σ)·Vᵀ with
/// σ = 4, 2, 1, 0.5, 0.25, 0.125 (U, V orthonormal), so power iteration at
/// rank 1 converges at (σ₂/σ₁)² = 1/4 per step.
torch::Tensor powersgd_mean_gradient() {
  auto gen = at::detail::createCPUGenerator(31);
  auto u = std::get<0>(torch::linalg_qr(torch::randn({6, 6}, gen)));
  auto v = std::get<0>(torch::linalg_qr(torch::randn({10, 6}, gen)));
  auto sigma = torch::tensor({4.0, 2.0, 1.0, 0.5, 0.25, 0.125});
  return (u * sigma).mm(v.t());
}

/// The PowerSGD hook alone (no reducer) at rank 1, no error feedback, on
/// one 6×10 gradient per rank, the same every step, the ranks' mean being
/// powersgd_mean_gradient(); T_WARM=0 turns the warm start off. Each rank
/// saves the averaged gradient of every step.
DDPKIT_WORKER(powersgd_warm_start) {
  auto g = test::worker_group();
  const int r = g.rank();
  parallel::PowerSGD hook(parallel::PowerSGDOptions()
                              .rank(1)
                              .start_step(0)
                              .min_compression_rate(0)
                              .error_feedback(false)
                              .warm_start(env_or("T_WARM", "1") == "1"));
  auto noise = torch::randn({6, 10}, at::detail::createCPUGenerator(32));
  const auto mine = powersgd_mean_gradient() + (r == 0 ? noise : -noise);
  auto buffer = torch::empty({60});
  const std::vector<torch::Tensor> grads{buffer.view({6, 10})};
  const std::vector<std::size_t> params{0};
  std::vector<torch::Tensor> out;
  for (int64_t s = 0; s < kWarmSteps; ++s) {
    grads[0].copy_(mine);
    parallel::GradBucket b{0, 1, s, buffer, grads, params};
    auto f = hook.run(g, b);
    while (f.pending()) f.advance(g, "PowerSGD test bucket");
    out.push_back(grads[0].clone());
  }
  torch::save(
      out,
      (test::worker_dir() / ("warm" + std::to_string(r) + ".pt")).string());
  return 0;
}

// SyncBatchNorm's workers and the reference they are checked against
// (tests/nn/: the cases are in sync_batch_norm_cases.hpp).
#include "../nn/sync_batch_norm_workers.hpp"

// libtorch 1.13 has the fused unscale kernel on CUDA only (see amp_test).
#if DDPKIT_TORCH_AT_LEAST(2, 0)
/// AMP through the DDP engine (`T_MODE=zero2`: ZeRO-2's, whose ranks hold
/// and unscale only their own gradient buckets): step 1 has an inf in rank
/// 1's gradients only (put there after the reduce, in a bucket it owns), so
/// both ranks must skip it; step 2 is clean: its gradients are divided by
/// the (halved) scale. Writes the outcome and how many gradients it held.
DDPKIT_WORKER(amp_unscale) {
  auto g = test::worker_group();
  const int r = g.rank();
  auto net = test::make_net(100);
  parallel::LossScaler scaler(1024.0);
  auto [x, y] = test::global_batch(0, 2 * kPerRank);
  auto xr = x.narrow(0, r * kPerRank, kPerRank);
  auto yr = y.narrow(0, r * kPerRank, kPerRank);
  auto scaled = [&](const torch::Tensor& o, const torch::Tensor& t) {
    return test::ce_loss(o, t) * scaler.scale();
  };
  auto run = [&](auto& eng) {
    eng.zero_grad();
    eng.forward_backward(xr, yr, scaled);
    if (r == 1) {
      torch::NoGradGuard no_grad;
      for (auto& b : eng.reducer()->buckets()) {
        if (!b.flat.defined()) continue;  // ZeRO-2: another rank's
        b.flat[0].fill_(std::numeric_limits<float>::infinity());
        break;
      }
    }
    const bool step1 = eng.unscale_and_check(scaler);
    const double scale1 = scaler.scale();
    eng.zero_grad();
    eng.forward_backward(xr, yr, scaled);
    std::vector<torch::Tensor> before;
    for (auto& p : net->parameters()) {
      before.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    }
    const bool step2 = eng.unscale_and_check(scaler);
    double worst = 0;
    int held = 0;
    auto params = net->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!before[i].defined()) continue;
      ++held;
      worst = test::worse(worst,
                          test::rel_diff(params[i].grad(), before[i] / scale1));
    }
    std::ofstream(test::worker_dir() / ("amp" + std::to_string(r)))
        << step1 << " " << scale1 << " " << step2 << " " << worst << " " << held
        << " " << params.size();
  };
  if (env_or("T_MODE", "ddp") == "zero2") {
    parallel::ZeRO2::engine<test::SmallNet> eng(net, g, {}, torch::kCPU);
    run(eng);
  } else {
    parallel::DDP::engine<test::SmallNet> eng(net, g, parallel::DDPOptions(),
                                              torch::kCPU);
    run(eng);
  }
  return 0;
}

#endif

DDPKIT_WORKER(unused_params) {
  auto g = test::worker_group();
  bool find = env_or("T_FIND", "0") == "1";
  auto net = test::make_net(5, false, /*unused=*/true);
  parallel::DDPOptions opts;
  opts.reducer().find_unused_parameters(find);
  parallel::DDP::engine<test::SmallNet> eng(net, g, opts, torch::kCPU);
  auto [x, y] = test::global_batch(0, 4);
  try {
    eng.forward_backward(x, y, test::ce_loss);
  } catch (const std::exception& e) {
    std::ofstream(test::worker_dir() / ("error" + std::to_string(g.rank())))
        << e.what();
    return 5;
  }
  // Used parameters got averaged gradients; the unused one none or zero.
  bool ok = net->fc->weight.grad().defined() &&
            (!net->unused->weight.grad().defined() ||
             net->unused->weight.grad().abs().sum().item<double>() == 0);
  return ok ? 0 : 6;
}

/// Tied weights: `tied` is `first`'s weight registered a second time, under
/// another name, and used twice in forward (what weight tying in language
/// models does).
struct TiedNetImpl : torch::nn::Cloneable<TiedNetImpl> {
  TiedNetImpl() {
    reset();
  }
  void reset() override {
    first = register_module("first", torch::nn::Linear(6, 6));
    tied = register_parameter("tied", first->weight);
    head = register_module("head", torch::nn::Linear(6, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x.mean({2, 3}).repeat({1, 2});  // N x 6
    x = torch::tanh(first(x));
    x = torch::tanh(torch::nn::functional::linear(x, tied));
    return head(x);
  }
  torch::nn::Linear first{nullptr}, head{nullptr};
  torch::Tensor tied;
};
TORCH_MODULE(TiedNet);

TiedNet make_tied(uint64_t seed) {
  torch::manual_seed(seed);
  return TiedNet();
}

/// SGD steps on the tied net: one process on the joined batch, or DDP.
void train_tied(TiedNet& net, int steps, int world, int rank,
                parallel::DDP::engine<TiedNet>* eng) {
  // Each tensor once (libtorch's parameters() lists a tied one twice, and
  // an optimizer given it twice would step it twice).
  std::vector<torch::Tensor> unique;
  for (auto& p : net->parameters()) {
    bool seen = false;
    for (auto& u : unique) seen |= u.is_same(p);
    if (!seen) unique.push_back(p);
  }
  torch::optim::SGD opt(unique, torch::optim::SGDOptions(0.1));
  for (int s = 0; s < steps; ++s) {
    auto [x, y] = test::global_batch(s, world * kPerRank);
    if (eng) {
      x = x.narrow(0, rank * kPerRank, kPerRank);
      y = y.narrow(0, rank * kPerRank, kPerRank);
    }
    opt.zero_grad();
    if (eng) {
      eng->forward_backward(x, y, test::ce_loss);
    } else {
      test::ce_loss(net->forward(x), y).backward();
    }
    opt.step();
  }
}

/// A large weight tied (registered again, first in parameters()): counted
/// twice it would move the ZeRO partition's cut (a.bias to rank 1; each
/// tensor once, it stays with rank 0), so the reducer's gradient owners
/// must come from the same de-duplicated partition as the optimizer's.
struct BigTiedImpl : torch::nn::Module {
  BigTiedImpl() {
    a = register_module("a", torch::nn::Linear(64, 64));
    tied = register_parameter("tied", a->weight);
    b = register_module("b", torch::nn::Linear(64, 64));
    head = register_module("head", torch::nn::Linear(64, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x.flatten(1).narrow(1, 0, 64);
    x = torch::tanh(a(x));
    x = torch::tanh(torch::nn::functional::linear(x, tied));
    return head(torch::tanh(b(x)));
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, head{nullptr};
  torch::Tensor tied;
};
TORCH_MODULE(BigTied);

/// Tied weights through DDP (`T_MODE=ddp`, the optimizer given each tensor
/// once), ZeRO-1 (`zero1`) or ZeRO-2 (`zero2`: the engine's sharded
/// optimizer and the reducer's gradient owners, from `parameters()`, which
/// lists the tied tensor twice), SGD with momentum: writes the net
/// (`tied{r}.pt`) and the optimizer state bytes kept (`bytes{r}`). A
/// ShardedOptimizer built directly over `parameters()` must own each
/// tensor once (exit 9 otherwise). `T_NET=big`: BigTied instead of TiedNet.
template <class Net>
int zero_tied_run(Net net, const dist::Group& g, const std::string& mode) {
  auto sgd = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.1).momentum(0.9));
  };
  auto train = [&](auto& eng, torch::optim::Optimizer& opt) {
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = test::global_batch(s, g.size() * kPerRank);
      x = x.narrow(0, g.rank() * kPerRank, kPerRank);
      y = y.narrow(0, g.rank() * kPerRank, kPerRank);
      eng.zero_grad();
      eng.forward_backward(x, y, test::ce_loss);
      opt.step();
    }
  };
  {
    parallel::ShardedOptimizer direct(net->parameters(), sgd, g);
    std::size_t owned = 0;
    for (int q = 0; q < g.size(); ++q) owned += direct.owned(q).size();
    if (owned != parallel::unique_parameters(*net).size() ||
        owned == net->parameters().size()) {
      return 9;
    }
  }
  uint64_t bytes = 0;
  if (mode == "ddp") {
    parallel::DDP::engine<Net> eng(net, g, {}, torch::kCPU);
    auto opt = sgd(parallel::unique_parameters(*net));
    train(eng, *opt);
    bytes = parallel::optimizer_state_bytes(*opt);
  } else {
    parallel::ZeROOptions zopts;
    zopts.stage(mode == "zero1" ? 1 : 2);
    parallel::ZeRO2::engine<Net> eng(net, g, zopts, torch::kCPU);
    auto opt = eng.make_optimizer(sgd);
    train(eng, *opt);
    bytes = eng.optimizer_state_bytes();
  }
  const auto r = std::to_string(g.rank());
  torch::save(net, (test::worker_dir() / ("tied" + r + ".pt")).string());
  std::ofstream(test::worker_dir() / ("bytes" + r)) << bytes;
  return 0;
}

DDPKIT_WORKER(zero_tied) {
  auto g = test::worker_group();
  const std::string mode = env_or("T_MODE", "ddp");
  if (env_or("T_NET", "tied") == "big") {
    torch::manual_seed(41 + g.rank());
    return zero_tied_run(BigTied(), g, mode);
  }
  return zero_tied_run(make_tied(40 + g.rank()), g, mode);
}

DDPKIT_WORKER(tied_weights) {
  auto g = test::worker_group();
  auto net = make_tied(40 + g.rank());
  parallel::DDP::engine<TiedNet> eng(net, g, parallel::DDPOptions(),
                                     torch::kCPU);
  // Four tensors under five names: one slot, one hook each.
  if (eng.reducer()->num_parameters() != 4) {
    std::fprintf(stderr, "rank %d: the reducer holds %zu parameters, want 4\n",
                 g.rank(), eng.reducer()->num_parameters());
    return 8;
  }
  train_tied(net, kSteps, g.size(), g.rank(), &eng);
  torch::save(net,
              (test::worker_dir() / ("tied" + std::to_string(g.rank()) + ".pt"))
                  .string());
  return 0;
}

/// Identity in forward; its backward throws while `g_throw_in_backward` is
/// set: a custom op failing in the middle of backward, after the buckets of
/// the layers above it have started their all-reduces.
bool g_throw_in_backward = false;
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*,
                               torch::Tensor x) {
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    if (g_throw_in_backward) throw std::runtime_error("injected failure");
    return {g[0]};
  }
};

/// Identity in forward; its backward runs a nested (reentrant) backward
/// through parameter `w`, as reentrant activation checkpointing does, so
/// `w`'s gradient is accumulated a second time in the same backward.
struct ReenterThrough : torch::autograd::Function<ReenterThrough> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx,
                               torch::Tensor x, torch::Tensor w) {
    ctx->saved_data["w"] = w;
    return x.clone();
  }
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx, torch::autograd::variable_list g) {
    auto w = ctx->saved_data["w"].toTensor();
    torch::AutoGradMode on(true);
    torch::autograd::backward({(w * w).sum() * 1e-3});
    return {g[0], torch::Tensor()};
  }
};

/// fc1 → [failing op | reentrant op] → fc2 → fc3.
struct ChainNetImpl : torch::nn::Cloneable<ChainNetImpl> {
  explicit ChainNetImpl(bool reenter = false) : reenter(reenter) {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(12, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(fc1(x.mean({2, 3}).repeat({1, 4})));
    x = reenter ? ReenterThrough::apply(x, fc2->weight)
                : ThrowInBackward::apply(x);
    return fc3(torch::tanh(fc2(x)));
  }
  bool reenter;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(ChainNet);

ChainNet make_chain(uint64_t seed, bool reenter = false) {
  torch::manual_seed(seed);
  return ChainNet(reenter);
}

constexpr int kFailingStep = 2;

/// One parameter per bucket, so the buckets of fc3 and fc2 are in flight
/// when the op below them throws.
parallel::ReducerOptions one_param_buckets() {
  return parallel::ReducerOptions()
      .bucket_cap_bytes(1)
      .first_bucket_cap_bytes(1)
      .last_bucket_cap_bytes(1);
}

/// The chain trained without step kFailingStep: one process on the joined
/// batches (reference) or one rank's part through `step`.
void train_chain_skipping(
    ChainNet& net, int world, int rank, bool distributed,
    const std::function<bool(int, const torch::Tensor&, const torch::Tensor&)>&
        step) {
  torch::optim::SGD opt(net->parameters(),
                        torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = test::global_batch(s, world * kPerRank);
    if (distributed) {
      x = x.narrow(0, rank * kPerRank, kPerRank);
      y = y.narrow(0, rank * kPerRank, kPerRank);
    }
    opt.zero_grad();
    if (step(s, x, y)) opt.step();
  }
}

/// A backward that throws at step kFailingStep on every rank; the loop
/// catches it, skips the batch and goes on. T_MODE=engine: through the DDP
/// engine. T_MODE=direct: the Reducer alone; the next backward must be
/// refused until prepare_for_backward() is called.
DDPKIT_WORKER(abandoned_step) {
  auto g = test::worker_group();
  const int r = g.rank();
  const auto mode = env_or("T_MODE", "engine");
  auto net = make_chain(60);
  parallel::DDPOptions opts;
  opts.reducer(one_param_buckets());
  std::unique_ptr<parallel::DDP::engine<ChainNet>> eng;
  std::unique_ptr<parallel::Reducer<>> reducer;
  if (mode == "engine") {
    eng = std::make_unique<parallel::DDP::engine<ChainNet>>(net, g, opts,
                                                            torch::kCPU);
  } else {
    std::vector<torch::Tensor> params;
    std::vector<std::string> names;
    for (auto& p : net->named_parameters()) {
      names.push_back(p.key());
      params.push_back(p.value());
    }
    reducer = std::make_unique<parallel::Reducer<>>(params, names, g,
                                                    one_param_buckets());
  }
  auto* red = eng ? eng->reducer() : reducer.get();
  int failures = 0;
  std::string refused;
  auto step = [&](int s, const torch::Tensor& x, const torch::Tensor& y) {
    g_throw_in_backward = s == kFailingStep;
    try {
      if (eng) {
        eng->forward_backward(x, y, test::ce_loss);
      } else {
        test::ce_loss(net->forward(x), y).backward();
      }
    } catch (const std::exception&) {
      ++failures;
      return false;  // skip this batch
    }
    return true;
  };
  auto guarded = [&](int s, const torch::Tensor& x, const torch::Tensor& y) {
    if (reducer && s == kFailingStep + 1) {
      // The step after the failure, without prepare_for_backward: refused.
      g_throw_in_backward = false;
      net->zero_grad();
      try {
        test::ce_loss(net->forward(x), y).backward();
        refused = "(the step after the failure was not refused)";
      } catch (const std::exception& e) {
        refused = e.what();
      }
      reducer->prepare_for_backward();
      net->zero_grad();
    }
    return step(s, x, y);
  };
  train_chain_skipping(net, g.size(), r, true, guarded);
  std::ofstream(test::worker_dir() / ("report" + std::to_string(r)))
      << failures << " failure(s), " << red->abandoned_steps() << " abandoned, "
      << red->buckets_in_flight() << " in flight\n"
      << refused;
  torch::save(
      net,
      (test::worker_dir() / ("chain" + std::to_string(r) + ".pt")).string());
  return 0;
}

/// A reentrant backward accumulates fc2.weight's gradient twice in one
/// backward: an error naming it, and the next step runs normally.
DDPKIT_WORKER(ready_twice) {
  auto g = test::worker_group();
  auto net = make_chain(61, /*reenter=*/true);
  parallel::DDPOptions opts;
  opts.reducer(one_param_buckets());
  parallel::DDP::engine<ChainNet> eng(net, g, opts, torch::kCPU);
  auto [x, y] = test::global_batch(0, kPerRank);
  std::string msg = "(no error)";
  try {
    eng.forward_backward(x, y, test::ce_loss);
  } catch (const std::exception& e) {
    msg = e.what();
  }
  // Afterwards nothing is in flight, and a step without the reentrant op
  // completes.
  const auto in_flight = eng.reducer()->buckets_in_flight();
  net->reenter = false;
  eng.zero_grad();
  eng.forward_backward(x, y, test::ce_loss);
  std::ofstream(test::worker_dir() / ("error" + std::to_string(g.rank())))
      << in_flight << " in flight\n"
      << msg;
  return 0;
}

/// A block run twice per forward (shared weights), each call under
/// nn::checkpoint when `ckpt` (reentrant: each call's gradients come in a
/// backward of its own, so block's are accumulated twice), and a layer no
/// forward uses.
struct TwiceNetImpl : torch::nn::Module {
  explicit TwiceNetImpl(bool ckpt) : ckpt(ckpt) {
    stem = register_module("stem", torch::nn::Linear(3, 8));
    block = register_module("block", torch::nn::Linear(8, 8));
    unused = register_module("unused", torch::nn::Linear(8, 8));
    head = register_module("head", torch::nn::Linear(8, 5));
  }
  torch::Tensor run_block(torch::Tensor x) {
    auto f = [this](torch::Tensor t) { return torch::tanh(block(t)); };
    return ckpt ? ddpkit::nn::checkpoint(f, x) : f(x);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(stem(x.mean({2, 3})));
    x = run_block(x);
    if (twice) x = run_block(x);
    return head(x);
  }
  bool ckpt;
  bool twice = true;
  torch::nn::Linear stem{nullptr}, block{nullptr}, unused{nullptr},
      head{nullptr};
};
TORCH_MODULE(TwiceNet);

TwiceNet make_twice(uint64_t seed, bool ckpt) {
  torch::manual_seed(seed);
  return TwiceNet(ckpt);
}

/// kSteps of SGD with momentum on TwiceNet: one process on the joined batch
/// (`eng` null), or this rank's part through DDP.
void train_twice(TwiceNet& net, int world, int rank,
                 CopyAtLaunchDDP::engine<TwiceNet>* eng) {
  auto opt = test::make_sgd(*net);
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = test::global_batch(s, world * kPerRank);
    opt.zero_grad();
    if (eng) {
      x = x.narrow(0, rank * kPerRank, kPerRank);
      y = y.narrow(0, rank * kPerRank, kPerRank);
      eng->zero_grad();
      eng->forward_backward(x, y, test::ce_loss);
    } else {
      test::ce_loss(net->forward(x), y).backward();
    }
    opt.step();
  }
}

/// static_graph (`T_STATIC=1`) or the dynamic path with
/// find_unused_parameters, on TwiceNet checkpointed (`T_CKPT=1`) or not,
/// with one parameter a bucket, each bucket's content copied when it is
/// launched (CopyAtLaunch): trains kSteps and writes twice<r>.pt, or
/// the error to error<r> (exit 5). Also writes counts<r> (static: the
/// recorded gradient counts, and whether `unused` kept an undefined
/// gradient). `T_CHANGE=1`: after the steps, one forward runs the block
/// once: the error goes to changed<r> with the buckets left in flight.
DDPKIT_WORKER(static_graph) {
  auto g = test::worker_group();
  const bool static_graph = env_or("T_STATIC", "1") == "1";
  auto net = make_twice(70 + g.rank(), env_or("T_CKPT", "1") == "1");
  parallel::DDPOptions opts;
  opts.reducer(one_param_buckets().find_unused_parameters(!static_graph));
  opts.static_graph(static_graph);
  CopyAtLaunchDDP::engine<TwiceNet> eng(net, g, opts, torch::kCPU);
  const auto r = std::to_string(g.rank());
  try {
    train_twice(net, g.size(), g.rank(), &eng);
  } catch (const std::exception& e) {
    std::ofstream(test::worker_dir() / ("error" + r)) << e.what();
    return 5;
  }
  {
    std::ofstream out(test::worker_dir() / ("counts" + r));
    for (auto c : eng.reducer()->static_gradient_counts()) out << c << ' ';
    out << "| unused grad "
        << (net->unused->weight.grad().defined() ? "defined" : "undefined");
  }
  torch::save(net, (test::worker_dir() / ("twice" + r + ".pt")).string());
  if (env_or("T_CHANGE", "0") == "1") {
    net->twice = false;
    auto [x, y] = test::global_batch(0, kPerRank);
    std::string msg = "(no error)";
    try {
      eng.zero_grad();
      eng.forward_backward(x, y, test::ce_loss);
    } catch (const std::exception& e) {
      msg = e.what();
    }
    std::ofstream(test::worker_dir() / ("changed" + r))
        << eng.reducer()->buckets_in_flight() << " in flight\n"
        << msg;
  }
  return 0;
}

/// Writes DIR/cpp<rank>.pt: this rank's parameters by name, plus `extra`,
/// for a Python script to compare.
void save_for_python_check(
    const dist::Group& g, torch::nn::Module& net,
    std::vector<std::pair<std::string, torch::Tensor>> extra = {}) {
  for (auto& p : net.named_parameters()) extra.emplace_back(p.key(), p.value());
  test::save_tensors(
      test::worker_dir() / ("cpp" + std::to_string(g.rank()) + ".pt"), extra);
}

/// Writes DIR/data.pt for a Python script to rerun a C++ run: `init`'s
/// parameters as "init.<name>", and batch(a, b) as "x<a>_<b>", "y<a>_<b>"
/// for a < na, b < nb.
template <class Batch>
void save_init_and_batches(torch::nn::Module& init, int na, int nb,
                           Batch batch) {
  std::vector<std::pair<std::string, torch::Tensor>> data;
  for (auto& p : init.named_parameters())
    data.emplace_back("init." + p.key(), p.value().detach());
  for (int a = 0; a < na; ++a) {
    for (int b = 0; b < nb; ++b) {
      auto [x, y] = batch(a, b);
      auto tag = std::to_string(a) + "_" + std::to_string(b);
      data.emplace_back("x" + tag, x);
      data.emplace_back("y" + tag, y);
    }
  }
  test::save_tensors(test::worker_dir() / "data.pt", data);
}

/// The start of the Python checks: a gloo group of 2 through a file in
/// DIR (argv[1]), DIR/data.pt loaded, `net`'s parameters set from it.
const char* const kPythonDdpPrelude = R"PY(
import os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

d = sys.argv[1]

def setup(rank, net):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(d, "rdzv"),
                            rank=rank, world_size=2)
    torch.set_num_threads(1)
    data = torch.load(os.path.join(d, "data.pt"))
    with torch.no_grad():
        for k, p in net.named_parameters():
            p.copy_(data["init." + k])
    return data

def compare(rank, net):
    """The largest relative difference to what C++ rank `rank` wrote."""
    cpp = torch.load(os.path.join(d, f"cpp{rank}.pt"))
    worst = 0.0
    for k, p in net.named_parameters():
        diff = ((cpp[k] - p.detach()).abs().max() / p.detach().abs().max()).item()
        print(f"rank {rank} {k}: relative difference {diff:.3g}")
        worst = max(worst, diff)
    return cpp, worst
)PY";

/// fc1 → [c] → fc2 (+ a): `a` is used when `use_a` is set, `c` when
/// `use_c` is, `b` never. The same module in Python is in kUnusedCheck.
struct PatternNetImpl : torch::nn::Cloneable<PatternNetImpl> {
  PatternNetImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(12, 8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 5));
    a = register_module("a", torch::nn::Linear(8, 5));
    b = register_module("b", torch::nn::Linear(8, 5));
    c = register_module("c", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(torch::Tensor x) {
    auto h = torch::tanh(fc1(x));
    if (use_c) h = torch::tanh(c(h));
    auto out = fc2(h);
    return use_a ? out + a(h) : out;
  }
  bool use_a = true, use_c = true;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, a{nullptr}, b{nullptr},
      c{nullptr};
};
TORCH_MODULE(PatternNet);

constexpr int kPatternSteps = 3;

/// Step s's micro-batch m (0: under no_sync, 1: synced) of the joined
/// batch: 2 ranks x 4 rows x 12 features.
std::pair<torch::Tensor, torch::Tensor> pattern_batch(int s, int m) {
  auto gen = at::detail::createCPUGenerator(500 + 2 * s + m);
  return {torch::randn({2 * kPerRank, 12}, gen),
          torch::randint(0, 5, {2 * kPerRank}, gen, torch::kLong)};
}

/// PyTorch's unused-parameter pattern at world 2, through the DDP engine
/// with find_unused_parameters: `a` used on rank 0 only, `b` on no rank,
/// `c` only in the no_sync micro-step. Gradients zeroed through the engine
/// (what the Trainer does); SGD with momentum and weight decay, so a
/// gradient that should stay undefined but is zero moves the weights.
/// `T_MODE=zero1|zero2`: the same through ZeRO's engine and sharded
/// optimizer instead (writes only `pattern{r}.pt`, the net, as every mode
/// does).
DDPKIT_WORKER(unused_pattern) {
  auto g = test::worker_group();
  const int r = g.rank();
  const std::string mode = env_or("T_MODE", "ddp");
  torch::manual_seed(77);
  PatternNet net;
  parallel::DDPOptions opts;
  opts.reducer(one_param_buckets().find_unused_parameters(true));
  auto sgd = [](std::vector<torch::Tensor> p) {
    return std::make_unique<torch::optim::SGD>(
        p, torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.01));
  };
  std::size_t overlapped = 0;
  auto train = [&](auto& eng, torch::optim::Optimizer& opt) {
    for (int s = 0; s < kPatternSteps; ++s) {
      eng.zero_grad();
      net->use_a = r == 0;
      for (int m = 0; m < 2; ++m) {
        auto [x, y] = pattern_batch(s, m);
        x = x.narrow(0, r * kPerRank, kPerRank);
        y = y.narrow(0, r * kPerRank, kPerRank);
        net->use_c = m == 0;
        auto half = [](const torch::Tensor& o, const torch::Tensor& t) {
          return test::ce_loss(o, t) / 2;
        };
        if (m == 0) {
          auto guard = eng.no_sync();
          eng.forward_backward(x, y, half);
        } else {
          eng.forward_backward(x, y, half);
        }
      }
      overlapped += eng.reducer()->buckets_launched_in_backward();
      opt.step();
    }
    torch::save(net,
                (test::worker_dir() / ("pattern" + std::to_string(r) + ".pt"))
                    .string());
  };
  if (mode != "ddp") {
    parallel::ZeROOptions zopts(opts);
    zopts.stage(mode == "zero1" ? 1 : 2);
    parallel::ZeRO2::engine<PatternNet> eng(net, g, zopts, torch::kCPU);
    auto opt = eng.make_optimizer(sgd);
    train(eng, *opt);
    return 0;
  }
  parallel::DDP::engine<PatternNet> eng(net, g, opts, torch::kCPU);
  auto opt = sgd(net->parameters());
  train(eng, *opt);
  save_for_python_check(
      g, *net,
      {{"b_grad_defined",
        torch::tensor(net->b->weight.grad().defined() ? 1 : 0)}});
  std::ofstream(test::worker_dir() / ("overlap" + std::to_string(r)))
      << eng.reducer()->buckets().size() << " " << overlapped;
  if (r == 0) {
    torch::manual_seed(77);
    PatternNet init;
    save_init_and_batches(*init, kPatternSteps, 2, pattern_batch);
  }
  return 0;
}

/// PyTorch's DistributedDataParallel (gloo, 2 processes) on the same model,
/// data and pattern; compares with what each C++ rank wrote.
const char* const kUnusedCheck = R"PY(
STEPS = int(sys.argv[2])

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 8)
        self.fc2 = torch.nn.Linear(8, 5)
        self.a = torch.nn.Linear(8, 5)
        self.b = torch.nn.Linear(8, 5)
        self.c = torch.nn.Linear(8, 8)
        self.use_a = True
        self.use_c = True
    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.use_c:
            h = torch.tanh(self.c(h))
        out = self.fc2(h)
        return out + self.a(h) if self.use_a else out

def run(rank):
    net = Net()
    data = setup(rank, net)
    ddp = DDP(net, find_unused_parameters=True, bucket_cap_mb=1e-6)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    for s in range(STEPS):
        opt.zero_grad()
        net.use_a = rank == 0
        for m in range(2):
            x = data[f"x{s}_{m}"][rank * 4:(rank + 1) * 4]
            y = data[f"y{s}_{m}"][rank * 4:(rank + 1) * 4]
            net.use_c = m == 0
            if m == 0:
                with ddp.no_sync():
                    (torch.nn.functional.cross_entropy(ddp(x), y) / 2).backward()
            else:
                (torch.nn.functional.cross_entropy(ddp(x), y) / 2).backward()
        opt.step()
    cpp, worst = compare(rank, net)
    b_none = net.b.weight.grad is None
    print(f"rank {rank}: b.grad is None in PyTorch: {b_none}; defined in ddpkit: "
          f"{bool(cpp['b_grad_defined'].item())}")
    ok = worst <= 1e-5 and b_none and not bool(cpp["b_grad_defined"].item())
    # No destroy_process_group and no interpreter teardown: torch 2.11's
    # ProcessGroupGloo can abort or deadlock there ("terminate called
    # without an active exception", seen in CI after every check passed).
    sys.stdout.flush()
    os._exit(0 if ok else 1)

if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
)PY";

/// A head registered before the trunk it follows: registration order is
/// the reverse of what backward produces.
struct HeadFirstNetImpl : torch::nn::Cloneable<HeadFirstNetImpl> {
  HeadFirstNetImpl() {
    reset();
  }
  void reset() override {
    head = register_module("head", torch::nn::Linear(16, 5));
    trunk1 = register_module("trunk1", torch::nn::Linear(12, 16));
    trunk2 = register_module("trunk2", torch::nn::Linear(16, 16));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(trunk1(x.mean({2, 3}).repeat({1, 4})));
    return head(torch::tanh(trunk2(x)));
  }
  torch::nn::Linear head{nullptr}, trunk1{nullptr}, trunk2{nullptr};
};
TORCH_MODULE(HeadFirstNet);

HeadFirstNet make_head_first(uint64_t seed) {
  torch::manual_seed(seed);
  return HeadFirstNet();
}

/// SGD with momentum on the head-first (or branch) net: one process on the
/// joined batch, or one rank's part through the DDP engine.
template <class Net>
void train_head_first(Net& net, int world, int rank,
                      std::type_identity_t<parallel::DDP::engine<Net>>* eng) {
  torch::optim::SGD opt(net->parameters(),
                        torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int s = 0; s < kSteps; ++s) {
    auto [x, y] = test::global_batch(s, world * kPerRank);
    if (eng) {
      x = x.narrow(0, rank * kPerRank, kPerRank);
      y = y.narrow(0, rank * kPerRank, kPerRank);
      eng->zero_grad();
      eng->forward_backward(x, y, test::ce_loss);
    } else {
      opt.zero_grad();
      test::ce_loss(net->forward(x), y).backward();
    }
    opt.step();
  }
}

/// Two branches a and b (12→8 each, tanh) summed into a head (8→5).
/// `a_first` orders the forward only: the function is the same, but
/// backward runs the branch recorded last first (autograd takes the
/// latest node first), so a rank with a_first gets b's gradients before
/// a's, and one without gets a's first.
struct BranchNetImpl : torch::nn::Cloneable<BranchNetImpl> {
  BranchNetImpl() {
    reset();
  }
  void reset() override {
    // Registered head first: the initial buckets (reverse registration
    // order) are neither rank's arrival order.
    head = register_module("head", torch::nn::Linear(8, 5));
    a = register_module("a", torch::nn::Linear(12, 8));
    b = register_module("b", torch::nn::Linear(12, 8));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = x.mean({2, 3}).repeat({1, 4});
    torch::Tensor ha, hb;
    if (a_first) {
      ha = torch::tanh(a(x));
      hb = torch::tanh(b(x));
    } else {
      hb = torch::tanh(b(x));
      ha = torch::tanh(a(x));
    }
    return head(ha + hb);
  }
  bool a_first = true;
  torch::nn::Linear a{nullptr}, b{nullptr}, head{nullptr};
};
TORCH_MODULE(BranchNet);

BranchNet make_branch(uint64_t seed, bool a_first) {
  torch::manual_seed(seed);
  BranchNet net;
  net->a_first = a_first;
  return net;
}

/// The order (parameter names, comma-separated) in which one backward of
/// `net` on a batch delivers the gradients.
std::string arrival_order(BranchNet& net) {
  std::string order;
  std::vector<std::pair<torch::Tensor, unsigned>> hooks;
  for (auto& p : net->named_parameters()) {
    const auto name = p.key();
    hooks.emplace_back(p.value(),
                       p.value().register_hook([&order, name](torch::Tensor) {
                         order += (order.empty() ? "" : ",") + name;
                       }));
  }
  auto [x, y] = test::global_batch(0, kPerRank);
  test::ce_loss(net->forward(x), y).backward();
  for (auto& [t, h] : hooks) t.remove_hook(h);
  net->zero_grad();
  return order;
}

/// Writes the names in bucket 0 before and after training (the first
/// gradients to be ready should be there once the buckets are rebuilt).
DDPKIT_WORKER(bucket_rebuild) {
  auto g = test::worker_group();
  auto net = make_head_first(80 + g.rank());
  parallel::DDPOptions opts;
  opts.reducer(
      one_param_buckets().rebuild_buckets(env_or("T_REBUILD", "1") == "1"));
  parallel::DDP::engine<HeadFirstNet> eng(net, g, opts, torch::kCPU);
  auto names = net->named_parameters().keys();
  auto first = [&] {
    std::string out;
    for (auto i : eng.reducer()->buckets().front().params) out += names[i];
    return out;
  };
  const auto before = first();
  train_head_first(net, g.size(), g.rank(), &eng);
  std::ofstream(test::worker_dir() / ("order" + std::to_string(g.rank())))
      << before << " " << first() << " " << eng.reducer()->rebuilds();
  torch::save(
      net, (test::worker_dir() / ("hf" + std::to_string(g.rank()))).string() +
               ".pt");
  return 0;
}

/// The branch net with a_first on rank 0 only, so the ranks' first steps
/// deliver gradients in different orders: writes every bucket's
/// parameters in order (comma-separated) before and after training.
DDPKIT_WORKER(bucket_rebuild_disagree) {
  auto g = test::worker_group();
  auto net = make_branch(90 + g.rank(), /*a_first=*/g.rank() == 0);
  parallel::DDPOptions opts;
  opts.reducer(one_param_buckets().rebuild_buckets(true));
  parallel::DDP::engine<BranchNet> eng(net, g, opts, torch::kCPU);
  auto names = net->named_parameters().keys();
  auto order = [&] {
    std::string out;
    for (const auto& b : eng.reducer()->buckets()) {
      for (auto i : b.params) out += (out.empty() ? "" : ",") + names[i];
    }
    return out;
  };
  const auto before = order();
  train_head_first(net, g.size(), g.rank(), &eng);
  std::ofstream(test::worker_dir() / ("order" + std::to_string(g.rank())))
      << before << " " << order() << " " << eng.reducer()->rebuilds();
  torch::save(
      net, (test::worker_dir() / ("br" + std::to_string(g.rank()))).string() +
               ".pt");
  return 0;
}

/// fc1 → tanh → fc2, the same in kJoinCheck's Python.
struct JoinNetImpl : torch::nn::Cloneable<JoinNetImpl> {
  JoinNetImpl() {
    reset();
  }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(12, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 5));
  }
  torch::Tensor forward(torch::Tensor x) {
    return fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(JoinNet);

/// Rank r's batch s (rank 0 has 2 batches, rank 1 has 3).
std::pair<torch::Tensor, torch::Tensor> join_batch(int r, int s) {
  auto gen = at::detail::createCPUGenerator(700 + 10 * r + s);
  return {torch::randn({kPerRank, 12}, gen),
          torch::randint(0, 5, {kPerRank}, gen, torch::kLong)};
}

/// Uneven inputs through join_round: rank 0 runs out after 2 batches,
/// rank 1 after 3.
DDPKIT_WORKER(join_uneven) {
  auto g = test::worker_group();
  const int r = g.rank();
  torch::manual_seed(90 + r);  // rank 0's init is broadcast
  JoinNet net;
  parallel::DDPOptions opts;
  opts.reducer(one_param_buckets());
  parallel::DDP::engine<JoinNet> eng(net, g, opts, torch::kCPU);
  torch::optim::SGD opt(net->parameters(),
                        torch::optim::SGDOptions(0.1).momentum(0.9));
  const int have = r == 0 ? 2 : 3;
  int s = 0, rounds = 0;
  for (;;) {
    const bool has = s < have;
    if (!eng.join_round(has)) break;
    ++rounds;
    if (!has) continue;
    auto [x, y] = join_batch(r, s++);
    opt.zero_grad();
    eng.forward_backward(x, y, test::ce_loss);
    opt.step();
  }
  save_for_python_check(
      g, *net, {{"rounds", torch::tensor(static_cast<int64_t>(rounds))}});
  if (r == 0) {
    torch::manual_seed(90);
    JoinNet init;
    save_init_and_batches(*init, 2, 3, join_batch);
  }
  return 0;
}

/// PyTorch's DistributedDataParallel under torch.distributed.algorithms.Join
/// on the same model and batches; compares with each C++ rank.
const char* const kJoinCheck = R"PY(
from torch.distributed.algorithms.join import Join

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(12, 16)
        self.fc2 = torch.nn.Linear(16, 5)
    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))

def run(rank):
    net = Net()
    data = setup(rank, net)
    ddp = DDP(net, bucket_cap_mb=1e-6)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with Join([ddp]):
        for s in range(2 if rank == 0 else 3):
            opt.zero_grad()
            out = ddp(data[f"x{rank}_{s}"])
            torch.nn.functional.cross_entropy(out, data[f"y{rank}_{s}"]).backward()
            opt.step()
    cpp, worst = compare(rank, net)
    print(f"rank {rank}: {int(cpp['rounds'].item())} rounds in ddpkit")
    # As above: no teardown of the process group (torch 2.11 can abort).
    sys.stdout.flush()
    os._exit(0 if worst <= 1e-5 and int(cpp["rounds"].item()) == 3 else 1)

if __name__ == "__main__":
    mp.spawn(run, nprocs=2)
)PY";

DDPKIT_WORKER(mismatched_models) {
  auto g = test::worker_group();
  // Rank 1 builds the model with BatchNorm, rank 0 without.
  auto net = test::make_net(5, g.rank() == 1);
  try {
    parallel::DDP::engine<test::SmallNet> eng(net, g, {}, torch::kCPU);
  } catch (const DistError& e) {
    std::ofstream(test::worker_dir() / ("error" + std::to_string(g.rank())))
        << e.what();
    return 7;
  }
  return 0;
}

// ZeRO-1 and ZeRO-2: their workers and cases (the suite "parallel").
#include "zero_cases.hpp"
// ZeRO-3: its workers and cases.
#include "zero3_cases.hpp"

TEST_SUITE("parallel") {
  TEST_CASE(
      "to_memory_format converts 4-D parameters and buffers in place, "
      "values and identities kept; has_4d_tensors sees either") {
    torch::manual_seed(2);
    torch::nn::Sequential convnet(torch::nn::Conv2d(3, 4, 3),
                                  torch::nn::Linear(4, 2));
    torch::nn::Sequential mlp(torch::nn::Linear(4, 2));
    CHECK(parallel::has_4d_tensors(*convnet));
    CHECK_FALSE(parallel::has_4d_tensors(*mlp));
    auto with_buffer = std::make_shared<torch::nn::Module>();
    auto buf = with_buffer->register_buffer("b", torch::randn({2, 3, 4, 5}));
    CHECK(parallel::has_4d_tensors(*with_buffer));

    const auto cl = torch::MemoryFormat::ChannelsLast;
    auto w = convnet->parameters()[0];  // as an optimizer holds it
    const auto w_before = w.clone(), b_before = buf.clone();
    const auto linear_w = convnet->parameters()[2];
    const auto linear_strides = linear_w.strides().vec();
    parallel::to_memory_format(*convnet, cl);
    parallel::to_memory_format(*with_buffer, cl);
    CHECK(w.is_contiguous(cl));
    CHECK_FALSE(w.is_contiguous());
    CHECK(convnet->parameters()[0].unsafeGetTensorImpl() ==
          w.unsafeGetTensorImpl());
    CHECK(w.requires_grad());
    CHECK(torch::equal(w, w_before));
    CHECK(buf.is_contiguous(cl));
    CHECK_FALSE(buf.is_contiguous());
    CHECK(torch::equal(buf, b_before));
    CHECK(linear_w.strides().vec() == linear_strides);
    parallel::to_memory_format(*convnet, torch::MemoryFormat::Contiguous);
    CHECK(w.is_contiguous());
    CHECK(torch::equal(w, w_before));
  }

  TEST_CASE("DDP equals one process on the joined batch") {
    for (bool bn : {false, true}) {
      for (int world : {2, 4}) {
        CAPTURE(bn);
        CAPTURE(world);
        TempDir dir;
        auto res = run_workers("ddp_train", world, dir.str(),
                               {{"T_BN", bn ? "1" : "0"}});
        REQUIRE(res.ok());
        auto ref = reference(world, bn);
        for (int r = 0; r < world; ++r) {
          auto net = load_net(dir / ("net" + std::to_string(r) + ".pt"), bn);
          double d = test::max_state_diff(*net, *ref);
          MESSAGE("world ", world, std::string(bn ? " SyncBN" : ""), " rank ",
                  r, ": max relative difference ", d);
          CHECK(d <= 1e-5);
        }
      }
    }
  }

  TEST_CASE("DDP: no_sync accumulation equals one step on the joined batch") {
    TempDir dir;
    auto res = run_workers("ddp_train", 2, dir.str(), {{"T_NOSYNC", "1"}});
    REQUIRE(res.ok());
    auto ref = reference(2, false);
    auto net = load_net(dir / "net0.pt", false);
    double d = test::max_state_diff(*net, *ref);
    MESSAGE("no_sync: max relative difference ", d);
    CHECK(d <= 1e-5);
  }

  TEST_CASE(
      "DDP over gloo's TCP, and with buckets copied through shared memory, "
      "equals one process") {
    auto ref = reference(2, false);
    for (auto [name, env] : std::vector<std::pair<
             std::string, std::vector<std::pair<std::string, std::string>>>>{
             {"gloo", {{"DDPKIT_SHM", "0"}}},
             {"copied buckets", {{"T_SHARED", "0"}}}}) {
      CAPTURE(name);
      TempDir dir;
      REQUIRE(run_workers("ddp_train", 2, dir.str(), env).ok());
      auto net = load_net(dir / "net1.pt", false);
      double d = test::max_state_diff(*net, *ref);
      MESSAGE(name, ": max relative difference ", d);
      CHECK(d <= 1e-5);
    }
  }

  TEST_CASE(
      "DDP: gradients stay bucket views however they are zeroed, with the "
      "same result") {
    auto ref = reference(2, false);
    for (std::string zero : {"none", "reducer"}) {
      CAPTURE(zero);
      TempDir dir;
      REQUIRE(run_workers("ddp_train", 2, dir.str(), {{"T_ZERO", zero}}).ok());
      auto net = load_net(dir / "net0.pt", false);
      double d = test::max_state_diff(*net, *ref);
      MESSAGE("zeroing by ", zero, ": max relative difference ", d);
      CHECK(d <= 1e-5);
    }
  }

  TEST_CASE("DDP: 1 KiB and 25 MiB buckets give identical results") {
    TempDir small, large;
    auto trace = (small / "trace_{rank}.json").string();
    REQUIRE(run_workers("ddp_train", 2, small.str(),
                        {{"T_BUCKET", "1024"}, {"T_TRACE", trace}})
                .ok());
    REQUIRE(run_workers("ddp_train", 2, large.str(), {{"T_BUCKET", "26214400"}})
                .ok());
    for (int r = 0; r < 2; ++r) {
      auto a = load_net(small / ("net" + std::to_string(r) + ".pt"), false);
      auto b = load_net(large / ("net" + std::to_string(r) + ".pt"), false);
      CHECK(test::max_state_diff(*a, *b) == 0);
    }
    // The trace of the 1 KiB run has many buckets, each with an all-reduce.
    std::ifstream in(small / "trace_0.json");
    std::string json((std::istreambuf_iterator<char>(in)), {});
    CHECK(json.find("\"traceEvents\"") != std::string::npos);
    CHECK(json.find("allreduce bucket 2") != std::string::npos);
    CHECK(json.find("wait after backward") != std::string::npos);
    CHECK(json.find("\"forward\"") != std::string::npos);
  }

  TEST_CASE(
      "DDP PowerSGD: at full rank it equals plain averaging; at rank 1 it "
      "does not") {
    auto ref = reference(2, false);
    for (auto [comm, full] : {std::pair{std::string("powersgd_full"), true},
                              std::pair{std::string("powersgd_r1"), false}}) {
      CAPTURE(comm);
      TempDir dir;
      auto res = run_workers("ddp_train", 2, dir.str(), {{"T_COMM", comm}});
      CAPTURE(res.message);
      REQUIRE(res.ok());
      auto a = load_net(dir / "net0.pt", false);
      auto b = load_net(dir / "net1.pt", false);
      CHECK(test::max_state_diff(*a, *b) == 0);  // every rank the same
      double d = test::max_state_diff(*a, *ref);
      MESSAGE(comm, ": max relative difference to plain averaging ", d);
      if (full) {
        CHECK(d <= 1e-5);
      } else {
        CHECK(d > 1e-3);  // rank 1 really approximates
      }
    }
  }

  TEST_CASE(
      "DDP PowerSGD: with error feedback the updates add up to the mean "
      "gradient minus the error left; 1-D tensors are averaged exactly; "
      "fewer bytes") {
    TempDir dir;
    auto res = run_workers("powersgd_feedback", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    auto load = [&](const std::string& name, int r) {
      std::vector<torch::Tensor> v;
      torch::load(v, (dir / (name + "_" + std::to_string(r) + ".pt")).string());
      return v;
    };
    auto w0 = load("w0", 0), w1 = load("w1", 0), w1b = load("w1", 1);
    auto g0 = load("g", 0), g1 = load("g", 1);
    auto e0 = load("e", 0), e1 = load("e", 1);
    const double lr = 0.1;
    int compressed = 0;
    for (std::size_t i = 0; i < w0.size(); ++i) {
      CAPTURE(i);
      CHECK(test::rel_diff(w1[i], w1b[i]) == 0);  // ranks agree exactly
      // SGD: w0 - w1 = lr * sum of applied gradients; error feedback makes
      // that sum the ranks' mean gradient minus the mean error left over.
      auto applied = (w0[i] - w1[i]) / lr;
      auto mean_g = (g0[i] + g1[i]) / 2;
      auto mean_e = (e0[i] + e1[i]) / 2;
      const double d = test::rel_diff(applied, mean_g - mean_e);
      const double left = test::rel_diff(mean_g - mean_e, mean_g);
      MESSAGE("parameter ", i, " (", w0[i].dim(), "-D): relative difference ",
              d, "; error left ", left);
      CHECK(d <= 1e-4);
      if (w0[i].dim() == 1) {
        CHECK(e0[i].abs().max().item<double>() == 0);  // sent uncompressed
      } else {
        compressed += left > 1e-4;  // a real approximation error
      }
    }
    CHECK(compressed == 3);  // conv1, conv2, fc
    std::ifstream in(dir / "stats0");
    uint64_t plain = 0, sent = 0, matrices = 0;
    in >> plain >> sent >> matrices;
    MESSAGE("bytes per step: ", plain, " plain, ", sent, " PowerSGD rank 1 (",
            matrices, " matrices compressed)");
    CHECK(matrices == 3);
    CHECK(sent * 4 < plain);
  }

  TEST_CASE(
      "DDP PowerSGD: the warm start continues the power iteration from last "
      "step's Q") {
    const auto mean = powersgd_mean_gradient().to(torch::kDouble);
    // The best rank-1 approximation's error, ‖M - M₁‖ = sqrt(Σ_{i≥2} σᵢ²).
    const double best = std::sqrt(4.0 + 1.0 + 0.25 + 0.0625 + 0.015625);
    for (bool warm : {true, false}) {
      CAPTURE(warm);
      TempDir dir;
      auto res = run_workers("powersgd_warm_start", 2, dir.str(),
                             {{"T_WARM", warm ? "1" : "0"}});
      CAPTURE(res.message);
      REQUIRE(res.ok());
      std::vector<torch::Tensor> out0, out1;
      torch::load(out0, (dir / "warm0.pt").string());
      torch::load(out1, (dir / "warm1.pt").string());
      REQUIRE(out0.size() == static_cast<std::size_t>(kWarmSteps));
      REQUIRE(out1.size() == out0.size());
      double worst_step = 0;  // largest difference to the power iteration
      std::vector<double> err;
      for (std::size_t s = 0; s < out0.size(); ++s) {
        CAPTURE(s);
        CHECK(test::rel_diff(out0[s], out1[s]) == 0);  // ranks agree
        const auto got = out0[s].to(torch::kDouble);
        err.push_back((mean - got).norm().item<double>());
        if (s == 0) continue;
        // One power-iteration step from last step's result P·Qᵀ (rank 1,
        // so its rows are multiples of Qᵀ): v = Q/‖Q‖, u = M·v/‖M·v‖, and
        // the gradient becomes u·(Mᵀ·u)ᵀ = u·uᵀ·M.
        const auto prev = out0[s - 1].to(torch::kDouble);
        const auto row = prev.norm(2, {1}).argmax().item<int64_t>();
        const auto v = prev[row] / prev[row].norm();
        auto u = mean.mv(v);
        u = u / u.norm();
        const auto want = torch::outer(u, u).mm(mean);
        worst_step = test::worse(worst_step, test::rel_diff(got, want));
      }
      std::string errs;
      for (double e : err) errs += " " + std::to_string(e);
      MESSAGE(std::string(warm ? "warm start" : "random Q each step"),
              ": ‖mean - approximation‖ per step" + errs, " (best ", best,
              "); largest relative difference to one power-iteration step "
              "from the previous result ",
              worst_step);
      if (warm) {
        CHECK(worst_step <= 1e-4);
        for (std::size_t s = 1; s < err.size(); ++s) {
          CHECK(err[s] <= err[s - 1] + 1e-6);  // power iteration converges
        }
        CHECK(err.front() > best * 1.001);  // it had something to converge
        CHECK(err.back() <= best * 1.0001);
      } else {
        CHECK(worst_step > 1e-2);  // the check above can tell
      }
    }
  }

  TEST_CASE(
      "DDP: compressed gradients stay within their documented tolerance") {
    auto ref = reference(2, false);
    for (auto [comm, tol] : {std::pair{std::string("fp16"), 1e-3},
                             std::pair{std::string("bf16"), 1e-2}}) {
      CAPTURE(comm);
      TempDir dir;
      REQUIRE(run_workers("ddp_train", 2, dir.str(), {{"T_COMM", comm}}).ok());
      auto net = load_net(dir / "net0.pt", false);
      double d = test::max_state_diff(*net, *ref);
      MESSAGE(comm, ": max relative difference to float32 ", d);
      CHECK(d <= tol);
      CHECK(d > 0);  // it really went through the compressed path
    }
    // A hook of one's own (DESIGN's example, fp16 on the wire in a few
    // lines) gives exactly the built-in fp16 hook's result.
    {
      TempDir mine, builtin;
      REQUIRE(run_workers("ddp_train", 2, mine.str(), {{"T_COMM", "my_fp16"}})
                  .ok());
      REQUIRE(run_workers("ddp_train", 2, builtin.str(), {{"T_COMM", "fp16"}})
                  .ok());
      auto a = load_net(mine / "net0.pt", false);
      auto b = load_net(builtin / "net0.pt", false);
      const double d = test::max_state_diff(*a, *b);
      MESSAGE("DESIGN's own-hook example vs Fp16Compression: ", d);
      CHECK(d == 0);
    }
    // bf16 over gloo's TCP: libtorch 2.x's gloo adds bf16; 1.13's cannot,
    // and then the buckets go uncompressed as float32 (said once), equal to
    // plain DDP, not rounded to bf16 and sent as float32 (no bytes saved).
    TempDir dir;
    REQUIRE(run_workers("ddp_train", 2, dir.str(),
                        {{"T_COMM", "bf16"}, {"DDPKIT_SHM", "0"}})
                .ok());
    int wire = -1;
    std::ifstream(dir / "wire0") >> wire;
    auto net = load_net(dir / "net0.pt", false);
    double d = test::max_state_diff(*net, *ref);
    MESSAGE("bf16 over gloo: ",
            std::string(wire == 1 ? "compressed" : "sent as float32"),
            ", max relative difference to float32 ", d);
    REQUIRE(wire >= 0);
    if (wire == 1) {
      CHECK(d <= 1e-2);
      CHECK(d > 0);
    } else {
      CHECK(d <= 1e-5);
    }
  }

  TEST_CASE(
      "AMP unscale through the DDP and ZeRO-2 engines: an inf on one rank "
      "(in ZeRO-2, in its own gradient shard) skips the step on every rank; "
      "a clean step is divided by the halved scale") {
    DDPKIT_REQUIRE_BUILD(DDPKIT_TORCH_AT_LEAST(2, 0),
                         "libtorch < 2.0 has no CPU kernel for the fused "
                         "unscale");
    for (const char* mode : {"ddp", "zero2"}) {
      CAPTURE(mode);
      TempDir dir;
      auto res = run_workers("amp_unscale", 2, dir.str(), {{"T_MODE", mode}});
      CAPTURE(res.message);
      REQUIRE(res.ok());
      for (int r = 0; r < 2; ++r) {
        std::ifstream in(dir / ("amp" + std::to_string(r)));
        int step1 = -1, step2 = -1, held = 0, all = 0;
        double scale1 = 0, worst = 1;
        in >> step1 >> scale1 >> step2 >> worst >> held >> all;
        MESSAGE(std::string(mode), " rank ", r, ": step 1 ",
                std::string(step1 ? "taken" : "skipped"), ", scale then ",
                scale1, "; step 2 ", std::string(step2 ? "taken" : "skipped"),
                ", unscaled gradients off by ", worst, " (", held, " of ", all,
                " gradients held)");
        CHECK(step1 == 0);
        CHECK(scale1 == 512.0);
        CHECK(step2 == 1);
        CHECK(worst <= 1e-7);
        CHECK(held > 0);
        // ZeRO-2: each rank holds only its shard.
        if (std::string(mode) == "zero2") CHECK(held < all);
      }
    }
  }

  TEST_CASE("DataParallel with CPU replicas equals single-device training") {
    auto ref = reference(1, false, 6);
    for (int replicas : {2, 3}) {
      CAPTURE(replicas);
      auto net = test::make_net(100, false);
      parallel::DataParallel::engine<test::SmallNet> eng(
          net, dist::Group{},
          parallel::DataParallelOptions().replicas(replicas), torch::kCPU);
      CHECK(eng.num_replicas() == static_cast<std::size_t>(replicas));
      auto opt = test::make_sgd(*net);
      for (int s = 0; s < kSteps; ++s) {
        auto [x, y] = test::global_batch(s, 6);
        opt.zero_grad();
        auto out = eng.forward_backward(x, y, test::ce_loss);
        CHECK(out.output.size(0) == 6);
        opt.step();
      }
      double d = test::max_state_diff(*net, *ref);
      MESSAGE(replicas, " replicas: max relative difference ", d);
      CHECK(d <= 1e-5);
    }
  }

  TEST_CASE(
      "DataParallel: batch 7 over 3 replicas, unequal parts weighted exactly") {
    auto ref = reference(1, false, 7);
    auto net = test::make_net(100, false);
    parallel::DataParallel::engine<test::SmallNet> eng(
        net, dist::Group{}, parallel::DataParallelOptions().replicas(3),
        torch::kCPU);
    auto opt = test::make_sgd(*net);
    for (int s = 0; s < kSteps; ++s) {
      auto [x, y] = test::global_batch(s, 7);
      // The weights this step starts from, for the per-replica check.
      auto start = test::make_net(0, false);
      {
        torch::NoGradGuard no_grad;
        auto src = net->parameters();
        auto dst = start->parameters();
        for (std::size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
      }
      opt.zero_grad();
      auto out = eng.forward_backward(x, y, test::ce_loss);
      CHECK(out.output.size(0) == 7);
      // Every replica ran, on 3, 2 and 2 rows.
      CHECK(eng.last_split() == std::vector<int64_t>{3, 2, 2});
      // Replicas 1 and 2 hold the gradient of their own rows' mean loss
      // weighted by their share of the batch (2/7).
      int64_t row = 3;
      for (std::size_t k = 1; k < 3; ++k) {
        CAPTURE(k);
        start->zero_grad();
        (test::ce_loss(start->forward(x.narrow(0, row, 2)),
                       y.narrow(0, row, 2)) *
         (2.0 / 7.0))
            .backward();
        auto want = start->parameters();
        auto got = eng.replica(k)->parameters();
        REQUIRE(got.size() == want.size());
        for (std::size_t i = 0; i < got.size(); ++i) {
          REQUIRE(got[i].grad().defined());
          CHECK(torch::allclose(got[i].grad(), want[i].grad(), 1e-5, 1e-7));
        }
        row += 2;
      }
      opt.step();
    }
    double d = test::max_state_diff(*net, *ref);
    MESSAGE("7 rows over 3 replicas: max relative difference ", d);
    CHECK(d <= 1e-5);
  }

  TEST_CASE("DDP: unused parameters are an error naming them, or handled") {
    TempDir dir;
    auto res = run_workers("unused_params", 2, dir.str(), {{"T_FIND", "0"}});
    CHECK(res.exit_code == 5);
    std::ifstream in(dir / "error0");
    std::string msg((std::istreambuf_iterator<char>(in)), {});
    MESSAGE(msg);
    CHECK(msg.find("unused.weight") != std::string::npos);
    CHECK(msg.find("find_unused_parameters") != std::string::npos);
    TempDir dir2;
    CHECK(run_workers("unused_params", 2, dir2.str(), {{"T_FIND", "1"}}).ok());
  }

  TEST_CASE("DDP: tied weights get one slot and equal one process") {
    auto ref = make_tied(40);
    REQUIRE(ref->named_parameters().size() == 5);
    REQUIRE(ref->parameters().size() == 5);  // libtorch lists it twice
    train_tied(ref, kSteps, 2, 0, nullptr);
    TempDir dir;
    auto res = run_workers("tied_weights", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    for (int r = 0; r < 2; ++r) {
      auto net = make_tied(0);
      torch::load(net, (dir / ("tied" + std::to_string(r) + ".pt")).string());
      CHECK(net->tied.data_ptr() == net->first->weight.data_ptr());
      double d = test::max_state_diff(*net, *ref);
      MESSAGE("tied weights, rank ", r, ": max relative difference ", d);
      CHECK(d <= 1e-5);
    }
  }

  TEST_CASE(
      "DDP: a backward that throws mid-step can be skipped; the run equals "
      "one process that never saw that batch") {
    auto ref = make_chain(60);
    train_chain_skipping(
        ref, 2, 0, false,
        [&](int s, const torch::Tensor& x, const torch::Tensor& y) {
          if (s == kFailingStep) return false;
          test::ce_loss(ref->forward(x), y).backward();
          return true;
        });
    for (std::string mode : {"engine", "direct"}) {
      CAPTURE(mode);
      TempDir dir;
      auto res =
          run_workers("abandoned_step", 2, dir.str(), {{"T_MODE", mode}});
      CAPTURE(res.message);
      REQUIRE(res.ok());
      for (int r = 0; r < 2; ++r) {
        std::ifstream in(dir / ("report" + std::to_string(r)));
        std::string first, rest;
        std::getline(in, first);
        rest.assign(std::istreambuf_iterator<char>(in), {});
        MESSAGE(mode, " rank ", r, ": ", first, " | ", rest);
        CHECK(first == "1 failure(s), 1 abandoned, 0 in flight");
        if (mode == "direct") {
          CHECK(rest.find("the previous step's reduction did not finish") !=
                std::string::npos);
          CHECK(rest.find("prepare_for_backward") != std::string::npos);
        }
        auto net = make_chain(0);
        torch::load(net,
                    (dir / ("chain" + std::to_string(r) + ".pt")).string());
        double d = test::max_state_diff(*net, *ref);
        MESSAGE(mode, " rank ", r, ": max relative difference ", d);
        CHECK(d <= 1e-5);
      }
    }
  }

  TEST_CASE(
      "DDP: a gradient marked ready twice in one backward is an error "
      "naming it") {
    TempDir dir;
    auto res = run_workers("ready_twice", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(dir / ("error" + std::to_string(r)));
      std::string msg((std::istreambuf_iterator<char>(in)), {});
      MESSAGE("rank ", r, ": ", msg);
      CHECK(msg.rfind("0 in flight\n", 0) == 0);
      CHECK(msg.find("parameter fc2.weight was marked ready twice") !=
            std::string::npos);
    }
  }

  TEST_CASE(
      "DDP static_graph: a module run twice under reentrant activation "
      "checkpointing, refused by the dynamic path, equals one process") {
    // One process: the checkpointed net equals the plain one.
    auto ref = make_twice(70, false);
    train_twice(ref, 2, 0, nullptr);
    auto ref_ckpt = make_twice(70, true);
    train_twice(ref_ckpt, 2, 0, nullptr);
    const double d_ckpt = test::max_state_diff(*ref_ckpt, *ref);
    MESSAGE("one process, checkpointed vs plain: ", d_ckpt);
    CHECK(d_ckpt <= 1e-6);
    {
      TempDir dir;
      auto res = run_workers("static_graph", 2, dir.str(), {{"T_STATIC", "0"}});
      CHECK(res.exit_code == 5);
      std::ifstream in(dir / "error0");
      std::string msg((std::istreambuf_iterator<char>(in)), {});
      MESSAGE("dynamic path: ", msg);
      CHECK(msg.find("block.") != std::string::npos);
      CHECK(msg.find("marked ready twice") != std::string::npos);
    }
    for (const std::string ckpt : {"1", "0"}) {
      CAPTURE(ckpt);
      TempDir dir;
      auto res = run_workers("static_graph", 2, dir.str(),
                             {{"T_CKPT", ckpt}, {"T_CHANGE", ckpt}});
      CAPTURE(res.message);
      REQUIRE(res.ok());
      for (int r = 0; r < 2; ++r) {
        const auto rs = std::to_string(r);
        auto net = make_twice(0, ckpt == "1");
        torch::load(net, (dir / ("twice" + rs + ".pt")).string());
        const double d = test::max_state_diff(*net, *ref);
        MESSAGE("static graph, checkpointed ", ckpt, ", rank ", r,
                ": max relative difference to one process ", d);
        CHECK(d <= 1e-5);
        std::ifstream in(dir / ("counts" + rs));
        std::string counts((std::istreambuf_iterator<char>(in)), {});
        MESSAGE(
            "recorded counts (stem.w, stem.b, block.w, block.b, "
            "unused.w, unused.b, head.w, head.b): ",
            counts);
        // Checkpointed: block's gradients come in two backwards.
        CHECK(counts == (ckpt == "1"
                             ? "1 1 2 2 0 0 1 1 | unused grad undefined"
                             : "1 1 1 1 0 0 1 1 | unused grad undefined"));
        if (ckpt == "1") {
          std::ifstream ch(dir / ("changed" + rs));
          std::string msg((std::istreambuf_iterator<char>(ch)), {});
          MESSAGE("graph changed: ", msg);
          CHECK(msg.rfind("0 in flight\n", 0) == 0);
          CHECK(msg.find("block.weight (1 of 2)") != std::string::npos);
        }
      }
    }
  }

  TEST_CASE(
      "DDP: unused parameters follow PyTorch's semantics (its own DDP run "
      "in Python on the same model, data and pattern)") {
    TempDir dir;
    auto res = run_workers("unused_pattern", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    for (int r = 0; r < 2; ++r) {
      // Overlap: the walk marks the unused parameters ready when backward
      // starts, so every bucket but the last is launched inside backward.
      std::ifstream in(dir / ("overlap" + std::to_string(r)));
      int64_t buckets = 0, launched = 0;
      in >> buckets >> launched;
      MESSAGE("rank ", r, ": ", launched, " of ", kPatternSteps * buckets,
              " bucket launches inside backward");
      CHECK(launched >= kPatternSteps * (buckets - 1));
    }
    const int rc = test::run_python_check(
        dir.path(), std::string(kPythonDdpPrelude) + kUnusedCheck,
        dir.str() + " " + std::to_string(kPatternSteps));
    if (rc != -1) CHECK(rc == 0);
  }

  TEST_CASE(
      "DDP: buckets are rebuilt in the order gradients arrive, with the "
      "same results") {
    auto ref = make_head_first(80);
    train_head_first(ref, 2, 0, nullptr);
    TempDir dir;
    auto res = run_workers("bucket_rebuild", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(dir / ("order" + std::to_string(r)));
      std::string before, after;
      int rebuilds = -1;
      in >> before >> after >> rebuilds;
      MESSAGE("rank ", r, ": bucket 0 held ", before, ", then ", after);
      // Reverse registration order puts trunk2's bias first; backward
      // produces the head's bias first.
      CHECK(before == "trunk2.bias");
      CHECK(after == "head.bias");
      CHECK(rebuilds == 1);
      auto net = make_head_first(0);
      torch::load(net, (dir / ("hf" + std::to_string(r))).string() + ".pt");
      double d = test::max_state_diff(*net, *ref);
      MESSAGE("rank ", r, ": max relative difference ", d);
      CHECK(d <= 1e-5);
    }
  }

  TEST_CASE(
      "DDP: ranks whose gradients arrive in different orders all rebuild "
      "their buckets in rank 0's order, with the same results") {
    // Each rank's own order, measured on one process: they differ.
    auto own0 = make_branch(90, true), own1 = make_branch(90, false);
    const auto order0 = arrival_order(own0), order1 = arrival_order(own1);
    MESSAGE("arrival order with a first: ", order0, "; with b first: ", order1);
    REQUIRE(order0 != order1);
    auto ref = make_branch(90, true);
    train_head_first(ref, 2, 0, nullptr);
    TempDir dir;
    auto res = run_workers("bucket_rebuild_disagree", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      std::ifstream in(dir / ("order" + std::to_string(r)));
      std::string before, after;
      int rebuilds = -1;
      in >> before >> after >> rebuilds;
      MESSAGE("rank ", r, ": buckets ", before, ", then ", after);
      CHECK(before != order0);  // the rebuild changes every rank's buckets
      CHECK(after == order0);   // rank 0's arrival order, on every rank
      CHECK(rebuilds == 1);
      auto net = make_branch(0, true);
      torch::load(net, (dir / ("br" + std::to_string(r))).string() + ".pt");
      double d = test::max_state_diff(*net, *ref);
      MESSAGE("rank ", r, ": max relative difference to one process ", d);
      CHECK(d <= 1e-5);
    }
  }

  TEST_CASE(
      "DDP join: ranks with 2 and 3 batches equal PyTorch's Join (its own "
      "run in Python on the same model and batches)") {
    TempDir dir;
    auto res = run_workers("join_uneven", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    const int rc = test::run_python_check(
        dir.path(), std::string(kPythonDdpPrelude) + kJoinCheck, dir.str());
    if (rc != -1) CHECK(rc == 0);
  }

  TEST_CASE("DDP: models that differ across ranks fail at construction") {
    TempDir dir;
    auto res = run_workers("mismatched_models", 2, dir.str());
    CHECK(res.exit_code == 7);
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(dir / ("error" + std::to_string(r)));
      std::string msg((std::istreambuf_iterator<char>(in)), {});
      CAPTURE(msg);
      CHECK(msg.find("the model differs across ranks") != std::string::npos);
      CHECK(msg.find("rank 1 has 'parameter bn1.weight") != std::string::npos);
    }
  }

}  // TEST_SUITE("parallel")

// SyncBatchNorm (include/ddpkit/nn/): cases of the "parallel" suite, in
// tests/nn/ beside the module; their workers are above.
#include "../nn/sync_batch_norm_cases.hpp"

// Run by scripts/gpu-check.sh on a machine with a GPU (`ddpkit_tests
// --test-suite=cuda`); not a CTest entry, since CI has no GPU. Two ranks
// share cuda:0 over gloo (NCCL refuses two ranks on one device).
TEST_SUITE("cuda") {
  TEST_CASE("cuda: DDP at world 2 with CUDA tensors equals one process") {
    REQUIRE(torch::cuda::is_available());
    for (bool bn : {false, true}) {
      CAPTURE(bn);
      TempDir dir;
      REQUIRE(run_workers("ddp_train", 2, dir.str(),
                          {{"T_DEVICE", "cuda"}, {"T_BN", bn ? "1" : "0"}})
                  .ok());
      auto ref = reference(2, bn);
      for (int r = 0; r < 2; ++r) {
        auto net = load_net(dir / ("net" + std::to_string(r) + ".pt"), bn);
        double d = test::max_state_diff(*net, *ref);
        MESSAGE("CUDA world 2", std::string(bn ? " SyncBN" : ""), " rank ", r,
                ": max relative difference ", d);
        CHECK(d <= 1e-4);  // float32 on the GPU against the CPU reference
      }
    }
  }

  TEST_CASE(
      "cuda: SyncBN (ATen kernels) equals BN on the joined uneven batch") {
    REQUIRE(torch::cuda::is_available());
    TempDir dir;
    REQUIRE(run_workers("syncbn_unequal", 2, dir.str(), {{"T_DEVICE", "cuda"}})
                .ok());
    check_syncbn_unequal(dir.path(), 1e-4);
  }

#if defined(DDPKIT_HAS_NCCL)
  TEST_CASE(
      "cuda: an NCCL rank whose LOCAL_RANK is past the device count is "
      "refused; pinning loader workers use the consumer's device") {
    REQUIRE(torch::cuda::is_available());
    TempDir dir;
    const int gpus = static_cast<int>(torch::cuda::device_count());
    auto opts = [&](const std::string& file) {
      return dist::GroupOptions()
          .backend(dist::BackendKind::nccl)
          .init_method("file://" + (dir / file).string());
    };
    // Rank `gpus` of gpus + 1, all on this host: one rank too many,
    // refused before the rendezvous (so nothing waits for the others).
    // (With one GPU the loader's half below cannot tell device 0 from a
    // new thread's default.)
    CHECK_THROWS_WITH_AS(
        dist::Group::init(dist::explicit_env(gpus, gpus + 1, "127.0.0.1", 29500,
                                             gpus, gpus + 1),
                          opts("past")),
        doctest::Contains("but this host has"), UsageError);
    // A transform that notes the CUDA device of the worker thread it runs
    // on (a new thread starts on device 0).
    struct NoteDevice {
      std::shared_ptr<std::atomic<int>> seen;
      torch::Tensor operator()(const torch::Tensor& batch,
                               torch::Generator&) const {
        seen->store(compat::current_cuda_device());
        return batch.to(torch::kFloat);
      }
    };
    data::ImageTensors set{torch::zeros({8, 3, 4, 4}, torch::kUInt8),
                           torch::zeros({8}, torch::kInt64),
                           {"a"}};
    auto seen = std::make_shared<std::atomic<int>>(-2);
    compat::set_cuda_device(gpus - 1);
    data::Loader loader(set, NoteDevice{seen},
                        data::LoaderOptions(4).workers(1).pin_memory(true));
    std::vector<std::size_t> idx{0, 1, 2, 3, 4, 5, 6, 7};
    for (data::Batch b : loader.epoch(idx, 0)) CHECK(b.data.is_pinned());
    CHECK(seen->load() == gpus - 1);
    compat::set_cuda_device(0);
  }

  TEST_CASE("cuda: NCCL at world 1: init, all-reduce, broadcast") {
    REQUIRE(torch::cuda::is_available());
    TempDir dir;
    auto store = dist::compat::make_file_store((dir / "store").string(), 1,
                                               std::chrono::seconds(30));
    auto pg = dist::compat::make_nccl(store, 0, 1, std::chrono::seconds(30),
                                      /*blocking_wait=*/true);
    auto t = torch::arange(6, torch::kFloat32).cuda();
    std::vector<torch::Tensor> v{t};
    pg->allreduce(v)->wait();
    CHECK(torch::equal(t.cpu(), torch::arange(6, torch::kFloat32)));
    auto b = torch::full({3}, 7.0, torch::kCUDA);
    std::vector<torch::Tensor> vb{b};
    pg->broadcast(vb)->wait();
    CHECK(torch::equal(b.cpu(), torch::full({3}, 7.0)));
  }
#endif

  TEST_CASE(
      "cuda: ZeRO-1 and ZeRO-2 with CUDA tensors equal DDP (world 2, SGD "
      "with momentum; AdamW with accumulation and clipping)") {
    REQUIRE(torch::cuda::is_available());
    for (const char* opt : {"sgd", "adamw"}) {
      CAPTURE(opt);
      const bool extra = std::string(opt) == "adamw";
      std::vector<std::pair<std::string, std::string>> env{
          {"T_DEVICE", "cuda"},
          {"T_OPT", opt},
          {"T_ACCUM", extra ? "1" : "0"},
          {"T_CLIP", extra ? "1" : "0"}};
      auto with = [&](const char* mode) {
        auto e = env;
        e.emplace_back("T_MODE", mode);
        return e;
      };
      TempDir ddp, zero, zero2;
      REQUIRE(run_workers("zero_train", 2, ddp.str(), with("ddp")).ok());
      REQUIRE(run_workers("zero_train", 2, zero.str(), with("zero")).ok());
      REQUIRE(run_workers("zero_train", 2, zero2.str(), with("zero2")).ok());
      auto want = load_net(ddp / "net0.pt", false);
      for (const auto* run : {&zero, &zero2}) {
        for (int r = 0; r < 2; ++r) {
          auto got =
              load_net(*run / ("net" + std::to_string(r) + ".pt"), false);
          const double d = test::max_state_diff(*got, *want);
          MESSAGE("CUDA ", std::string(run == &zero ? "ZeRO-1 " : "ZeRO-2 "),
                  std::string(opt), " rank ", r,
                  ": max relative difference from DDP ", d);
          CHECK(d <= 1e-4);  // cuDNN's backward may differ run to run
        }
      }
    }
  }
}  // TEST_SUITE("cuda")
