// SyncBatchNorm's workers (DDP ranks) and the one-process reference they
// are checked against, included by tests/parallel/parallel_test.cpp (one
// translation unit: its helpers env_or, worker_device, kPerRank are in
// scope); the cases are in sync_batch_norm_cases.hpp.
#pragma once

DDPKIT_WORKER(syncbn_unequal) {
  auto g = device_worker_group();
  const int r = g.rank();
  const auto device = worker_device();
  // Rank 0 holds 3 samples, rank 1 holds 5: statistics must come from all 8.
  auto gen = at::detail::createCPUGenerator(7);
  auto x_all = torch::randn({8, 4, 3, 3}, gen) * 2 + 1;
  auto wts = torch::randn({8, 4, 3, 3}, gen);
  int64_t start = r == 0 ? 0 : 3, len = r == 0 ? 3 : 5;
  // T_HALF=1: fp16 input (statistics in float32, output in fp16).
  const bool half = env_or("T_HALF", "0") == "1";
  auto x = x_all.narrow(0, start, len)
               .clone()
               .to(device, half ? torch::kHalf : torch::kFloat)
               .requires_grad_(true);
  torch::manual_seed(3);
  // Synchronised by construction (no convert_sync_batchnorm call).
  nn::SyncBatchNorm bn(4, g);
  bn->weight.data().uniform_(0.5, 1.5);
  bn->bias.data().uniform_(-0.5, 0.5);
  bn->to(device);
  auto y = bn(x);
  auto dir = test::worker_dir();
  auto tag = std::to_string(r);
  std::ofstream(dir / ("dtypes" + tag))
      << c10::toString(y.scalar_type()) << " "
      << c10::toString(bn->running_mean.scalar_type());
  test::save_tensor(bn->running_mean.cpu(), dir / ("rm" + tag + ".pt"));
  test::save_tensor(bn->running_var.cpu(), dir / ("rv" + tag + ".pt"));
  // T_DROP_MODULE=1: the module (and the group it holds) is gone before
  // backward, which must still reduce over the group.
  auto weight = bn->weight, bias = bn->bias;
  if (env_or("T_DROP_MODULE", "0") == "1") bn = nn::SyncBatchNorm(nullptr);
  // The global loss is the sum over ranks of each rank's part.
  (y * wts.narrow(0, start, len).to(device, y.scalar_type())).sum().backward();
  std::ofstream(dir / ("dtypes" + tag), std::ios::app)
      << " " << c10::toString(x.grad().scalar_type());
  test::save_tensor(y.detach().cpu().to(torch::kFloat),
                    dir / ("y" + tag + ".pt"));
  test::save_tensor(x.grad().cpu().to(torch::kFloat),
                    dir / ("dx" + tag + ".pt"));
  // Each rank's weight and bias gradients: its own samples' part (DDP sums
  // or averages them like any other parameter's).
  test::save_tensor(weight.grad().cpu().to(torch::kFloat),
                    dir / ("gw" + tag + ".pt"));
  test::save_tensor(bias.grad().cpu().to(torch::kFloat),
                    dir / ("gb" + tag + ".pt"));
  return 0;
}

