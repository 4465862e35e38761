#!/usr/bin/env bash
# partition.sh OUT DDP [default]
# Two hosts (tests/multihost/netns.sh), two ranks on each, training DDP
# with a 10 s collective timeout (DDPKIT_COLLECTIVE_TIMEOUT); once an epoch
# is done, host 1's link goes down (its veth end, as a pulled cable or a
# dead switch port: no socket is closed, nothing tells the peers). Every
# rank, on both sides, must exit non-zero within the collective timeout
# plus 15 s, with a message naming the failed operation, and rank 0's
# checkpoint (checkpoints/last.pt) must still load (torch.load,
# weights_only).
# With "default": the default settings (collective timeout 300 s); the
# liveness watch must end every rank within 30 s, host 0's ranks naming
# host 1's as silent, host 1's saying the store (on host 0) does not
# answer.
set -euo pipefail
out=$1 ddp=$2 mode=${3:-}
here=$(dirname "$0")
source "$here/../examples/torch_python.sh"
source "$here/netns.sh"
multihost_begin "$out" 2
if [[ $mode == default ]]; then
  limit_s=30
  train_until_epoch_one "$out" "$ddp" 29529
else
  timeout_s=10 limit_s=25
  train_until_epoch_one "$out" "$ddp" 29525 DDPKIT_COLLECTIVE_TIMEOUT=$timeout_s
fi
pids=("${train_pids[@]}")
t0=$(date +%s%N)
on_host 1 ip link set eth0 down
echo "host 1's link is down (ranks 2 and 3 cut off)"
status=0
said_host0="" said_host1=""
for r in 0 1 2 3; do
  if [[ $mode == default ]]; then
    # The first rank of a host to judge ends; its host's other rank may
    # then fail its shared-memory all-reduce instead (a casualty's error).
    expect_failed_exit "$r" "${pids[$r]}" "$t0" $limit_s "the partition" "error" || status=1
    if ((r < 2)); then said_host0+=$rank_msg; else said_host1+=$rank_msg; fi
  else
    expect_failed_exit "$r" "${pids[$r]}" "$t0" $limit_s "the partition" || status=1
  fi
done
if [[ $mode == default ]]; then
  [[ $said_host0 == *"on host 'ddpkit-host1') sent no heartbeat"* ]] ||
    { echo "FAILED: no rank on host 0 named host 1's ranks as silent"; status=1; }
  [[ $said_host1 == *"the rendezvous store has not answered"* ]] ||
    { echo "FAILED: no rank on host 1 said the store does not answer"; status=1; }
fi
"$py" -c "
import sys, torch
ck = torch.load(sys.argv[1], weights_only=True)
print('checkpoints/last.pt loads (weights_only): keys', sorted(ck)[:8])
" "$out/run/checkpoints/last.pt" || { echo "FAILED: last.pt does not load"; status=1; }
exit $status
