// SPDX-License-Identifier: BSD-3-Clause
// ddpkit: train libtorch models on one device, on several devices of one
// process (DataParallel), or across processes and machines (DDP), with the
// mode chosen by a type. This header is the whole public API.
#pragma once

#include <type_traits>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data.hpp"
#include "ddpkit/dist.hpp"
#include "ddpkit/nn/models.hpp"
#include "ddpkit/parallel.hpp"
#include "ddpkit/train.hpp"
#include "ddpkit/version.hpp"

namespace ddpkit {

// The names users compose with, at the top level.
using data::DistributedSampling;
using data::RandomSampling;
using data::SequentialSampling;
using nn::PlainBN;
using nn::SyncBN;
using parallel::DataParallel;
using parallel::DDP;
using parallel::DDPBf16;
using parallel::DDPFp16;
using parallel::DDPPowerSGD;
using parallel::DDPRuntimeComm;
using parallel::SingleDevice;
using train::LinearScaling;
using train::NoScaling;
using train::RankZeroEval;
using train::ShardedEval;
using train::SqrtScaling;
using train::Trainer;
using train::TrainerOptions;
using train::UnevenInputs;

/// The sampler a parallel policy needs: sharded for multi-process policies,
/// shuffled otherwise.
template <parallel_policy Mode>
using sampling_for = std::conditional_t<Mode::is_multi_process,
                                        DistributedSampling, RandomSampling>;
/// SyncBN where the policy can synchronise, plain BN otherwise.
template <parallel_policy Mode>
using sync_bn_for = std::conditional_t<Mode::is_multi_process, SyncBN, PlainBN>;

/// A policy's default options, with DataParallel's replica count set to
/// `devices` (other policies ignore it).
template <parallel_policy Mode>
typename Mode::options_type parallel_options(int devices) {
  typename Mode::options_type o;
  if constexpr (requires { o.replicas(devices); }) o.replicas(devices);
  return o;
}

/// The common combinations, named.
template <class Model, class BN = PlainBN, class Scaling = NoScaling,
          class Reduction = RankZeroEval>
using DDPTrainer =
    Trainer<Model, DDP, DistributedSampling, BN, Scaling, Reduction>;
template <class Model, class Reduction = RankZeroEval>
using SingleDeviceTrainer =
    Trainer<Model, SingleDevice, RandomSampling, PlainBN, NoScaling, Reduction>;
template <class Model, class Reduction = RankZeroEval>
using DataParallelTrainer =
    Trainer<Model, DataParallel, RandomSampling, PlainBN, NoScaling, Reduction>;

}  // namespace ddpkit
