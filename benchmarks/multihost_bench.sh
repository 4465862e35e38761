#!/usr/bin/env bash
# benchmarks/multihost_bench.sh DDP_BENCH OUT [ROUNDS, default 3]   (STEPS=20 timed steps per point)
# DDP across two test hosts (network namespaces: tests/multihost/netns.sh;
# needs root), side by side in one run: for ResNet-18 @64 (batch 8) and
# CifarNet @32 (batch 32) per rank, on 2 hosts x 1 rank and 2 hosts x 2
# ranks, flat (DDPKIT_ALLREDUCE=flat: every rank in one gloo ring) against
# hierarchical (shared memory inside a host, gloo between the leaders),
# over the unshaped link and links shaped with `tc ... tbf` to 10 Gbit/s and
# 1 Gbit/s (each host's egress). Each point is DDP_BENCH's rank task
# (benchmarks/ddp_bench.cpp, --mode=ddp) started on the hosts as an
# environment launch; `--mode=bare` (the same ranks, no communication) at
# each layout, and one rank alone, are the references. Writes OUT/points.tsv
# (one line per point and round) and prints a markdown table of medians
# over rounds:
#   step ms, exposed wait ms (the reducer's wait after backward), scaling
#   efficiency (images/s over N x one rank alone), communication
#   efficiency (bare step / DDP step at the same layout), and the
#   projection check: predicted = the unshaped step of the same layout and
#   algorithm + bytes crossing a host's link / rate, against measured.
# No delay is added: this kernel has no sch_netem ("qdisc kind is
# unknown"), so the links are shaped in rate only.
set -euo pipefail
if [[ $# -lt 2 || $# -gt 3 ]]; then
  echo "usage: $0 DDP_BENCH OUT [ROUNDS]   (DDP_BENCH: a built ddpkit_ddp_bench; OUT: a new directory)" >&2
  exit 2
fi
if [[ ! -x $1 ]]; then
  echo "$0: DDP_BENCH '$1' is not an executable file (build it first: ./scripts/run-benchmarks.sh --quick builds build-bench/benchmarks/ddpkit_ddp_bench)" >&2
  exit 2
fi
if [[ -e $2 && -n $(ls -A "$2" 2>/dev/null) ]]; then
  echo "$0: OUT '$2' exists and is not empty; the run would replace it. Give a new directory." >&2
  exit 2
fi
if [[ -n ${3:-} && ! $3 =~ ^[1-9][0-9]*$ ]]; then
  echo "$0: ROUNDS '$3' is not a positive whole number" >&2
  exit 2
fi
bench=$(realpath "$1")
out=$2
rounds=${3:-3}
steps=${STEPS:-20}
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../tests/multihost/netns.sh"
multihost_begin "$out" 2
port=29540
points=$out/points.tsv
echo -e "round\tmodel\tlayout\talgo\tlink\tmode\tstep_ms\twait_ms\timages_per_s\tbytes" >"$points"

shape() {  # shape unshaped|10gbit|1gbit
  local h
  for h in 0 1; do
    on_host "$h" tc qdisc del dev eth0 root 2>/dev/null || true
    case $1 in
      unshaped) ;;
      10gbit) on_host "$h" tc qdisc add dev eth0 root tbf rate 10gbit burst 4mb latency 20ms ;;
      1gbit) on_host "$h" tc qdisc add dev eth0 root tbf rate 1gbit burst 512kb latency 50ms ;;
    esac
  done
}

# run ROUND MODEL_ARGS LAYOUT ALGO LINK MODE: one world; rank 0's numbers
# into points.tsv.
run() {
  local round=$1 margs=$2 layout=$3 algo=$4 link=$5 mode=$6
  local per_host world hosts r pids=() log
  case $layout in
    1x1) per_host=1 world=1 ;;
    2x1) per_host=1 world=2 ;;
    2x2) per_host=2 world=4 ;;
  esac
  port=$((port + 1))
  read -r -a ma <<<"$margs"
  for ((r = 0; r < world; r++)); do
    log=$out/r$round.${ma[0]#--model=}.$layout.$algo.$link.$mode.rank$r.log
    rank_on_hosts "$r" "$per_host" "$world" "$port" env DDPKIT_SPAWNED=1 \
      DDPKIT_ALLREDUCE="$algo" GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 \
      "$bench" --rank-task "${ma[@]}" --mode="$mode" --steps="$steps" --warmup=3 >"$log" 2>&1 &
    pids+=($!)
  done
  for ((r = 0; r < world; r++)); do
    wait "${pids[$r]}" || { echo "FAILED: rank $r of $margs $layout $algo $link $mode"; cat "$out"/r$round.*rank$r.log | tail -5; exit 1; }
  done
  log=$out/r$round.${ma[0]#--model=}.$layout.$algo.$link.$mode.rank0.log
  val() { awk -v k="$1" '$1 == k { print $2 }' "$log"; }
  echo -e "$round\t${ma[0]#--model=}\t$layout\t$algo\t$link\t$mode\t$(val step_ms)\t$(val wait_ms)\t$(val images_per_s)\t$(val grad_bytes)" >>"$points"
}

for ((round = 1; round <= rounds; round++)); do
  for margs in "--model=resnet18 --image=64 --batch=8" "--model=cifarnet --image=32 --batch=32"; do
    shape unshaped
    run "$round" "$margs" 1x1 flat unshaped bare
    run "$round" "$margs" 2x1 flat unshaped bare
    run "$round" "$margs" 2x2 flat unshaped bare
    for link in unshaped 10gbit 1gbit; do
      shape "$link"
      run "$round" "$margs" 2x1 flat "$link" ddp
      run "$round" "$margs" 2x2 flat "$link" ddp
      run "$round" "$margs" 2x2 hierarchical "$link" ddp
    done
    shape unshaped
  done
  echo "round $round done"
done
python3 "$here/multihost_report.py" "$points"
