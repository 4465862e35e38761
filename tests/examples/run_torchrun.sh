#!/usr/bin/env bash
# run_torchrun.sh BINARY OUT_DIR [args...]: runs a -ddp example under
# PyTorch's own launcher (torchrun = python3 -m torch.distributed.run, from
# the project's environment) with 2 processes and checks it left one set of
# outputs, trained 1 epoch and printed each epoch line once. Exits 77 (skip)
# when no Python with torch is installed.
set -euo pipefail
bin=$1 out=$2
shift 2
source "$(dirname "$0")/torch_python.sh"
rm -rf "$out"
log=$(mktemp)
# --redirects 2 --tee 2: Debian's torchrun 1.13 on Python 3.11 cannot parse
# the default "0" (IntFlag no longer iterates Std.NONE) and crashes.
new_rdzv
"$py" -m torch.distributed.run "${standalone[@]}" --nproc_per_node=2 --redirects 2 --tee 2 --no_python \
  "$bin" --out "$out" --epochs 1 "$@" 2>&1 | tee "$log"
grep -q '"world_size": 2' "$out/summary.json" || { echo "summary does not say world_size 2"; exit 1; }
[[ $(grep -c '"epoch"' "$out/metrics.jsonl") == 1 ]] || { echo "expected 1 metrics row"; exit 1; }
[[ $(grep -c '^epoch 1/1 ' "$log") == 1 ]] || { echo "epoch line not printed exactly once"; exit 1; }
echo "torchrun launch: ok"

# Passed: the run folder goes (a flowers checkpoint is 170 MB; CI ran out of
# disk keeping them all). DDPKIT_KEEP_TEST_RUNS=1 keeps it; a failed check
# has exited before this line.
[[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out"
