// ResNet34 on flower_photos with SGD, cosine LR, SyncBN and linear LR
// scaling: the second reference recipe (train_single_gpu.py /
// train_multi_gpu_using_launch.py / _using_spawn.py), in C++. The mode is a
// compile-time type chosen by -DDDPKIT_MODE=single|dp|ddp|zero (the zero
// build: --zero-stage 1|2|3).
//
//   ./flowers-resnet34-ddp --world-size 2 --image-size 64
//   torchrun --nproc_per_node=8 --no_python ./flowers-resnet34-ddp --data
//   flower_photos
//   ./flowers-resnet34-single --data flower_photos --weights resnet34.pt
//   --freeze-layers
#include <ddpkit/cli.hpp>
#include <ddpkit/ddpkit.hpp>
#include <ddpkit/image.hpp>
#include <ddpkit/testing.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "../example_mode.hpp"

// The recipe's defaults.
constexpr int kNumClasses = 5;
constexpr int kEpochs = 30;
constexpr int kBatchPerRank = 16;
constexpr double kLr = 0.001;  // scaled by the world size (LinearScaling)
constexpr double kLrf = 0.1;
constexpr double kMomentum = 0.9;
constexpr double kWeightDecay = 0.005;
constexpr int kImageSize = 224;

// The recipe's --syncBN (default on): a run-time choice between two
// compile-time Trainer types. SyncBN needs several processes, so the single
// and dp builds always use plain BN.
// The zero build's --zero-stage 3 picks the ZeRO3 policy at run time the
// same way (ddpkit::cli::with_policy).
template <class Policy, class BN>
using TrainerWith =
    ddpkit::Trainer<ddpkit::nn::ResNet, Policy, ddpkit::sampling_for<Policy>,
                    BN, ddpkit::LinearScaling, ddpkit::ShardedEval>;

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  ddpkit::cli::CommonArgs args;
  args.epochs = kEpochs;
  args.batch_size = kBatchPerRank;
  args.lr = kLr;
  int image_size = kImageSize;
  int num_classes = kNumClasses;
  std::string weights;
  bool freeze_layers = false;
  std::size_t synthetic_per_class = 60;
  CLI::App app{"ddpkit flowers / ResNet34 example (" + std::string(Mode::name) +
               " build)"};
  ddpkit::cli::add_common_options(app, args);
  app.add_option("--image-size", image_size,
                 "training crop size (224 as in the recipe; 64 for CPU runs)")
      ->check(CLI::Range(16, 1024))
      ->capture_default_str();
  app.add_option("--num-classes", num_classes, "classes")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option(
         "--weights", weights,
         "state dict to start from (tensors of another shape are skipped)")
      ->check(CLI::ExistingFile);
  app.add_flag("--freeze-layers", freeze_layers, "train only fc");
  bool sync_bn = true;
  app.add_flag("--sync-bn,!--no-sync-bn", sync_bn,
               "synchronise BatchNorm statistics across processes (the "
               "recipe's --syncBN; on unless --no-sync-bn; ddp build only)");
  bool no_augment = false;
  app.add_flag("--no-augment", no_augment,
               "train on the evaluation transform (resize, centre crop): no "
               "random crop or flip");
  app.add_option(
         "--synthetic-per-class", synthetic_per_class,
         "images per class of the generated folder when --data is not given")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  ddpkit::cli::add_mode_options<Mode>(app, args);
  if (auto code = ddpkit::cli::parse(app, argc, argv)) return *code;
  if (auto code = ddpkit::cli::finish_args<Mode>(args, "flowers-resnet34"))
    return *code;

  return ddpkit::dist::launch(
      argc, argv, args.world_size, [&](ddpkit::dist::Group& group) {
        torch::set_num_threads(args.threads);
        const fs::path out = args.out;
        fs::path root = args.data;
        if (root.empty()) {
          // No download: rank 0 draws a small flower_photos-like JPEG folder.
          root = out / "synthetic_flower_photos";
          if (group.is_main() && !fs::exists(root / "daisy")) {
            ddpkit::testing::make_jpeg_folder(
                root, ddpkit::testing::JpegFolderOptions()
                          .images_per_class(synthetic_per_class)
                          .seed(args.seed));
          }
          if (Mode::is_multi_process) ddpkit::dist::barrier(group);
        }
        auto folder = ddpkit::data::read_image_folder(
            root,
            ddpkit::data::ImageFolderOptions().seed(0).class_indices_json(""));
        if (group.is_main()) {
          // class_indices.json maps the model's outputs to names: a run that
          // would change it under existing weights/checkpoints is refused.
          const auto json = ddpkit::data::class_indices_json(folder.classes);
          const auto path = out / "class_indices.json";
          if (fs::exists(path)) {
            std::ifstream in(path);
            std::string old((std::istreambuf_iterator<char>(in)), {});
            if (old != json) {
              throw ddpkit::UsageError(
                  path.string() + " lists other classes than " + root.string() +
                  " holds; use another --out (or remove the old run's folder)");
            }
          } else {
            std::error_code ec;
            fs::create_directories(out, ec);
            if (ec) {
              throw ddpkit::UsageError("output folder " + out.string() +
                                       " cannot be created: " + ec.message());
            }
            ddpkit::detail::write_atomically(path, json);
          }
        }
        if (static_cast<int>(folder.classes.size()) != num_classes &&
            group.is_main()) {
          std::printf(
              "note: %zu classes found in %s; using that many outputs\n",
              folder.classes.size(), root.c_str());
        }
        num_classes = static_cast<int>(folder.classes.size());
        torch::manual_seed(args.seed);
        auto model = ddpkit::nn::resnet34(num_classes);
        // The first line, once the Trainer has resolved --precision /
        // --memory-format auto (the layout timed on a batch of the training
        // shape, opts.layout_sample).
        auto announce = [&](const auto& trainer) {
          if (!group.is_main() || args.quiet) return;
          std::printf(
              "flowers-resnet34 %s: world size %d on %d host%s (transport %s), "
              "%zu train / "
              "%zu val images, %d classes, %dpx; %s\n",
              ddpkit::cli::mode_name<Mode>(args).c_str(),
              Mode::is_multi_process ? group.size() : 1, group.hosts(),
              group.hosts() == 1 ? "" : "s",
              Mode::is_multi_process ? group.transport().c_str() : "none",
              folder.train.size(), folder.val.size(), num_classes, image_size,
              ddpkit::cli::precision_summary(trainer.options()).c_str());
          if (!trainer.auto_reason().empty()) {
            std::printf("%s\n", trainer.auto_reason().c_str());
          }
        };
        if (!weights.empty()) {
          // The recipe's transfer-learning step: keep what fits, skip fc if the
          // class count differs.
          auto report = ddpkit::nn::load_state_dict(
              *model, weights,
              ddpkit::nn::LoadStateDictOptions().strict(false).skip_mismatched(
                  true));
          if (group.is_main()) {
            std::printf(
                "loaded %zu tensors from %s (%zu skipped for shape, %zu "
                "missing)\n",
                report.loaded.size(), weights.c_str(),
                report.skipped_shape.size(), report.missing.size());
          }
        }
        if (freeze_layers) {
          for (auto& p : model->named_parameters()) {
            if (p.key().rfind("fc.", 0) != 0)
              p.value().set_requires_grad(false);
          }
        }
        auto opts = ddpkit::cli::trainer_options(args)
                        .schedule(ddpkit::train::ScheduleOptions()
                                      .kind(ddpkit::train::Schedule::cosine)
                                      .lrf(kLrf))
                        .weights_pattern("weights/model-{epoch}.pt")
                        .run_name("flowers-resnet34")
                        .layout_sample(torch::zeros(
                            {args.batch_size, 3, image_size, image_size}));
        auto make_optimizer = [](std::vector<torch::Tensor> params) {
          std::vector<torch::Tensor> trainable;
          for (auto& p : params) {
            if (p.requires_grad()) trainable.push_back(p);
          }
          // libtorch's SGD stepped with multi-tensor kernels: the same
          // arithmetic and checkpoints, fewer kernel launches on a GPU.
          return std::make_unique<ddpkit::parallel::ForeachSGD>(
              trainable,
              torch::optim::SGDOptions(kLr).momentum(kMomentum).weight_decay(
                  kWeightDecay));
        };
        auto loader =
            ddpkit::data::LoaderOptions(args.batch_size).workers(args.workers);
        ddpkit::data::ImageNetTrain train_tf;
        train_tf.options.size(image_size).augment(!no_augment);
        ddpkit::data::ImageNetEval eval_tf;
        eval_tf.size = image_size;
        auto fit = [&]<class Policy, class BN>() {
          TrainerWith<Policy, BN> trainer(
              model, make_optimizer, opts, group,
              ddpkit::cli::mode_options<Policy>(args));
          announce(trainer);
          return trainer.fit(folder.train, folder.val, train_tf, eval_tf,
                             loader);
        };
        const auto result =
            ddpkit::cli::with_policy<Mode>(args, [&]<class Policy>() {
              return sync_bn
                         ? fit.template
                           operator()<Policy, ddpkit::sync_bn_for<Policy>>()
                         : fit.template operator()<Policy, ddpkit::PlainBN>();
            });
        if (group.is_main() && !args.quiet) {
          std::printf(
              "done: %d epochs, best %s %.4f (epoch %d), %.1f s; outputs in "
              "%s\n",
              result.epochs_run, result.monitor.name.c_str(), result.best_value,
              result.best_epoch, result.total_seconds, args.out.c_str());
        }
        return 0;
      });
}