/// conv(3→8) (+ mid) SyncBN relu conv(8→8) SyncBN relu pool fc, with `mid`
/// (a per-channel offset) registered last, so its bucket comes first, but
/// used before bn1: with `use_mid` on rank 0 only, rank 1 finds it unused
/// and launches its bucket at the first gradient, rank 0 only after both
/// SyncBN backward collectives. (`batch_split`: the rows that get `mid`, in
/// the one-process reference.)
struct MidNetImpl : torch::nn::Module {
  MidNetImpl() {
    conv1 = register_module(
        "conv1",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    bn1 = register_module("bn1", nn::BatchNorm2d(8));
    conv2 = register_module(
        "conv2",
        torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    bn2 = register_module("bn2", nn::BatchNorm2d(8));
    fc = register_module("fc", torch::nn::Linear(8, 5));
    // In a child registered last (a module's own parameters come before
    // its children's), so it is the last parameter and its bucket the first.
    holder = register_module("offset", std::make_shared<torch::nn::Module>());
    mid = holder->register_parameter("mid", torch::randn({1, 8, 1, 1}) * 0.5);
  }
  torch::Tensor forward(torch::Tensor x) {
    x = conv1(x);
    if (mid_rows > 0) {
      x = torch::cat({x.narrow(0, 0, mid_rows) + mid,
                      x.narrow(0, mid_rows, x.size(0) - mid_rows)});
    }
    x = torch::relu(bn1(x));
    x = torch::relu(bn2(conv2(x)));
    return fc(torch::adaptive_avg_pool2d(x, {1, 1}).flatten(1));
  }
  int64_t mid_rows = 0;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
  torch::nn::Linear fc{nullptr};
  std::shared_ptr<torch::nn::Module> holder;
  torch::Tensor mid;
};
TORCH_MODULE(MidNet);

MidNet make_mid_net(uint64_t seed) {
  torch::manual_seed(seed);
  return MidNet();
}

/// SyncBN + find_unused_parameters with rank-dependent usage (MidNetImpl):
/// three SGD steps, 4 samples per rank.
DDPKIT_WORKER(syncbn_rank_dependent) {
  auto g = test::worker_group();
  const int r = g.rank();
  auto net = make_mid_net(100 + r);
  nn::SyncBN::apply(*net, g);
  net->mid_rows = r == 0 ? kPerRank : 0;
  parallel::DDPOptions opts;
  // One parameter per bucket: mid's bucket is the first.
  opts.reducer()
      .find_unused_parameters(true)
      .bucket_cap_bytes(1)
      .first_bucket_cap_bytes(1)
      .last_bucket_cap_bytes(1);
  parallel::DDP::engine<MidNet> eng(net, g, opts, torch::kCPU);
  auto opt = test::make_sgd(*net);
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = test::global_batch(s, 2 * kPerRank);
    eng.zero_grad();
    eng.forward_backward(x.narrow(0, r * kPerRank, kPerRank),
                         y.narrow(0, r * kPerRank, kPerRank), test::ce_loss);
    opt.step();
  }
  torch::save(
      net, (test::worker_dir() / ("mid" + std::to_string(r) + ".pt")).string());
  return 0;
}

/// DDP with SyncBN and unequal per-rank batches (rank 0: 3 samples, rank
/// 1: 5): three SGD steps of SmallNet with each rank's loss the mean over
/// its own batch.
DDPKIT_WORKER(ddp_syncbn_unequal) {
  auto g = test::worker_group();
  const int r = g.rank();
  auto net = test::make_net(100 + r, /*bn=*/true);
  nn::SyncBN::apply(*net, g);
  parallel::DDP::engine<test::SmallNet> eng(net, g, parallel::DDPOptions(),
                                            torch::kCPU);
  auto opt = test::make_sgd(*net);
  for (int s = 0; s < 3; ++s) {
    auto [x, y] = test::global_batch(s, 8);
    const int64_t start = r == 0 ? 0 : 3, len = r == 0 ? 3 : 5;
    eng.zero_grad();
    eng.forward_backward(x.narrow(0, start, len), y.narrow(0, start, len),
                         test::ce_loss);
    opt.step();
  }
  torch::save(
      net, (test::worker_dir() / ("net" + std::to_string(r) + ".pt")).string());
  return 0;
}

/// Rank 0 evaluates a synchronised BN with track_running_stats=false alone
/// (batch statistics in eval mode); rank 1 does nothing. Evaluation must not
/// communicate (PyTorch's rule), so rank 0 finishes with local statistics
/// and starts no collective.
DDPKIT_WORKER(syncbn_eval_alone) {
  auto g = test::worker_group();
  if (g.rank() != 0) return 0;
  nn::BatchNorm2d bn(torch::nn::BatchNormOptions(4).track_running_stats(false));
  nn::convert_sync_batchnorm(*bn, g);
  bn->eval();
  auto x = torch::randn({6, 4, 3, 3}, at::detail::createCPUGenerator(9));
  const auto before = g.collectives_started();
  auto y = bn(x);
  const auto during = g.collectives_started() - before;
  auto want = torch::batch_norm(x, bn->weight, bn->bias, {}, {}, true, 0.1,
                                1e-5, false);
  std::ofstream(test::worker_dir() / "eval0")
      << test::rel_diff(y, want) << " " << during;
  return 0;
}

/// Both ranks, after one synchronised training forward (the SyncBN side
/// group exists and the running statistics moved), evaluate on batches of
/// their own: SmallNet's SyncBNs with running statistics, and a SyncBN with
/// track_running_stats=false (batch statistics). Each rank writes the
/// collectives started during evaluation and the relative differences to
/// the same layers unsynchronised.
DDPKIT_WORKER(syncbn_eval_both) {
  auto g = test::worker_group();
  const int r = g.rank();
  auto net = test::make_net(100, /*bn=*/true);
  nn::SyncBN::apply(*net, g);
  nn::BatchNorm2d batch_stats(
      torch::nn::BatchNormOptions(3).track_running_stats(false));
  nn::convert_sync_batchnorm(*batch_stats, g);
  auto [x_train, y_train] = test::global_batch(0, 2 * kPerRank);
  net->forward(x_train.narrow(0, r * kPerRank, kPerRank));
  // The same weights and running statistics, unsynchronised.
  auto local = test::make_net(0, /*bn=*/true);
  {
    torch::NoGradGuard no_grad;
    auto src = net->named_parameters(), dst = local->named_parameters();
    for (auto& p : src) dst[p.key()].copy_(p.value());
    auto bsrc = net->named_buffers(), bdst = local->named_buffers();
    for (auto& b : bsrc) bdst[b.key()].copy_(b.value());
  }
  net->eval();
  local->eval();
  batch_stats->eval();
  auto x = torch::randn({5, 3, 8, 8}, at::detail::createCPUGenerator(20 + r));
  const auto before = g.collectives_started();
  torch::Tensor y, y_batch;
  {
    torch::NoGradGuard no_grad;
    y = net->forward(x);
    y_batch = batch_stats(x);
  }
  const auto during = g.collectives_started() - before;
  torch::NoGradGuard no_grad;
  const auto want = local->forward(x);
  const auto want_batch =
      torch::batch_norm(x, batch_stats->weight, batch_stats->bias, {}, {}, true,
                        0.1, 1e-5, false);
  std::ofstream(test::worker_dir() / ("eval" + std::to_string(r)))
      << during << " " << test::rel_diff(y, want) << " "
      << test::rel_diff(y_batch, want_batch);
  return 0;
}
/// Compares the two syncbn_unequal ranks' outputs, input, weight and bias
/// gradients and running statistics with libtorch's BatchNorm on the joined
/// batch of 8.
void check_syncbn_unequal(const std::filesystem::path& dir, double tol) {
  auto gen = at::detail::createCPUGenerator(7);
  auto x_all = torch::randn({8, 4, 3, 3}, gen) * 2 + 1;
  auto wts = torch::randn({8, 4, 3, 3}, gen);
  auto x = x_all.clone().requires_grad_(true);
  torch::manual_seed(3);
  torch::nn::BatchNorm2d bn(4);  // libtorch's own BatchNorm as the reference
  bn->weight.data().uniform_(0.5, 1.5);
  bn->bias.data().uniform_(-0.5, 0.5);
  auto y = bn(x);
  (y * wts).sum().backward();
  auto y_dist = torch::cat(
      {test::load_tensor(dir / "y0.pt"), test::load_tensor(dir / "y1.pt")});
  auto dx_dist = torch::cat(
      {test::load_tensor(dir / "dx0.pt"), test::load_tensor(dir / "dx1.pt")});
  MESSAGE("outputs ", test::rel_diff(y_dist, y.detach()), ", input grads ",
          test::rel_diff(dx_dist, x.grad()));
  CHECK(test::rel_diff(y_dist, y.detach()) <= tol);
  CHECK(test::rel_diff(dx_dist, x.grad()) <= tol);
  // The ranks' parts of the weight and bias gradients add up to the
  // joined batch's.
  for (std::string name : {"gw", "gb"}) {
    auto sum = test::load_tensor(dir / (name + "0.pt")) +
               test::load_tensor(dir / (name + "1.pt"));
    auto ref = name == "gw" ? bn->weight.grad() : bn->bias.grad();
    MESSAGE(name, " (sum over ranks): ", test::rel_diff(sum, ref));
    CHECK(test::rel_diff(sum, ref) <= tol);
  }
  for (int r = 0; r < 2; ++r) {
    auto tag = std::to_string(r);
    CHECK(test::rel_diff(test::load_tensor(dir / ("rm" + tag + ".pt")),
                         bn->running_mean) <= tol);
    CHECK(test::rel_diff(test::load_tensor(dir / ("rv" + tag + ".pt")),
                         bn->running_var) <= tol);
  }
}
