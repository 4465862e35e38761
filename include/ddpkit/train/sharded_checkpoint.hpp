// SPDX-License-Identifier: BSD-3-Clause
// Sharded checkpoint files: each rank writes its pieces of the training
// state to a file of its own, and the whole tensors are rebuilt from the
// files of every rank, at whatever world size reads them. See Note
// [Sharded checkpoint files].
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/train/checkpoint.hpp"

namespace ddpkit::train {

// Note [Sharded checkpoint files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The file format of sharded checkpoints, as built so far (issue 47, item
// 6). A *piece* is a run of one tensor's elements in the order they lie in
// memory: a whole parameter (ZeRO-1/2 own whole parameters), or the part
// of a parameter that falls in a rank's flat shard of a unit (ZeRO-3).
// Each rank writes its pieces to its own file, `rank-RRRRR-of-WWWWW.pt`, a
// ddpkit checkpoint container (durable and atomic: atomic_save; Python's
// `torch.load` reads it): "format" "ddpkit.shard", "rank", "world",
// "pieces" {key: 1-D tensor} and "offsets" {key: its first element}, at
// most one piece of a tensor per file (a flat shard meets each parameter
// in one run). A `ShardIndex` names every whole tensor with its sizes,
// strides and dtype; it is written once, beside the files, by whoever
// commits the checkpoint. `assemble_shards` rebuilds each whole tensor from
// the files of all the writer's ranks, with the writer's strides (a
// channels-last parameter stays channels-last), and checks on the way that
// every file is the rank and world it should be, and that the pieces of
// each tensor tile it exactly: a missing, overlapping, out-of-range or
// mistyped piece is an error naming the key and the files. Reading does
// not depend on the world that reads: a checkpoint written at world 2
// assembles the same at world 1, 2 or 4. A file may also describe the
// tensors it holds pieces of ("metas", merged into the index: one rank's
// optimizer state is known only to it) and carry whole numbers
// ("scalars": an optimizer's step counts). Lists are pickled as plain
// lists, so Python's torch.load(weights_only=True) reads every file. What
// a training checkpoint writes in them: Note [Sharded training
// checkpoints] (sharded_state.hpp).

/// What a whole tensor of a sharded checkpoint is: its sizes, strides
/// (dense: contiguous, channels-last or another permutation) and dtype.
struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  c10::ScalarType dtype = c10::ScalarType::Float;

  static TensorMeta of(const torch::Tensor& t) {
    return {t.sizes().vec(), t.strides().vec(), t.scalar_type()};
  }
  int64_t numel() const {
    int64_t n = 1;
    for (const auto s : sizes) n *= s;
    return n;
  }
};

/// Every whole tensor of a sharded checkpoint, by key.
using ShardIndex = std::map<std::string, TensorMeta>;

/// One rank's pieces: key -> (first element, the run as a 1-D tensor).
using ShardPieces = std::map<std::string, std::pair<int64_t, torch::Tensor>>;

inline constexpr const char* kShardFormat = "ddpkit.shard";

/// The file name of rank `rank`'s shard at world `world`.
inline std::string shard_file_name(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof name, "rank-%05d-of-%05d.pt", rank, world);
  return name;
}

/// The part of `t` (dense) from element `begin` to `end` in memory order,
/// as a 1-D view: what a rank writes as its piece of `t`.
inline torch::Tensor memory_run(const torch::Tensor& t, int64_t begin,
                                int64_t end) {
  if (!t.is_non_overlapping_and_dense()) {
    throw UsageError(
        "a sharded checkpoint's tensor must be dense (contiguous, "
        "channels-last or another permutation of its dimensions)");
  }
  return t.as_strided({end - begin}, {1}, t.storage_offset() + begin);
}

inline c10::IValue shard_index_value(const ShardIndex& index);

