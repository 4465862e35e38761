// SPDX-License-Identifier: BSD-3-Clause
// The char_lm example's model and data: a small GPT-style character
// Transformer, a byte vocabulary, and a dataset of fixed-length windows of a
// text (input: window, target: the window shifted by one character).
//
// Only plain tensor operations are used (no scaled_dot_product_attention,
// no nn::TransformerEncoder), so the same code builds against Debian's
// libtorch 1.13 and PyTorch 2.x's.
#pragma once

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/data/loader.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/scope_guard.hpp"
#include "ddpkit/detail/seed.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/nn/unit.hpp"

namespace char_lm {

// ---- model -----------------------------------------------------------------

/// Options of `CharTransformer`.
struct CharTransformerOptions {
  explicit CharTransformerOptions(int64_t vocab) : vocab_(vocab) {}
  /// Distinct tokens (`Vocabulary::size()`).
  TORCH_ARG(int64_t, vocab);
  /// Longest input (block size): the position embedding has this many rows.
  TORCH_ARG(int64_t, context) = 64;
  /// Width of the residual stream; a multiple of `heads`.
  TORCH_ARG(int64_t, embed) = 64;
  TORCH_ARG(int64_t, heads) = 4;
  /// Transformer blocks.
  TORCH_ARG(int64_t, layers) = 2;
  /// After the embeddings, on the attention weights and on each block's two
  /// residual branches.
  TORCH_ARG(double, dropout) = 0.0;
};

/// Multi-head self-attention in which position t sees positions 0..t only.
class CausalSelfAttentionImpl
    : public torch::nn::Cloneable<CausalSelfAttentionImpl> {
 public:
  explicit CausalSelfAttentionImpl(const CharTransformerOptions& options)
      : options(options) {
    reset();
  }

  void reset() override {
    namespace tnn = torch::nn;
    const auto c = options.embed();
    qkv = register_module("qkv", tnn::Linear(c, 3 * c));
    proj = register_module("proj", tnn::Linear(c, c));
    attn_drop = register_module("attn_drop", tnn::Dropout(options.dropout()));
    resid_drop = register_module("resid_drop", tnn::Dropout(options.dropout()));
  }

  /// x: B×T×C → B×T×C.
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0), t = x.size(1), c = x.size(2);
    const auto h = options.heads(), d = c / h;
    // One matmul for q, k and v, then B×T×3×H×D → 3×B×H×T×D.
    auto qkv_heads =
        qkv->forward(x).view({b, t, 3, h, d}).permute({2, 0, 3, 1, 4});
    auto q = qkv_heads[0], k = qkv_heads[1], v = qkv_heads[2];
    auto att = torch::matmul(q, k.transpose(-2, -1)) *
               (1.0 / std::sqrt(static_cast<double>(d)));
    // The mask is made per call rather than kept as a buffer: a buffer
    // would be saved in every checkpoint and broadcast by DDP, and at these
    // sizes (T ≤ a few hundred) making it costs nothing next to the matmuls.
    auto future =
        torch::ones({t, t},
                    torch::TensorOptions(torch::kBool).device(x.device()))
            .triu(1);
    att = att.masked_fill(future, -std::numeric_limits<float>::infinity());
    att = attn_drop->forward(torch::softmax(att, -1));
    auto y = torch::matmul(att, v).transpose(1, 2).reshape({b, t, c});
    return resid_drop->forward(proj->forward(y));
  }

  CharTransformerOptions options;
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::nn::Dropout attn_drop{nullptr}, resid_drop{nullptr};
};
TORCH_MODULE(CausalSelfAttention);

/// A pre-LayerNorm Transformer block: x + attn(ln1(x)), then
/// x + mlp(ln2(x)) with a GELU MLP four times as wide as the stream.
class BlockImpl : public torch::nn::Cloneable<BlockImpl> {
 public:
  explicit BlockImpl(const CharTransformerOptions& options) : options(options) {
    reset();
  }

