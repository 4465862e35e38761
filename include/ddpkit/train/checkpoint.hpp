// SPDX-License-Identifier: BSD-3-Clause
// The checkpoint file format: one dict of named values in torch.save's zip
// format (the container; what a Trainer's checkpoint holds is
// checkpoint_connector.hpp's), written
// atomically (temporary file, flush, fsync, rename), so a crash mid-write
// never leaves a broken `last` or `best`, and loaded with errors that name
// the file and the first mismatching key.
//
// Python reads them with a plain `torch.load(path)` (default
// `weights_only=True`): `ckpt["model"]` is the model's state dict, which
// `model.load_state_dict` accepts. The optimizer state is libtorch's own
// serialization of it, kept as bytes (a uint8 tensor) under "optimizer".
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/detail/archive_check.hpp"
#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/loaded_tensors.hpp"
#include "ddpkit/detail/pickle_reader.hpp"
#include "ddpkit/detail/strings.hpp"
#include "ddpkit/nn/state_dict.hpp"
#include "ddpkit/train/metrics.hpp"

namespace ddpkit::train {

// Note [Checkpoints and weights are torch.save files Python reads by default]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Checkpoints and weights are `torch.save` files Python reads by default.
// Since PyTorch 2.6 `torch.load(path)` means `weights_only=True`, which
// refuses TorchScript's pickles (they call
// `torch.jit._pickle.restore_type_tag`, ddpkit 0.1's format).
// `compat::save_for_python` pickles with those type tags off, so a model file
// is a plain dict of tensors in PyTorch's key order (each module's
// parameters, then its buffers, then its children), and a checkpoint
// (`train::Checkpoint`, format `ddpkit.checkpoint` version 3; version 3
// widened the history table with the train/validation time split, and
// version-2 files still resume, their rows' split NaN) a plain dict: `model`
// (that state dict), `optimizer` (libtorch's own archive, as a uint8 tensor,
// since libtorch's optimizer state has no Python equivalent), epoch, best
// value, history, RNG state. Reading uses ddpkit's own bounded unpickler
// (`detail/pickle_reader.hpp`): it accepts what Python writes (an
// `OrderedDict` from `torch.save(model.state_dict())`, torchvision's layout)
// and refuses, with the file's name and a conversion hint, the legacy pre-1.6
// format. Checkpoints written by ddpkit 0.1 (libtorch `OutputArchive`s) are
// not meant to be read by this version (untested: which error they give);
// resume them with that build. Written through `detail/atomic_file.hpp`
// (every file ddpkit writes): a temporary with a unique name
// (`NAME.tmp-XXXXXX`, mkstemp) beside the target, every write, the fsync and
// the close checked, renamed, the folder fsynced; a failure removes the
// temporary, leaves the old file and throws `IoError` (exit 74). `last.pt`'s
// previous version stays as `last-prev.pt` (a hard link renamed into place,
// so `last.pt` never disappears), for `resume("auto")` to fall back to when
// `last.pt` fails its checks; reading verifies each stored zip entry's
// CRC-32.

/// Test hook: called between the temporary file's fsync and the rename.
using ddpkit::detail::before_rename_hook;

/// The "format" entry of every checkpoint ddpkit writes, and its version.
inline constexpr const char* kCheckpointFormat = "ddpkit.checkpoint";
/// Version 4 names the task's history columns and the monitored metric;
/// version 3 widened the history table (train/val seconds split); versions
/// 2 and 3 still load.
inline constexpr std::int64_t kCheckpointVersion = 4;

/// `optimizer`'s state as a checkpoint stores it: libtorch's own archive,
/// as a uint8 tensor.
inline torch::Tensor optimizer_bytes(const torch::optim::Optimizer& optimizer) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::string bytes;
  archive.save_to([&](const void* data, std::size_t n) {
    bytes.append(static_cast<const char*>(data), n);
    return n;
  });
  auto t =
      torch::empty({static_cast<std::int64_t>(bytes.size())}, torch::kUInt8);
  if (!bytes.empty()) std::memcpy(t.data_ptr(), bytes.data(), bytes.size());
  return t;
}

/// A checkpoint's contents: named values (tensors, numbers, strings, and
/// dicts or lists of them), in the order they were written.
class Checkpoint {
 public:
  Checkpoint() : dict_(c10::StringType::get(), c10::AnyType::get()) {}
  explicit Checkpoint(c10::impl::GenericDict d) : dict_(std::move(d)) {}

