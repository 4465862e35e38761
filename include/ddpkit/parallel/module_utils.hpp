// SPDX-License-Identifier: BSD-3-Clause
// Small helpers over libtorch modules used by every parallel policy:
// consistent flat views of parameters/buffers, and coalesced broadcast.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/distributed/collectives.hpp"

namespace ddpkit::parallel {

// Note [Each tensor once]
// ~~~~~~~~~~~~~~~~~~~~~~~
// Each tensor once. libtorch's `Module::parameters()` does not de-duplicate:
// a tensor registered under two names (tied embeddings) appears twice, and an
// optimizer given that list steps it twice, a norm counts its gradient twice.
// Python's `parameters()` lists it once. The Trainer therefore gives the
// optimizer factory, clipping, the finiteness check and AMP's unscale
// `parallel::unique_parameters(m)` (test: a tied model through the Trainer
// equals the same model registered once, with and without clipping); the
// reducer already gave such a tensor one slot.

/// The module behind a holder (`ResNet34`) or a `std::shared_ptr<Module>`.
template <class Model>
torch::nn::Module& as_module(Model& model) {
  return *model;
}

/// `tensors` with each tensor once, in first-seen order.
inline std::vector<torch::Tensor> unique_tensors(
    const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& t : tensors) {
    if (seen.insert(t.unsafeGetTensorImpl()).second) out.push_back(t);
  }
  return out;
}

/// `m`'s parameters, each tensor once. libtorch's `parameters()` lists a
/// tensor registered under two names (tied weights) twice, and an
/// optimizer given it twice steps it twice, a norm counts it twice
/// (Python's `parameters()` lists it once). What the Trainer gives the
/// optimizer factory, clips and checks.
inline std::vector<torch::Tensor> unique_parameters(
    const torch::nn::Module& m) {
  return unique_tensors(m.parameters());
}

/// Whether `m` or one of its submodules is a batch norm: a module type
/// whose name holds "BatchNorm" (libtorch's BatchNorm1d/2d/3d, ddpkit's
/// SyncBatchNorm). What summary.json's "bn" is said of.
inline bool has_batch_norm(const torch::nn::Module& m) {
  if (m.name().find("BatchNorm") != std::string::npos) return true;
  for (const auto& sub : m.modules(/*include_self=*/false)) {
    if (sub->name().find("BatchNorm") != std::string::npos) return true;
  }
  return false;
}

/// Whether `m` has a 4-D parameter or buffer: the only tensors a memory
/// format (channels-last) changes.
inline bool has_4d_tensors(const torch::nn::Module& m) {
  for (const auto& p : m.parameters()) {
    if (p.dim() == 4) return true;
  }
  for (const auto& b : m.buffers()) {
    if (b.dim() == 4) return true;
  }
  return false;
}

/// Puts each 4-D parameter and buffer of `m` in `format`, in place
/// (`set_data`: the tensors the optimizer and autograd hold stay the
/// same); the others are untouched. Before DDP's buckets are made, which
/// then take these strides.
inline void to_memory_format(torch::nn::Module& m, torch::MemoryFormat format) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    if (p.dim() == 4) p.set_data(p.detach().contiguous(format));
  }
  for (auto& b : m.buffers()) {
    if (b.dim() == 4) b.set_data(b.detach().contiguous(format));
  }
}

/// Clears the gradients of `m`'s parameters: set to None (PyTorch 2.x's
/// `zero_grad()` default, the same on every libtorch version), so the next
/// backward writes them fresh instead of adding to zeros.
inline void clear_grads(torch::nn::Module& m) {
  for (auto& p : m.parameters()) {
    if (p.grad().defined()) p.mutable_grad() = torch::Tensor();
  }
}

/// Bytes of the gradients `m`'s parameters hold now (those defined).
inline uint64_t held_gradient_bytes(const torch::nn::Module& m) {
  uint64_t n = 0;
  for (const auto& p : unique_parameters(m)) {
    if (p.grad().defined()) n += static_cast<uint64_t>(p.grad().nbytes());
  }
  return n;
}

