// SPDX-License-Identifier: BSD-3-Clause
// The BN policies of a Trainer: PlainBN (batch norm per process) and SyncBN
// (every ddpkit BatchNorm2d made a SyncBatchNorm over the group).
#pragma once

#include <torch/torch.h>

#include "ddpkit/concepts.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/nn/batch_norm.hpp"

namespace ddpkit::nn {

/// Batch norm stays per process.
struct PlainBN {
  using bn_concept = bn_tag;
  static constexpr bool is_synchronized = false;
  static constexpr const char* name = "bn";
  static int apply(torch::nn::Module&, const dist::Group&) {
    return 0;
  }
};

/// Batch-norm statistics are shared by every rank (needs a multi-process
/// parallel policy).
struct SyncBN {
  using bn_concept = bn_tag;
  static constexpr bool is_synchronized = true;
  static constexpr const char* name = "syncbn";
  static int apply(torch::nn::Module& m, const dist::Group& g) {
    return convert_sync_batchnorm(m, g);
  }
};

}  // namespace ddpkit::nn
