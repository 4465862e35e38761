#!/usr/bin/env bash
# Installs ddpkit's dependencies (scripts/install-deps.sh: Debian packages
# and PyTorch 2.11 in .venv; nothing when present) and runs everything CI
# checks, against both libtorch versions ddpkit supports:
#
#   1. torch 2.11 (the PyTorch wheel, CUDA 13.0 build: CUDA, NCCL and
#      autocast code compiled and linked, run without a GPU): -O1 release
#      build of tests, examples and benchmarks (build-test/), the CTest
#      suite with the Trainer's doctest suites (train, reliability; the
#      other five run in stage 2, unless DDPKIT_SANITIZE=0: then all seven
#      run here)
#   2. torch 2.11: the unit and multi-process suites of the distributed,
#      parallel, data and nn code (dist, samplers, parallel, nn, data: where
#      ddpkit handles raw memory — the reducer, shared memory, pickle and
#      image decoding, transforms) under AddressSanitizer + UBSan (CMake
#      preset "asan-ubsan", build-asan/; without GCC's
#      -Wmaybe-uninitialized, which the sanitizers' instrumentation makes
#      report false positives inside libtorch's inline code, and without
#      UBSan's vptr check, which instruments every virtual call and
#      downcast: 13 % of a test file's compile here). The Trainer's
#      suites ran under the sanitizers too until CI time asked for each
#      test file to be compiled once per libtorch version.
#   3. torch 2.11: short libFuzzer runs of the input parsers
#      (scripts/fuzz.sh, build-fuzz/)
#   4. torch 1.13 (Debian's libtorch-dev, CPU): -O1 build of the five
#      suites of the distributed, parallel, data and nn code and the
#      cifar10 example's single and ddp builds (build-test-113/), and their
#      CTest entries: unit, multi-process and the example runs that cross
#      libtorch versions
#
# ddpkit's own code builds with -Wall -Wextra -Werror in stages 1 and 4.
# Not run here, for want of a GPU: the "cuda" doctest suite (compiled into
# ddpkit_tests; scripts/gpu-check.sh runs it on a GPU machine).
#
#   0. before anything is built: the layering of include/ddpkit/
#      (scripts/check-layers.py) and every C++ file against .clang-format
#      (scripts/check-format.sh, PyPI's clang-format 21 in .venv)
#
# It ends with a summary naming every stage and what it did not run. This
# is the README's test command and exactly what CI runs.
#
#   scripts/test.sh              all four stages
#   scripts/test.sh --sanitize   stage 2 only
#
#   DDPKIT_SANITIZE=0        skip stage 2 (the summary says so)
#   DDPKIT_FUZZ_SECONDS=N    seconds per fuzz target (default 10; 0 skips 3)
#   DDPKIT_TORCH113=0        skip stage 4
#   DDPKIT_JOBS=N            build and test parallelism (default: nproc)
#   DDPKIT_TEST_FLAGS=...    release flags of stages 1 and 4 (-O1 -DNDEBUG)
#   DDPKIT_BUILD_DIR=DIR     stage 1's build folder (default build-test;
#                            build/ stays demo.sh's -O3 build)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
# Every compile goes through ccache (Debian's, which install-deps.sh
# installs) into its cache folder (default ~/.cache/ccache), with paths
# taken relative to this checkout: a rerun of the same tree compiles
# nothing, from any folder (CI's clean clone after a session's own run).
# CMake takes the launcher from these variables when it configures a fresh
# build folder (the consumers of tests/cmake_import and fuzz.sh too).
# DDPKIT_CCACHE=0 compiles everything. The summary names its hits.
if [[ ${DDPKIT_CCACHE:-1} != 0 ]] && command -v ccache >/dev/null; then
  export CMAKE_CXX_COMPILER_LAUNCHER=ccache CMAKE_C_COMPILER_LAUNCHER=ccache
  export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=true
  export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
  export CCACHE_MAXSIZE=${CCACHE_MAXSIZE:-16G}
  ccache --zero-stats >/dev/null
fi
jobs=${DDPKIT_JOBS:-$(nproc)}
flags=${DDPKIT_TEST_FLAGS:--O1 -DNDEBUG}
t0=$(date +%s)
summary=()
stamp() { echo "== $* ($(($(date +%s) - t0)) s since start)"; }
note() { summary+=("$*"); }
finish() {
  local rc=$?
  echo
  echo "== summary ($(($(date +%s) - t0)) s)"
  for line in "${summary[@]}"; do echo "  $line"; done
  if [[ -n ${CMAKE_CXX_COMPILER_LAUNCHER:-} ]]; then
    echo "  ccache: $(ccache --print-stats 2>/dev/null | awk -F'\t' '$1 ~ /^(direct_cache_hit|preprocessed_cache_hit|cache_miss|could_not_use_precompiled_header|uncacheable)$/ { printf "%s %s  ", $1, $2 }')"
  fi
  ((rc == 0)) || echo "  FAILED (exit $rc) in the stage after the last line above"
}
trap finish EXIT

