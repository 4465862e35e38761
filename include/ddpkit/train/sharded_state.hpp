// SPDX-License-Identifier: BSD-3-Clause
// Sharded training checkpoints: each rank writes its part of the model and
// optimizer state to a file of its own (sharded_checkpoint.hpp's format);
// a small manifest names them; reading rebuilds the whole checkpoint a
// plain one is, for any engine and world size. See Note [Sharded training
// checkpoints].
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/parallel/optimizer_state.hpp"
#include "ddpkit/parallel/zero/sharded_optimizer.hpp"
#include "ddpkit/parallel/zero/zero3_optimizer.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/optimizer_snapshot.hpp"
#include "ddpkit/train/sharded_checkpoint.hpp"

namespace ddpkit::train {

// Note [Sharded training checkpoints]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With TrainerOptions::sharded_checkpoints (--sharded-checkpoint) no rank
// gathers the whole state to write a checkpoint. At a checkpoint every
// rank writes its part to OUT/checkpoints/shards/<state>/rank-R-of-W.pt
// (Note [Sharded checkpoint files]): ZeRO-3 the runs of each parameter in
// its shards and the optimizer state over the same elements; ZeRO-1/2 the
// parameters it owns, whole, with their state; another engine rank 0
// everything. Keys: "model/<name>" for every parameter and buffer name
// (a tied weight under each of its names), "optimizer/<first name>/<field>"
// for the optimizer's state tensors (momentum_buffer, exp_avg, ...), and
// as whole numbers "optimizer/<first name>/step". Each file describes the
// tensors it holds pieces of (sizes, strides, dtype). A rank refuses a
// non-finite piece. The ranks then agree (one all-reduce) that every file
// is durable; only then does rank 0 write `last.pt` (and best.pt, ...) as
// before, atomically, keeping last-prev.pt, but as a *manifest*: every
// entry of a plain checkpoint except "model" and "optimizer", plus
// "shards" {folder, world, index: every model tensor} and
// "optimizer_groups" (the optimizer's parameter groups and options, no
// state, in libtorch's format). A failed write on any rank leaves the
// previous manifest, and the folders it names, untouched. The folder's
// name holds the state (global step, epochs, batches) and a number drawn
// per fit, so a resumed run never rewrites a folder a manifest names.
// Folders no manifest in checkpoints/ names are removed after each
// checkpoint event. Reading (`assemble_training_checkpoint`) rebuilds the
// whole checkpoint from the manifest and every rank's file: the model's
// state dict and an optimizer of the reader's type over every parameter
// holding each state field; then the resume is the plain checkpoint's,
// so the world size and the engine may differ from the writer's. Every
// host's ranks must see the same OUT (a shared file system) for writing
// and for rank 0's reading. With asynchronous checkpoints each rank blocks
// only while its part is copied to host memory (its share of the state);
// its file is written by its background job, and rank 0's job, before it
// writes the manifest, waits until every rank's file exists (each appears
// whole, by rename; up to 10 minutes, or until the fit ends by an error),
// so the agreement needs no collective off the training thread. Not yet:
// reading only a rank's own part (every rank rebuilds the whole state on
// resume, as a plain checkpoint's resume does).

inline constexpr const char* kShardsEntry = "shards";
inline constexpr const char* kOptimizerGroupsEntry = "optimizer_groups";

/// Every name of each parameter of `module` (a tied weight has several),
/// by its TensorImpl, in `named_parameters` order.
inline std::map<const c10::TensorImpl*, std::vector<std::string>>
parameter_names(const torch::nn::Module& module) {
  std::map<const c10::TensorImpl*, std::vector<std::string>> names;
  for (const auto& kv : module.named_parameters(/*recurse=*/true)) {
    names[kv.value().unsafeGetTensorImpl()].push_back(kv.key());
  }
  return names;
}

/// This rank's part of each parameter of `module` (rank `rank`): a ZeRO
/// optimizer's own parts; for any other optimizer, rank 0 every parameter
/// whole with its state.
inline std::vector<parallel::ParamPart> checkpoint_parts(
    const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
    int rank) {
  if (const auto* z =
          dynamic_cast<const parallel::Zero3Optimizer*>(&optimizer)) {
    return z->checkpoint_parts();
  }
  if (const auto* s =
          dynamic_cast<const parallel::ShardedOptimizer*>(&optimizer)) {
    return s->checkpoint_parts();
  }
  std::vector<parallel::ParamPart> out;
  if (rank != 0) return out;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters(/*recurse=*/true)) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) {
      out.push_back(parallel::detail::whole_part(p, optimizer));
    }
  }
  return out;
}

