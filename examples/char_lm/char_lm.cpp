// A character-level Transformer language model on a plain text file: the
// third example, and the first whose samples are not images (the
// LanguageModel task: token cross entropy, metrics loss and ppl). The mode
// is a compile-time type chosen by -DDDPKIT_MODE=single|dp|ddp|zero.
//
//   ./char-lm-ddp --world-size 2                  # a licence text, 2 ranks
//   ./char-lm-single --data book.txt --epochs 10 --context 128
//   torchrun --nproc_per_node=2 --no_python ./char-lm-ddp
#include <ddpkit/cli.hpp>
#include <ddpkit/ddpkit.hpp>

#include <cstdio>
#include <string>

#include "char_model.hpp"

#include "../example_mode.hpp"

// Defaults: about 10 s at world 2 on a 2-core CPU with the built-in text.
constexpr int kEpochs = 20;
constexpr int kBatchPerRank = 32;
constexpr double kLr = 3e-3;
constexpr double kWeightDecay = 0.01;
constexpr double kValFraction = 0.1;
constexpr int kSampleChars = 200;

// No BatchNorm in the model, so PlainBN (nothing to convert); the loss is
// small next to the model, so each rank evaluates its share (ShardedEval).
// The zero build's --zero-stage 3 picks the ZeRO3 policy at run time
// (ddpkit::cli::with_policy): each Transformer block is a unit.
template <class Policy>
using CharTrainer =
    ddpkit::Trainer<char_lm::CharTransformer, Policy,
                    ddpkit::sampling_for<Policy>, ddpkit::PlainBN,
                    ddpkit::NoScaling, ddpkit::ShardedEval,
                    ddpkit::train::LanguageModel>;

// One line of `s`: newlines, tabs and other control bytes become spaces.
std::string one_line(std::string s) {
  for (char& c : s) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) c = ' ';
  }
  return s;
}

