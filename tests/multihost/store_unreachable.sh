#!/usr/bin/env bash
# store_unreachable.sh OUT DDP
# A MASTER_ADDR that resolves but drops every packet: two test hosts
# (tests/multihost/netns.sh); host 0 has the address MASTER_ADDR names, but
# its replies to host 1 vanish (a blackhole route back to host 1, so SYNs
# arrive and nothing answers: no RST, no ICMP, as behind a firewall that
# drops). Rank 1 of 2 on host 1, with an 8 s rendezvous timeout
# (DDPKIT_RENDEZVOUS_TIMEOUT), must exit non-zero within the timeout plus
# 10 s, with a message naming the address, the port and what to check.
# (Rank 0 never starting, with nothing on the port, is the dist test
# "rendezvous without rank 0 ...".)
set -euo pipefail
out=$1 ddp=$2
here=$(dirname "$0")
source "$here/netns.sh"
multihost_begin "$out" 2
timeout_s=8 port=29527
on_host 0 ip route add blackhole "$(host_addr 1)/32"
# The drop is real: a connection from host 1 to a closed port of host 0
# gets no answer at all (no refusal), so it runs into `timeout` (124).
probe=0
on_host 1 timeout 2 bash -c "exec 3<>/dev/tcp/$(host_addr 0)/$port" 2>/dev/null || probe=$?
if ((probe != 124)); then
  echo "FAILED: host 0 answered host 1 despite the blackhole route (probe exit $probe)"
  exit 1
fi
t0=$(date +%s%N)
rc=0
on_host 1 env RANK=1 LOCAL_RANK=0 WORLD_SIZE=2 LOCAL_WORLD_SIZE=1 \
  MASTER_ADDR="$(host_addr 0)" MASTER_PORT=$port GLOO_SOCKET_IFNAME=eth0 \
  DDPKIT_RENDEZVOUS_TIMEOUT=$timeout_s \
  timeout $((timeout_s + 60)) "$ddp" --out "$out/run" --epochs 1 --synthetic-size 64 \
  --workers 0 --quiet >"$out/rank1.log" 2>&1 || rc=$?
ms=$((($(date +%s%N) - t0) / 1000000))
msg=$(grep -m1 "^error" "$out/rank1.log" || true)
echo "rank 1: exit $rc after $ms ms: $msg"
status=0
if ((rc == 0 || rc == 124)); then
  echo "FAILED: rank 1 did not fail on its own (exit $rc)"
  cat "$out/rank1.log"
  status=1
fi
if ((ms > (timeout_s + 10) * 1000)); then
  echo "FAILED: rank 1 took $ms ms, more than the $timeout_s s timeout plus 10 s"
  status=1
fi
for want in "cannot reach the rendezvous store at $(host_addr 0):$port" "within $timeout_s s" \
  "rank 0"; do
  [[ $msg == *"$want"* ]] || { echo "FAILED: the message does not say '$want'"; status=1; }
done
exit $status