/// Writes rank `rank`'s pieces (of a world of `world`) to `path` atomically
/// and durably, with `metas` (what each piece's whole tensor is, for keys
/// the reader's index may not list) and `scalars` (whole numbers by key).
/// Each piece is written as its own run (a view is copied out of its
/// larger storage first); copy them before calling this if training may
/// change them while it runs.
inline void write_shard_file(
    const std::filesystem::path& path, int rank, int world,
    const ShardPieces& pieces, const ShardIndex& metas = {},
    const std::map<std::string, int64_t>& scalars = {}) {
  c10::Dict<std::string, torch::Tensor> data;
  c10::Dict<std::string, int64_t> offsets;
  for (const auto& [key, piece] : pieces) {
    const auto& [offset, run] = piece;
    if (run.dim() != 1 || offset < 0) {
      throw UsageError(ddpkit::detail::cat(
          "sharded checkpoint ", path.string(), ": the piece of '", key,
          "' must be a 1-D run at an offset >= 0 (got ", run.dim(),
          " dimensions at ", offset, ")"));
    }
    torch::Tensor own = run.to(torch::kCPU).contiguous();
    if (own.storage().nbytes() != own.nbytes() || own.storage_offset() != 0) {
      own = own.clone();  // a view writes its whole storage otherwise
    }
    data.insert(key, own);
    offsets.insert(key, offset);
  }
  Checkpoint c;
  c.write("format", std::string(kShardFormat));
  c.write("rank", static_cast<int64_t>(rank));
  c.write("world", static_cast<int64_t>(world));
  c.write("pieces", c10::IValue(data));
  c.write("offsets", c10::IValue(offsets));
  if (!metas.empty()) c.write("metas", shard_index_value(metas));
  if (!scalars.empty()) {
    c10::Dict<std::string, int64_t> sc;
    for (const auto& [k, v] : scalars) sc.insert(k, v);
    c.write("scalars", c10::IValue(sc));
  }
  atomic_save(c, path);
}

/// `index` as a checkpoint entry: {key: {"sizes": [...], "strides": [...],
/// "dtype": "Float"}} (what Python's torch.load reads as dicts and lists).
inline c10::IValue shard_index_value(const ShardIndex& index) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  for (const auto& [key, meta] : index) {
    c10::impl::GenericDict m(c10::StringType::get(), c10::AnyType::get());
    // Lists of Any: an int list would be pickled as build_intlist, which
    // Python's torch.load(weights_only=True) refuses.
    auto list = [](const std::vector<int64_t>& v) {
      c10::impl::GenericList l(c10::AnyType::get());
      for (const auto x : v) l.push_back(x);
      return c10::IValue(l);
    };
    m.insert("sizes", list(meta.sizes));
    m.insert("strides", list(meta.strides));
    m.insert("dtype", std::string(c10::toString(meta.dtype)));
    d.insert(key, c10::IValue(m));
  }
  return c10::IValue(d);
}

/// The index `shard_index_value` wrote, read back from `v`; a UsageError
/// naming `where` and the key when it is not one.
inline ShardIndex read_shard_index(const c10::IValue& v,
                                   const std::string& where) {
  using ddpkit::detail::cat;
  if (!v.isGenericDict()) {
    throw UsageError(cat(where, ": the shard index is not a dict"));
  }
  auto ints = [&](const c10::impl::GenericDict& m, const char* field,
                  const std::string& key) {
    const auto it = m.find(field);
    // (A list read back from a file may be typed List[Any].)
    bool ok = it != m.end() && it->value().isList();
    std::vector<int64_t> out;
    if (ok) {
      for (const auto& e : it->value().toListRef()) {
        ok = ok && e.isInt();
        if (ok) out.push_back(e.toInt());
      }
    }
    if (!ok) {
      throw UsageError(cat(where, ": the shard index entry '", key,
                           "' has no list of whole numbers '", field, "'"));
    }
    return out;
  };
  ShardIndex index;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.key().isString() || !kv.value().isGenericDict()) {
      throw UsageError(cat(where, ": the shard index holds a non-entry"));
    }
    const std::string key = kv.key().toStringRef();
    const auto m = kv.value().toGenericDict();
    TensorMeta meta{ints(m, "sizes", key), ints(m, "strides", key)};
    const auto d = m.find("dtype");
    bool known = false;
    if (d != m.end() && d->value().isString()) {
      for (const auto t : {c10::ScalarType::Float, c10::ScalarType::Double,
                           c10::ScalarType::BFloat16, c10::ScalarType::Half,
                           c10::ScalarType::Long, c10::ScalarType::Int,
                           c10::ScalarType::Short, c10::ScalarType::Char,
                           c10::ScalarType::Byte, c10::ScalarType::Bool}) {
        if (d->value().toStringRef() == c10::toString(t)) {
          meta.dtype = t;
          known = true;
        }
      }
    }
    if (!known || meta.sizes.size() != meta.strides.size()) {
      throw UsageError(cat(where, ": the shard index entry '", key,
                           "' has no known dtype or its sizes and strides "
                           "differ in length"));
    }
    index.emplace(key, std::move(meta));
  }
  return index;
}