  void write(const std::string& key, c10::IValue value) {
    dict_.insert_or_assign(key, std::move(value));
  }
  /// The container's own entries: "format" (kCheckpointFormat),
  /// "format_version" (kCheckpointVersion) and "torch_version" (the
  /// writer's libtorch).
  void stamp() {
    write("format", std::string(kCheckpointFormat));
    write("format_version", kCheckpointVersion);
    write("torch_version", ddpkit::compat::torch_version());
  }
  /// The optimizer's state, in libtorch's own format, under "optimizer".
  void write_optimizer(const torch::optim::Optimizer& optimizer) {
    write("optimizer", optimizer_bytes(optimizer));
  }
  /// An entry whose value `make` gives when the checkpoint is serialised
  /// (an asynchronous checkpoint's optimizer state, from a copy taken now);
  /// it keeps this place in the order.
  void write_later(const std::string& key, std::function<c10::IValue()> make) {
    write(key, c10::IValue());
    later_.emplace_back(key, std::move(make));
  }
  /// The entries written by `write_later`.
  const std::vector<std::pair<std::string, std::function<c10::IValue()>>>&
  later() const {
    return later_;
  }
  /// This checkpoint with the entries written later made (itself when it
  /// has none).
  Checkpoint made() const {
    if (later_.empty()) return *this;
    Checkpoint m(dict_.copy());
    for (const auto& [key, make] : later_) m.write(key, make());
    return m;
  }
  bool try_read(const std::string& key, c10::IValue& out) const {
    const auto it = dict_.find(key);
    if (it == dict_.end()) return false;
    out = it->value();
    return true;
  }
  /// `value[key]`; a UsageError when it is missing.
  void read(const std::string& key, c10::IValue& out) const {
    if (!try_read(key, out)) {
      throw UsageError(ddpkit::detail::cat("checkpoint has no '", key, "'"));
    }
  }
  void read(const std::string& key, torch::Tensor& out) const {
    c10::IValue v;
    read(key, v);
    if (!v.isTensor()) {
      throw UsageError(
          ddpkit::detail::cat("checkpoint's '", key, "' is not a tensor"));
    }
    out = v.toTensor();
  }
  std::vector<std::string> keys() const {
    std::vector<std::string> k;
    for (const auto& kv : dict_) {
      if (kv.key().isString()) k.push_back(kv.key().toStringRef());
    }
    return k;
  }
  const c10::impl::GenericDict& dict() const {
    return dict_;
  }

 private:
  c10::impl::GenericDict dict_;
  std::vector<std::pair<std::string, std::function<c10::IValue()>>> later_;
};

// Note [Checkpoint durability]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A checkpoint is never half written and never lost to the next one: rank 0
// writes it to a unique temporary, checks every write, fsyncs and renames
// (atomic_save, detail/atomic_file.hpp), so readers see the old file or the
// new one; `last.pt`'s predecessor stays as `last-prev.pt` until the new
// one is durable, and `--resume auto` falls back to it when `last.pt` is
// missing or damaged (read_resume_source). A checkpoint never holds
// non-finite weights (CheckpointConnector::save refuses, naming the tensor),
// so a run that diverged cannot overwrite the last good state. Only rank 0
// reads the file on resume and sends its bytes: on a second host without a
// shared filesystem the other ranks have none, and every rank parses the
// same bytes, so all resume, start fresh or fail alike.

/// `checkpoint` as the bytes of a file Python's `torch.load` reads (`path`:
/// the file they are for, named in the error when they cannot be made).
inline std::string checkpoint_bytes(const Checkpoint& checkpoint,
                                    const std::filesystem::path& path) {
  try {
    return ddpkit::compat::save_for_python(
        c10::IValue(checkpoint.made().dict()));
  } catch (const c10::Error& e) {
    throw UsageError(ddpkit::detail::cat("cannot write checkpoint ",
                                         path.string(), ": ",
                                         e.what_without_backtrace()));
  }
}