  void reset() override {
    namespace tnn = torch::nn;
    const auto c = options.embed();
    ln1 = register_module("ln1", tnn::LayerNorm(tnn::LayerNormOptions({c})));
    attn = register_module("attn", CausalSelfAttention(options));
    ln2 = register_module("ln2", tnn::LayerNorm(tnn::LayerNormOptions({c})));
    mlp = register_module("mlp",
                          tnn::Sequential(tnn::Linear(c, 4 * c), tnn::GELU(),
                                          tnn::Linear(4 * c, c),
                                          tnn::Dropout(options.dropout())));
  }

  torch::Tensor forward(torch::Tensor x) {
    x = x + attn->forward(ln1->forward(x));
    return x + mlp->forward(ln2->forward(x));
  }

  CharTransformerOptions options;
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  CausalSelfAttention attn{nullptr};
  torch::nn::Sequential mlp{nullptr};
};
TORCH_MODULE(Block);

/// A GPT-style character language model:
///
/// | name        | layer                                        | output  |
/// |-------------|----------------------------------------------|---------|
/// | tok         | Embedding(vocab, C)                          | B×T×C   |
/// | pos         | Embedding(context, C), added to tok          | B×T×C   |
/// | drop        | Dropout                                      | B×T×C   |
/// | blocks.i    | `layers` × pre-LN block (causal attention,   | B×T×C   |
/// |             | GELU MLP 4C)                                 |         |
/// | ln_f        | LayerNorm(C)                                 | B×T×C   |
/// | head        | Linear(C, vocab)                             | B×T×V   |
///
/// No BatchNorm: under DDP each rank's update is then exactly its share of
/// the joined batch's, with no statistics to synchronise. Cloneable, so
/// DataParallel can replicate it.
///
/// Example:
/// ```
/// char_lm::CharTransformer m(char_lm::CharTransformerOptions(65));
/// auto logits = m->forward(torch::randint(65, {8, 64}));  // 8×64×65
/// ```
class CharTransformerImpl : public torch::nn::Cloneable<CharTransformerImpl> {
 public:
  explicit CharTransformerImpl(CharTransformerOptions options)
      : options(options) {
    reset();
  }

  void reset() override {
    namespace tnn = torch::nn;
    using ddpkit::detail::cat;
    const auto& o = options;
    if (o.vocab() < 1 || o.context() < 1 || o.embed() < 1 || o.heads() < 1 ||
        o.layers() < 1) {
      throw ddpkit::UsageError(
          cat("CharTransformer: vocab ", o.vocab(), ", context ", o.context(),
              ", embed ", o.embed(), ", heads ", o.heads(), ", layers ",
              o.layers(), ": each must be >= 1"));
    }
    if (o.embed() % o.heads() != 0) {
      throw ddpkit::UsageError(cat("CharTransformer: embed ", o.embed(),
                                   " is not a multiple of heads ", o.heads()));
    }
    if (!(o.dropout() >= 0 && o.dropout() < 1)) {
      throw ddpkit::UsageError(
          cat("CharTransformer: dropout ", o.dropout(), " must be in [0, 1)"));
    }
    const auto c = o.embed();
    tok = register_module("tok", tnn::Embedding(o.vocab(), c));
    pos = register_module("pos", tnn::Embedding(o.context(), c));
    drop = register_module("drop", tnn::Dropout(o.dropout()));
    blocks = register_module("blocks", tnn::ModuleList());
    for (int64_t i = 0; i < o.layers(); ++i) blocks->push_back(Block(o));
    list_units();
    ln_f = register_module("ln_f", tnn::LayerNorm(tnn::LayerNormOptions({c})));
    head = register_module("head", tnn::Linear(c, o.vocab()));
    // GPT-2's initialisation: N(0, 0.02) weights, zero biases. libtorch's
    // defaults (N(0, 1) embeddings, fan-in uniform linears) start the
    // logits far from uniform, so the first steps go to undoing that.
    torch::NoGradGuard no_grad;
    for (auto& m : modules(/*include_self=*/false)) {
      if (auto* l = m->as<tnn::Linear>()) {
        l->weight.normal_(0.0, 0.02);
        if (l->bias.defined()) l->bias.zero_();
      } else if (auto* e = m->as<tnn::Embedding>()) {
        e->weight.normal_(0.0, 0.02);
      }
    }
  }

