#!/usr/bin/env bash
# The GPU check, for a lent machine with one NVIDIA GPU whose python3 holds
# torch 2.11.0+cu130 and torchvision (the H200 of the device tool). Runs what
# scripts/gpu-prepare.sh built here and carried in .gpu/:
#
#   1. the "cuda" test suite: DDP at world 2 with CUDA tensors equals one
#      process; SyncBN on CUDA (ATen's kernels) equals BatchNorm on the
#      joined uneven batch; NCCL at world 1 (init, all-reduce, broadcast);
#      AMP training lowers the loss and never steps on inf gradients;
#   2. ResNet-34 training throughput at 224 px, batch 64, float32 and AMP,
#      ddpkit against PyTorch eager with torchvision's resnet34, side by
#      side on the same GPU: on synthetic tensors (ddpkit_gpu_throughput vs
#      scripts/gpu_pytorch_baseline.py), and on a generated JPEG folder
#      (flowers-resnet34-single vs torchvision's ImageFolder + DataLoader);
#      the flowers example also at --precision bf16-mixed (ddpkit only:
#      the PyTorch scripts have --amp, not bf16; added at stop 38, not yet
#      run on a GPU).
#
# Writes $OUT/gpu.json (one JSON object per run), $OUT/GPU.md (the table for
# docs/GPU.md) and $OUT/gpu-check.log. About 4 minutes on an H200 (before
# the bf16 run was added).
#
#   here:   scripts/gpu-prepare.sh
#   device: run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=540)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1
if [[ ! -x .gpu/bin/ddpkit_tests ]]; then
  echo "gpu-check: .gpu/bin/ddpkit_tests is missing: run scripts/gpu-prepare.sh and carry .gpu"
  exit 2
fi
PY=${DDPKIT_GPU_PYTHON:-python3}
torch_lib=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))') ||
  { echo "gpu-check: $PY cannot import torch"; exit 2; }
