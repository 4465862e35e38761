#!/usr/bin/env bash
# Installs ddpkit's dependencies (Debian packages; nothing when present) and
# runs everything CI checks, in three stages:
#   1. -O1 release build of tests, examples and benchmarks (build-test/);
#      the CTest suite (the six doctest suites are built and run in stage 2
#      instead, unless DDPKIT_SANITIZE=0)
#   2. the unit and multi-process suites under AddressSanitizer + UBSan
#      (CMake preset "asan-ubsan", build-asan/)
#   3. short libFuzzer runs of the input parsers (scripts/fuzz.sh, build-fuzz/)
# This is the README's test command and exactly what CI runs (about 15 min
# from clean on 2 cores).
#
#   scripts/test.sh              all three stages
#   scripts/test.sh --sanitize   stage 2 only
#
#   DDPKIT_SANITIZE=0        skip stage 2
#   DDPKIT_FUZZ_SECONDS=N    seconds per fuzz target (default here 20, so CI
#                            stays well inside 20 min; 0 skips stage 3)
#   DDPKIT_JOBS=N            build and test parallelism (default: nproc)
#   DDPKIT_TEST_FLAGS=...    stage 1's release flags (default -O1 -DNDEBUG)
#   DDPKIT_BUILD_DIR=DIR     stage 1's build folder (default build-test;
#                            build/ stays demo.sh's -O3 build)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
jobs=${DDPKIT_JOBS:-$(nproc)}
t0=$(date +%s)
stamp() { echo "== $* ($(($(date +%s) - t0)) s since start)"; }

sanitized_suites() {
  stamp "stage 2: unit and multi-process suites under ASan + UBSan"
  cmake --preset asan-ubsan >/dev/null
  cmake --build --preset asan-ubsan -j "$jobs"
  ctest --preset asan-ubsan -j "$jobs" --output-on-failure
}

if [[ "${1:-}" == "--sanitize" ]]; then
  sanitized_suites
  exit 0
fi

stamp "stage 1: release build and the whole test suite"
build=${DDPKIT_BUILD_DIR:-build-test}
# When stage 2 runs, the six doctest suites (ddpkit_tests) are built and run
# there, under ASan + UBSan, rather than also here: CI stays inside its 20
# minutes. DDPKIT_SANITIZE=0 builds and runs them here.
# The tests build at -O1: half the compile time of CMake's -O3, and the
# heavy arithmetic runs inside libtorch anyway. Speed is measured by
# scripts/run-benchmarks.sh, which builds at -O3 in its own folder.
unit=ON
[[ "${DDPKIT_SANITIZE:-1}" != 0 ]] && unit=OFF
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_CXX_FLAGS_RELEASE=${DDPKIT_TEST_FLAGS:--O1 -DNDEBUG}" \
  -DDDPKIT_BUILD_TESTS=ON -DDDPKIT_BUILD_EXAMPLES=ON -DDDPKIT_BUILD_BENCHMARKS=ON \
  -DDDPKIT_UNIT_TESTS=$unit
cmake --build "$build" -j "$jobs"
# Multi-process tests pin one intra-op thread per rank themselves.
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 900)

if [[ "${DDPKIT_SANITIZE:-1}" != 0 ]]; then
  sanitized_suites
else
  stamp "stage 2 skipped (DDPKIT_SANITIZE=0)"
fi

stamp "stage 3: fuzzing"
DDPKIT_FUZZ_SECONDS=${DDPKIT_FUZZ_SECONDS:-20} ./scripts/fuzz.sh
stamp "all passed"
