// SPDX-License-Identifier: BSD-3-Clause
// ddpkit: train libtorch models on one device, on several devices of one
// process (DataParallel), or across processes and machines (DDP), with the
// mode chosen by a type. This header is the whole public API but image
// files (ddpkit/image.hpp: JPEG/PNG, ImageFolder, the ImageNet transforms;
// kept apart so a program that reads no images never parses the codecs'
// headers) and the data tests make (ddpkit/testing.hpp, opt-in).
#pragma once

#include "ddpkit/concepts.hpp"
#include "ddpkit/data.hpp"
#include "ddpkit/distributed.hpp"
#include "ddpkit/nn/activation_checkpoint.hpp"
#include "ddpkit/nn/models.hpp"
#include "ddpkit/parallel.hpp"
#include "ddpkit/policies.hpp"
#include "ddpkit/train.hpp"
#include "ddpkit/version.hpp"