  /// A deep copy (Cloneable's), whose own blocks are its units.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device =
          c10::nullopt) const override {
    auto copy = Cloneable<CharTransformerImpl>::clone(device);
    std::dynamic_pointer_cast<CharTransformerImpl>(copy)->list_units();
    return copy;
  }

  /// idx: int64 B×T token ids, T ≤ context → float logits B×T×vocab.
  torch::Tensor forward(const torch::Tensor& idx) {
    if (idx.dim() != 2 || idx.size(1) < 1 || idx.size(1) > options.context()) {
      throw ddpkit::UsageError(ddpkit::detail::cat(
          "CharTransformer: input of shape ", idx.sizes(),
          "; expected B×T token ids with 1 <= T <= context ",
          options.context()));
    }
    const auto t = idx.size(1);
    auto positions = torch::arange(
        t, torch::TensorOptions(torch::kLong).device(idx.device()));
    auto x = drop->forward(tok->forward(idx) + pos->forward(positions));
    for (auto& block : block_units) x = block(x);
    return head->forward(ln_f->forward(x));
  }

  CharTransformerOptions options;
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::Dropout drop{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  /// The blocks, in order, each marked as a unit of a fully sharded model
  /// (ddpkit/nn/unit.hpp: ZeRO-3 gathers a block's parameters for its
  /// call; a no-op elsewhere). `blocks` holds them under their names.
  std::vector<ddpkit::nn::Unit<Block>> block_units;
  torch::nn::LayerNorm ln_f{nullptr};
  torch::nn::Linear head{nullptr};

 private:
  void list_units() {
    block_units.clear();
    for (const auto& m : blocks->children()) {
      block_units.emplace_back(Block(std::dynamic_pointer_cast<BlockImpl>(m)));
    }
  }
};
TORCH_MODULE(CharTransformer);

