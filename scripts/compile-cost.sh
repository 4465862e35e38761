#!/usr/bin/env bash
# Seconds to compile a user's file that includes one ddpkit header, for each
# header named, alternating between this tree and another (e.g. an older
# checkout) so both see the same machine load.
#
#   scripts/compile-cost.sh BUILD_DIR [OTHER_TREE] [ROUNDS]
#
# BUILD_DIR is a configured build of this tree (its flags are used: libtorch,
# codecs, CUDA defines). Each header is compiled as `#include <H>` plus an
# empty main, -O1, no precompiled header. Prints one line per header and
# tree: the fastest of ROUNDS (default 3) and all times.
set -euo pipefail
build=${1:?usage: scripts/compile-cost.sh BUILD_DIR [OTHER_TREE] [ROUNDS]}
other=${2:-}
rounds=${3:-3}
here=$(cd "$(dirname "$0")/.." && pwd)
# The compile flags of the test binary (a TU that includes ddpkit).
flags=$(ninja -C "$build" -t commands tests/CMakeFiles/ddpkit_tests.dir/train/trainer_test.cpp.o 2>/dev/null |
  tail -1 | tr ' ' '\n' |
  grep -E '^(-D|-I|-isystem|-std=|-f|-W)|^/' | grep -vE 'pch|\.cpp$|\.o$|\.d$|\.gch|^/usr/bin|DDPKIT_TEST_PYTHON|-Winvalid-pch' |
  awk 'prev=="-isystem"{print "-isystem " $0; prev=""; next} $0=="-isystem"{prev=$0; next} {print}' | tr '\n' ' ')
[ -n "$flags" ] || { echo "compile-cost: no compile flags found in $build" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
measure() {  # tree header -> seconds
  local tree=$1 h=$2
  printf '#include <%s>\nint main() { return 0; }\n' "$h" > "$tmp/u.cpp"
  local f=${flags//-I$here\/include/-I$tree\/include}
  local t0=$(date +%s.%N)
  # shellcheck disable=SC2086
  /usr/bin/c++ $f -O1 -c "$tmp/u.cpp" -o "$tmp/u.o"
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'
}
headers=(ddpkit/ddpkit.hpp ddpkit/train.hpp ddpkit/distributed.hpp)
[ -n "${HEADERS:-}" ] && read -r -a headers <<< "$HEADERS"
for h in "${headers[@]}"; do
  for tree in "$here" ${other:+"$other"}; do
    hh=$h
    # The distributed runtime was ddpkit/dist.hpp before 0.3.
    [ "$h" = ddpkit/distributed.hpp ] && [ ! -e "$tree/include/$h" ] && hh=ddpkit/dist.hpp
    times=()
    for ((r = 0; r < rounds; r++)); do times+=("$(measure "$tree" "$hh")"); done
    best=$(printf '%s\n' "${times[@]}" | sort -g | head -1)
    codecs=$(printf '#include <%s>\n' "$hh" | /usr/bin/c++ ${flags//-I$here\/include/-I$tree\/include} -x c++ -E -H - -o /dev/null 2>&1 | grep -cE '(jpeglib|png|turbojpeg)\.h$' || true)
    printf '%-28s %-40s best %6.1f s  (all: %s)  codec headers parsed: %s\n' "$hh" "$tree" "$best" "${times[*]}" "$codecs"
  done
done
