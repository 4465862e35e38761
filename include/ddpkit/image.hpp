// SPDX-License-Identifier: BSD-3-Clause
// Image files: JPEG/PNG decode and encode (libjpeg-turbo, libpng),
// ImageFolder datasets and the ImageNet recipe's decoding transforms (the
// JPEG folder generator tests use is in ddpkit/testing.hpp). Separate from
// ddpkit.hpp so a program that does not read images never parses the
// codecs' C headers.
#pragma once

#include "ddpkit/data/image_folder.hpp"
#include "ddpkit/data/image_io.hpp"
#include "ddpkit/data/image_transforms.hpp"
