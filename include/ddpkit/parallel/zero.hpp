// SPDX-License-Identifier: BSD-3-Clause
// ZeRO stages 1, 2 and 3 (Rajbhandari et al., SC'20): the sharded optimizer
// (zero/sharded_optimizer.hpp), ZeRO1 (zero/zero1.hpp), ZeRO2
// (zero/zero2.hpp) and ZeRO3 (zero/zero3.hpp, parameters sharded by
// nn::Unit). See Note [ZeRO's ownership] and Note [ZeRO-3's parameter
// lifecycle].
#pragma once

#include "ddpkit/parallel/zero/sharded_optimizer.hpp"
#include "ddpkit/parallel/zero/zero1.hpp"
#include "ddpkit/parallel/zero/zero2.hpp"
#include "ddpkit/parallel/zero/zero3.hpp"