namespace detail {

struct Placed {
  int64_t begin, end;
  int file;
};

inline std::string files_named(const std::vector<std::filesystem::path>& files,
                               const std::vector<Placed>& runs) {
  std::string out;
  for (const auto& r : runs) {
    if (!out.empty()) out += ", ";
    out += ddpkit::detail::cat(files[static_cast<std::size_t>(r.file)].string(),
                               " [", r.begin, ", ", r.end, ")");
  }
  return out;
}

}  // namespace detail

/// Every tensor of `index`, rebuilt whole from `files`: the shard files of
/// ranks 0, 1, ... of the world that wrote them, in rank order. Each comes
/// back with its writer's sizes, strides and dtype. Files may describe
/// tensors the index does not list ("metas"); they are rebuilt too, and
/// their whole numbers ("scalars") go to `scalars` when given. Throws a
/// UsageError naming the file (one missing, damaged, of another rank or
/// world or format) or the key (a piece missing, overlapping another,
/// beyond the tensor's end, of another dtype; a key nothing describes; two
/// descriptions of one tensor that differ).
inline std::map<std::string, torch::Tensor> assemble_shards(
    ShardIndex index, const std::vector<std::filesystem::path>& files,
    std::map<std::string, int64_t>* scalars = nullptr) {
  using ddpkit::detail::cat;
  const int world = static_cast<int>(files.size());
  std::vector<Checkpoint> read;
  read.reserve(files.size());
  for (int i = 0; i < world; ++i) {
    const auto& file = files[static_cast<std::size_t>(i)];
    Checkpoint c = open_checkpoint(file);  // checked; names the file
    c10::IValue v;
    if (!c.try_read("format", v) || !v.isString() ||
        v.toStringRef() != kShardFormat) {
      throw UsageError(cat("shard file ", file.string(),
                           " is not a ddpkit shard (format '", kShardFormat,
                           "' expected)"));
    }
    constexpr int kMax = std::numeric_limits<int>::max();
    const int rank = read_checkpoint_int(c, "rank", file, 0, kMax);
    const int w = read_checkpoint_int(c, "world", file, 1, kMax);
    if (rank != i || w != world) {
      throw UsageError(cat("shard file ", file.string(), " is rank ", rank,
                           " of ", w, "; expected rank ", i, " of ", world));
    }
    if (c.try_read("metas", v)) {
      for (auto& [key, meta] : read_shard_index(v, file.string())) {
        const auto [it, added] = index.emplace(key, meta);
        if (!added && (it->second.sizes != meta.sizes ||
                       it->second.strides != meta.strides ||
                       it->second.dtype != meta.dtype)) {
          throw UsageError(cat("shard file ", file.string(), " describes '",
                               key,
                               "' otherwise than the index or an "
                               "earlier rank's file"));
        }
      }
    }
    if (scalars && c.try_read("scalars", v)) {
      if (!v.isGenericDict()) {
        throw UsageError(
            cat("shard file ", file.string(), ": 'scalars' is not a dict"));
      }
      for (const auto& kv : v.toGenericDict()) {
        if (!kv.key().isString() || !kv.value().isInt()) {
          throw UsageError(cat("shard file ", file.string(),
                               ": 'scalars' holds a non-number"));
        }
        (*scalars)[kv.key().toStringRef()] = kv.value().toInt();
      }
    }
    read.push_back(std::move(c));
  }
  std::map<std::string, torch::Tensor> whole;
  std::map<std::string, std::vector<detail::Placed>> placed;
  for (const auto& [key, meta] : index) {
    auto t = torch::empty_strided(meta.sizes, meta.strides,
                                  torch::TensorOptions().dtype(meta.dtype));
    if (!t.is_non_overlapping_and_dense()) {
      throw UsageError(cat("sharded checkpoint: the index gives '", key,
                           "' strides that are not dense"));
    }
    whole.emplace(key, std::move(t));
  }
  for (int i = 0; i < world; ++i) {
    const auto& file = files[static_cast<std::size_t>(i)];
    const Checkpoint& c = read[static_cast<std::size_t>(i)];
    c10::IValue pieces, offsets;
    if (!c.try_read("pieces", pieces) || !pieces.isGenericDict() ||
        !c.try_read("offsets", offsets) || !offsets.isGenericDict()) {
      throw UsageError(cat("shard file ", file.string(),
                           " has no 'pieces' and 'offsets' dicts"));
    }
    const auto offs = offsets.toGenericDict();
    for (const auto& kv : pieces.toGenericDict()) {
      const std::string key = kv.key().toStringRef();
      const auto it = whole.find(key);
      if (it == whole.end()) {
        throw UsageError(cat("shard file ", file.string(), " holds '", key,
                             "', which the checkpoint's index does not list"));
      }
      const auto o = offs.find(kv.key());
      if (o == offs.end() || !o->value().isInt() || !kv.value().isTensor()) {
        throw UsageError(cat("shard file ", file.string(), ": the piece of '",
                             key, "' has no offset or is not a tensor"));
      }
      const auto run = kv.value().toTensor();
      const int64_t begin = o->value().toInt();
      const int64_t end = begin + run.numel();
      const auto& t = it->second;
      if (run.dim() != 1 || run.scalar_type() != t.scalar_type() || begin < 0 ||
          end > t.numel()) {
        throw UsageError(cat("shard file ", file.string(), ": the piece of '",
                             key, "' (", run.scalar_type(), ", ", run.numel(),
                             " elements at ", begin, ") does not fit '", key,
                             "' (", t.scalar_type(), ", ", t.numel(),
                             " elements)"));
      }
      memory_run(t, begin, end).copy_(run);
      placed[key].push_back({begin, end, i});
    }
  }
  // The pieces of each tensor tile it: from 0 to its end, none twice.
  for (const auto& [key, t] : whole) {
    auto& runs = placed[key];
    std::sort(runs.begin(), runs.end(),
              [](const auto& a, const auto& b) { return a.begin < b.begin; });
    int64_t at = 0;
    std::size_t k = 0;
    for (; k < runs.size() && runs[k].begin == at; ++k) at = runs[k].end;
    if (k < runs.size() && runs[k].begin < at) {
      throw UsageError(cat("sharded checkpoint: pieces of '", key,
                           "' overlap at element ", runs[k].begin, " (",
                           detail::files_named(files, runs), ")"));
    }
    if (at != t.numel()) {
      const int64_t gap_end = k < runs.size() ? runs[k].begin : t.numel();
      throw UsageError(cat(
          "sharded checkpoint: no file holds elements [", at, ", ", gap_end,
          ") of '", key, "' (", t.numel(), " elements; pieces: ",
          runs.empty() ? std::string("none") : detail::files_named(files, runs),
          ")"));
    }
  }
  return whole;
}

}  // namespace ddpkit::train
