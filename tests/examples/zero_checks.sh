#!/usr/bin/env bash
# ZeRO-2 example checks against the DDP example's run.
#   zero_checks.sh memory DDP_OUT ZERO_OUT
#     summary.json's measured memory per rank: ZeRO's optimizer state is
#     split (each rank below DDP's, the ranks' sum equal to it) and every
#     rank's gradient peak is below DDP's.
#   zero_checks.sh resume OUT ZERO_BIN DDP_BIN ARGS...
#     a ZeRO run's checkpoint (1 epoch, world 2) resumes in the DDP build
#     (world 2, to epoch 2), and a DDP checkpoint in the ZeRO build (to
#     epoch 3): one format for both.
set -euo pipefail
source "$(dirname "$0")/torch_python.sh"
mode=$1
shift
case $mode in
  memory)
    "$py" - "$1" "$2" <<'PY'
import json, sys
ddp = json.load(open(f"{sys.argv[1]}/summary.json"))["memory_bytes_per_rank"]
zero = json.load(open(f"{sys.argv[2]}/summary.json"))["memory_bytes_per_rank"]
mb = lambda xs: " / ".join(f"{x / 2**20:.1f}" for x in xs)
for key in ("optimizer_state", "gradients_peak", "parameter_gather"):
    print(f"{key:16s} MiB per rank: DDP {mb(ddp[key])}   ZeRO-2 {mb(zero[key])}")
bad = []
if not all(z < ddp["optimizer_state"][0] for z in zero["optimizer_state"]):
    bad.append("a ZeRO rank keeps as much optimizer state as DDP")
if sum(zero["optimizer_state"]) != ddp["optimizer_state"][0]:
    bad.append("the ZeRO ranks' optimizer states do not add up to DDP's")
if not all(z < min(ddp["gradients_peak"]) for z in zero["gradients_peak"]):
    bad.append("a ZeRO rank's gradient peak is not below DDP's")
if bad:
    sys.exit("FAILED: " + "; ".join(bad))
print("ok")
PY
    ;;
  resume)
    out=$1 zero=$2 ddp=$3
    shift 3
    rm -rf "$out"
    "$zero" --world-size 2 --epochs 1 --out "$out" "$@"
    "$ddp" --world-size 2 --epochs 2 --resume auto --out "$out" "$@"
    "$zero" --world-size 2 --epochs 3 --resume auto --out "$out" "$@"
    "$py" - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
epochs = [r["epoch"] for r in rows]
if epochs != [1, 2, 3]:
    sys.exit(f"FAILED: metrics.jsonl epochs {epochs}, expected [1, 2, 3]")
print("ok: ZeRO -> DDP -> ZeRO resumed through epochs", epochs)
PY
    ;;
  *) echo "usage: zero_checks.sh memory|resume ..." >&2; exit 2 ;;
esac
