#!/usr/bin/env bash
# Seconds to compile a user's file that includes one ddpkit header, for each
# header named, alternating round by round between this tree and another (e.g. an older
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
flags_for() {  # tree -> the build's flags with tree's include/ instead
  echo "${flags//-I$here\/include/-I$1\/include}"
}
header_in() {  # tree header -> the header's name in that tree
  # The distributed runtime was ddpkit/dist.hpp before 0.3.
  if [ "$2" = ddpkit/distributed.hpp ] && [ ! -e "$1/include/$2" ]; then
    echo ddpkit/dist.hpp
  else
    echo "$2"
  fi
}
measure() {  # tree header -> seconds
  printf '#include <%s>\nint main() { return 0; }\n' "$2" > "$tmp/u.cpp"
  local t0
  t0=$(date +%s.%N)
  # shellcheck disable=SC2046
  /usr/bin/c++ $(flags_for "$1") -O1 -c "$tmp/u.cpp" -o "$tmp/u.o"
  awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'
}
headers=(ddpkit/ddpkit.hpp ddpkit/train.hpp ddpkit/distributed.hpp)
[ -n "${HEADERS:-}" ] && read -r -a headers <<< "$HEADERS"
trees=("$here")
[ -n "$other" ] && trees+=("$other")
for h in "${headers[@]}"; do
  declare -A times=()
  # Round by round, one compile per tree, so both see the same load.
  for ((r = 0; r < rounds; r++)); do
    for tree in "${trees[@]}"; do
      times[$tree]+="$(measure "$tree" "$(header_in "$tree" "$h")") "
    done
  done
  for tree in "${trees[@]}"; do
    hh=$(header_in "$tree" "$h")
    best=$(printf '%s\n' ${times[$tree]} | sort -g | head -1)
    # shellcheck disable=SC2046
    codecs=$(printf '#include <%s>\n' "$hh" | /usr/bin/c++ $(flags_for "$tree") -x c++ -E -H - -o /dev/null 2>&1 | grep -cE '(jpeglib|png|turbojpeg)\.h$' || true)
    printf '%-28s %-40s best %6.1f s  (all: %s)  codec headers parsed: %s\n' "$hh" "$tree" "$best" "${times[$tree]% }" "$codecs"
  done
  unset times
done
