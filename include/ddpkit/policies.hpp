// SPDX-License-Identifier: BSD-3-Clause
// What can be composed: every policy the Trainer takes, by axis, named at
// the top level of `ddpkit::`, with the common combinations. Each policy is
// defined beside the code it drives (the folder in brackets); this header
// only gathers them, so one file shows the choices.
//
//   Trainer<Model, Parallel, Sampler, BN, LRScaling, Evaluation, Task>
//
//   Parallel    SingleDevice, DataParallel, DDP, DDPFp16, DDPBf16,
//               DDPPowerSGD, DDPRuntimeComm, ZeRO1, ZeRO2       [parallel/]
//   Sampler     SequentialSampling, RandomSampling,
//               DistributedSampling                             [data/]
//   BN          PlainBN, SyncBN                                 [nn/]
//   LRScaling   NoScaling, LinearScaling, SqrtScaling           [train/]
//   Evaluation  RankZeroEval, ShardedEval                       [train/]
//   Task        Classification, Regression, LanguageModel      [train/]
//
// The concepts that check each axis and the pairs of axes are in
// ddpkit/concepts.hpp; what a parallel policy's engine must offer is in
// ddpkit/parallel/engine.hpp, what a task must say in ddpkit/train/task.hpp.
#pragma once

#include <type_traits>

#include "ddpkit/concepts.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/nn/batch_norm.hpp"
#include "ddpkit/nn/bn_policies.hpp"
#include "ddpkit/parallel.hpp"
#include "ddpkit/train/lr.hpp"
#include "ddpkit/train/reduction.hpp"
#include "ddpkit/train/task.hpp"
#include "ddpkit/train/trainer.hpp"

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
using parallel::ZeRO1;
using parallel::ZeRO2;
using parallel::ZeRO3;
using train::Classification;
using train::LanguageModel;
using train::LinearScaling;
using train::NoScaling;
using train::RankZeroEval;
using train::Regression;
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
          class Reduction = RankZeroEval, class Task = Classification>
using DDPTrainer =
    Trainer<Model, DDP, DistributedSampling, BN, Scaling, Reduction, Task>;
/// DDP with the optimizer state sharded across ranks (ZeRO stage 1).
template <class Model, class BN = PlainBN, class Scaling = NoScaling,
          class Reduction = RankZeroEval, class Task = Classification>
using ZeRO1Trainer =
    Trainer<Model, ZeRO1, DistributedSampling, BN, Scaling, Reduction, Task>;
/// DDP with the optimizer state and the gradients sharded across ranks
/// (ZeRO stage 2).
template <class Model, class BN = PlainBN, class Scaling = NoScaling,
          class Reduction = RankZeroEval, class Task = Classification>
using ZeRO2Trainer =
    Trainer<Model, ZeRO2, DistributedSampling, BN, Scaling, Reduction, Task>;
/// The parameters sharded too, by nn::Unit (ZeRO stage 3).
template <class Model, class BN = PlainBN, class Scaling = NoScaling,
          class Reduction = RankZeroEval, class Task = Classification>
using ZeRO3Trainer =
    Trainer<Model, ZeRO3, DistributedSampling, BN, Scaling, Reduction, Task>;
template <class Model, class Reduction = RankZeroEval,
          class Task = Classification>
using SingleDeviceTrainer = Trainer<Model, SingleDevice, RandomSampling,
                                    PlainBN, NoScaling, Reduction, Task>;
template <class Model, class Reduction = RankZeroEval,
          class Task = Classification>
using DataParallelTrainer = Trainer<Model, DataParallel, RandomSampling,
                                    PlainBN, NoScaling, Reduction, Task>;

}  // namespace ddpkit
