#!/usr/bin/env bash
# Runs one example binary small and checks what it left behind:
#   run_example.sh BINARY OUT_DIR MIN_VAL_ACC [example args...]
# Fails unless it exits 0, leaves exactly one summary/metrics set in OUT_DIR,
# one metrics row per epoch, and ends with val_acc >= MIN_VAL_ACC.
set -euo pipefail
bin=$1 out=$2 min_acc=$3
shift 3
rm -rf "$out"
start=$(date +%s)
"$bin" --out "$out" "$@"
echo "$(basename "$bin"): $(( $(date +%s) - start )) s"
for f in summary.json metrics.jsonl metrics.csv; do
  [[ -f $out/$f ]] || { echo "missing $out/$f"; exit 1; }
done
# Exactly one set of outputs: no per-rank copies anywhere below OUT.
n=$(find "$out" -name 'summary*.json' | wc -l)
[[ $n == 1 ]] || { echo "expected one summary.json, found $n"; exit 1; }
epochs=$(grep -c '"epoch"' "$out/metrics.jsonl")
run=$(sed -n 's/.*"epochs_run": \([0-9]*\).*/\1/p' "$out/summary.json")
[[ $epochs == "$run" ]] || { echo "metrics rows $epochs != epochs_run $run"; exit 1; }
acc=$(sed -n 's/.*"final_val_acc": \([0-9.e-]*\).*/\1/p' "$out/summary.json")
cat "$out/summary.json"
awk -v a="$acc" -v m="$min_acc" 'BEGIN { if (a + 0 < m + 0) { printf "final val_acc %s below %s\n", a, m; exit 1 } }'
echo "final val_acc $acc >= $min_acc"
# The precision and memory layout the run used, as the flags chose them.
want_precision=32 want_format=contiguous
for ((i = 1; i <= $#; i++)); do
  case ${!i} in
    --precision) j=$((i + 1)); want_precision=${!j} ;;
    --memory-format) j=$((i + 1)); want_format=${!j} ;;
  esac
done
grep -qF "\"precision\": \"$want_precision\"" "$out/summary.json" &&
  grep -qF "\"memory_format\": \"$want_format\"" "$out/summary.json" ||
  { echo "summary.json lacks precision $want_precision / memory_format $want_format"; exit 1; }
# The version, as include/ddpkit/version.hpp says it.
version=$(sed -n 's/^#define DDPKIT_VERSION_STRING "\(.*\)"/\1/p' "$(dirname "$0")/../../include/ddpkit/version.hpp")
grep -qF "\"ddpkit_version\": \"$version\"" "$out/summary.json" ||
  { echo "summary.json lacks \"ddpkit_version\": \"$version\""; exit 1; }

# Passed: the run folder goes (a flowers checkpoint is 170 MB; CI ran out of
# disk keeping them all). DDPKIT_KEEP_TEST_RUNS=1 keeps it; a failed check
# has exited before this line.
[[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out"
