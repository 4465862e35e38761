// SPDX-License-Identifier: BSD-3-Clause
// The distributed runtime: environment, rendezvous, process groups,
// collectives, self-spawn and the launch entry point.
#pragma once

#include "ddpkit/dist/collectives.hpp"
#include "ddpkit/dist/compat.hpp"
#include "ddpkit/dist/env.hpp"
#include "ddpkit/dist/launch.hpp"
#include "ddpkit/dist/process_group.hpp"
#include "ddpkit/dist/spawn.hpp"
