// SPDX-License-Identifier: BSD-3-Clause
// Everything about data: samplers, datasets (CIFAR-10 binary, the synthetic
// set, ImageFolder with JPEG/PNG decode), batched transforms and the
// prefetching loader.
#pragma once

#include "ddpkit/data/cifar10.hpp"
#include "ddpkit/data/image_folder.hpp"
#include "ddpkit/data/image_io.hpp"
#include "ddpkit/data/jpeg_folder_generator.hpp"
#include "ddpkit/data/loader.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/data/synthetic.hpp"
#include "ddpkit/data/transforms.hpp"