/// Broadcasts `tensors` from `src`, coalesced into one flat buffer per dtype
/// (one collective instead of hundreds).
/// `flat_bytes`, if given, is raised to the largest buffer's size.
inline void broadcast_coalesced(const dist::Group& g,
                                std::vector<torch::Tensor> tensors, int src = 0,
                                uint64_t* flat_bytes = nullptr) {
  if (g.size() == 1 || tensors.empty()) return;
  torch::NoGradGuard no_grad;
  std::vector<c10::ScalarType> kinds;
  for (auto& t : tensors) {
    if (std::find(kinds.begin(), kinds.end(), t.scalar_type()) == kinds.end())
      kinds.push_back(t.scalar_type());
  }
  for (auto kind : kinds) {
    std::vector<torch::Tensor> group;
    for (auto& t : tensors) {
      if (t.scalar_type() == kind) group.push_back(t);
    }
    std::vector<torch::Tensor> flat_parts;
    for (auto& t : group)
      flat_parts.push_back(t.detach().reshape({-1}).to(g.device()));
    auto flat = torch::cat(flat_parts);
    if (flat_bytes) {
      *flat_bytes = std::max(*flat_bytes, static_cast<uint64_t>(flat.nbytes()));
    }
    dist::broadcast(g, flat, src);
    int64_t off = 0;
    for (auto& t : group) {
      t.copy_(flat.narrow(0, off, t.numel()).view_as(t));
      off += t.numel();
    }
  }
}

/// "name:shape" of every parameter and buffer, in order.
inline std::string shape_signature(torch::nn::Module& m,
                                   std::vector<std::string>* lines = nullptr) {
  std::string sig;
  auto add = [&](const std::string& kind, const std::string& name,
                 const torch::Tensor& t) {
    std::string line = kind + " " + name + " " + c10::str(t.sizes()) + " " +
                       std::string(c10::toString(t.scalar_type()));
    if (lines) lines->push_back(line);
    sig += line + "\n";
  };
  for (auto& p : m.named_parameters()) add("parameter", p.key(), p.value());
  for (auto& b : m.named_buffers()) add("buffer", b.key(), b.value());
  return sig;
}

/// Checks that every rank holds a model of the same structure; on mismatch
/// every rank throws naming the first differing entry (no rank is left
/// waiting in a later collective).
inline void verify_same_structure(const dist::Group& g, torch::nn::Module& m) {
  if (g.size() == 1) return;
  std::vector<std::string> mine;
  shape_signature(m, &mine);
  std::string reference = dist::broadcast_string(g, shape_signature(m), 0);
  std::vector<std::string> ref_lines;
  for (std::size_t s = 0, e; s < reference.size(); s = e + 1) {
    e = reference.find('\n', s);
    ref_lines.push_back(reference.substr(s, e - s));
  }
  std::string problem;
  for (std::size_t i = 0; i < std::max(mine.size(), ref_lines.size()); ++i) {
    std::string a = i < mine.size() ? mine[i] : "(nothing)";
    std::string b = i < ref_lines.size() ? ref_lines[i] : "(nothing)";
    if (a != b) {
      problem = ddpkit::detail::cat("entry ", i, ": rank ", g.rank(), " has '",
                                    a, "' but rank 0 has '", b, "'");
      break;
    }
  }
  auto bad = dist::all_gather_value(g, problem.empty() ? 0 : 1);
  int first_bad = -1;
  for (int r = 0; r < g.size(); ++r) {
    if (bad[r] && first_bad < 0) first_bad = r;
  }
  if (first_bad < 0) return;
  std::string msg = dist::broadcast_string(g, problem, first_bad);
  throw DistError("DDP: the model differs across ranks; " + msg);
}

}  // namespace ddpkit::parallel
