// SPDX-License-Identifier: BSD-3-Clause
// Data that ddpkit's tests, examples and benchmarks make for themselves, so
// nothing is ever downloaded: the synthetic CIFAR-like set and its CIFAR-10
// binary writer, and a JPEG ImageFolder generator.
#pragma once

#include "ddpkit/testing/jpeg_folder_generator.hpp"
#include "ddpkit/testing/memory_cap.hpp"
#include "ddpkit/testing/synthetic.hpp"
