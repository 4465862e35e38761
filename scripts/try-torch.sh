#!/usr/bin/env bash
# Compiles ddpkit, its tests and its examples against any torch release on
# PyPI, in a throw-away environment, and runs the seven doctest suites (unit
# and multi-process tests, CPU):
#
#   scripts/try-torch.sh 2.15.0            # build + run the suites
#   scripts/try-torch.sh 2.15.0 --build-only
#
# The environment and the build live in build-torch-VERSION/ (ignored by
# git; delete it afterwards, it holds ~3 GB). Ends with one line for the
# README's "tested with" table. Needs PyPI; the CUDA toolkit on the PATH
# when the wheel is a CUDA build (its nccl.h comes from the wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/try-torch.sh VERSION [--build-only]}
run=1
[[ "${2:-}" == "--build-only" ]] && run=0
[[ "$version" =~ ^[0-9]+\.[0-9]+(\.[0-9]+)?$ ]] ||
  { echo "try-torch: '$version' is not a version like 2.15.0" >&2; exit 2; }
dir=build-torch-$version
jobs=${DDPKIT_JOBS:-$(nproc)}
./scripts/install-deps.sh  # Debian packages (and the main environment)
if ! [[ -x $dir/venv/bin/python3 ]] ||
   ! "$dir/venv/bin/python3" -c "from importlib.metadata import version; assert version('torch').split('+')[0] == '$version'" 2>/dev/null; then
  python3 -m venv "$dir/venv"
  "$dir/venv/bin/python3" -m pip install --quiet --disable-pip-version-check "torch==$version"
fi
info=$("$dir/venv/bin/python3" -c "import torch; print(torch.__version__, torch.version.cuda or 'cpu')")
echo "try-torch: $info"
t0=$(date +%s)
cmake -S . -B "$dir/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DDDPKIT_TORCH=venv "-DDDPKIT_VENV=$PWD/$dir/venv" \
  "-DCMAKE_CXX_FLAGS_RELEASE=${DDPKIT_TEST_FLAGS:--O1 -DNDEBUG}" \
  -DDDPKIT_BUILD_TESTS=ON -DDDPKIT_BUILD_EXAMPLES=ON -DDDPKIT_BUILD_BENCHMARKS=ON \
  | grep -E "^-- (ddpkit|Found CUDAToolkit|Found Torch)"
cmake --build "$dir/build" -j "$jobs"
built=$(($(date +%s) - t0))
ran="nothing run"
if ((run)); then
  # The interoperability tests need torchvision, which may not exist yet for
  # the newest torch: they use the main environment's Python (torch 2.11).
  export DDPKIT_PYTHON=$PWD/.venv/bin/python3
  (cd "$dir/build" && ctest --output-on-failure -j "$jobs" --timeout 900 \
     -R '^(dist|samplers|parallel|parallel\.zero|nn|data|train|reliability)$')
  ran="seven doctest suites passed (interop against Python torch 2.11)"
fi
cuda=$(echo "$info" | cut -d' ' -f2)
echo "tested with: | $version | ${cuda} | library, tests, examples, benchmarks (built in ${built} s) | $ran | $(date +%Y-%m-%d) |"
