#!/usr/bin/env bash
# pid_namespace.sh OUT DDP [args...]
# Two ranks on one machine that share /dev/shm but not a PID namespace
# (rank 1 runs under `unshare --pid --fork`, as in a container that shares
# IPC but not PIDs). A rank there cannot watch the other's pid, so the
# shared-memory channel (which notices a dead peer by its pid) must not be
# used: the ranks count as two hosts and sum over gloo. The run must finish
# and summary.json say "hosts": 2 and transport "gloo".
set -euo pipefail
out=$1 ddp=$2
shift 2
source "$(dirname "$0")/../examples/skip.sh"
[[ $(id -u) == 0 ]] || ddpkit_skip "a PID namespace needs root (unshare --pid)"
rm -rf "$out"
mkdir -p "$out"
port=$((29600 + $$ % 300))
launch() {
  local r=$1
  shift
  env RANK="$r" LOCAL_RANK="$r" WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
    "$@" "$ddp" --out "$out/run" "${args[@]}" >"$out/rank$r.log" 2>&1
}
args=("$@")
launch 0 &
p0=$!
launch 1 unshare --pid --fork --kill-child &
p1=$!
failed=0
wait $p0 || { echo "rank 0 failed:"; cat "$out/rank0.log"; failed=1; }
wait $p1 || { echo "rank 1 failed:"; cat "$out/rank1.log"; failed=1; }
((failed == 0)) || exit 1
grep -o '"transport": "[a-z+ ]*"\|"hosts": [0-9]*' "$out/run/summary.json"
grep -q '"transport": "gloo"' "$out/run/summary.json" && grep -q '"hosts": 2' "$out/run/summary.json" ||
  { echo "FAILED: ranks in two PID namespaces must count as two hosts over gloo"; cat "$out/run/summary.json"; exit 1; }
