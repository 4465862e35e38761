// The paths CMake knows (the project's Python, the doctor script), compiled
// into this one small file: as definitions on every test file they would
// put the checkout's folder into each compile command, and ccache could
// reuse nothing from a checkout in another folder (scripts/test.sh).
#include "test_paths.hpp"

namespace ddpkit::test {

const char* configured_python() {
  return DDPKIT_TEST_PYTHON;
}

const char* doctor_script() {
  return DDPKIT_DOCTOR;
}

}  // namespace ddpkit::test
