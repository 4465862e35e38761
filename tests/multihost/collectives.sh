#!/usr/bin/env bash
# collectives.sh OUT TESTS_BINARY
# The test suite's `collectives_across_hosts` worker (tests/distributed/dist_test.cpp:
# sums and means of every channel type, small and larger than a slot, in a
# shared buffer, empty, bf16; results checked and bit-identical on every
# rank) on test hosts (tests/multihost/netns.sh), in three layouts:
#   2 hosts x 2 ranks, hierarchical (the default)   transport "hierarchical shm+gloo"
#   2 hosts x 2 ranks, DDPKIT_ALLREDUCE=flat        transport "gloo"
#   hosts of 2 ranks and 1 rank, hierarchical       (a host whose leader is alone)
set -euo pipefail
out=$1 bin=$2
here=$(dirname "$0")
source "$here/netns.sh"
multihost_begin "$out" 2
layout() {  # layout NAME EXPECT_TRANSPORT PORT HOST_OF_RANK... (env passed through)
  local name=$1 transport=$2 port=$3
  shift 3
  local hosts=("$@") world=$# pids=() r failed=0
  for ((r = 0; r < world; r++)); do
    on_host "${hosts[$r]}" env RANK="$r" LOCAL_RANK="$r" WORLD_SIZE="$world" \
      MASTER_ADDR="$(host_addr 0)" MASTER_PORT="$port" GLOO_SOCKET_IFNAME=eth0 \
      DDPKIT_TEST_WORKER=collectives_across_hosts OMP_NUM_THREADS=1 \
      EXPECT_TRANSPORT="$transport" EXPECT_HOSTS=2 "$bin" >"$out/$name.rank$r.log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < world; r++)); do
    if ! wait "${pids[$r]}"; then
      echo "FAILED: $name: rank $r (host ${hosts[$r]}):"
      cat "$out/$name.rank$r.log"
      failed=1
    fi
  done
  ((failed == 0)) || exit 1
  echo "$name: $(head -1 "$out/$name.rank0.log")"
}
layout hierarchical-2x2 "hierarchical shm+gloo" 29521 0 0 1 1
DDPKIT_ALLREDUCE=flat layout flat-2x2 gloo 29522 0 0 1 1
layout hierarchical-2+1 "hierarchical shm+gloo" 29523 0 0 1
