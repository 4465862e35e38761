// OpProfile for a Python process that already runs libtorch:
// scripts/bench_pytorch_precision.py --op-profile loads this library with
// ctypes after `import torch` (it must be built against the same libtorch,
// so that the callback lands in the registry PyTorch's operators consult).
//
//   ddpkit_op_profile_torch_version()  the libtorch version it was built
//                              against, for the caller to compare with
//                              torch.__version__
//   ddpkit_op_profile_start()  start timing the calling thread's operators
//   ddpkit_op_profile_stop()   stop; returns {"aten::name": [seconds,
//                              calls], ...} as JSON, valid until the next
//                              call
#include <memory>
#include <sstream>
#include <string>

#include <torch/version.h>

#include "op_profile.hpp"

namespace {
std::unique_ptr<ddpkit_bench::OpProfile> active;
std::string result;
}  // namespace

extern "C" {

__attribute__((visibility("default"))) const char*
ddpkit_op_profile_torch_version() {
  return TORCH_VERSION;
}

__attribute__((visibility("default"))) void ddpkit_op_profile_start() {
  active.reset();
  active = std::make_unique<ddpkit_bench::OpProfile>();
}

__attribute__((visibility("default"))) const char* ddpkit_op_profile_stop() {
  std::ostringstream os;
  os.precision(9);
  os << '{';
  if (active) {
    const char* sep = "";
    for (const auto& [name, sc] : active->ops()) {
      os << sep << '"' << name << "\": [" << sc.first << ", " << sc.second
         << ']';  // operator names hold no quotes or backslashes
      sep = ", ";
    }
  }
  os << '}';
  active.reset();
  result = os.str();
  return result.c_str();
}
}
