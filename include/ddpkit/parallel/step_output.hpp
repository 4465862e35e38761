// SPDX-License-Identifier: BSD-3-Clause
// What an engine's training step returns (the engine contract's one type;
// the concepts that check an engine are in concepts.hpp).
#pragma once

#include <torch/torch.h>

namespace ddpkit::parallel {

/// What one training step returns: the batch's mean loss and the model's
/// outputs, both detached.
struct StepOutput {
  torch::Tensor loss;
  torch::Tensor output;
};

}  // namespace ddpkit::parallel
