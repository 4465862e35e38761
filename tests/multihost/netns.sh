# Test hosts on one machine, for multi-host tests. Source this file (bash),
# then:
#   multihost_begin OUT N   root check (SKIPPED without root unless
#                     CI=true), a fresh OUT, then hosts_up N.
#   hosts_up N        N hosts: network namespaces joined by a bridge in a
#                     namespace of their own (the "switch"), each with its
#                     own address 10.213.0.(i+1)/24 on eth0, its own host
#                     name (ddpkit-host<i>, UTS namespace, resolvable on
#                     every host through its own /etc/hosts) and its own
#                     /dev/shm (mount namespace), as separate machines have.
#                     With NETNS_SAME_NAME=1 every host is named
#                     "ddpkit-node" (as containers often are), a name no
#                     /etc/hosts lists: gloo then needs GLOO_SOCKET_IFNAME.
#   on_host I CMD...  runs CMD on host I (its network, name and /dev/shm).
#   rank_on_hosts R PER_HOST WORLD PORT CMD...   CMD as rank R, launched
#                     as a multi-node launcher would (below).
#   host_addr I       prints host I's address.
#   train_until_epoch_one OUT DDP PORT [VAR=value...]   2 x 2 ranks of a
#                     long cifar10-ddp run (below); returns after epoch 1.
#   expect_failed_exit R PID T0 LIMIT_S EVENT   rank R must stop with an
#                     error naming a failed operation (below).
#   host_pids I       prints the pids of the processes started by on_host I
#                     in the background (tracked by the caller).
# Everything is removed at exit (trap), even when the test fails: the
# processes still inside the hosts are killed, the namespaces deleted.
# Traffic stays inside these namespaces: the root namespace gets no
# interface or route. Needs root and iproute2 (`ip netns`); where the
# sandbox forbids namespaces, hosts_up fails saying so (the test must fail,
# not skip, in CI).
#
# Note [Test hosts on one machine]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Test hosts on one machine. `tests/multihost/netns.sh` makes N "hosts" as
# network namespaces joined by a bridge in a namespace of its own (so the root
# namespace gets no interface or route), each with its own address (10.213.0.x
# on `eth0`), host name (UTS namespace) and `/dev/shm` (a tmpfs in a mount
# namespace) and an `/etc/hosts` naming every host (bind-mounted, as a
# cluster's DNS would resolve them), held by one process per host that
# `on_host` joins with `nsenter`; a trap removes everything (processes
# included) on exit, also on SIGTERM from CTest's timeout. Ranks started there
# see other hosts exactly as separate machines would: each host's /dev/shm is
# its own, so shared memory joins only the ranks of one host and sums go
# hierarchically (transport "hierarchical shm+gloo", printed in the examples'
# first line and in summary.json). `NETNS_SAME_NAME=1` gives every host the
# same name. Without the hosts file, torchrun's rendezvous fails resolving the
# host name and gloo's default device falls back to loopback
# (`GLOO_SOCKET_IFNAME=eth0` pins it). Tests: DDP on 2 hosts × 2 ranks
# (environment launch, gloo's default device) equals one process on the joined
# batch (flowers ResNet-34, one step) with the hierarchical all-reduce, with
# the flat one, and with hosts of one name: relative difference 5.8e-6 with
# torch 2.11 in all three, 1.7e-3 with 1.13's CPU kernels (flat, measured
# before the hierarchical path), bound 1e-2; red with the lr not scaled (1.0)
# and with the leader's 1/world scaling left out (3.0); torchrun's multi-node
# form (`--nnodes 2 --rdzv_backend c10d`, one torchrun per host,
# `GLOO_SOCKET_IFNAME=eth0`) trains the flowers example on 2 × 2 ranks,
# summary.json saying transport "hierarchical shm+gloo"; a lost host (every
# process on it SIGKILLed) stops the others within 3.3 s, naming it (below). A
# partition (host 1's link down mid-epoch) fails every rank on both sides once
# the collective timeout passes (10 s in the test; no heartbeat finds it
# sooner). `multihost.collectives-across-hosts` runs the test suite's
# `collectives_across_hosts` worker on 2 × 2 ranks (hierarchical and flat) and
# on hosts of 2 and 1 ranks: sums of float, double, int, long and half tensors
# (empty, 5 elements, and 5 MiB: more than two slots), a float mean, a mean in
# a shared buffer, bf16 (summed, or failing on every rank with the channel
# usable afterwards), each checked against the exact value and compared bit
# for bit across ranks. torchrun's multi-node form with `--max_restarts 1`
# survives the loss of host 1's ranks (SIGKILLed after epoch 2): both agents
# restart the group, the ranks resume from rank 0's last.pt and end
# bit-identical to an uninterrupted two-host run
# (`multihost.torchrun-restart-two-hosts`). It hung before: ddpkit keyed each
# restart's rendezvous by `TORCHELASTIC_RESTART_COUNT`, which was 1 on the
# host whose workers failed and 0 on the other (torchrun counts only failures,
# not membership changes), so the two hosts' ranks met in different key
# spaces. The key space is now `/ddpkit/round_<n>`, n = how often this rank
# has started (a counter per rank in the agents' store): every round starts
# every rank once, so n agrees. Untested: elastic jobs whose membership
# changes (min < max nodes), where rank numbers move between nodes. Needs root
# (CI runs as root; elsewhere the tests say SKIPPED). Not done yet: link
# shaping with `tc` and the shaped-network benchmarks (this kernel has `tbf`
# but no `sch_netem`, so no added delay).

