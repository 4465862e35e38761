// The paths CMake configured for the tests (defined in test_paths.cpp).
#pragma once

namespace ddpkit::test {

/// The Python that scripts/install-deps.sh puts in the project's virtual
/// environment (DDPKIT_VENV/bin/python3).
const char* configured_python();

/// scripts/ddpkit-doctor in the source tree.
const char* doctor_script();

}  // namespace ddpkit::test
