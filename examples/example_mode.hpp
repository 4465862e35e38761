// SPDX-License-Identifier: BSD-3-Clause
// The parallel mode an example is built as, a compile-time type chosen by
// -DDDPKIT_MODE=single|dp|ddp|zero (examples/CMakeLists.txt defines
// DDPKIT_MODE_<MODE> for each build). The ddp build's policy is
// DDPKIT_EXAMPLE_DDP_POLICY when the example defines it before including
// this file (ddpkit::DDP otherwise).
#pragma once

#include <ddpkit/ddpkit.hpp>

#ifndef DDPKIT_EXAMPLE_DDP_POLICY
#define DDPKIT_EXAMPLE_DDP_POLICY ddpkit::DDP
#endif

#if defined(DDPKIT_MODE_DDP)
using Mode = DDPKIT_EXAMPLE_DDP_POLICY;
#elif defined(DDPKIT_MODE_ZERO)
// ZeRO stage 2: optimizer state and gradients sharded across processes.
using Mode = ddpkit::ZeRO2;
#elif defined(DDPKIT_MODE_DP)
using Mode = ddpkit::DataParallel;
#else
using Mode = ddpkit::SingleDevice;
#endif
