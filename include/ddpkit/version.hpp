// SPDX-License-Identifier: BSD-3-Clause
// ddpkit's version: the macros for the preprocessor, `ddpkit::version` for
// code and outputs (summary.json, the examples' --version). It follows
// semantic versioning; CHANGELOG.md says what each version added, and
// CONTRIBUTING.md how a release is tagged (vMAJOR.MINOR.PATCH).
#pragma once

#define DDPKIT_VERSION_MAJOR 0
#define DDPKIT_VERSION_MINOR 2
#define DDPKIT_VERSION_PATCH 0
#define DDPKIT_VERSION_STRING "0.2.0"

namespace ddpkit {

/// "MAJOR.MINOR.PATCH", e.g. "0.2.0".
inline constexpr const char* version = DDPKIT_VERSION_STRING;
inline constexpr int version_major = DDPKIT_VERSION_MAJOR;
inline constexpr int version_minor = DDPKIT_VERSION_MINOR;
inline constexpr int version_patch = DDPKIT_VERSION_PATCH;

}  // namespace ddpkit
