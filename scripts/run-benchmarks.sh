#!/usr/bin/env bash
# Builds and runs ddpkit's benchmark suite, then writes bench-results/:
# Google Benchmark JSON per binary, PyTorch DDP JSON, summary.md/json and
# SVG charts (speedup, efficiency, bandwidth).
#
#   scripts/run-benchmarks.sh [--quick] [--rounds N] [--jobs J] [--no-build]
#
# --quick: fewer steps, sizes up to 64 MiB (about 5 minutes on 2 cores).
# The DDP-overhead ratio is measured in N rounds, each running
# ddpkit and PyTorch back to back, so both see the same machine state
# (default 3 rounds, 1 with --quick).
# On a CUDA machine the same command runs NCCL ranks, one per GPU (the
# PyTorch twin stays on the CPU/gloo; it is the CPU comparison).
set -euo pipefail
cd "$(dirname "$0")/.."

QUICK=""
ROUNDS=""
JOBS=2
BUILD=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK="--quick" ;;
    --rounds) ROUNDS="$2"; shift ;;
    --jobs) JOBS="$2"; shift ;;
    --no-build) BUILD=0 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done

if [[ -z "$ROUNDS" ]]; then ROUNDS=$([[ -n "$QUICK" ]] && echo 1 || echo 3); fi
BUILD_DIR=${DDPKIT_BENCH_BUILD_DIR:-build-bench}
OUT=${DDPKIT_BENCH_OUT:-bench-results}
# Debian's PyTorch lives in the system interpreter, not in a pyenv.
PY=${DDPKIT_BENCH_PYTHON:-/usr/bin/python3}
"$PY" -c "import torch, torchvision" 2>/dev/null || PY=python3

if [[ $BUILD == 1 ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DDDPKIT_BUILD_TESTS=OFF -DDDPKIT_BUILD_EXAMPLES=OFF \
    -DDDPKIT_BUILD_BENCHMARKS=ON >/dev/null
  ninja -C "$BUILD_DIR" -j"$JOBS" ddpkit_ddp_bench ddpkit_comm_bench
  ninja -C "$BUILD_DIR" -j"$JOBS" ddpkit_data_bench || echo "(data bench did not build; skipped)"
fi
BIN="$BUILD_DIR/benchmarks"
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT"/*.svg "$OUT"/summary.md
{ lscpu | head -n 20; echo; nproc | sed 's/^/nproc: /'; free -g | head -n 2;
  echo; echo "uptime at start: $(uptime)"; git rev-parse --short HEAD | sed 's/^/commit: /'; } \
  > "$OUT/machine.txt"

gb() {  # binary, output json, extra args...
  local bin=$1 out=$2; shift 2
  "$BIN/$bin" "$@" --benchmark_out="$OUT/$out" --benchmark_out_format=json \
    --benchmark_counters_tabular=false
}

echo "== DDP overhead: ddpkit and PyTorch back to back, $ROUNDS round(s)"
for r in $(seq 1 "$ROUNDS"); do
  gb ddpkit_ddp_bench "overhead_ddpkit_r$r.json" $QUICK --sections=overhead \
    --rounds=1 --round-id="$r"
  # The same with gloo's loopback TCP instead of shared memory.
  export DDPKIT_SHM=0
  gb ddpkit_ddp_bench "overhead_ddpkittcp_r$r.json" $QUICK \
    --sections=overhead --rounds=1 --round-id="$r"
  unset DDPKIT_SHM
  if "$PY" -c "import torch, torchvision" 2>/dev/null; then
    "$PY" scripts/bench_pytorch_ddp.py $QUICK --round "$r" \
      --out "$OUT/overhead_pytorch_r$r.json"
  else
    echo "(no torch+torchvision for $PY: PyTorch comparison skipped)"
  fi
done

echo "== communication"
gb ddpkit_comm_bench comm.json $QUICK
echo "== DDP: decomposition, local hook cost, bucket caps, scaling, bucket order, communication hooks"
gb ddpkit_ddp_bench ddp.json $QUICK --sections=decompose,local,buckets,scaling,order,comm,syncbn
echo "== data pipeline"
if [[ ! -x "$BIN/ddpkit_data_bench" ]]; then
  echo "(no ddpkit_data_bench)"
elif [[ -n "$QUICK" ]]; then
  gb ddpkit_data_bench data.json --benchmark_min_time=0.2 || echo "(data bench failed)"
else
  gb ddpkit_data_bench data.json || echo "(data bench failed)"
fi
echo "uptime at end: $(uptime)" >> "$OUT/machine.txt"

python3 scripts/bench_report.py "$OUT" > /dev/null
echo "== wrote $OUT/summary.md, $OUT/*.svg"
cat "$OUT/summary.md"