int main(int argc, char** argv) {
  ddpkit::cli::CommonArgs args;
  args.epochs = kEpochs;
  args.batch_size = kBatchPerRank;
  args.lr = kLr;
  char_lm::CharTransformerOptions model_opts(1);  // vocab: from the text
  int sample_chars = kSampleChars;
  CLI::App app{"ddpkit character-level Transformer example (" +
               std::string(Mode::name) + " build)"};
  ddpkit::cli::add_common_options(app, args);
  // --data means a text file here, not a folder.
  app.get_option("--data")->description(
      "text file to learn (default: the first of "
      "/usr/share/common-licenses/{GPL-3,Apache-2.0,GPL-2})");
  app.add_option("--context", model_opts.context(),
                 "characters per training window (the model's block size)")
      ->check(CLI::Range(int64_t{1}, int64_t{4096}))
      ->capture_default_str();
  app.add_option("--embed", model_opts.embed(),
                 "width of the model (a multiple of --heads)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--layers", model_opts.layers(), "Transformer blocks")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--heads", model_opts.heads(), "attention heads per block")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--sample-chars", sample_chars,
                 "characters to generate after training (0: none)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  ddpkit::cli::add_mode_options<Mode>(app, args);
  if (auto code = ddpkit::cli::parse(app, argc, argv)) return *code;
  if (model_opts.embed() % model_opts.heads() != 0) {
    std::fprintf(stderr,
                 "error: --embed %lld is not a multiple of --heads %lld\n",
                 static_cast<long long>(model_opts.embed()),
                 static_cast<long long>(model_opts.heads()));
    return 2;
  }
  if (auto code = ddpkit::cli::finish_args<Mode>(args, "char-lm")) return *code;

  return ddpkit::dist::launch(
      argc, argv, args.world_size, [&](ddpkit::dist::Group& group) {
        torch::set_num_threads(args.threads);
        // Data: the whole text as byte ids, the last tenth for validation,
        // each part cut into windows of --context characters.
        const auto context = model_opts.context();
        const std::string path =
            args.data.empty() ? char_lm::default_text_path() : args.data;
        const std::string text = char_lm::read_text(path, context);
        const char_lm::Vocabulary vocab(text);
        auto split = char_lm::split_text(vocab.encode(text), kValFraction);
        char_lm::TextWindows train_set(split.train, context);
        char_lm::TextWindows val_set(split.val, context);
        if (train_set.size() == 0 || val_set.size() == 0) {
          throw ddpkit::UsageError(ddpkit::detail::cat(
              "text file ", path, " (", text.size(), " bytes) gives ",
              train_set.size(), " training and ", val_set.size(),
              " validation windows of ", context,
              " characters; each needs at least one (a longer text or a "
              "smaller --context)"));
        }
        // Initial weights from the seed; DDP then broadcasts rank 0's to all.
        torch::manual_seed(args.seed);
        char_lm::CharTransformer model(model_opts.vocab(vocab.size()));
        // The first line, once the Trainer has resolved --precision auto
        // (and --memory-format auto: no 4-D weights, so contiguous untimed).
        auto announce = [&](const auto& trainer) {
          if (!group.is_main() || args.quiet) return;
          std::printf(
              "char_lm %s: world size %d, %zu train / %zu val windows of "
              "%lld chars, vocabulary %lld (%s), %lld parameters; %s\n",
              ddpkit::cli::mode_name<Mode>(args).c_str(),
              Mode::is_multi_process ? group.size() : 1, train_set.size(),
              val_set.size(), static_cast<long long>(context),
              static_cast<long long>(vocab.size()), path.c_str(),
              static_cast<long long>(char_lm::parameter_count(model)),
              ddpkit::cli::precision_summary(trainer.options(),
                                             /*layout=*/false)
                  .c_str());
          if (!trainer.auto_reason().empty()) {
            std::printf("%s\n", trainer.auto_reason().c_str());
          }
        };
        auto opts = ddpkit::cli::trainer_options(args)
                        .run_name("char-lm")
                        .layout_sample(torch::zeros({args.batch_size, context},
                                                    torch::kLong));
        // AdamW decays every tensor, LayerNorm gains and biases included
        // (the factory sees a flat list); at 0.01 that costs nothing here.
        const double lr = args.lr;
        // libtorch's AdamW stepped with multi-tensor kernels (ForeachAdamW:
        // the same results and checkpoints).
        auto optimizer = [lr](std::vector<torch::Tensor> params) {
          return std::make_unique<ddpkit::parallel::ForeachAdamW>(
              params,
              torch::optim::AdamWOptions(lr).weight_decay(kWeightDecay));
        };
        return ddpkit::cli::with_policy<Mode>(args, [&]<class Policy>() {
          CharTrainer<Policy> trainer(model, optimizer, opts, group,
                                      ddpkit::cli::mode_options<Policy>(args));
          announce(trainer);
          auto result = trainer.fit(train_set, val_set,
                                    ddpkit::data::LoaderOptions(args.batch_size)
                                        .workers(args.workers));
          // The sample reads the weights: whole on every rank (ZeRO-3 shards
          // them; elsewhere this is free).
          auto whole = trainer.whole_parameters();
          if (group.is_main() && !args.quiet) {
            double best_ppl = 0;
            for (const auto& m : result.history) {
              if (m.epoch == result.best_epoch) best_ppl = m.value("val_ppl");
            }
            std::printf(
                "done: %d epochs, best %s %.4f (epoch %d, val_ppl %.2f), %.1f "
                "s; outputs in %s\n",
                result.epochs_run, result.monitor.name.c_str(),
                result.best_value, result.best_epoch, best_ppl,
                result.total_seconds, args.out.c_str());
            if (sample_chars > 0) {
              // From the start of a line when the text has lines; the same
              // --seed gives the same text.
              const std::string prompt =
                  vocab.chars().find('\n') != std::string::npos
                      ? std::string("\n")
                      : text.substr(0, 1);
              std::printf(
                  "sample: %s\n",
                  one_line(char_lm::sample(trainer.model(), vocab, prompt,
                                           sample_chars, args.seed))
                      .c_str());
            }
          }
          return 0;
        });
      });
}