/// An optimizer of `optimizer`'s type over every parameter, with its
/// parameter groups and options and no state.
inline std::shared_ptr<torch::optim::Optimizer> stateless_optimizer(
    const torch::optim::Optimizer& optimizer) {
  std::shared_ptr<torch::optim::Optimizer> copy;
  if (const auto* z =
          dynamic_cast<const parallel::Zero3Optimizer*>(&optimizer)) {
    copy = z->whole();
  } else if (const auto* s =
                 dynamic_cast<const parallel::ShardedOptimizer*>(&optimizer)) {
    copy = s->whole();
  } else {
    copy = detail::frozen_of(optimizer);
  }
  if (!copy) {
    throw UsageError(
        "sharded checkpoints: this optimizer's state cannot be written in "
        "parts (known: libtorch's SGD, Adam, AdamW, RMSprop, Adagrad and "
        "types derived from them); write whole checkpoints instead");
  }
  copy->state().clear();  // (Adagrad makes states when it is built)
  return copy;
}

/// What a manifest says of its shards.
struct ShardSet {
  std::string folder;  ///< relative to the checkpoints folder
  int world = 1;
  ShardIndex index;      ///< every model tensor (rank 0's)
  torch::Tensor groups;  ///< the optimizer without state (rank 0's)
};

/// One rank's part of a sharded checkpoint, collected and not yet written.
struct RankShard {
  ShardSet set;  ///< what the manifest needs (index and groups: rank 0's)
  std::filesystem::path path;  ///< checkpoints / folder / rank-R-of-W.pt
  int rank = 0, world = 1;
  ShardPieces pieces;
  ShardIndex metas;
  std::map<std::string, int64_t> scalars;
};

/// This rank's part of `module` and `optimizer` for a sharded checkpoint
/// in `checkpoints / folder` (Note [Sharded training checkpoints]): views
/// of the training state, or with `copy` host copies of it (what an
/// asynchronous write blocks for: this rank's share).
inline RankShard collect_training_shard(
    const std::filesystem::path& checkpoints, const std::string& folder,
    const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
    int rank, int world, bool copy = false) {
  auto own = [copy](const torch::Tensor& t) {
    return copy ? t.detach().to(torch::kCPU).clone() : t;
  };
  const auto names = parameter_names(module);
  RankShard r;
  r.rank = rank;
  r.world = world;
  r.path = checkpoints / folder / shard_file_name(rank, world);
  for (const auto& part : checkpoint_parts(module, optimizer, rank)) {
    const auto it = names.find(part.param.unsafeGetTensorImpl());
    if (it == names.end()) {
      throw UsageError(
          "sharded checkpoint: the optimizer holds a tensor that is not "
          "one of the model's parameters");
    }
    const auto meta = TensorMeta::of(part.param);
    const auto values = own(part.values);
    for (const auto& n : it->second) {
      r.pieces["model/" + n] = {part.begin, values};
      r.metas["model/" + n] = meta;
    }
    const std::string prefix = "optimizer/" + it->second.front() + "/";
    for (const auto& [field, run] : part.state) {
      r.pieces[prefix + field] = {part.begin, own(run)};
      TensorMeta m = meta;
      m.dtype = run.scalar_type();
      r.metas[prefix + field] = m;
    }
    if (part.step) r.scalars[prefix + "step"] = *part.step;
  }
  r.set = ShardSet{folder, world, {}, {}};
  if (rank == 0) {
    for (const auto& kv : module.named_buffers(/*recurse=*/true)) {
      const auto t = kv.value().detach();
      r.pieces["model/" + kv.key()] = {0, own(memory_run(t, 0, t.numel()))};
      r.metas["model/" + kv.key()] = TensorMeta::of(t);
      r.set.index["model/" + kv.key()] = TensorMeta::of(t);
    }
    for (const auto& kv : module.named_parameters(/*recurse=*/true)) {
      r.set.index["model/" + kv.key()] = TensorMeta::of(kv.value());
    }
    r.set.groups = optimizer_bytes(*stateless_optimizer(optimizer));
  }
  return r;
}

/// Writes `shard` to its file, atomically and durably; refuses a
/// non-finite value (NonFiniteError naming the tensor and the file).
inline void write_rank_shard(const RankShard& shard) {
  for (const auto& [key, piece] : shard.pieces) {
    const auto& run = piece.second;
    if (run.is_floating_point() && !torch::isfinite(run).all().item<bool>()) {
      throw NonFiniteError(ddpkit::detail::cat(
          "refusing to write checkpoint shard ", shard.path.string(), ": '",
          key, "' holds non-finite values"));
    }
  }
  std::filesystem::create_directories(shard.path.parent_path());
  write_shard_file(shard.path, shard.rank, shard.world, shard.pieces,
                   shard.metas, shard.scalars);
}

