// The libFuzzer entry points of one target, chosen at compile time by
// DDPKIT_FUZZ_TARGET (cifar10, image, checkpoint or env). Tiny on purpose:
// all the work is in targets.cpp, compiled once.
#include <cstddef>
#include <cstdint>

#include "targets.hpp"

#ifndef DDPKIT_FUZZ_TARGET
#error "compile with -DDDPKIT_FUZZ_TARGET=<name>"
#endif
#define DDPKIT_FUZZ_CAT2(a, b) a##b
#define DDPKIT_FUZZ_CAT(a, b) DDPKIT_FUZZ_CAT2(a, b)

namespace {
const ddpkit::fuzz::Target& target() {
  static const ddpkit::fuzz::Target t =
      ddpkit::fuzz::DDPKIT_FUZZ_CAT(DDPKIT_FUZZ_TARGET, _target)();
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  ddpkit::fuzz::initialize(target(), argc, argv);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data,
                                      std::size_t size) {
  return target().run(data, size);
}
