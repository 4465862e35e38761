#!/usr/bin/env bash
# compare_comm.sh PLAIN_OUT COMPRESSED_OUT MAX_ACC_DIFF MIN_BYTES_RATIO:
# two DDP runs of one example, the second with a compressing communication
# hook (e.g. --comm powersgd): its final val_acc is at most MAX_ACC_DIFF below
# the plain run's (compression may cost accuracy; a compressed run that ends
# higher, as seeds can make it, is no failure of the hook), and the plain run's gradient bytes per step are at least
# MIN_BYTES_RATIO times the compressed run's (both from summary.json), so a
# --comm that is ignored fails.
set -euo pipefail
get() { sed -n "s/.*\"$2\": \([0-9.e+-]*\).*/\1/p" "$1/summary.json"; }
comm() { sed -n 's/.*"comm": "\([a-z0-9_]*\)".*/\1/p' "$1/summary.json"; }
acc_a=$(get "$1" final_val_acc) acc_b=$(get "$2" final_val_acc)
bytes_a=$(get "$1" gradient_bytes_per_step) bytes_b=$(get "$2" gradient_bytes_per_step)
echo "$(comm "$1"): val_acc $acc_a, $bytes_a gradient bytes per step"
echo "$(comm "$2"): val_acc $acc_b, $bytes_b gradient bytes per step"
[[ -n $acc_a && -n $acc_b && -n $bytes_a && -n $bytes_b ]] ||
  { echo "summary.json lacks final_val_acc or gradient_bytes_per_step"; exit 1; }
awk -v a="$acc_a" -v b="$acc_b" -v m="$3" -v ba="$bytes_a" -v bb="$bytes_b" -v r="$4" 'BEGIN {
  d = a - b
  if (d > m) { printf "compressed val_acc is %.4f lower (limit %s)\n", d, m; exit 1 }
  if (bb <= 0 || ba < r * bb) { printf "bytes ratio %.2f (want >= %s)\n", (bb > 0 ? ba / bb : 0), r; exit 1 }
  printf "compressed val_acc %+.4f against plain, %.1fx fewer gradient bytes\n", -d, ba / bb
}'