/// collect_training_shard and write_rank_shard at once. Returns what the
/// manifest needs (index and groups on rank 0).
inline ShardSet write_training_shards(const std::filesystem::path& checkpoints,
                                      const std::string& folder,
                                      const torch::nn::Module& module,
                                      const torch::optim::Optimizer& optimizer,
                                      int rank, int world) {
  RankShard shard = collect_training_shard(checkpoints, folder, module,
                                           optimizer, rank, world);
  write_rank_shard(shard);
  return std::move(shard.set);
}

/// Waits until every file of `files` exists (each appears whole: written
/// to a temporary and renamed), polling; an IoError naming the missing
/// ones after `timeout`, or as soon as `cancelled()` (the fit is ending
/// by an error).
inline void wait_for_files(const std::vector<std::filesystem::path>& files,
                           std::chrono::seconds timeout,
                           const std::function<bool()>& cancelled) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    std::string missing;
    for (const auto& f : files) {
      std::error_code ec;
      if (!std::filesystem::exists(f, ec)) {
        missing += (missing.empty() ? "" : ", ") + f.string();
      }
    }
    if (missing.empty()) return;
    if (cancelled() || std::chrono::steady_clock::now() > deadline) {
      throw IoError(ddpkit::detail::cat(
          "sharded checkpoint: ", cancelled() ? "the fit ended" : "timed out",
          " before every rank's part was written (missing: ", missing,
          "); the previous checkpoint is kept"));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

/// `set` as the manifest's "shards" entry.
inline c10::IValue shard_set_value(const ShardSet& set) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("folder", set.folder);
  d.insert("world", static_cast<int64_t>(set.world));
  d.insert("index", shard_index_value(set.index));
  return c10::IValue(d);
}

/// Whether `c` is a sharded checkpoint's manifest.
inline bool is_shard_manifest(const Checkpoint& c) {
  c10::IValue v;
  return c.try_read(kShardsEntry, v);
}

/// The manifest's "shards" entry read back: a UsageError naming `path`
/// when it is not one.
inline ShardSet read_shard_set(const Checkpoint& manifest,
                               const std::filesystem::path& path) {
  using ddpkit::detail::cat;
  c10::IValue v;
  manifest.try_read(kShardsEntry, v);
  if (!v.isGenericDict()) {
    throw UsageError(
        cat("checkpoint ", path.string(), ": 'shards' is not a dict"));
  }
  const auto d = v.toGenericDict();
  const auto folder = d.find("folder");
  const auto world = d.find("world");
  const auto index = d.find("index");
  if (folder == d.end() || !folder->value().isString() || world == d.end() ||
      !world->value().isInt() || world->value().toInt() < 1 ||
      index == d.end()) {
    throw UsageError(cat("checkpoint ", path.string(),
                         ": 'shards' lacks a folder, a world size >= 1 or an "
                         "index"));
  }
  const std::string f = folder->value().toStringRef();
  if (f.empty() || std::filesystem::path(f).is_absolute() ||
      f.find("..") != std::string::npos) {
    throw UsageError(cat("checkpoint ", path.string(), ": shard folder '", f,
                         "' is not a folder below the checkpoint's"));
  }
  ShardSet set;
  set.folder = f;
  set.world = static_cast<int>(world->value().toInt());
  set.index = read_shard_index(index->value(), path.string());
  return set;
}

/// The shard files a manifest at `path` names, in rank order.
inline std::vector<std::filesystem::path> shard_files(
    const ShardSet& set, const std::filesystem::path& path) {
  std::vector<std::filesystem::path> files;
  for (int r = 0; r < set.world; ++r) {
    files.push_back(path.parent_path() / set.folder /
                    shard_file_name(r, set.world));
  }
  return files;
}