/// Writes a checkpoint's `bytes` to `path` as atomic_save does (its folder
/// made first).
inline void write_checkpoint_bytes(
    const std::string& bytes, const std::filesystem::path& path,
    const std::filesystem::path& keep_previous = {}) {
  std::error_code ec;
  std::filesystem::create_directories(path.parent_path(), ec);
  if (ec) {
    throw UsageError(ddpkit::detail::cat("cannot create folder ",
                                         path.parent_path().string(), ": ",
                                         ec.message()));
  }
  ddpkit::detail::write_atomically(path, bytes, keep_previous);
}

/// A copy of `v` that shares nothing with training: every tensor in it
/// (in dicts and lists too) copied to new host memory, values, dtype and
/// strides kept. What an asynchronous checkpoint writes from.
inline c10::IValue host_snapshot(const c10::IValue& v) {
  if (v.isTensor()) {
    const torch::Tensor& t = v.toTensor();
    if (!t.defined()) return v;
    return t.detach().to(torch::kCPU, t.scalar_type(), /*non_blocking=*/false,
                         /*copy=*/true);
  }
  if (v.isGenericDict()) {
    const auto d = v.toGenericDict();
    c10::impl::GenericDict out(d.keyType(), d.valueType());
    for (const auto& kv : d) out.insert(kv.key(), host_snapshot(kv.value()));
    return out;
  }
  if (v.isList()) {
    const auto l = v.toList();
    c10::impl::GenericList out(l.elementType());
    for (std::size_t i = 0; i < l.size(); ++i) {
      out.push_back(host_snapshot(l.get(i)));
    }
    return out;
  }
  if (v.isTuple()) {
    std::vector<c10::IValue> e;
    for (const auto& x : v.toTupleRef().elements()) {
      e.push_back(host_snapshot(x));
    }
    return c10::ivalue::Tuple::create(std::move(e));
  }
  return v;  // numbers, strings, None: immutable
}

/// Writes `checkpoint` to `path` atomically and durably (a unique
/// temporary, every write checked, fsync, rename: detail/atomic_file.hpp).
/// Readers see the old file or the new one, never a partial one; a failed
/// write (disk full, I/O error) leaves the old file and throws `IoError`.
/// With `keep_previous`, the old `path` is kept under that name.
/// See Note [Checkpoint durability].
inline void atomic_save(const Checkpoint& checkpoint,
                        const std::filesystem::path& path,
                        const std::filesystem::path& keep_previous = {}) {
  write_checkpoint_bytes(checkpoint_bytes(checkpoint, path), path,
                         keep_previous);
}

/// Reads a checkpoint, turning every problem into a UsageError that names
/// the file. The zip is checked before anything is allocated from its
/// length fields (`archive_check.hpp`), the pickle is read by ddpkit's own
/// unpickler (`pickle_reader.hpp`), and every tensor in it is checked
/// (`loaded_tensors.hpp`): a damaged file is an error, not a crash or an
/// out-of-bounds read.
inline Checkpoint parse_checkpoint(const std::string& bytes,
                                   const std::filesystem::path& path);

inline Checkpoint open_checkpoint(const std::filesystem::path& path) {
  if (!std::filesystem::is_regular_file(path)) {
    throw UsageError(
        ddpkit::detail::cat("checkpoint ", path.string(), " does not exist"));
  }
  return parse_checkpoint(
      ddpkit::detail::read_whole_file(path, "checkpoint " + path.string()),
      path);
}

/// `open_checkpoint` for a file's bytes read elsewhere (e.g. by rank 0 and
/// sent over the group); `path` names it in errors.
inline Checkpoint parse_checkpoint(const std::string& bytes,
                                   const std::filesystem::path& path) {
  const std::string what = "checkpoint " + path.string();
  ddpkit::detail::check_archive(std::string_view(bytes), what, "ddpkit");
  const c10::IValue v = ddpkit::detail::read_torch_save(bytes, what);
  if (!v.isGenericDict()) {
    throw UsageError(ddpkit::detail::cat(what, " holds a ", v.tagKind(),
                                         ", not a dict (not a ddpkit "
                                         "checkpoint)"));
  }
  Checkpoint checkpoint(v.toGenericDict());
  for (const auto& key : checkpoint.keys()) {
    c10::IValue value;
    checkpoint.try_read(key, value);
    ddpkit::detail::check_loaded_tensors(
        value, ddpkit::detail::cat(what, ": '", key, "'"));
  }
  c10::IValue version;
  if (checkpoint.try_read("format_version", version) && version.isInt() &&
      version.toInt() > kCheckpointVersion) {
    throw UsageError(
        ddpkit::detail::cat(what, " has format version ", version.toInt(),
                            "; this ddpkit reads up to ", kCheckpointVersion,
                            " (a newer ddpkit "
                            "wrote it)"));
  }
  return checkpoint;
}

