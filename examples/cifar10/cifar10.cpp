// CIFAR-10 with a compact CNN, Adam, StepLR and early stopping: the first
// reference recipe (single GPU → DataParallel → DDP), in C++. The mode is a
// compile-time type chosen by -DDDPKIT_MODE=single|dp|ddp|zero (the zero
// build: --zero-stage 1|2|3).
//
//   ./cifar10-ddp --world-size 2          # self-spawned, 2 ranks
//   ./cifar10-ddp --world-size 2 --comm powersgd --powersgd-rank 2
//   torchrun --nproc_per_node=2 --no_python ./cifar10-ddp
//   ./cifar10-single --data ~/datasets    # reads cifar-10-batches-bin
#include <ddpkit/cli.hpp>
#include <ddpkit/ddpkit.hpp>
#include <ddpkit/testing/synthetic.hpp>

#include <cstdio>
#include <filesystem>

// Plain DDP whose gradient communication (--comm) is chosen at run time.
#define DDPKIT_EXAMPLE_DDP_POLICY ddpkit::DDPRuntimeComm
#include "../example_mode.hpp"

// The recipe's configuration (configs/*.yaml of chapter 13).
constexpr int kEpochs = 30;
constexpr int kBatchPerRank = 64;
constexpr double kLr = 1e-3;
constexpr int kStepSize = 15;
constexpr double kGamma = 0.1;
constexpr int kPatience = 7;
constexpr double kValRatio = 0.1;
constexpr std::size_t kSyntheticTrain = 6000;
constexpr std::size_t kSyntheticTest = 1000;

// The recipe uses plain BatchNorm; --sync-bn (ddp build) picks the other
// compile-time Trainer type at run time, as the flowers example does.
// The zero build's --zero-stage 3 picks the ZeRO3 policy at run time the
// same way (ddpkit::cli::with_policy).
template <class Policy, class BN>
using TrainerWith =
    ddpkit::Trainer<ddpkit::nn::CifarNet, Policy, ddpkit::sampling_for<Policy>,
                    BN, ddpkit::NoScaling, ddpkit::RankZeroEval>;