# CTest's own summary line ("N tests failed out of M") is kept for the
# closing summary, with the skipped tests named and every skip's reason:
# a test skips only one way (tests/examples/skip.sh, DDPKIT_SKIP in
# tests/support.hpp: exit 77, which CTest reports as skipped), and each
# skip appends its reason to $DDPKIT_SKIP_LOG. Under CI=true a skip is a
# failure. The cases a build excludes by name (the libtorch cannot run
# them: BUILD/excluded-tests.txt, written by tests/CMakeLists.txt) are
# listed too.
run_ctest() {
  local label=$1 build_dir=$2
  shift 2
  local log
  log=$(mktemp)
  export DDPKIT_SKIP_LOG
  DDPKIT_SKIP_LOG=$(mktemp)
  set +e
  ctest "$@" 2>&1 | tee "$log"
  local rc=${PIPESTATUS[0]}
  set -e
  local line skipped reasons excluded=""
  line=$(grep -E "tests passed|tests failed" "$log" | tail -1)
  skipped=$(sed -nE 's/^[[:space:]]+[0-9]+ - ([^ ]+) \((Skipped|Not Run|Disabled)\).*/\1/p' "$log" | tr '\n' ' ')
  reasons=$(sed 's/^/      skipped: /' "$DDPKIT_SKIP_LOG")
  [[ -f $build_dir/excluded-tests.txt ]] &&
    excluded=$(sed 's/^/      excluded by name: /' "$build_dir/excluded-tests.txt")
  rm -f "$log" "$DDPKIT_SKIP_LOG"
  unset DDPKIT_SKIP_LOG
  note "$label: ${line:-no CTest summary}${skipped:+; SKIPPED: $skipped}"
  # Disk: what the runs left (a passed test removes its run folder; see
  # tests/examples/run_example.sh) and what is free (CI once ran out).
  [[ -d $build_dir/example-runs ]] &&
    note "      disk: example-runs $(du -sh "$build_dir/example-runs" | cut -f1), $(df -h --output=avail . | tail -1 | tr -d ' ') free"
  [[ -n $reasons ]] && note "$reasons"
  [[ -n $excluded ]] && note "$excluded"
  if [[ -n $skipped && ${CI:-} == true ]]; then
    echo "ddpkit: tests were skipped under CI=true: $skipped" >&2
    return 1
  fi
  return "$rc"
}

sanitized_suites() {
  stamp "stage 2: torch 2.11, the distributed, parallel, data and nn suites under ASan + UBSan"
  cmake --preset asan-ubsan >/dev/null
  cmake --build --preset asan-ubsan -j "$jobs"
  run_ctest "stage 2 (torch 2.11, ASan + UBSan: dist, samplers, parallel, nn, data)" build-asan --preset asan-ubsan -j "$jobs" --output-on-failure
}

if [[ "${1:-}" == "--sanitize" ]]; then
  sanitized_suites
  exit 0
fi

stamp "stage 0: layering of the headers and their format"
python3 scripts/check-layers.py
scripts/check-format.sh
note "stage 0 (layers: scripts/check-layers.py; format: scripts/check-format.sh): passed"

stamp "stage 1: torch 2.11 (CUDA build, run without a GPU), release build and the CTest suite"
build=${DDPKIT_BUILD_DIR:-build-test}
# When stage 2 runs, five doctest suites (ddpkit_tests with
# DDPKIT_TEST_PARTS=core) are built and run there, under ASan + UBSan, and
# the Trainer's two here (DDPKIT_TEST_PARTS=train). The tests build at -O1:
# half the compile time of -O3; speed is measured by
# scripts/run-benchmarks.sh, which builds at -O3 in its own folder.
parts=all
[[ "${DDPKIT_SANITIZE:-1}" != 0 ]] && parts=train
# Binaries no test here runs are compiled to check them (-fsyntax-only:
# every template instantiated, no code generated; CMakeLists.txt's
# DDPKIT_CHECK_ONLY), not built: the benchmarks but ddpkit_ddp_bench and
# OpProfile's library, which bench.op-profile runs
# (scripts/run-benchmarks.sh builds and runs them all at -O3), cifar10's zero
# build (ZeRO's example runs are flowers' and char_lm's), and flowers' and
# char_lm's dp builds (DataParallel's example run is cifar10's; the
# parallel suite checks it on other models).
check_only="cifar10-zero;flowers-resnet34-dp;char-lm-dp;ddpkit_comm_bench;ddpkit_data_bench;ddpkit_gpu_throughput"
note "stage 1 compiles without building (-fsyntax-only): ${check_only//;/, }"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDPKIT_TORCH=venv \
  "-DCMAKE_CXX_FLAGS_RELEASE=$flags" \
  -DDDPKIT_BUILD_TESTS=ON -DDDPKIT_BUILD_EXAMPLES=ON -DDDPKIT_BUILD_BENCHMARKS=ON \
  -DDDPKIT_UNIT_TESTS=ON -DDDPKIT_TEST_PARTS=$parts -DDDPKIT_WERROR=ON \
  "-DDDPKIT_CHECK_ONLY=$check_only" | grep -E "^-- (ddpkit|Found CUDAToolkit|Found Torch)"
