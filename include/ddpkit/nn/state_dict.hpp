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
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include "ddpkit/detail/archive_check.hpp"
#include "ddpkit/detail/atomic_file.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/detail/loaded_tensors.hpp"

namespace ddpkit::nn {

/// Every parameter and buffer of `module` under its dotted name, on the CPU
/// and detached — the keys of torchvision's `state_dict()`.
inline c10::Dict<std::string, torch::Tensor> state_dict(
    const torch::nn::Module& module) {
  c10::Dict<std::string, torch::Tensor> d;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    d.insert(p.key(), p.value().detach().cpu());
  for (const auto& b : module.named_buffers(/*recurse=*/true))
    d.insert(b.key(), b.value().detach().cpu());
  return d;
}

/// Writes `module`'s state dict to `path` in torch.save's zip format:
/// Python's `torch.load(path)` returns a plain dict, which
/// `model.load_state_dict` accepts.
inline void save_state_dict(const torch::nn::Module& module,
                            const std::filesystem::path& path) {
  const auto bytes = torch::pickle_save(c10::IValue(state_dict(module)));
  // Through path.tmp and a rename: an interrupted save keeps the old file.
  ddpkit::detail::write_atomically(
      path, std::string_view(bytes.data(), bytes.size()));
}

inline constexpr const char* kConvertStateDictHint =
    "convert it in Python with: python3 -c \"import torch; "
    "torch.save(dict(torch.load('in.pth')), 'out.pt')\"";

/// Reads a state dict file written by `save_state_dict` or by Python's
/// `torch.save(dict(sd), f)` (zip format, a plain dict of tensors).
inline c10::Dict<std::string, torch::Tensor> read_state_dict(
    const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw UsageError(
        ddpkit::detail::cat("load_state_dict: cannot open ", path.string()));
  }
  // torch.save's zip archives start with a local file header "PK\3\4";
  // anything else is the legacy (pre-1.6 or _use_new_zipfile_serialization
  // =False) format, which libtorch cannot read.
  char magic[4] = {};
  in.read(magic, 4);
  if (in.gcount() < 4 || magic[0] != 'P' || magic[1] != 'K') {
    throw UsageError(ddpkit::detail::cat(
        "load_state_dict: ", path.string(),
        " is not in torch.save's zip format (a legacy .pth?); ",
        kConvertStateDictHint));
  }
  in.close();
  // libtorch trusts the zip's and the pickle's length fields (see
  // archive_check.hpp): check them first.
  ddpkit::detail::check_archive(
      path, ddpkit::detail::cat("load_state_dict: ", path.string()),
      "torch.save or ddpkit");
  c10::IValue v;
  try {
    // What torch::pickle_load does, but reading the zip through the file
    // (FileAdapter clamps every read to the file's size). pickle_load's
    // in-memory reader copies whatever range the zip's offsets name: a
    // damaged file made it read past the buffer (found by fuzzing).
    caffe2::serialize::PyTorchStreamReader reader(path.string());
    v = torch::jit::readArchiveAndTensors(
        "data", /*pickle_prefix=*/"", /*tensor_prefix=*/"",
        /*type_resolver=*/c10::nullopt, /*obj_loader=*/c10::nullopt,
        /*device=*/c10::nullopt, reader);
  } catch (const c10::Error& e) {
    // libtorch 1.13's unpickler lacks some opcodes (e.g. SETITEM, which
    // Python emits for a one-entry dict) and every class but a few.
    throw UsageError(ddpkit::detail::cat(
        "load_state_dict: cannot unpickle ", path.string(), " (",
        e.what_without_backtrace(),
        "); it must be a plain dict of several tensors; if it holds a model "
        "or an OrderedDict, ",
        kConvertStateDictHint));
  } catch (const std::exception& e) {
    // A damaged pickle also makes the unpickler throw standard exceptions
    // (std::out_of_range from its memo or stack; found by fuzzing).
    throw UsageError(ddpkit::detail::cat("load_state_dict: cannot unpickle ",
                                         path.string(), " (", e.what(),
                                         "): the file is damaged"));
  }
  // Python's OrderedDict (what `model.state_dict()` is) has no C++ unpickler
  // class and comes back as None; only a plain dict of tensors is usable.
  if (!v.isGenericDict()) {
    throw UsageError(ddpkit::detail::cat(
        "load_state_dict: ", path.string(), " holds a ", v.tagKind(),
        ", not a plain dict of tensors (an OrderedDict from "
        "`torch.save(model.state_dict())` reads as None); ",
        kConvertStateDictHint));
  }
  c10::Dict<std::string, torch::Tensor> out;
  for (const auto& kv : v.toGenericDict()) {
    if (!kv.key().isString() || !kv.value().isTensor()) {
      throw UsageError(ddpkit::detail::cat(
          "load_state_dict: ", path.string(),
          " has an entry that is not str -> Tensor (key kind ",
          kv.key().tagKind(), ", value kind ", kv.value().tagKind(),
          "); a full checkpoint? save only the model's state dict: ",
          kConvertStateDictHint));
    }
    ddpkit::detail::check_loaded_tensor(
        kv.value().toTensor(),
        ddpkit::detail::cat("load_state_dict: ", path.string(), ": '",
                            kv.key().toStringRef(), "'"));
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
          "): ", what.substr(0, what.find('\n'))));
    }
    report.loaded.push_back(name);
  }
  for (const auto& kv : dict) {
    if (std::find(known.begin(), known.end(), kv.key()) == known.end())
      report.unexpected.push_back(kv.key());
  }
  if (options.strict() &&
      (!report.missing.empty() || !report.unexpected.empty())) {
    std::string miss, unex;
    for (const auto& s : report.missing) miss += (miss.empty() ? "" : ", ") + s;
    for (const auto& s : report.unexpected)
      unex += (unex.empty() ? "" : ", ") + s;
    throw UsageError(ddpkit::detail::cat(
        "load_state_dict: ", source, " does not match the model: missing [",
        miss, "], unexpected [", unex,
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
