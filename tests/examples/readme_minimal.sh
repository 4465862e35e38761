#!/usr/bin/env bash
# The README's minimal program is examples/minimal/minimal.cpp, byte for
# byte (the code block after the marker line), and it trains: run in its
# own folder, it exits 0 (best val_rmse under 0.1), twice in a row (the
# second run starts over), and rank 0 wrote its
# summary.
#   readme_minimal.sh README.md examples/minimal/minimal.cpp BINARY WORKDIR
set -euo pipefail
readme=$1 source=$2 binary=$3 work=$4
marker='<!-- examples/minimal/minimal.cpp -->'
block=$(awk -v m="$marker" '
  $0 == m { found = 1; next }
  found == 1 && /^```/ { if (inside) exit; inside = 1; next }
  inside { print }' "$readme")
if [[ -z $block ]]; then
  echo "readme_minimal: no code block after '$marker' in $readme" >&2
  exit 1
fi
if ! diff -u <(printf '%s\n' "$block") "$source"; then
  echo "readme_minimal: $readme's minimal program differs from $source (above)" >&2
  exit 1
fi
rm -rf "$work" && mkdir -p "$work" && cd "$work"
rc=0
# Twice: the second run starts over in the same folder (overwrite(true)),
# as a newcomer running it again expects.
for run in first second; do
  "$binary" || rc=$?
  if ((rc != 0)); then
    echo "readme_minimal: $binary exited $rc in its $run run (1: it did not reach val_rmse 0.1)" >&2
    exit 1
  fi
done
summary=runs/minimal/summary.json
grep -q '"monitor": "val_rmse"' "$summary" || { echo "readme_minimal: $summary lacks the monitor val_rmse" >&2; exit 1; }
grep -o '"best_val_rmse": [0-9.e-]*' "$summary"
echo "readme_minimal: README block equals $source; it trained"
