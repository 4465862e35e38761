#!/usr/bin/env bash
# Builds, on this machine, what scripts/gpu-check.sh runs on a lent GPU
# machine, and puts it in .gpu/ (ignored by git; carry it to the device):
# the test binary (its "cuda" suite), flowers-resnet34-single,
# flowers-resnet34-ddp, cifar10-single and ddpkit_gpu_throughput, compiled at -O2 against the torch 2.11.0+cu130
# wheel in .venv -- the same build of libtorch the GPU machine has -- plus
# the Debian libraries they load (libturbojpeg, libpng, libbenchmark,
# libstdc++). The GPU
# machine has no network and no Debian headers to build ddpkit itself.
#
#   scripts/gpu-prepare.sh     then, through the device tool:
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
build="build-gpu"
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDPKIT_TORCH=venv \
  "-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG" -DDDPKIT_MODE=all \
  -DDDPKIT_BUILD_TESTS=ON -DDDPKIT_BUILD_EXAMPLES=ON -DDDPKIT_BUILD_BENCHMARKS=ON \
  | grep -E "^-- (ddpkit|Found CUDAToolkit)"
cmake --build "$build" -j "$(nproc)" --target ddpkit_tests flowers-resnet34-single flowers-resnet34-ddp cifar10-single ddpkit_gpu_throughput
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib
cp "$build/tests/ddpkit_tests" "$build/bin/flowers-resnet34-single" "$build/bin/flowers-resnet34-ddp" "$build/bin/cifar10-single" \
   "$build/benchmarks/ddpkit_gpu_throughput" .gpu/bin/
# Debian's libraries the binaries need beyond torch's (and bookworm's
# libstdc++, in case the GPU machine's is older).
for lib in libturbojpeg.so.0 libpng16.so.16 libbenchmark.so.1debian libstdc++.so.6; do
  cp -L "/usr/lib/$(gcc -print-multiarch)/$lib" .gpu/lib/
done
# The CUDA code paths must be in the binaries.
# (grep -c reads all of nm's output: grep -q would close the pipe early,
# and pipefail would report nm's SIGPIPE.)
n=$(nm -DC .gpu/bin/ddpkit_tests | grep -c "c10d::ProcessGroupNCCL::ProcessGroupNCCL" || true)
((n > 0)) ||
  { echo "gpu-prepare: ddpkit_tests lacks the NCCL process group (not a CUDA build?)" >&2; exit 1; }
du -sh .gpu
echo "gpu-prepare: ready; carry .gpu and run scripts/gpu-check.sh on the GPU machine"
