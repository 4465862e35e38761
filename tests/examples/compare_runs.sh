#!/usr/bin/env bash
# compare_runs.sh OUT_A OUT_B MAX_DIFF: the two runs' final val_acc differ by
# at most MAX_DIFF (e.g. single vs DDP on the same data).
set -euo pipefail
get() { sed -n 's/.*"final_val_acc": \([0-9.e-]*\).*/\1/p' "$1/summary.json"; }
a=$(get "$1") b=$(get "$2")
echo "final val_acc: $1 $a, $2 $b"
awk -v a="$a" -v b="$b" -v m="$3" 'BEGIN { d = a - b; if (d < 0) d = -d; if (d > m) { print "differ by", d; exit 1 } }'
