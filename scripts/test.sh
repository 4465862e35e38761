#!/usr/bin/env bash
# Installs ddpkit's dependencies (Debian packages; nothing when present),
# builds everything, runs the whole test suite, then short fuzz runs
# (scripts/fuzz.sh). This is the README's test command and exactly what CI
# runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
if [[ "${1:-}" == "--sanitize" ]]; then
  # The unit and multi-process suites under AddressSanitizer + UBSan
  # (CMakePresets.json "asan-ubsan"; ~10 min to build on 2 cores, so not
  # part of the default run).
  cmake --preset asan-ubsan
  cmake --build --preset asan-ubsan -j "${DDPKIT_JOBS:-$(nproc)}"
  exec ctest --preset asan-ubsan -j "${DDPKIT_JOBS:-$(nproc)}" --output-on-failure
fi
build=${DDPKIT_BUILD_DIR:-build}
jobs=${DDPKIT_JOBS:-$(nproc)}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DDDPKIT_BUILD_TESTS=ON -DDDPKIT_BUILD_EXAMPLES=ON -DDDPKIT_BUILD_BENCHMARKS=ON
cmake --build "$build" -j "$jobs"
# Multi-process tests pin one intra-op thread per rank themselves.
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900)
# Short libFuzzer runs of the input parsers (clang build in build-fuzz;
# DDPKIT_FUZZ_SECONDS per target, default 60; 0 skips).
./scripts/fuzz.sh
