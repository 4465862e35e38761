// SPDX-License-Identifier: BSD-3-Clause
// Data without image codecs: samplers, the CIFAR-10 binary reader, batched
// tensor transforms and the prefetching loader. Image files (JPEG/PNG,
// ImageFolder, the ImageNet transforms) are in ddpkit/image.hpp; the
// synthetic data tests make in ddpkit/testing.hpp.
#pragma once

#include "ddpkit/data/cifar10.hpp"
#include "ddpkit/data/inputs.hpp"
#include "ddpkit/data/loader.hpp"
#include "ddpkit/data/samplers.hpp"
#include "ddpkit/data/transforms.hpp"
