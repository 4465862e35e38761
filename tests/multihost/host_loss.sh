#!/usr/bin/env bash
# host_loss.sh OUT DDP
# Two hosts (tests/multihost/netns.sh), two ranks on each, training DDP;
# once an epoch is done every process on host 1 is killed (SIGKILL, as a
# machine that loses power). Host 0's ranks must stop on their own within
# 10 s with a non-zero exit and a message naming the failed collective and
# the lost host and its ranks.
set -euo pipefail
out=$1 ddp=$2
here=$(dirname "$0")
source "$here/netns.sh"
multihost_begin "$out" 2
train_until_epoch_one "$out" "$ddp" 29515
pids=("${train_pids[@]}")
t0=$(date +%s%N)
for p in $(ip netns pids "$NETNS_PREFIX-h1"); do
  [[ $p == "${NETNS_HOLDERS[1]}" ]] || kill -9 "$p" 2>/dev/null || true
done
echo "killed every process on host 1 (ranks 2 and 3)"
status=0
for r in 0 1; do
  # Each survivor gets up to 10 s from the kill.
  expect_failed_exit "$r" "${pids[$r]}" "$t0" 10 "host 1 was lost" || { status=1; continue; }
  if [[ $rank_msg != *"every rank of host 'ddpkit-host1' (ranks 2, 3) did not answer"* ]]; then
    echo "FAILED: rank $r's message does not name the lost host and ranks"
    status=1
  fi
done
exit $status