NETNS_PREFIX="ddpk$$"
NETNS_HOSTS=()   # namespace names
NETNS_HOLDERS=() # pid of a process holding each host's UTS/mount namespaces

hosts_down() {
  local ns pid
  for pid in "${NETNS_HOLDERS[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  for ns in "${NETNS_HOSTS[@]}" "$NETNS_PREFIX-sw"; do
    # Whatever still runs in the namespace (ranks left behind) goes too.
    for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
    ip netns del "$ns" 2>/dev/null || true
  done
  NETNS_HOSTS=()
  NETNS_HOLDERS=()
  [[ -z ${NETNS_HOSTS_FILE:-} ]] || rm -f "$NETNS_HOSTS_FILE"
}

hosts_up() {
  local n=$1 i ns
  if [[ $(id -u) != 0 ]]; then
    echo "netns.sh: multi-host tests need root (ip netns); running as $(id -un)" >&2
    return 1
  fi
  if ! command -v ip >/dev/null; then
    echo "netns.sh: 'ip' (iproute2) not found; scripts/install.sh installs it" >&2
    return 1
  fi
  trap hosts_down EXIT
  trap "exit 143" TERM
  trap "exit 130" INT
  if ! ip netns add "$NETNS_PREFIX-sw" 2>/tmp/netns.$$.err; then
    echo "netns.sh: cannot create a network namespace: $(cat /tmp/netns.$$.err)" >&2
    rm -f /tmp/netns.$$.err
    return 1
  fi
  rm -f /tmp/netns.$$.err
  # Every host resolves every host's name, as a cluster's DNS would
  # (torchrun's rendezvous and gloo's default device look names up).
  NETNS_HOSTS_FILE=$(mktemp /tmp/ddpkit-netns-hosts.XXXXXX)
  {
    echo "127.0.0.1 localhost"
    [[ ${NETNS_SAME_NAME:-} == 1 ]] ||
      for ((i = 0; i < n; i++)); do echo "$(host_addr "$i") ddpkit-host$i"; done
  } >"$NETNS_HOSTS_FILE"
  chmod 644 "$NETNS_HOSTS_FILE"
  local sw="ip -n $NETNS_PREFIX-sw"
  $sw link add br0 type bridge
  $sw link set br0 up
  $sw link set lo up
  for ((i = 0; i < n; i++)); do
    ns="$NETNS_PREFIX-h$i"
    ip netns add "$ns"
    NETNS_HOSTS+=("$ns")
    # A veth pair made in the host, its far end moved to the switch.
    ip -n "$ns" link add eth0 type veth peer name "port$i"
    ip -n "$ns" link set "port$i" netns "$NETNS_PREFIX-sw"
    $sw link set "port$i" master br0
    $sw link set "port$i" up
    ip -n "$ns" addr add "10.213.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # The host's own name and /dev/shm, held by a process that on_host
    # joins.
    local ready name=ddpkit-host$i
    [[ ${NETNS_SAME_NAME:-} != 1 ]] || name=ddpkit-node
    ready=$(mktemp -u /tmp/ddpkit-netns-ready.XXXXXX)
    ip netns exec "$ns" unshare --uts --mount --propagation private \
      bash -c "hostname $name && mount -t tmpfs -o size=2g tmpfs /dev/shm && mount --bind $NETNS_HOSTS_FILE /etc/hosts && touch $ready && exec sleep infinity" &
    NETNS_HOLDERS+=($!)
    disown
    local t=0
    until [[ -e $ready ]]; do
      sleep 0.05
      if ((++t > 200)) || ! kill -0 "${NETNS_HOLDERS[$i]}" 2>/dev/null; then
        echo "netns.sh: host $i did not come up (unshare --uts --mount, tmpfs on /dev/shm)" >&2
        return 1
      fi
    done
    rm -f "$ready"
  done
}

