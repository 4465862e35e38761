// SyncBatchNorm and ddpkit's BatchNorm2d (include/ddpkit/nn/batch_norm.hpp,
// sync_batch_norm_function.hpp): cases of the "parallel" suite (they run
// DDP workers), included by tests/parallel/parallel_test.cpp (one
// translation unit); their workers are in sync_batch_norm_workers.hpp.
#pragma once

TEST_SUITE("parallel") {
  TEST_CASE(
      "SyncBatchNorm with unequal per-rank batches equals BatchNorm on the "
      "concatenated batch") {
    TempDir dir;
    REQUIRE(run_workers("syncbn_unequal", 2, dir.str()).ok());
    check_syncbn_unequal(dir.path(), 1e-5);
  }

  TEST_CASE(
      "SyncBatchNorm: fp16 input gives fp16 output and input gradient, "
      "float32 statistics, within fp16's rounding of float32") {
    TempDir dir;
    REQUIRE(
        run_workers("syncbn_unequal", 2, dir.str(), {{"T_HALF", "1"}}).ok());
    for (int r = 0; r < 2; ++r) {
      std::ifstream in(dir / ("dtypes" + std::to_string(r)));
      std::string y, stats, dx;
      in >> y >> stats >> dx;
      MESSAGE("rank ", r, ": output ", y, ", running stats ", stats,
              ", input gradient ", dx);
      CHECK(y == "Half");
      CHECK(stats == "Float");
      CHECK(dx == "Half");
    }
    // Against BatchNorm in float32 on the joined batch of float32 inputs:
    // fp16 rounds the input, the output and the gradient (2^-11 each).
    check_syncbn_unequal(dir.path(), 5e-3);
  }

  TEST_CASE(
      "DDP: SyncBN with find_unused_parameters and rank-dependent usage "
      "(SyncBN collectives on their own channel) equals one process") {
    TempDir dir;
    auto res = run_workers("syncbn_rank_dependent", 2, dir.str(),
                           {{"DDPKIT_COLLECTIVE_TIMEOUT", "20"}});
    CAPTURE(res.message);
    REQUIRE(res.ok());
    // One process: the joined batch of 8, mid added to rank 0's 4 rows, BN
    // over all 8 (SyncBN's statistics), the loss the mean of the two
    // ranks' mean losses (what DDP's gradient average computes).
    auto ref = make_mid_net(100);
    ref->mid_rows = kPerRank;
    auto opt = test::make_sgd(*ref);
    for (int s = 0; s < 3; ++s) {
      auto [x, y] = test::global_batch(s, 2 * kPerRank);
      opt.zero_grad();
      auto out = ref->forward(x);
      auto loss =
          (test::ce_loss(out.narrow(0, 0, kPerRank), y.narrow(0, 0, kPerRank)) +
           test::ce_loss(out.narrow(0, kPerRank, kPerRank),
                         y.narrow(0, kPerRank, kPerRank))) /
          2;
      loss.backward();
      opt.step();
    }
    for (int r = 0; r < 2; ++r) {
      auto net = make_mid_net(0);
      torch::load(net, (dir / ("mid" + std::to_string(r) + ".pt")).string());
      const double d = test::max_state_diff(*net, *ref);
      MESSAGE("rank ", r, ": max relative difference ", d);
      CHECK(d <= 1e-5);
    }
  }

  // Excluded by name from libtorch 1.13's builds (tests/CMakeLists.txt).

  TEST_CASE(
      "DDP + SyncBN with unequal per-rank batches equals one process whose "
      "loss weights each rank's samples by 1/(world * that rank's batch)") {
    TempDir dir;
    auto res = run_workers("ddp_syncbn_unequal", 2, dir.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    // DDP averages the ranks' gradients with equal weights, each the mean
    // over its own batch (3 and 5 samples): one process on the joined batch
    // of 8 (BN statistics over all 8, as SyncBN gives) with loss
    // sum_r 1/(2 n_r) sum_{i in r} loss_i. The plain mean over 8 is not it.
    auto train_reference = [](bool weighted) {
      auto net = test::make_net(100, /*bn=*/true);
      auto opt = test::make_sgd(*net);
      for (int s = 0; s < 3; ++s) {
        auto [x, y] = test::global_batch(s, 8);
        opt.zero_grad();
        auto per_sample = torch::nn::functional::cross_entropy(
            net->forward(x), y,
            torch::nn::functional::CrossEntropyFuncOptions().reduction(
                torch::kNone));
        auto w = torch::full({8}, 1.0 / 8);
        if (weighted) {
          w.narrow(0, 0, 3).fill_(1.0 / (2 * 3));
          w.narrow(0, 3, 5).fill_(1.0 / (2 * 5));
        }
        (per_sample * w).sum().backward();
        opt.step();
      }
      return net;
    };
    auto weighted = train_reference(true), plain = train_reference(false);
    for (int r = 0; r < 2; ++r) {
      auto net = load_net(dir / ("net" + std::to_string(r) + ".pt"), true);
      const double d = test::max_state_diff(*net, *weighted);
      const double d_plain = test::max_state_diff(*net, *plain);
      MESSAGE("rank ", r, ": vs the weighted loss ", d,
              "; vs the plain mean over 8 ", d_plain);
      CHECK(d <= 1e-5);
      CHECK(d_plain > 1e-3);
    }
  }

  TEST_CASE(
      "SyncBatchNorm: backward after the module is gone; evaluation never "
      "communicates") {
    TempDir dir;
    REQUIRE(
        run_workers("syncbn_unequal", 2, dir.str(), {{"T_DROP_MODULE", "1"}})
            .ok());
    check_syncbn_unequal(dir.path(), 1e-5);
    // Both ranks evaluating, on different batches: no collective, and each
    // rank's own statistics (batch) or the running ones.
    TempDir both;
    auto res = run_workers("syncbn_eval_both", 2, both.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      std::ifstream f(both / ("eval" + std::to_string(r)));
      uint64_t during = 1;
      double d_running = 1, d_batch = 1;
      f >> during >> d_running >> d_batch;
      MESSAGE("rank ", r, " in eval: ", during,
              " collective(s); relative difference to unsynchronised BN ",
              d_running, " (running statistics), ", d_batch,
              " (batch statistics)");
      CHECK(during == 0);
      CHECK(d_running <= 1e-6);
      CHECK(d_batch <= 1e-6);
    }
    // Rank 0 evaluating alone: no collective (one would wait for rank 1).
    TempDir eval;
    res = run_workers("syncbn_eval_alone", 2, eval.str());
    CAPTURE(res.message);
    REQUIRE(res.ok());
    std::ifstream in(eval / "eval0");
    double d = 1;
    uint64_t collectives = 1;
    in >> d >> collectives;
    MESSAGE("rank 0 alone in eval: relative difference to local batch norm ", d,
            ", ", collectives, " collective(s) during evaluation");
    CHECK(d <= 1e-6);
    CHECK(collectives == 0);
  }

  TEST_CASE("BatchNorm2d matches torch::nn::BatchNorm2d and its state dict") {
    torch::manual_seed(1);
    nn::BatchNorm2d ours(6);
    torch::nn::BatchNorm2d theirs(6);
    auto x = torch::randn({5, 6, 4, 4});
    CHECK(torch::allclose(ours(x), theirs(x), 1e-5, 1e-6));
    CHECK(torch::allclose(ours->running_var, theirs->running_var));
    ours->eval();
    theirs->eval();
    CHECK(torch::allclose(ours(x), theirs(x), 1e-5, 1e-6));
    std::vector<std::string> a, b;
    for (auto& p : ours->named_parameters()) a.push_back(p.key());
    for (auto& p : ours->named_buffers()) a.push_back(p.key());
    for (auto& p : theirs->named_parameters()) b.push_back(p.key());
    for (auto& p : theirs->named_buffers()) b.push_back(p.key());
    CHECK(a == b);
  }

  TEST_CASE(
      "convert_sync_batchnorm names a torch::nn::BatchNorm2d it cannot "
      "convert") {
    torch::nn::Sequential seq(torch::nn::Conv2d(3, 4, 1),
                              torch::nn::BatchNorm2d(4));
    CHECK_THROWS_WITH_AS(
        nn::convert_sync_batchnorm(*seq, dist::Group{}),
        doctest::Contains("module '1' is a torch::nn::BatchNorm2d"),
        UsageError);
    auto net = test::make_net(1, true);
    CHECK(nn::convert_sync_batchnorm(*net, dist::Group{}) == 2);
  }
}  // TEST_SUITE("parallel")
