#!/usr/bin/env bash
# The README's main job: installs ddpkit's dependencies (Debian packages),
# builds the CIFAR-10 example in DDP mode and trains it with 2 processes on
# the built-in synthetic data; accuracy rises epoch by epoch. Extra
# arguments go to the example (e.g. --epochs 30, --data DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/install-deps.sh
build=${DDPKIT_BUILD_DIR:-build}
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDDPKIT_BUILD_EXAMPLES=ON >/dev/null
cmake --build "$build" --target cifar10-ddp -j "$(nproc)"
# --overwrite: running the demo again starts over in the same folder.
exec "$build/bin/cifar10-ddp" --world-size 2 --epochs 6 --out runs/demo-cifar10-ddp --overwrite "$@"