/// Loads a module's state from `archive[key]` (a dict written from
/// `nn::state_dict`), checking every parameter and buffer: a missing key or a
/// shape mismatch is an error naming the file and the first such key.
inline void load_module_checked(torch::nn::Module& module,
                                const Checkpoint& archive,
                                const std::string& key,
                                const std::filesystem::path& file) {
  c10::IValue value;
  if (!archive.try_read(key, value) || !value.isGenericDict()) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(),
                                         " has no '", key, "' state"));
  }
  auto dict = value.toGenericDict();
  torch::NoGradGuard no_grad;
  auto check = [&](const std::string& name, torch::Tensor& target) {
    auto it = dict.find(name);
    if (it == dict.end()) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name,
          "' is missing (the checkpoint is of another model)"));
    }
    if (!it->value().isTensor()) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name, "' holds a ",
          it->value().tagKind(), ", not a tensor"));
    }
    auto t = it->value().toTensor();
    ddpkit::detail::check_loaded_tensor(
        t, ddpkit::detail::cat("checkpoint ", file.string(), ": key '", name,
                               "'"));
    if (t.sizes() != target.sizes()) {
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name, "' has shape ",
          c10::str(t.sizes()), " but the model expects ",
          c10::str(target.sizes())));
    }
    try {
      target.copy_(t);
    } catch (const c10::Error& e) {  // e.g. a quantized or complex tensor
      const std::string what = e.what_without_backtrace();
      throw UsageError(ddpkit::detail::cat(
          "checkpoint ", file.string(), ": key '", name,
          "' cannot be copied into the model (", t.scalar_type(),
          "): ", ddpkit::detail::first_line(what)));
    }
  };
  for (auto& p : module.named_parameters()) check(p.key(), p.value());
  for (auto& b : module.named_buffers()) check(b.key(), b.value());
}

/// Loads `optimizer`'s state from `archive["optimizer"]` (libtorch's own
/// serialization, as bytes); a UsageError naming the file when it is
/// missing, damaged or does not fit (libtorch throws c10::Error or, for a
/// damaged archive, torch::jit::ObjectAttributeError).
inline void load_optimizer_checked(torch::optim::Optimizer& optimizer,
                                   const Checkpoint& archive,
                                   const std::filesystem::path& file) {
  c10::IValue v;
  if (!archive.try_read("optimizer", v) || !v.isTensor() ||
      v.toTensor().scalar_type() != torch::kUInt8 || v.toTensor().dim() != 1) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(),
                                         " has no optimizer state"));
  }
  const auto blob = v.toTensor().contiguous();
  const std::string_view bytes(static_cast<const char*>(blob.data_ptr()),
                               static_cast<std::size_t>(blob.numel()));
  const std::string what =
      ddpkit::detail::cat("checkpoint ", file.string(), ": optimizer state");
  // libtorch's archive reader trusts what it reads: check it first.
  ddpkit::detail::check_archive(bytes, what, "ddpkit");
  auto does_not_fit = [&](const std::string& why) {
    return UsageError(
        ddpkit::detail::cat("checkpoint ", file.string(),
                            ": optimizer state does not fit this "
                            "optimizer (another optimizer type or model?): ",
                            why.substr(0, 200)));
  };
  try {
    torch::serialize::InputArchive opt_archive;
    opt_archive.load_from(bytes.data(), bytes.size());
    for (const auto& key : opt_archive.keys()) {
      c10::IValue value;
      if (opt_archive.try_read(key, value)) {
        ddpkit::detail::check_loaded_tensors(
            value, ddpkit::detail::cat(what, ": '", key, "'"));
      }
    }
    optimizer.load(opt_archive);
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw does_not_fit(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw does_not_fit(e.what());
  }
}

