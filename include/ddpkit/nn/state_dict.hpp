// SPDX-License-Identifier: BSD-3-Clause
// State dicts that Python reads and writes: a module's parameters and
// buffers saved as a pickled `dict[str, Tensor]` (what `torch.load` returns
// for `torch.save(dict(model.state_dict()), f)`), and loaded back by name.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <caffe2/serialize/inline_container.h>
#include <torch/torch.h>

#include "ddpkit/detail/archive_check.hpp"
#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/compat.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/loaded_tensors.hpp"
#include "ddpkit/detail/pickle_reader.hpp"

namespace ddpkit::nn {

namespace detail {
inline void collect_state(const torch::nn::Module& m, const std::string& prefix,
                          c10::Dict<std::string, torch::Tensor>& d) {
  for (const auto& p : m.named_parameters(/*recurse=*/false))
    d.insert(prefix + p.key(), p.value().detach().cpu());
  for (const auto& b : m.named_buffers(/*recurse=*/false))
    d.insert(prefix + b.key(), b.value().detach().cpu());
  for (const auto& c : m.named_children())
    collect_state(*c.value(), prefix + c.key() + ".", d);
}
}  // namespace detail

/// Every parameter and buffer of `module` under its dotted name, on the CPU
/// and detached, in PyTorch's `state_dict()` order (each module's own
/// parameters, then its buffers, then its children's): the keys, and their
/// order, of torchvision's `state_dict()`.
inline c10::Dict<std::string, torch::Tensor> state_dict(
    const torch::nn::Module& module) {
  c10::Dict<std::string, torch::Tensor> d;
  detail::collect_state(module, "", d);
  return d;
}

/// Writes `module`'s state dict to `path` in torch.save's zip format:
/// Python's `torch.load(path)` (default `weights_only=True`) returns a plain
/// dict, which `model.load_state_dict` accepts.
inline void save_state_dict(const torch::nn::Module& module,
                            const std::filesystem::path& path) {
  // Through a checked temporary and a rename: a failed save keeps the old
  // file (detail/atomic_file.hpp).
  ddpkit::detail::write_atomically(
      path, ddpkit::compat::save_for_python(c10::IValue(state_dict(module))));
}

/// Reads a state dict file written by `save_state_dict` or by Python's
/// `torch.save(model.state_dict(), f)` (zip format; an OrderedDict or a plain
/// dict of tensors, e.g. torchvision's resnet34 weights re-saved that way).
inline c10::Dict<std::string, torch::Tensor> read_state_dict(
    const std::filesystem::path& path) {
  const std::string what = "load_state_dict: " + path.string();
  const std::string bytes = ddpkit::detail::read_whole_file(path, what);
  // torch.save's zip archives start with a local file header "PK\3\4";
  // anything else is the legacy (pre-1.6 or _use_new_zipfile_serialization
  // =False) format, which ddpkit does not read.
  if (bytes.size() < 4 || bytes[0] != 'P' || bytes[1] != 'K') {
    throw UsageError(ddpkit::detail::cat(
        what,
        " is not in torch.save's zip format (a legacy .pth?); convert it in "
        "Python with: python3 -c \"import torch; "
        "torch.save(torch.load('in.pth'), 'out.pt')\""));
  }
  // The zip's length fields are checked before anything is allocated from
  // them (see archive_check.hpp), the pickle by ddpkit's own reader.
  ddpkit::detail::check_archive(std::string_view(bytes), what,
                                "torch.save or ddpkit");
  const c10::IValue v = ddpkit::detail::read_torch_save(bytes, what);
  if (!v.isGenericDict()) {
    throw UsageError(ddpkit::detail::cat(
        what, " holds a ", v.tagKind(),
        ", not a dict of tensors (save `model.state_dict()`)"));
  }
  c10::Dict<std::string, torch::Tensor> out;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.key().isString() || !kv.value().isTensor()) {
      throw UsageError(ddpkit::detail::cat(
          what, " has an entry that is not str -> Tensor (key kind ",
          kv.key().tagKind(), ", value kind ", kv.value().tagKind(),
          "); a full checkpoint? save only the model's state dict, or "
          "load a ddpkit checkpoint's 'model'"));
    }
    ddpkit::detail::check_loaded_tensor(
        kv.value().toTensor(),
        ddpkit::detail::cat(what, ": '", kv.key().toStringRef(), "'"));
    out.insert(kv.key().toStringRef(), kv.value().toTensor());
  }
  return out;
}

