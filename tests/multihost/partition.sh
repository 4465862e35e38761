#!/usr/bin/env bash
# partition.sh OUT DDP
# Two hosts (tests/multihost/netns.sh), two ranks on each, training DDP
# with a 10 s collective timeout (DDPKIT_COLLECTIVE_TIMEOUT); once an epoch
# is done, host 1's link goes down (its veth end, as a pulled cable or a
# dead switch port: no socket is closed, nothing tells the peers). Every
# rank, on both sides, must exit non-zero within the collective timeout
# plus 15 s, with a message naming the failed operation, and rank 0's
# checkpoint (checkpoints/last.pt) must still load (torch.load,
# weights_only).
set -euo pipefail
out=$1 ddp=$2
here=$(dirname "$0")
source "$here/../examples/torch_python.sh"
source "$here/netns.sh"
multihost_begin "$out" 2
timeout_s=10
train_until_epoch_one "$out" "$ddp" 29525 DDPKIT_COLLECTIVE_TIMEOUT=$timeout_s
pids=("${train_pids[@]}")
t0=$(date +%s%N)
on_host 1 ip link set eth0 down
echo "host 1's link is down (ranks 2 and 3 cut off)"
status=0
for r in 0 1 2 3; do
  expect_failed_exit "$r" "${pids[$r]}" "$t0" $((timeout_s + 15)) "the partition" || status=1
done
"$py" -c "
import sys, torch
ck = torch.load(sys.argv[1], weights_only=True)
print('checkpoints/last.pt loads (weights_only): keys', sorted(ck)[:8])
" "$out/run/checkpoints/last.pt" || { echo "FAILED: last.pt does not load"; status=1; }
exit $status
