// ddpkit's libFuzzer targets. Each `fuzz_<name>` binary is `entry.cpp`
// compiled with DDPKIT_FUZZ_TARGET=<name> and linked with `targets.cpp` (the
// one translation unit that includes libtorch, compiled once for all).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace ddpkit::fuzz {

/// One target: its input handler and a writer of valid seed inputs.
struct Target {
  const char* name;
  /// Runs one input. Expected failures (ddpkit's exception types,
  /// c10::Error) are swallowed; a broken invariant or any other exception
  /// prints what went wrong and aborts, which libFuzzer reports as a crash.
  int (*run)(const std::uint8_t* data, std::size_t size);
  /// Writes valid inputs into `dir` (created if needed); returns how many.
  int (*write_seeds)(const std::string& dir);
};

Target cifar10_target();
Target image_target();
Target checkpoint_target();
Target env_target();

/// Process-wide set-up shared by every target (one intra-op thread, quiet
/// torch warnings); handles `-ddpkit_write_seeds=DIR`, which writes the
/// target's seeds and exits.
void initialize(const Target& t, int* argc, char*** argv);

}  // namespace ddpkit::fuzz