/// Trainable parameters (elements, not tensors).
inline int64_t parameter_count(CharTransformer& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

// ---- vocabulary ------------------------------------------------------------

/// The distinct bytes of a text, sorted, so a text always gives the same
/// ids. A multi-byte UTF-8 character is several tokens; the licence texts
/// the example defaults to are plain ASCII.
class Vocabulary {
 public:
  explicit Vocabulary(std::string_view text) {
    std::array<bool, 256> seen{};
    for (unsigned char ch : text) seen[ch] = true;
    index_.fill(-1);
    for (int b = 0; b < 256; ++b) {
      if (!seen[b]) continue;
      index_[b] = static_cast<int16_t>(chars_.size());
      chars_.push_back(static_cast<char>(b));
    }
  }

  /// Distinct tokens.
  int64_t size() const {
    return static_cast<int64_t>(chars_.size());
  }
  /// The tokens in id order.
  const std::string& chars() const {
    return chars_;
  }

  /// int64 1-D ids of `s`; a UsageError naming the first byte the text did
  /// not have.
  torch::Tensor encode(std::string_view s) const {
    auto ids = torch::empty({static_cast<int64_t>(s.size())}, torch::kLong);
    auto* out = ids.data_ptr<int64_t>();
    for (std::size_t i = 0; i < s.size(); ++i) {
      const auto b = static_cast<unsigned char>(s[i]);
      if (index_[b] < 0) {
        throw ddpkit::UsageError(ddpkit::detail::cat(
            "character ", static_cast<int>(b), " at offset ", i,
            " is not in the vocabulary (", size(), " characters)"));
      }
      out[i] = index_[b];
    }
    return ids;
  }

  /// The characters of `ids` (any shape, read in order; any device).
  std::string decode(const torch::Tensor& ids) const {
    auto flat = ids.to(torch::kCPU, torch::kLong).contiguous().view(-1);
    const auto* p = flat.data_ptr<int64_t>();
    std::string s;
    s.reserve(static_cast<std::size_t>(flat.numel()));
    for (int64_t i = 0; i < flat.numel(); ++i) {
      if (p[i] < 0 || p[i] >= size()) {
        throw ddpkit::UsageError(ddpkit::detail::cat(
            "token id ", p[i], " is outside the vocabulary [0, ", size(), ")"));
      }
      s.push_back(chars_[static_cast<std::size_t>(p[i])]);
    }
    return s;
  }

 private:
  std::string chars_;
  std::array<int16_t, 256> index_{};
};

// ---- data ------------------------------------------------------------------

/// Non-overlapping windows of a token sequence: window i is
/// ids[i·ctx, i·ctx + ctx) and its target the same range one token later,
/// so the model learns to predict every next character of the window.
class TextWindows {
 public:
  TextWindows(torch::Tensor ids, int64_t context)
      : ids_(std::move(ids)), context_(context) {
    if (ids_.dim() != 1 || ids_.scalar_type() != torch::kLong) {
      throw ddpkit::UsageError("TextWindows: ids must be a 1-D int64 tensor");
    }
    if (context_ < 1) {
      throw ddpkit::UsageError(ddpkit::detail::cat("TextWindows: context ",
                                                   context_, " must be >= 1"));
    }
  }

  /// Whole windows whose shifted target also fits: (n - 1) / context.
  std::size_t size() const {
    const auto n = ids_.size(0);
    return n < 1 ? 0 : static_cast<std::size_t>((n - 1) / context_);
  }

  ddpkit::data::Example get(std::size_t i) const {
    if (i >= size()) {
      throw ddpkit::UsageError(
          ddpkit::detail::cat("TextWindows: window ", i, " of ", size()));
    }
    const auto start = static_cast<int64_t>(i) * context_;
    // Views into the text: the loader's stacking makes the batch's copy.
    return {ids_.slice(0, start, start + context_),
            ids_.slice(0, start + 1, start + context_ + 1)};
  }

  int64_t context() const {
    return context_;
  }
  const torch::Tensor& ids() const {
    return ids_;
  }

 private:
  torch::Tensor ids_;
  int64_t context_;
};

/// A text's ids cut in two.
struct TextSplit {
  torch::Tensor train;
  torch::Tensor val;
};

/// The first (1 - val_fraction) of `ids` for training, the rest for
/// validation. A contiguous tail rather than random windows: neighbouring
/// windows of a text share phrases, so a random split would let validation
/// measure memorisation.
inline TextSplit split_text(const torch::Tensor& ids, double val_fraction) {
  if (!(val_fraction > 0 && val_fraction < 1)) {
    throw ddpkit::UsageError(ddpkit::detail::cat(
        "split_text: val_fraction ", val_fraction, " must be in (0, 1)"));
  }
  const auto n = ids.size(0);
  const auto n_val =
      static_cast<int64_t>(std::llround(static_cast<double>(n) * val_fraction));
  return {ids.slice(0, 0, n - n_val), ids.slice(0, n - n_val, n)};
}

// ---- files -----------------------------------------------------------------

/// The text used without --data: the first licence text present (Debian's
/// base-files installs all three).
inline std::string default_text_path() {
  const char* candidates[] = {"/usr/share/common-licenses/GPL-3",
                              "/usr/share/common-licenses/Apache-2.0",
                              "/usr/share/common-licenses/GPL-2"};
  std::error_code ec;
  for (const char* p : candidates) {
    if (std::filesystem::is_regular_file(p, ec)) return p;
  }
  throw ddpkit::UsageError(ddpkit::detail::cat(
      "no --data given and none of ", ddpkit::detail::join(candidates, ", "),
      " exists; pass a text file with --data FILE"));
}

/// The whole of `path`, as bytes. A UsageError naming the file and the
/// reason when it cannot be read or is too short to give one training and
/// one validation window of `context` characters (2·context + 2 bytes).
inline std::string read_text(const std::filesystem::path& path,
                             int64_t context) {
  using ddpkit::detail::cat;
  namespace fs = std::filesystem;
  const auto name = path.string();
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) {
    throw ddpkit::UsageError(cat("text file ", name, " does not exist"));
  }
  if (ec) {
    throw ddpkit::UsageError(
        cat("text file ", name, " cannot be read: ", ec.message()));
  }
  if (fs::is_directory(status)) {
    throw ddpkit::UsageError(
        cat("text file ", name, " is a directory; --data takes a text file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw ddpkit::UsageError(
        cat("text file ", name, " cannot be opened: ", std::strerror(errno)));
  }
  std::string text((std::istreambuf_iterator<char>(in)),
                   std::istreambuf_iterator<char>());
  if (in.bad()) {
    throw ddpkit::UsageError(cat("text file ", name, " could not be read"));
  }
  const auto need = static_cast<std::size_t>(2 * context + 2);
  if (text.size() < need) {
    throw ddpkit::UsageError(cat("text file ", name, " has ", text.size(),
                                 " bytes; a context of ", context,
                                 " needs at least ", need,
                                 " (one training and one validation window)"));
  }
  return text;
}

// ---- sampling --------------------------------------------------------------

/// `n` characters continuing `prompt` (not included in the result). Each
/// step feeds the last `context` tokens and draws the next from the
/// softmax of the logits divided by `temperature`, with a CPU generator
/// seeded by `seed` (the same seed gives the same text on any device);
/// `temperature` 0 takes the most likely character instead (greedy). Runs
/// in eval mode without autograd and puts the model back in the mode it
/// was in.
inline std::string sample(CharTransformer& model, const Vocabulary& vocab,
                          const std::string& prompt, int n, std::uint64_t seed,
                          double temperature = 1.0) {
  if (prompt.empty()) {
    throw ddpkit::UsageError("sample: the prompt must not be empty");
  }
  if (!(temperature >= 0)) {
    throw ddpkit::UsageError(ddpkit::detail::cat(
        "sample: temperature ", temperature, " must be >= 0 (0: greedy)"));
  }
  torch::NoGradGuard no_grad;
  const bool was_training = model->is_training();
  model->eval();
  ddpkit::detail::ScopeExit restore([&] { model->train(was_training); });
  const auto device = model->head->weight.device();
  const auto context = model->options.context();
  auto gen = ddpkit::detail::make_generator(seed);
  std::vector<int64_t> ids;
  {
    auto p = vocab.encode(prompt);
    ids.assign(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + p.numel());
  }
  const auto prompt_len = ids.size();
  for (int i = 0; i < n; ++i) {
    const auto t = std::min<int64_t>(context, static_cast<int64_t>(ids.size()));
    auto window = torch::tensor(std::vector<int64_t>(ids.end() - t, ids.end()),
                                torch::kLong);
    auto logits = model->forward(window.unsqueeze(0).to(device))[0][t - 1].to(
        torch::kCPU, torch::kFloat);
    int64_t next = 0;
    if (temperature == 0) {
      next = logits.argmax().item<int64_t>();
    } else {
      auto probs = torch::softmax(logits / temperature, -1);
      next = torch::multinomial(probs, 1, /*replacement=*/false, gen)
                 .item<int64_t>();
    }
    ids.push_back(next);
  }
  return vocab.decode(torch::tensor(
      std::vector<int64_t>(
          ids.begin() + static_cast<std::ptrdiff_t>(prompt_len), ids.end()),
      torch::kLong));
}

}  // namespace char_lm
