#!/usr/bin/env bash
# Installs ddpkit's build and test dependencies from Debian's archive.
# Does nothing (and needs no network) when everything is already present.
set -euo pipefail
pkgs=(cmake ninja-build g++ pkg-config libtorch-dev libgloo-dev librange-v3-dev
      doctest-dev libbenchmark-dev libturbojpeg0-dev libpng-dev libcli11-dev
      # libFuzzer targets (scripts/fuzz.sh): clang and its sanitizer runtimes.
      clang-14 libclang-rt-14-dev)
# Optional extras used by interop tests and benchmarks against PyTorch itself.
if [[ "${DDPKIT_WITH_PYTHON:-1}" == 1 ]]; then
  pkgs+=(python3-torch python3-torchvision)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "ddpkit: installing missing Debian packages: ${missing[*]}" >&2
SUDO=""
if [[ $(id -u) != 0 ]]; then SUDO=sudo; fi
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
