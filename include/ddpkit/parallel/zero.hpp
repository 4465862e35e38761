// SPDX-License-Identifier: BSD-3-Clause
// ZeRO stages 1 and 2 (Rajbhandari et al., SC'20): the sharded optimizer
// (zero/sharded_optimizer.hpp), ZeRO1 (zero/zero1.hpp) and ZeRO2
// (zero/zero2.hpp). See Note [ZeRO's ownership].
#pragma once

#include "ddpkit/parallel/zero/sharded_optimizer.hpp"
#include "ddpkit/parallel/zero/zero1.hpp"
#include "ddpkit/parallel/zero/zero2.hpp"

// Note [Stage 3 (parameter sharding) on paper]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Stage 3 (parameter sharding) on paper. What ZeRO-3 / FSDP needs that
// libtorch's C++ modules lack: a hook before each module's forward (PyTorch's
// `register_forward_pre_hook`) to all-gather that module's parameters just in
// time and free them after, and the same before its backward. libtorch's
// `Module` has no hooks at all; `forward` is an ordinary member function
// called directly. What ddpkit could do: (1) a wrapper module (`Sharded<M>`)
// that the user puts around each large submodule, whose `forward` gathers the
// wrapped module's parameters (from flat shards), calls the inner forward,
// and frees them; the backward's gather is an autograd function inserted on
// the output (its backward gathers before the inner module's gradients are
// computed, and the parameters' AccumulateGrad hooks — which the reducer
// already uses — reduce-scatter and free them). (2) Parameters kept as flat
// 1/world shards with the module's tensors re-pointed (`set_`) at a gather
// buffer during the wrapped call; an optimizer over the shards as flat
// tensors (elementwise optimizers — SGD, Adam, AdamW — give the same result
// on a flat slice; non-elementwise ones would be refused). Projected memory
// per rank with Adam in fp32: parameters 4Ψ/N + the largest wrapped module,
// gradients 4Ψ/N + buckets in flight, optimizer state 8Ψ/N — 16Ψ/N in all
// (the paper's stage 3 with mixed precision: (2 + 2 + 12)Ψ/N). Not built: it
// needs the user to wrap modules (no automatic wrapping without hooks), and
// checkpoints would gather parameters the way `consolidate()` gathers state.
