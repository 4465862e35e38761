// SPDX-License-Identifier: BSD-3-Clause
// The parallel engines: SingleDevice, DataParallel, DDP, ZeRO-1 and ZeRO-2
// policies, the DDP gradient reducer and its communication strategies
// (SyncBatchNorm is nn/'s: nn/batch_norm.hpp, nn/bn_policies.hpp).
#pragma once

#include "ddpkit/parallel/data_parallel.hpp"
#include "ddpkit/parallel/ddp.hpp"
#include "ddpkit/parallel/engine.hpp"
#include "ddpkit/parallel/foreach_adam.hpp"
#include "ddpkit/parallel/foreach_sgd.hpp"
#include "ddpkit/parallel/grad_comm.hpp"
#include "ddpkit/parallel/loss_scaler.hpp"
#include "ddpkit/parallel/module_utils.hpp"
#include "ddpkit/parallel/optimizer_state.hpp"
#include "ddpkit/parallel/reducer.hpp"
#include "ddpkit/parallel/single_device.hpp"
#include "ddpkit/parallel/trace.hpp"
#include "ddpkit/parallel/zero.hpp"