/// Options of `load_state_dict`.
struct LoadStateDictOptions {
  /// Missing or unexpected keys are an error (PyTorch's `strict=True`).
  TORCH_ARG(bool, strict) = true;
  /// Leave tensors whose shape differs untouched and report them, instead of
  /// failing — transfer learning onto a new head (e.g. `fc` for 5 classes).
  TORCH_ARG(bool, skip_mismatched) = false;
};

/// What `load_state_dict` did.
struct LoadReport {
  std::vector<std::string> loaded;
  /// In the file, but the module's shape differs (skipped).
  std::vector<std::string> skipped_shape;
  /// In the module, not in the file.
  std::vector<std::string> missing;
  /// In the file, not in the module.
  std::vector<std::string> unexpected;
};

/// Copies the tensors of `dict` into `module`'s parameters and buffers by
/// name. With `skip_mismatched`, shape mismatches are skipped and reported;
/// with `strict`, missing or unexpected keys throw (after shape handling).
inline LoadReport load_state_dict(
    torch::nn::Module& module,
    const c10::Dict<std::string, torch::Tensor>& dict,
    LoadStateDictOptions options = {},
    const std::string& source = "state dict") {
  LoadReport report;
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> targets;
  for (const auto& p : module.named_parameters(true))
    targets.emplace_back(p.key(), p.value());
  for (const auto& b : module.named_buffers(true))
    targets.emplace_back(b.key(), b.value());
  std::vector<std::string> known;
  for (auto& [name, target] : targets) {
    known.push_back(name);
    auto it = dict.find(name);
    if (it == dict.end()) {
      report.missing.push_back(name);
      continue;
    }
    const auto& src = it->value();
    ddpkit::detail::check_loaded_tensor(
        src,
        ddpkit::detail::cat("load_state_dict: ", source, ": '", name, "'"));
    if (src.sizes() != target.sizes()) {
      if (options.skip_mismatched()) {
        report.skipped_shape.push_back(name);
        continue;
      }
      throw UsageError(ddpkit::detail::cat(
          "load_state_dict: ", source, ": '", name, "' has shape ", src.sizes(),
          " but the model expects ", target.sizes(),
          " (use skip_mismatched(true) to keep the model's own value)"));
    }
    try {
      target.copy_(src.to(target.dtype()));
    } catch (const c10::Error& e) {  // e.g. a quantized or complex tensor
      const std::string what = e.what_without_backtrace();
      throw UsageError(ddpkit::detail::cat(
          "load_state_dict: ", source, ": '", name,
          "' cannot be copied into the model (", src.scalar_type(),
          "): ", ddpkit::detail::first_line(what)));
    }
    report.loaded.push_back(name);
  }
  for (const auto& kv : dict) {
    if (std::find(known.begin(), known.end(), kv.key()) == known.end())
      report.unexpected.push_back(kv.key());
  }
  if (options.strict() &&
      (!report.missing.empty() || !report.unexpected.empty())) {
    using ddpkit::detail::join;
    throw UsageError(ddpkit::detail::cat(
        "load_state_dict: ", source, " does not match the model: missing [",
        join(report.missing, ", "), "], unexpected [",
        join(report.unexpected, ", "),
        "] (use strict(false) to load what matches)"));
  }
  return report;
}

/// Reads `path` (see `read_state_dict`) and loads it into `module`.
///
/// Example:
/// ```
/// auto net = ddpkit::nn::resnet34(5);
/// auto report = ddpkit::nn::load_state_dict(
///     *net, "resnet34-imagenet.pt",
///     ddpkit::nn::LoadStateDictOptions().skip_mismatched(true));
/// // report.skipped_shape == {"fc.weight", "fc.bias"}
/// ```
inline LoadReport load_state_dict(torch::nn::Module& module,
                                  const std::filesystem::path& path,
                                  LoadStateDictOptions options = {}) {
  return load_state_dict(module, read_state_dict(path), options, path.string());
}

}  // namespace ddpkit::nn