/// The whole checkpoint a manifest (read from `path`) and its shards make:
/// the manifest's entries, "model" (the state dict) and "optimizer" (an
/// optimizer of `optimizer`'s type over `module`'s parameters, with the
/// manifest's groups and every rank's state), as a plain checkpoint holds
/// them. A UsageError naming the file or key for anything missing,
/// damaged or not fitting.
inline Checkpoint assemble_training_checkpoint(
    const Checkpoint& manifest, const std::filesystem::path& path,
    const torch::nn::Module& module, const torch::optim::Optimizer& optimizer) {
  using ddpkit::detail::cat;
  const ShardSet set = read_shard_set(manifest, path);
  std::map<std::string, int64_t> scalars;
  auto whole = assemble_shards(set.index, shard_files(set, path), &scalars);
  c10::Dict<std::string, torch::Tensor> model;
  for (const auto& [key, t] : whole) {
    if (key.rfind("model/", 0) == 0) model.insert(key.substr(6), t);
  }
  auto opt = stateless_optimizer(optimizer);
  {
    c10::IValue groups;
    if (!manifest.try_read(kOptimizerGroupsEntry, groups)) {
      throw UsageError(cat("checkpoint ", path.string(), " lacks '",
                           kOptimizerGroupsEntry, "'"));
    }
    Checkpoint g;
    g.write("optimizer", groups);
    load_optimizer_checked(*opt, g, path);
  }
  const auto names = parameter_names(module);
  std::set<const c10::TensorImpl*> seen;
  for (const auto& group : opt->param_groups()) {
    for (const auto& p : group.params()) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      const auto it = names.find(p.unsafeGetTensorImpl());
      if (it == names.end()) continue;
      const std::string prefix = "optimizer/" + it->second.front() + "/";
      auto state = parallel::detail::new_state_like(*opt);
      bool any = false;
      for (auto& [field, ref] : parallel::detail::state_fields(*state)) {
        const auto f = whole.find(prefix + field);
        if (f == whole.end()) continue;
        if (f->second.sizes() != p.sizes()) {
          throw UsageError(cat("checkpoint ", path.string(), ": '", f->first,
                               "' has sizes ", f->second.sizes(),
                               ", the parameter ", p.sizes()));
        }
        *ref = f->second;
        any = true;
      }
      const auto step = scalars.find(prefix + "step");
      if (int64_t* s = parallel::detail::state_step(*state);
          s && step != scalars.end()) {
        *s = step->second;
        any = true;
      }
      if (any) opt->state()[compat::optimizer_state_key(p)] = std::move(state);
    }
  }
  Checkpoint out;
  for (const auto& key : manifest.keys()) {
    if (key == kShardsEntry || key == kOptimizerGroupsEntry) continue;
    c10::IValue v;
    manifest.try_read(key, v);
    out.write(key, v);
  }
  out.write("model", c10::IValue(model));
  out.write_optimizer(*opt);
  return out;
}

/// Writes the model's state dict a checkpoint at `from` holds (a sharded
/// checkpoint's manifest, its shards read in; or a plain checkpoint) to
/// `to`, whole, in torch.save's format (Python's `torch.load` reads it;
/// `load_state_dict` takes it), atomically. A UsageError naming the file
/// for anything missing or damaged.
inline void consolidate_state_dict(const std::filesystem::path& from,
                                   const std::filesystem::path& to) {
  using ddpkit::detail::cat;
  const Checkpoint c = open_checkpoint(from);
  c10::Dict<std::string, torch::Tensor> model;
  if (is_shard_manifest(c)) {
    const ShardSet set = read_shard_set(c, from);
    for (const auto& [key, t] :
         assemble_shards(set.index, shard_files(set, from))) {
      if (key.rfind("model/", 0) == 0) model.insert(key.substr(6), t);
    }
  } else {
    c10::IValue v;
    if (!c.try_read("model", v) || !v.isGenericDict()) {
      throw UsageError(
          cat("checkpoint ", from.string(), " holds no model state dict"));
    }
    for (const auto& kv : v.toGenericDict()) {
      model.insert(kv.key().toStringRef(), kv.value().toTensor());
    }
  }
  ddpkit::detail::write_atomically(
      to, ddpkit::compat::save_for_python(c10::IValue(model)));
}

/// The shard folders (relative to `checkpoints`) the manifests in it name:
/// every `*.pt` there small enough to be a manifest (under 64 MiB) that is
/// one. Unreadable files name none.
inline std::set<std::string> named_shard_folders(
    const std::filesystem::path& checkpoints) {
  namespace fs = std::filesystem;
  std::set<std::string> named;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(checkpoints, ec)) {
    if (e.path().extension() != ".pt" || !e.is_regular_file(ec)) continue;
    if (e.file_size(ec) > (64u << 20) || ec) continue;
    try {
      const Checkpoint c = open_checkpoint(e.path());
      if (is_shard_manifest(c))
        named.insert(read_shard_set(c, e.path()).folder);
    } catch (const std::exception&) {
    }
  }
  return named;
}

/// Removes the folders under `checkpoints`/shards that no manifest in
/// `checkpoints` names (a failed write's, superseded ones).
inline void remove_unnamed_shards(const std::filesystem::path& checkpoints) {
  namespace fs = std::filesystem;
  const auto named = named_shard_folders(checkpoints);
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(checkpoints / "shards", ec)) {
    const std::string rel = "shards/" + e.path().filename().string();
    if (e.is_directory(ec) && rel.rfind("shards/step-", 0) == 0 &&
        !named.count(rel)) {
      fs::remove_all(e.path(), ec);
    }
  }
}

}  // namespace ddpkit::train
