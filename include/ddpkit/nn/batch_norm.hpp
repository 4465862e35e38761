// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's BatchNorm2d: state-dict compatible with torch::nn::BatchNorm2d,
// and able to synchronise its training statistics across ranks once a
// process group is attached (SyncBatchNorm; the statistics and their
// autograd function are sync_batch_norm_function.hpp's, the BN policies
// bn_policies.hpp's).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/detail/error.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/nn/sync_batch_norm_function.hpp"

namespace ddpkit::nn {

// Note [Our own BatchNorm2d]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Our own BatchNorm2d. libtorch cannot swap a module held in a parent's field
// (`replace_module` updates the children map, not the field nor a
// `Sequential`'s list), so a `convert_sync_batchnorm` over
// `torch::nn::BatchNorm2d` cannot work in C++. `ddpkit::nn::BatchNorm2d` has
// exactly torch's parameters and buffers (state dicts interchangeable,
// checked against torchvision) and becomes a SyncBatchNorm when a group is
// attached; `convert_sync_batchnorm` attaches it everywhere and names any
// `torch::nn::BatchNorm2d` it meets. The model zoo uses it.
// `ddpkit::nn::SyncBatchNorm(num_features, group)` is synchronised from
// construction (a BatchNorm2d holder whose constructor attaches the group;
// the SyncBN tests build theirs this way).

// Note [SyncBN communicates in training mode only]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// SyncBN communicates in training mode only (PyTorch's rule): in eval mode,
// even with `track_running_stats=false` (batch statistics), it is local batch
// norm, so rank 0 can evaluate alone (test: rank 0 evaluates while rank 1 has
// exited; no collective, equal to local batch norm). The autograd node owns a
// copy of the group (a capsule in its saved data), so backward after the
// module is gone is safe (ASan reported a heap-use-after-free there with the
// raw pointer it held before).

/// Batch norm over N×C×H×W inputs with torch::nn::BatchNorm2d's parameters
/// and buffers (weight, bias, running_mean, running_var,
/// num_batches_tracked), so state dicts are interchangeable. Plain batch
/// norm until `set_sync_group` attaches a group of more than one rank; then
/// training statistics are global across ranks (SyncBatchNorm). Evaluation
/// uses the running statistics (or, with track_running_stats=false, the
/// local batch's) and never communicates.
///
/// Example:
/// ```
/// ddpkit::nn::BatchNorm2d bn(64);
/// bn->set_sync_group(group);   // now a SyncBatchNorm
/// auto y = bn(x);              // statistics over every rank's batch
/// ```
class BatchNorm2dImpl : public torch::nn::Cloneable<BatchNorm2dImpl> {
 public:
  explicit BatchNorm2dImpl(int64_t num_features)
      : BatchNorm2dImpl(torch::nn::BatchNormOptions(num_features)) {}
  explicit BatchNorm2dImpl(torch::nn::BatchNormOptions options)
      : options(std::move(options)) {
    reset();
  }

  void reset() override {
    const auto c = options.num_features();
    if (options.affine()) {
      weight = register_parameter("weight", torch::ones({c}));
      bias = register_parameter("bias", torch::zeros({c}));
    } else {
      weight = register_parameter("weight", torch::Tensor(), false);
      bias = register_parameter("bias", torch::Tensor(), false);
    }
    if (options.track_running_stats()) {
      running_mean = register_buffer("running_mean", torch::zeros({c}));
      running_var = register_buffer("running_var", torch::ones({c}));
      num_batches_tracked = register_buffer("num_batches_tracked",
                                            torch::tensor(0, torch::kLong));
    }
  }

