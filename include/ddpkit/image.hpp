// SPDX-License-Identifier: BSD-3-Clause
// Image files: JPEG/PNG decode and encode (libjpeg-turbo, libpng),
// ImageFolder datasets, the ImageNet recipe's decoding transforms, and the
// JPEG ImageFolder generator tests use. Separate from ddpkit.hpp so a
// program that does not read images never parses the codecs' C headers.
#pragma once

#include "ddpkit/data/image_folder.hpp"
#include "ddpkit/data/image_io.hpp"
#include "ddpkit/data/image_transforms.hpp"
#include "ddpkit/testing/jpeg_folder_generator.hpp"