site=$(dirname "$(dirname "$torch_lib")")
nvlibs=$(ls -d "$site"/nvidia/*/lib 2>/dev/null | tr '\n' ':')
export LD_LIBRARY_PATH="$torch_lib:$nvlibs$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
missing=$(ldd .gpu/bin/* 2>&1 | grep -E "not found|GLIBC" | sort -u)
if [[ -n $missing ]]; then
  echo "gpu-check: the binaries from .gpu/ cannot start on this machine:"
  echo "$missing"
  exit 2
fi
t0=$(date +%s)
stamp() { echo "== $* ($(($(date +%s) - t0)) s)"; }

stamp "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, torchvision; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0))"

stamp "1. the cuda test suite"
timeout 300 .gpu/bin/ddpkit_tests --test-suite=cuda --force-colors=0 --no-skip
tests_rc=$?
echo "cuda suite exit code: $tests_rc"

results=$OUT/gpu.json
: > "$results"
record() {  # a command printing one JSON object; failures are recorded too
  local line
  line=$("$@" 2>"$OUT/last.err" | tail -n 1)
  if [[ $line == \{* ]]; then
    echo "$line" | tee -a "$results"
  else
    echo "{\"error\": \"$(echo "$* :: $(tail -n 3 "$OUT/last.err")" | tr '"\n' "' ")\"}" | tee -a "$results"
  fi
}

stamp "2a. throughput on synthetic tensors (224 px, batch 64)"
for amp in "" --amp; do
  record timeout 200 .gpu/bin/ddpkit_gpu_throughput --device cuda --image-size 224 --batch-size 64 --steps 40 --warmup 10 $amp
  record timeout 200 "$PY" scripts/gpu_pytorch_baseline.py --data tensors --image-size 224 --batch-size 64 --steps 40 --warmup 10 $amp
done

stamp "2b. throughput on a generated JPEG folder (224 px, batch 64, 20 steps + validation per epoch)"
work=$(mktemp -d)
# ddpkit at --precision 32 / 16-mixed / bf16-mixed (PyTorch's baseline at
# the first two: its script has --amp only).
for prec in 32 16-mixed bf16-mixed; do
  case $prec in 32) mode=fp32 amp="" ;; 16-mixed) mode=amp amp=--amp ;; *) mode=bf16 amp="" ;; esac
  run=$work/flowers-$mode
  timeout 300 .gpu/bin/flowers-resnet34-single --image-size 224 --batch-size 64 --epochs 2 \
    --max-steps 20 --synthetic-per-class 300 --workers 12 --threads 4 --out "$run" --quiet \
    --precision "$prec" > "$OUT/flowers-$mode.log" 2>&1
  # The second epoch (the first warms up cuDNN and the loader).
  "$PY" - "$run" "$mode" >> "$results" <<'PY'
import json, sys
run, mode = sys.argv[1:3]
try:
    rows = [json.loads(l) for l in open(run + "/metrics.jsonl")]
    m = rows[-1]
    print(json.dumps({"impl": "ddpkit", "data": "jpeg-folder", "mode": mode,
                      "device": "cuda", "image_size": 224, "batch_size": 64,
                      "steps": 20, "seconds": m["seconds"],
                      "img_per_s": m["epoch_images_per_second"]}))
except Exception as e:  # noqa: BLE001
    print(json.dumps({"error": f"flowers-resnet34-single {mode}: {e}"}))
PY
  tail -n 1 "$results"
  [[ $mode == bf16 ]] && continue
  nval=$(( 5 * 300 / 5 ))
  record timeout 300 "$PY" scripts/gpu_pytorch_baseline.py --data "folder=$work/flowers-fp32/synthetic_flower_photos" \
    --image-size 224 --batch-size 64 --steps 20 --val-images $nval --workers 12 $amp
done
rm -rf "$work"

stamp "3. report"
"$PY" - "$results" "$tests_rc" > "$OUT/GPU.md" <<'PY'
import json, subprocess, sys, datetime
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
tests_rc = int(sys.argv[2])
try:
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                          "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip()
except OSError:
    gpu = "unknown GPU"
import torch
out = ["# ddpkit on a GPU", "",
       f"Measured by `scripts/gpu-check.sh` on {datetime.date.today()}: {gpu}, "
       f"torch {torch.__version__}. Side by side in one run, same GPU and settings "
       "(ResNet-34, 5 classes, 224 px, batch 64, SGD momentum 0.9).", "",
       f"CUDA test suite (`ddpkit_tests --test-suite=cuda`): "
       f"{'passed' if tests_rc == 0 else f'FAILED (exit {tests_rc})'}.", "",
       "| data | precision | ddpkit img/s | PyTorch eager img/s | ddpkit / PyTorch |",
       "|---|---|---|---|---|"]
def find(impl, data, mode):
    for r in rows:
        if r.get("impl") == impl and r.get("data") == data and r.get("mode") == mode:
            return r.get("img_per_s")
    return None
for data in ("tensors", "jpeg-folder"):
    for mode in ("fp32", "amp", "bf16"):
        a, b = find("ddpkit", data, mode), find("pytorch", data, mode)
        if mode == "bf16" and data == "tensors":
            continue  # bf16-mixed: the flowers example only
        if mode == "bf16":
            out.append(f"| {data} | bf16 | {a or 'failed'} | not run | n/a |")
            continue
        ratio = f"{a / b:.2f}" if a and b else "n/a"
        out.append(f"| {data} | {mode} | {a or 'failed'} | {b or 'failed'} | {ratio} |")
errors = [r["error"] for r in rows if "error" in r]
if errors:
    out += ["", "Runs that failed:", ""] + [f"- {e}" for e in errors]
out += ["", "`tensors`: random batches already on the GPU (the training step alone). "
        "`jpeg-folder`: a generated flower_photos-like JPEG folder (1500 images), "
        "20 training steps plus the validation pass per epoch, second epoch timed, "
        "images/s = training images / epoch seconds (ddpkit's `epoch_images_per_second`)."]
print("\n".join(out))
PY
cat "$OUT/GPU.md"
stamp "done"
exit "$tests_rc"
