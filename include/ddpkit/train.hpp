// SPDX-License-Identifier: BSD-3-Clause
// Training: the Trainer, LR scaling and schedules, evaluation strategies,
// checkpoints, metrics files and progress.
#pragma once

#include "ddpkit/train/auto_settings.hpp"
#include "ddpkit/train/capture_safety.hpp"
#include "ddpkit/train/checkpoint.hpp"
#include "ddpkit/train/checkpoint_connector.hpp"
#include "ddpkit/train/checkpoint_queue.hpp"
#include "ddpkit/train/clip.hpp"
#include "ddpkit/train/evaluation.hpp"
#include "ddpkit/train/lr.hpp"
#include "ddpkit/train/memory_format.hpp"
#include "ddpkit/train/metrics.hpp"
#include "ddpkit/train/reduction.hpp"
#include "ddpkit/train/resume_source.hpp"
#include "ddpkit/train/run_summary.hpp"
#include "ddpkit/train/sharded_checkpoint.hpp"
#include "ddpkit/train/sharded_state.hpp"
#include "ddpkit/train/signals.hpp"
#include "ddpkit/train/trainer.hpp"
