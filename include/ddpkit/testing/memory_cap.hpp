// SPDX-License-Identifier: BSD-3-Clause
// Memory measured where tensors get it, for tests that cap it: libtorch's
// CPU allocator metered (bytes in use, their peak), with an optional cap
// beyond which an allocation fails as a smaller machine's would
// (detail/metered_allocator.hpp; the Trainer reads the same meter).
#pragma once

#include "ddpkit/detail/metered_allocator.hpp"

namespace ddpkit::testing {

using MeteredCpuAllocator = ddpkit::detail::MeteredCpuAllocator;

}  // namespace ddpkit::testing