cmake --build "$build" -j "$jobs"
# Multi-process tests pin one intra-op thread per rank themselves.
run_ctest "stage 1 (torch 2.11, CTest: examples, torchrun, compile-fail, cmake import; doctest suites here: $parts)" "$build" \
  --test-dir "$build" --output-on-failure -j "$jobs" --timeout 900

if [[ "${DDPKIT_SANITIZE:-1}" != 0 ]]; then
  sanitized_suites
else
  note "stage 2 NOT RUN (DDPKIT_SANITIZE=0); all seven suites ran in stage 1 instead"
fi

if [[ "${DDPKIT_FUZZ_SECONDS:-10}" != 0 ]]; then
  stamp "stage 3: torch 2.11, fuzzing"
  DDPKIT_FUZZ_SECONDS=${DDPKIT_FUZZ_SECONDS:-10} ./scripts/fuzz.sh
  note "stage 3 (torch 2.11, libFuzzer): ${DDPKIT_FUZZ_SECONDS:-10} s per target, no finding"
else
  note "stage 3 NOT RUN (DDPKIT_FUZZ_SECONDS=0)"
fi

if [[ "${DDPKIT_TORCH113:-1}" != 0 ]]; then
  stamp "stage 4: torch 1.13 (Debian's libtorch-dev, CPU): the core suites and the cifar10 example"
  cmake -S . -B build-test-113 -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDPKIT_TORCH=system \
    "-DCMAKE_CXX_FLAGS_RELEASE=$flags" \
    -DDDPKIT_BUILD_TESTS=ON -DDDPKIT_BUILD_EXAMPLES=ON -DDDPKIT_BUILD_BENCHMARKS=OFF \
    -DDDPKIT_UNIT_TESTS=ON -DDDPKIT_TEST_PARTS=core -DDDPKIT_WERROR=ON | grep -E "^-- (ddpkit|Found Torch)"
  cmake --build build-test-113 -j "$jobs" --target ddpkit_tests cifar10-single cifar10-ddp
  # Against 1.13: the five suites of the distributed, parallel, data and
  # nn code (every engine, DataParallel included: where the libtorch APIs
  # ddpkit wraps differ most), the cifar10 example's runs that cross what
  # differs between libtorch versions in the Trainer (training single and
  # DDP, single equal to DDP, its checkpoints loading in Python's torch
  # 2.11, its TensorBoard file, a run killed and resumed, the torchrun
  # environment), the bad-argument checks, and
  # multihost.collectives-across-hosts (it needs ddpkit_tests, which
  # stage 1 does not build).
  # 2.11 only (stage 1), to keep CI within its time: the Trainer's suites
  # (train, reliability, sharded: until stop 59 they ran here too), the
  # flowers and char_lm examples and their runs (flowers' Python load into
  # torchvision's resnet34, DDP on 2 x 2 hosts equal to one process), the
  # dp and zero builds, the example scripts that exercise ddpkit's own
  # logic (config files, progress on a terminal, run lock, full disk,
  # changed data, torchrun faults, PowerSGD, weight freezing), compile-fail
  # and cmake import, the minimal program, benchmarks, sanitizers and
  # fuzzers. Stop 37 ran all of these against 1.13 too (all passed).
  run_ctest "stage 4 (torch 1.13, CTest: dist, samplers, parallel, nn, data; cifar10 single/ddp runs and checks, bad arguments, torchrun, collectives across hosts; the rest is 2.11 only, see scripts/test.sh)" build-test-113 \
    --test-dir build-test-113 --output-on-failure -j "$jobs" --timeout 900 \
    -R '^(dist|samplers|parallel|parallel\.zero|nn|data|example\.(cifar10-single|cifar10-ddp|cifar10-single-equals-ddp|cifar10-ddp-python-load|cifar10-ddp-tensorboard|cifar10-tensorboard-kill-resume|cifar10-ddp-torchrun|bad-args\..*)|multihost\.collectives-across-hosts)$' \
    -E '^example\.bad-args\.class-indices$'
else
  note "stage 4 NOT RUN (DDPKIT_TORCH113=0)"
fi
note "not run anywhere in CI: the \"cuda\" doctest suite (no GPU; scripts/gpu-check.sh runs it on one)"
stamp "all passed"