  torch::Tensor forward(const torch::Tensor& x) {
    if (x.dim() < 2 || x.size(1) != options.num_features()) {
      throw Error(ddpkit::detail::cat(
          "BatchNorm2d: expected input with ", options.num_features(),
          " channels in dim 1, got shape ", c10::str(x.sizes())));
    }
    double momentum = options.momentum().value_or(0.1);
    if (is_training() && options.track_running_stats()) {
      num_batches_tracked.add_(1);
      if (!options.momentum()) {
        momentum =
            1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
      }
    }
    const bool use_batch_stats =
        is_training() || !options.track_running_stats();
    // Synchronised in training mode only (PyTorch's rule): evaluation, even
    // with batch statistics (track_running_stats=false), is local, so one
    // rank may evaluate alone.
    if (is_training() && group_ && group_->size() > 1) {
      return detail::SyncBNFunction::apply(x, weight, bias, running_mean,
                                           running_var, options.eps(), momentum,
                                           reinterpret_cast<int64_t>(&*group_));
    }
    return torch::batch_norm(x, weight, bias, running_mean, running_var,
                             use_batch_stats, momentum, options.eps(),
                             /*cudnn_enabled=*/true);
  }

  /// Attaches (or, with nullopt, detaches) the group whose ranks share
  /// training statistics.
  void set_sync_group(std::optional<dist::Group> group) {
    group_ = std::move(group);
  }
  bool is_synchronized() const {
    return group_ && group_->size() > 1;
  }

  void pretty_print(std::ostream& os) const override {
    os << (is_synchronized() ? "ddpkit::nn::SyncBatchNorm("
                             : "ddpkit::nn::BatchNorm2d(")
       << options.num_features() << ", eps=" << options.eps() << ")";
  }

  torch::nn::BatchNormOptions options;
  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  std::optional<dist::Group> group_;
};
TORCH_MODULE(BatchNorm2d);

/// A BatchNorm2d synchronised over `group` from construction (PyTorch's
/// `SyncBatchNorm(num_features, process_group=group)`): no later
/// `convert_sync_batchnorm` call is needed. It is a BatchNorm2d (same
/// parameters, buffers and state dict; register it as one), so
/// `set_sync_group` and `is_synchronized` work on it; over a group of one
/// rank it is plain batch norm.
///
/// ```
/// auto bn = register_module("bn", ddpkit::nn::SyncBatchNorm(64, group));
/// ```
class SyncBatchNorm : public BatchNorm2d {
 public:
  SyncBatchNorm(int64_t num_features, dist::Group group)
      : SyncBatchNorm(torch::nn::BatchNormOptions(num_features),
                      std::move(group)) {}
  SyncBatchNorm(torch::nn::BatchNormOptions options, dist::Group group)
      : BatchNorm2d(std::move(options)) {
    (*this)->set_sync_group(std::move(group));
  }
  /* implicit */ SyncBatchNorm(std::nullptr_t) : BatchNorm2d(nullptr) {}
};

/// Makes every ddpkit BatchNorm2d in `module`'s tree a SyncBatchNorm over
/// `group` (state is kept: it is the same module). Like PyTorch's
/// `convert_sync_batchnorm`. A `torch::nn::BatchNorm2d` in the tree is an
/// error naming it: libtorch cannot swap a module that a parent holds in a
/// field, so build models with `ddpkit::nn::BatchNorm2d` (same state dict).
/// Returns how many layers were converted.
inline int convert_sync_batchnorm(torch::nn::Module& module,
                                  const dist::Group& group) {
  int converted = 0;
  for (auto& item : module.named_modules()) {
    if (auto* bn = dynamic_cast<BatchNorm2dImpl*>(item.value().get())) {
      bn->set_sync_group(group);
      ++converted;
    } else if (dynamic_cast<torch::nn::BatchNorm2dImpl*>(item.value().get())) {
      throw UsageError(ddpkit::detail::cat(
          "convert_sync_batchnorm: module '", item.key(),
          "' is a torch::nn::BatchNorm2d; use ddpkit::nn::BatchNorm2d (same "
          "parameters and state dict) so it can be synchronised"));
    }
  }
  return converted;
}

}  // namespace ddpkit::nn