# The common start of a multi-host test: without root it skips
# (tests/examples/skip.sh: exit 77, or a failure under CI=true); then a fresh
# OUT folder and N hosts.
multihost_begin() {
  local out=$1 n=$2
  source "$(dirname "${BASH_SOURCE[0]}")/../examples/skip.sh"
  [[ $(id -u) == 0 ]] || ddpkit_skip "multi-host tests make network namespaces, which needs root"
  rm -rf "$out"
  mkdir -p "$out"
  hosts_up "$n"
}

# rank_on_hosts R PER_HOST WORLD PORT CMD...: runs CMD as rank R of WORLD
# on host R / PER_HOST, with the environment a multi-node launcher gives
# (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR =
# host 0, MASTER_PORT = PORT).
rank_on_hosts() {
  local r=$1 per_host=$2 world=$3 port=$4
  shift 4
  on_host $((r / per_host)) env RANK="$r" LOCAL_RANK=$((r % per_host)) \
    WORLD_SIZE="$world" LOCAL_WORLD_SIZE="$per_host" GROUP_RANK=$((r / per_host)) \
    MASTER_ADDR="$(host_addr 0)" MASTER_PORT="$port" "$@"
}

host_addr() { echo "10.213.0.$(($1 + 1))"; }

on_host() {
  local i=$1
  shift
  nsenter -t "${NETNS_HOLDERS[$i]}" --net --uts --mount --wd="$PWD" -- "$@"
}

# train_until_epoch_one OUT DDP PORT [VAR=value...]: starts 2 hosts x 2
# ranks of DDP (the cifar10 example: 500 epochs, batch 16, 2400 synthetic
# images, gloo pinned to eth0, the extra environment given) in the
# background, logs in OUT/rank<r>.log and pids in train_pids; returns once
# rank 0 has finished epoch 1, or fails saying why.
train_until_epoch_one() {
  local out=$1 ddp=$2 port=$3 r t
  shift 3
  train_pids=()
  for r in 0 1 2 3; do
    rank_on_hosts "$r" 2 4 "$port" env GLOO_SOCKET_IFNAME=eth0 "$@" \
      "$ddp" --out "$out/run" --epochs 500 --batch-size 16 --synthetic-size 2400 \
      --workers 0 >"$out/rank$r.log" 2>&1 &
    train_pids+=($!)
  done
  for ((t = 0; t < 600; t++)); do
    grep -q "^epoch 1/" "$out/rank0.log" 2>/dev/null && break
    kill -0 "${train_pids[0]}" 2>/dev/null || break  # rank 0 ended early
    sleep 0.2
  done
  grep -q "^epoch 1/" "$out/rank0.log" ||
    { echo "FAILED: rank 0 finished no epoch:"; cat "$out/rank0.log"; return 1; }
}

# expect_failed_exit R PID T0 LIMIT_S EVENT [WORD]: waits up to LIMIT_S
# seconds from T0 (date +%s%N) for rank R's process PID to end; it must
# exit non-zero with an "error" line in $out/rank<R>.log holding WORD
# (default "failed": naming a failed operation). Prints what it saw and
# leaves the error line in rank_msg; returns 1 when the rank did not stop
# in time, exited 0 or said nothing of the kind.
expect_failed_exit() {
  local r=$1 pid=$2 t0=$3 limit_s=$4 event=$5 word=${6:-failed} rc=0 ms status=0
  rank_msg=""
  while kill -0 "$pid" 2>/dev/null && (($(date +%s%N) - t0 < limit_s * 1000000000)); do
    sleep 0.05
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "FAILED: rank $r still running $limit_s s after $event"
    return 1
  fi
  wait "$pid" || rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  rank_msg=$(grep -m1 "^error" "$out/rank$r.log" || true)
  echo "rank $r: exit $rc after ${ms} ms: ${rank_msg:0:400}"
  if ((rc == 0)); then echo "FAILED: rank $r exited 0"; status=1; fi
  if [[ $rank_msg != *"$word"* ]]; then
    echo "FAILED: rank $r's message does not say '$word'"
    status=1
  fi
  return $status
}
