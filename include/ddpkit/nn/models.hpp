// SPDX-License-Identifier: BSD-3-Clause
// The model zoo and model I/O: ResNet-18/34/50 equal to torchvision's, the
// compact CIFAR classifier, and Python-compatible state dict files.
#pragma once

#include "ddpkit/nn/cifar_net.hpp"
#include "ddpkit/nn/resnet.hpp"
#include "ddpkit/nn/state_dict.hpp"
