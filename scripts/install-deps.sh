#!/usr/bin/env bash
# Installs ddpkit's build and test dependencies:
#   - Debian packages (compilers, Debian's libtorch-dev 1.13 and gloo, the
#     header libraries, image codecs, the fuzzers' clang);
#   - PyTorch 2.11 (the CUDA 13.0 build, with its NVIDIA runtime packages)
#     and the matching torchvision from PyPI, in a Python virtual
#     environment (default .venv in the repository, ignored by git): the
#     libtorch ddpkit builds against by default, and the Python the
#     interoperability and torchrun tests run; with TensorBoard (PyPI
#     `tensorboard`, DDPKIT_TENSORBOARD_VERSION, default 2.21.0), whose
#     reader the TensorBoard tests use, and clang-format
#     (DDPKIT_CLANG_FORMAT_VERSION, default 21.1.8) for the format check.
# Does nothing, and needs no network, when everything is already there.
#
#   DDPKIT_VENV=DIR        the environment's folder (default: .venv, a link
#                          to DDPKIT_VENV_HOME/venv-torch<V>-vision<V>,
#                          shared by the machine's checkouts; DDPKIT_VENV_HOME
#                          defaults to ~/.cache/ddpkit)
#   DDPKIT_TORCH_VERSION   torch version for it (default 2.11.0; torchvision
#                          DDPKIT_TORCHVISION_VERSION, default 0.26.0)
#   DDPKIT_WITH_VENV=0     Debian packages only
#   DDPKIT_VENV_FREE_GB=N  free space required before installing (default 9)
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs=(cmake ninja-build g++ pkg-config libtorch-dev libgloo-dev librange-v3-dev
      doctest-dev libbenchmark-dev libturbojpeg0-dev libjpeg62-turbo-dev
      libpng-dev libcli11-dev python3-venv
      # scripts/test.sh compiles through ccache (a rerun of the same tree,
      # as CI's clean clone after a session's own run, compiles nothing).
      ccache
      # `script`: the progress-bar test runs an example under a pseudo-terminal.
      bsdutils
      # Multi-host tests (tests/multihost/netns.sh): ip netns, unshare, nsenter.
      iproute2 util-linux
      # libFuzzer targets (scripts/fuzz.sh): clang and its sanitizer runtimes.
      clang-14 libclang-rt-14-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]} > 0)); then
  echo "ddpkit: installing missing Debian packages: ${missing[*]}" >&2
  SUDO=""
  if [[ $(id -u) != 0 ]]; then SUDO=sudo; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

[[ "${DDPKIT_WITH_VENV:-1}" == 1 ]] || exit 0
venv=${DDPKIT_VENV:-.venv}
torch_v=${DDPKIT_TORCH_VERSION:-2.11.0}
vision_v=${DDPKIT_TORCHVISION_VERSION:-0.26.0}
# By default the environment is shared by every checkout on the machine
# (5 GB each otherwise; a fresh clone, as CI makes, would download 3 GB
# again): it lives in DDPKIT_VENV_HOME (default ~/.cache/ddpkit), one
# folder per torch/torchvision pair, and .venv is a link to it. With
# DDPKIT_VENV set, or a .venv folder already there, that is used as before.
if [[ -z ${DDPKIT_VENV:-} && ( -L .venv || ! -e .venv ) ]]; then
  shared=${DDPKIT_VENV_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/ddpkit}/venv-torch$torch_v-vision$vision_v
  mkdir -p "$(dirname "$shared")"
  [[ -L .venv ]] || ln -s "$shared" .venv
  venv=$(readlink .venv)
  # One install at a time into the shared folder.
  exec 9>"$venv.lock"
  flock 9
fi
tb_v=${DDPKIT_TENSORBOARD_VERSION:-2.21.0}
# clang-format that understands C++20 (concepts, requires clauses); Debian
# bookworm's is 14. scripts/check-format.sh uses this one.
clang_format_v=${DDPKIT_CLANG_FORMAT_VERSION:-21.1.8}
small_pins=("tensorboard==$tb_v" "clang-format==$clang_format_v")
# Already there: torch and torchvision of these versions are installed.
if [[ -x "$venv/bin/python3" ]] &&
   "$venv/bin/python3" - "$torch_v" "$vision_v" 2>/dev/null <<'PY'
import sys
from importlib.metadata import version
ok = (version("torch").split("+")[0] == sys.argv[1]
      and version("torchvision").split("+")[0] == sys.argv[2])
sys.exit(0 if ok else 1)
PY
then
  # Tools added to an environment made before the tests needed them:
  # TensorBoard (about 15 MB with its dependencies) and clang-format.
  missing_pins=$("$venv/bin/python3" - "${small_pins[@]}" 2>/dev/null <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        ok = version(name) == want
    except PackageNotFoundError:
        ok = False
    if not ok:
        print(pin)
PY
)
  if [[ -n $missing_pins ]]; then
    echo "ddpkit: installing $(echo $missing_pins) from PyPI into $venv" >&2
    # shellcheck disable=SC2086
    "$venv/bin/python3" -m pip install --quiet --disable-pip-version-check \
      --no-cache-dir $missing_pins
  fi
  exit 0
fi
# The wheels take about 3 GB to download and 5 GB installed; pip unpacks
# them through its temporary folder. Without room pip fails deep inside a
# traceback ("No space left on device"), so say it first, plainly.
need_gb=${DDPKIT_VENV_FREE_GB:-9}
mkdir -p "$(dirname "$venv")"
for where in "$(dirname "$venv")" "${TMPDIR:-/tmp}"; do
  free_gb=$(df -P -k "$where" | awk 'NR == 2 { print int($4 / 1048576) }')
  if ((free_gb < need_gb)); then
    echo "ddpkit: installing torch==$torch_v needs about $need_gb GB free in $where (for $venv and pip's downloads); it has $free_gb GB. Free some space (or point TMPDIR / DDPKIT_VENV elsewhere) and run this again." >&2
    exit 1
  fi
done
echo "ddpkit: installing torch==$torch_v and torchvision==$vision_v from PyPI into $venv (about 3 GB to download, 5 GB installed)" >&2
[[ -x "$venv/bin/python3" ]] || python3 -m venv "$venv"
# --no-cache-dir: pip's HTTP cache would keep a second copy of every wheel.
"$venv/bin/python3" -m pip install --quiet --disable-pip-version-check \
  --no-cache-dir "torch==$torch_v" "torchvision==$vision_v" "${small_pins[@]}"
"$venv/bin/python3" -c "import torch; print('ddpkit: PyTorch', torch.__version__, 'in $venv')" >&2
