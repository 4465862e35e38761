// SPDX-License-Identifier: BSD-3-Clause
// The distributed runtime: environment, rendezvous, process groups,
// collectives, self-spawn and the launch entry point.
#pragma once

#include "ddpkit/detail/compat.hpp"
#include "ddpkit/distributed/collectives.hpp"
#include "ddpkit/distributed/env.hpp"
#include "ddpkit/distributed/launch.hpp"
#include "ddpkit/distributed/process_group.hpp"
#include "ddpkit/distributed/spawn.hpp"