int main(int argc, char** argv) {
  ddpkit::cli::CommonArgs args;
  args.epochs = kEpochs;
  args.batch_size = kBatchPerRank;
  args.lr = kLr;
  std::size_t synthetic_size = kSyntheticTrain;
  CLI::App app{"ddpkit CIFAR-10 example (" + std::string(Mode::name) +
               " build)"};
  ddpkit::cli::add_common_options(app, args);
  app.add_option("--synthetic-size", synthetic_size,
                 "training images of the built-in synthetic set")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  double dropout = ddpkit::nn::CifarNetOptions().dropout();
  app.add_option("--dropout", dropout,
                 "dropout before each fully connected layer")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  bool no_augment = false;
  app.add_flag("--no-augment", no_augment,
               "train on the evaluation transform: no random crop, flip or "
               "colour jitter");
  // Gradient communication (ddp build): PyTorch's DDP comm hooks.
  std::string comm = "allreduce";
  ddpkit::parallel::PowerSGDOptions powersgd;
  powersgd.start_step(100);
  bool sync_bn = false;
  if constexpr (Mode::is_multi_process) {
    app.add_flag("--sync-bn,!--no-sync-bn", sync_bn,
                 "synchronise BatchNorm statistics across processes (off, as "
                 "in the recipe)");
  }
  if constexpr (std::is_same_v<Mode, ddpkit::DDPRuntimeComm>) {
    app.add_option("--comm", comm,
                   "gradient communication: allreduce (float32), fp16, bf16 "
                   "or powersgd (low-rank, with error feedback)")
        ->check(CLI::IsMember({"allreduce", "fp16", "bf16", "powersgd"}))
        ->capture_default_str();
    app.add_option("--powersgd-rank", powersgd.rank(),
                   "rank of PowerSGD's approximation of each gradient matrix")
        ->check(CLI::PositiveNumber)
        ->capture_default_str();
    app.add_option("--powersgd-start-step", powersgd.start_step(),
                   "steps of plain all-reduce before PowerSGD starts")
        ->check(CLI::NonNegativeNumber)
        ->capture_default_str();
  }
  ddpkit::cli::add_mode_options<Mode>(app, args);
  if (auto code = ddpkit::cli::parse(app, argc, argv)) return *code;
  if (auto code = ddpkit::cli::finish_args<Mode>(args, "cifar10")) return *code;

  return ddpkit::dist::launch(
      argc, argv, args.world_size, [&](ddpkit::dist::Group& group) {
        torch::set_num_threads(args.threads);
        // Data: the real CIFAR-10 when --data is given, else the built-in set.
        ddpkit::data::ImageTensors train_all, test;
        if (args.data.empty()) {
          train_all = ddpkit::testing::make_synthetic(
              ddpkit::testing::SyntheticOptions(synthetic_size).seed(1));
          test = ddpkit::testing::make_synthetic(
              ddpkit::testing::SyntheticOptions(kSyntheticTest).seed(2));
        } else {
          auto c = ddpkit::data::load_cifar10(args.data);
          train_all = c.train;
          test = c.test;
        }
        auto split =
            ddpkit::data::split_train_val(train_all, kValRatio, args.seed);
        // Initial weights from the seed; DDP then broadcasts rank 0's to all.
        torch::manual_seed(args.seed);
        ddpkit::nn::CifarNet model(
            ddpkit::nn::CifarNetOptions(10).dropout(dropout));
        // The first line, once the Trainer has resolved --precision /
        // --memory-format auto (the layout timed on a batch of the training
        // shape, opts.layout_sample).
        auto announce = [&](const auto& trainer) {
          if (!group.is_main() || args.quiet) return;
          std::printf(
              "cifar10 %s: world size %d on %d host%s (transport %s), %zu "
              "train / %zu val "
              "/ %zu test images (%s)%s%s; %s\n",
              ddpkit::cli::mode_name<Mode>(args).c_str(),
              Mode::is_multi_process ? group.size() : 1, group.hosts(),
              group.hosts() == 1 ? "" : "s",
              Mode::is_multi_process ? group.transport().c_str() : "none",
              split.train.size(), split.val.size(), test.size(),
              args.data.empty() ? "built-in synthetic set" : args.data.c_str(),
              Mode::is_multi_process ? ", gradients: " : "",
              Mode::is_multi_process ? comm.c_str() : "",
              ddpkit::cli::precision_summary(trainer.options()).c_str());
          if (!trainer.auto_reason().empty()) {
            std::printf("%s\n", trainer.auto_reason().c_str());
          }
        };
        auto opts =
            ddpkit::cli::trainer_options(args)
                .schedule(ddpkit::train::ScheduleOptions()
                              .kind(ddpkit::train::Schedule::step)
                              .step_size(kStepSize)
                              .gamma(kGamma))
                .patience(kPatience)
                .run_name("cifar10")
                .layout_sample(torch::zeros({args.batch_size, 3, 32, 32}));
        // The policy's options (generic: only the ddp build's have comm()).
        auto options_for = [&]<class Policy>() {
          auto p = ddpkit::cli::mode_options<Policy>(args);
          if constexpr (requires { p.comm(); }) {
            p.comm(ddpkit::parallel::CommOptions()
                       .kind(ddpkit::parallel::parse_comm_kind(comm))
                       .powersgd(powersgd));
          }
          return p;
        };
        // libtorch's Adam stepped with multi-tensor kernels (the same
        // results and checkpoints; fewer kernel launches on a GPU).
        auto optimizer = [](std::vector<torch::Tensor> params) {
          return std::make_unique<ddpkit::parallel::ForeachAdam>(
              params, torch::optim::AdamOptions(kLr));
        };
        auto loader =
            ddpkit::data::LoaderOptions(args.batch_size).workers(args.workers);
        ddpkit::data::CifarTrain train_tf;
        if (no_augment) train_tf.options.padding(0).flip(0).jitter(false);
        auto run = [&]<class Policy, class BN>() {
          TrainerWith<Policy, BN> trainer(
              model, optimizer, opts, group,
              options_for.template operator()<Policy>());
          announce(trainer);
          auto result = trainer.fit(split.train, split.val, train_tf,
                                    ddpkit::data::CifarEval{}, loader);
          // The test set once, at the end, evaluated the recipe's way.
          auto t = trainer.evaluate(test, ddpkit::data::CifarEval{}, loader);
          if (group.is_main()) {
            trainer.write_summary(result, &t);
            if (!args.quiet) {
              std::printf(
                  "done: %d epochs, best %s %.4f (epoch %d), test_acc %.4f, "
                  "%.1f s; outputs in %s\n",
                  result.epochs_run, result.monitor.name.c_str(),
                  result.best_value, result.best_epoch, t.value("acc"),
                  result.total_seconds, args.out.c_str());
            }
          }
        };
        return ddpkit::cli::with_policy<Mode>(args, [&]<class Policy>() {
          if constexpr (Policy::is_multi_process) {
            if (sync_bn) {
              run.template operator()<Policy, ddpkit::sync_bn_for<Policy>>();
              return 0;
            }
          }
          run.template operator()<Policy, ddpkit::PlainBN>();
          return 0;
        });
      });
}