/// The number `archive[key]` (an int, a float, or a one-element real or
/// integer tensor); a UsageError naming the file and key when it is missing
/// or not one number.
inline double read_checkpoint_scalar(const Checkpoint& archive,
                                     const std::string& key,
                                     const std::filesystem::path& file) {
  c10::IValue v;
  if (!archive.try_read(key, v)) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(),
                                         " lacks '", key, "'"));
  }
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isDouble()) return v.toDouble();
  if (v.isBool()) return v.toBool() ? 1.0 : 0.0;
  if (!v.isTensor() || v.toTensor().numel() != 1 ||
      !(v.toTensor().is_floating_point() ||
        c10::isIntegralType(v.toTensor().scalar_type(),
                            /*includeBool=*/true))) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(), ": '",
                                         key, "' is not a number"));
  }
  return v.toTensor().to(torch::kFloat64).item<double>();
}

/// `read_checkpoint_scalar` for a whole number in [lo, hi].
inline int read_checkpoint_int(const Checkpoint& archive,
                               const std::string& key,
                               const std::filesystem::path& file, int lo,
                               int hi) {
  const double v = read_checkpoint_scalar(archive, key, file);
  if (!(v >= lo && v <= hi) || v != std::floor(v)) {
    std::ostringstream value;
    value << std::setprecision(17) << v;
    throw UsageError(ddpkit::detail::cat(
        "checkpoint ", file.string(), ": '", key, "' is ", value.str(),
        ", not a whole number in ", lo, "..", hi));
  }
  return static_cast<int>(v);
}

/// The text `archive[key]`; a UsageError naming the file and key when it is
/// missing or not text.
inline std::string read_checkpoint_string(const Checkpoint& archive,
                                          const std::string& key,
                                          const std::filesystem::path& file) {
  c10::IValue v;
  if (!archive.try_read(key, v) || !v.isString()) {
    throw UsageError(ddpkit::detail::cat("checkpoint ", file.string(), ": '",
                                         key, "' is missing or not text"));
  }
  return v.toStringRef();
}

/// The part of a training set's fingerprint that identifies it: up to the
/// first ';' ("files:<hash>"); what follows describes the data for
/// messages (ImageFiles: ";<class>=<files>" per class).
inline std::string fingerprint_identity(const std::string& fingerprint) {
  return fingerprint.substr(0, fingerprint.find(';'));
}

/// What differs between two fingerprints' descriptions, e.g. "class
/// 'daisy' 633 -> 634 files, class 'tulips' new (12 files)"; "" when either
/// has none or they agree. Names at most 5 classes, then how many more.
inline std::string fingerprint_difference(const std::string& before,
                                          const std::string& now) {
  using Counts = std::vector<std::pair<std::string, std::string>>;
  auto parse = [](const std::string& fp) {
    Counts out;
    std::size_t at = fp.find(';');
    while (at != std::string::npos) {
      const auto next = fp.find(';', at + 1);
      const auto part =
          fp.substr(at + 1, next == std::string::npos ? std::string::npos
                                                      : next - at - 1);
      const auto eq = part.rfind('=');
      if (eq != std::string::npos) {
        out.emplace_back(part.substr(0, eq), part.substr(eq + 1));
      }
      at = next;
    }
    return out;
  };
  const Counts a = parse(before), b = parse(now);
  if (a.empty() || b.empty()) return "";
  auto find = [](const Counts& c,
                 const std::string& name) -> const std::string* {
    for (const auto& [n, v] : c) {
      if (n == name) return &v;
    }
    return nullptr;
  };
  std::vector<std::string> diffs;
  for (const auto& [name, count] : a) {
    const auto* other = find(b, name);
    if (!other) {
      diffs.push_back(ddpkit::detail::cat("class '", name, "' gone (had ",
                                          count, " files)"));
    } else if (*other != count) {
      diffs.push_back(ddpkit::detail::cat("class '", name, "' ", count, " -> ",
                                          *other, " files"));
    }
  }
  for (const auto& [name, count] : b) {
    if (!find(a, name)) {
      diffs.push_back(
          ddpkit::detail::cat("class '", name, "' new (", count, " files)"));
    }
  }
  std::string out;
  for (std::size_t i = 0; i < diffs.size() && i < 5; ++i) {
    out += (i ? ", " : "") + diffs[i];
  }
  if (diffs.size() > 5) {
    out += ddpkit::detail::cat(" and ", diffs.size() - 5, " more classes");
  }
  return out;
}

}  // namespace ddpkit::train
