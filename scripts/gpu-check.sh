#!/usr/bin/env bash
# The GPU check, for a lent machine with one NVIDIA GPU whose python3 holds
# torch 2.11.0+cu130 and torchvision (the H200 of the device tool). Runs what
# scripts/gpu-prepare.sh built here and carried in .gpu/:
#
#   1. the "cuda" test suite: DDP at world 2 with CUDA tensors equals one
#      process; SyncBN on CUDA (ATen's kernels) equals BatchNorm on the
#      joined uneven batch; NCCL at world 1 (init, all-reduce, broadcast);
#      AMP training lowers the loss and never steps on inf gradients;
#      ZeRO-1 and ZeRO-2 with CUDA tensors equal DDP;
#   2. the Trainer on the GPU through the flowers example (ResNet-34, a
#      generated JPEG folder, 224 px, batch 64): flowers-resnet34-single at
#      --precision 32, 16-mixed and auto (which must pick bf16-mixed on a
#      GPU with native bfloat16; its first lines are printed), each against
#      PyTorch eager with torchvision's resnet34, ImageFolder and
#      DataLoader at the same precision (scripts/gpu_pytorch_baseline.py);
#   3. flowers-resnet34-ddp at world 1 on the GPU, bf16-mixed with
#      --memory-format auto: it must train (a world of one makes no process
#      group, so this is the DDP build's Trainer path, not NCCL: one GPU
#      cannot hold two NCCL ranks);
#   4. the training step alone on synthetic tensors already on the GPU,
#      ddpkit (ddpkit_gpu_throughput) against PyTorch eager, at 32 /
#      16-mixed / bf16-mixed x NCHW / channels-last; then PyTorch with
#      SGD's loop and ddpkit with ForeachSGD;
#   5. CIFAR-10 and flowers at the examples' default epochs, --precision 32
#      against auto: accuracy and the precision auto chose;
#   6. ForeachSGD against libtorch's SGD loop, alternated over 4 rounds;
#   7. ForeachAdam/AdamW: their cuda test alone, then ForeachAdamW against
#      libtorch's AdamW loop, alternated over 2 rounds (part 1 runs the
#      test too; part 7 is the short run for them).
#
# Writes $OUT/gpu.json (one JSON object per run), $OUT/GPU.md (the table for
# docs/GPU.md) and $OUT/gpu-check.log, as it goes (a run cut short still
# returns what it measured). Each part has its own timeout. On an H200
# (2026-12-04): parts 1-4 took 3 minutes, 1+4+5 under 5, part 6 under 1.
#
#   here:   scripts/gpu-prepare.sh
#   device: run(command="bash scripts/gpu-check.sh", carry=[".gpu"], timeout_s=570)
#
# Note [GPU choices, compiled here, run only by scripts/gpu-check.sh]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# GPU choices, compiled here, run only by `scripts/gpu-check.sh` (on a lent
# H200, 2026-12-04: its "cuda" suite passes; docs/GPU.md). AMP's unscale and
# inf/NaN check is one fused ATen call over all gradients
# (`_amp_foreach_non_finite_check_and_unscale_`) and one host sync per step
# (`parallel/loss_scaler.hpp`, `LossScaler`; a max all-reduce of the flag
# under DDP so every rank skips the same steps). SyncBN on CUDA uses ATen's
# batch-norm statistics kernels (`batch_norm_stats`,
# `batch_norm_gather_stats_with_counts`, `batch_norm_backward_reduce`,
# `batch_norm_backward_elemt`); the float64 merge stays on the CPU path.
# DataParallel's replica threads copy the caller's autocast state. Every
# rank's CUDA work runs on its own device: an NCCL group makes LOCAL_RANK the
# rank's current device before its communicator exists (a LOCAL_RANK past the
# device count is refused before the rendezvous, so a rank too many fails at
# once instead of after the rendezvous timeout), and threads that launch CUDA
# work for it set their device first (`compat::CudaDeviceScope`:
# DataParallel's replica threads, loader workers pinning batches on the
# consumer's device), since a new thread starts on device 0 and would make a
# context there. Untested on several GPUs (the lent machine has one; its
# "cuda" suite checks the refusal and that the device is set). NCCL groups
# never set up the shared-memory channel. NCCL's error handling is chosen
# explicitly (`GroupOptions::nccl_error_handling`): blocking wait (default: a
# timed-out or failed collective throws on every rank, naming the operation)
# or PyTorch's asynchronous teardown by the watchdog.
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
# GPU_CHECK_PARTS="1 5": only those parts (a second, shorter run).
parts=" ${GPU_CHECK_PARTS:-1 2 3 4 5 6 7} "
part() { [[ $parts == *" $1 "* ]]; }

stamp "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch, torchvision; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'torchvision', torchvision.__version__, torch.cuda.get_device_name(0))"

tests_rc=-1
if part 1; then
stamp "1. the cuda test suite"
timeout 240 .gpu/bin/ddpkit_tests --test-suite=cuda --force-colors=0 --no-skip
tests_rc=$?
echo "cuda suite exit code: $tests_rc"
fi

results=$OUT/gpu.json
: > "$results"
# record CMD...: CMD prints one JSON object, appended to the results with
# the fields in RECORD_TAG (',"key":value,...') added; a failure is recorded
# as {"error": ...}.
record() {
  local line
  line=$("$@" 2>"$OUT/last.err" | tail -n 1)
  if [[ $line == \{* ]]; then
    echo "${line%\}}${RECORD_TAG:-}}" | tee -a "$results"
  else
    "$PY" -c 'import json, sys; print(json.dumps({"error": sys.argv[1]}))' \
      "$* :: $(tail -n 3 "$OUT/last.err")" | tee -a "$results"
  fi
}

work=$(mktemp -d)
if part 2; then
stamp "2. the Trainer on a generated JPEG folder (flowers-resnet34-single vs PyTorch eager; 224 px, batch 64, 20 steps + validation per epoch)"
# ddpkit at --precision 32 / 16-mixed / auto (bf16-mixed expected here),
# PyTorch at 32 / 16-mixed / bf16-mixed.
for prec in 32 16-mixed auto; do
  case $prec in 32) mode=fp32 ;; 16-mixed) mode=amp ;; *) mode=bf16 ;; esac
  run=$work/flowers-$mode
  timeout 240 .gpu/bin/flowers-resnet34-single --image-size 224 --batch-size 64 --epochs 2 \
    --max-steps 20 --synthetic-per-class 300 --workers 12 --threads 4 --out "$run" --quiet \
    --precision "$prec" > "$OUT/flowers-$mode.log" 2>&1
  echo "flowers-resnet34-single --precision $prec: exit $?"
  grep -m2 -E "^(flowers|precision)" "$OUT/flowers-$mode.log" || tail -n 5 "$OUT/flowers-$mode.log"
  # The second epoch (the first warms up cuDNN and the loader).
  "$PY" - "$run" "$mode" "$prec" >> "$results" <<'PY'
import json, sys
run, mode, prec = sys.argv[1:4]
try:
    rows = [json.loads(l) for l in open(run + "/metrics.jsonl")]
    m = rows[-1]
    chosen = json.load(open(run + "/summary.json")).get("precision")
    print(json.dumps({"impl": "ddpkit", "data": "jpeg-folder", "mode": mode,
                      "layout": "contiguous", "precision_flag": prec,
                      "sgd": "foreach",  # the flowers example's ForeachSGD
                      "precision_run": chosen,
                      "device": "cuda", "image_size": 224, "batch_size": 64,
                      "steps": 20, "seconds": m["seconds"],
                      "img_per_s": m["epoch_images_per_second"],
                      "train_loss": m.get("train_loss")}))
except Exception as e:  # noqa: BLE001
    print(json.dumps({"error": f"flowers-resnet34-single {prec}: {e}"}))
PY
  tail -n 1 "$results"
  folder=$work/flowers-fp32/synthetic_flower_photos
  case $mode in fp32) pprec=32 ;; amp) pprec=16-mixed ;; *) pprec=bf16-mixed ;; esac
  record timeout 240 "$PY" scripts/gpu_pytorch_baseline.py --data "folder=$folder" \
    --image-size 224 --batch-size 64 --steps 20 --val-images 300 --workers 12 --precision $pprec
done
fi

if part 3; then
stamp "3. flowers-resnet34-ddp at world 1 on the GPU, bf16-mixed, --memory-format auto (no process group at world 1: NCCL itself is the cuda suite's)"
timeout 180 .gpu/bin/flowers-resnet34-ddp --world-size 1 --image-size 224 --batch-size 64 --epochs 1 \
  --max-steps 10 --synthetic-per-class 100 --workers 12 --threads 4 --out "$work/ddp" \
  --precision bf16-mixed --memory-format auto > "$OUT/flowers-ddp.log" 2>&1
ddp_rc=$?
echo "flowers-resnet34-ddp exit code: $ddp_rc"
head -n 3 "$OUT/flowers-ddp.log"; tail -n 4 "$OUT/flowers-ddp.log"
echo "{\"impl\": \"ddpkit\", \"run\": \"flowers-ddp-world1\", \"exit\": $ddp_rc}" >> "$results"
fi

if part 4; then
stamp "4. the step alone on synthetic tensors (224 px, batch 64, 30 steps after 10)"
for prec in 32 16-mixed bf16-mixed; do
  for layout in "" --channels-last; do
    record timeout 120 .gpu/bin/ddpkit_gpu_throughput --device cuda --image-size 224 --batch-size 64 \
      --steps 30 --warmup 10 --precision $prec $layout
    record timeout 120 "$PY" scripts/gpu_pytorch_baseline.py --data tensors --image-size 224 \
      --batch-size 64 --steps 30 --warmup 10 --precision $prec $layout
  done
done
# The optimizer step: PyTorch with SGD's per-parameter loop (libtorch's C++
# SGD steps that way) and ddpkit with ForeachSGD (multi-tensor kernels, as
# PyTorch's default): what the multi-tensor step gives each (issue 32, 3).
for prec in 32 bf16-mixed; do
  record timeout 120 "$PY" scripts/gpu_pytorch_baseline.py --data tensors --image-size 224 \
    --batch-size 64 --steps 30 --warmup 10 --precision $prec --no-foreach
  for layout in "" --channels-last; do
    record timeout 120 .gpu/bin/ddpkit_gpu_throughput --device cuda --image-size 224 --batch-size 64 \
      --steps 30 --warmup 10 --precision $prec $layout --foreach-sgd
  done
done
fi

if part 5; then
stamp "5. accuracy at the examples' defaults (CIFAR-10 synthetic, flowers generated folder), 32 vs auto (bf16-mixed expected)"
for ex in cifar10-single flowers-resnet34-single; do
  for prec in 32 auto; do
    run=$work/acc-$ex-$prec
    timeout 240 .gpu/bin/$ex --out "$run" --quiet --precision $prec --workers 8 --threads 4 \
      > "$work/acc.log" 2>&1
    rc=$?
    [[ $rc == 0 ]] || { echo "$ex --precision $prec: exit $rc"; tail -n 5 "$work/acc.log"; }
    "$PY" - "$run" "$ex" "$rc" "$prec" >> "$results" <<'PY'
import json, sys
run, ex, rc = sys.argv[1:4]
try:
    s = json.load(open(run + "/summary.json"))
    keep = ("precision", "memory_format", "epochs_run", "best_epoch", "best_val_acc",
            "final_val_acc", "test_acc", "total_seconds")
    print(json.dumps({"run": "accuracy", "example": ex, "exit": int(rc), "flag": sys.argv[4],
                      **{k: s[k] for k in keep if k in s}}))
except Exception as e:  # noqa: BLE001
    print(json.dumps({"error": f"{ex} accuracy run (exit {rc}): {e}"}))
PY
    tail -n 1 "$results"
  done
done
fi
if part 6; then
stamp "6. ForeachSGD against libtorch's SGD loop, alternated: 4 rounds (even ones in reverse), 32 NCHW and bf16-mixed channels-last"
for round in 1 2 3 4; do
  order="loop foreach"; ((round % 2 == 0)) && order="foreach loop"
  for setting in "32" "bf16-mixed --channels-last"; do
    for sgd in $order; do
      flag=""; [[ $sgd == foreach ]] && flag=--foreach-sgd
      RECORD_TAG=",\"run\":\"sgd-ab\",\"round\":$round" \
        record timeout 120 .gpu/bin/ddpkit_gpu_throughput --device cuda --image-size 224 \
        --batch-size 64 --steps 30 --warmup 10 --precision $setting $flag
    done
  done
done
fi
if part 7; then
stamp "7. ForeachAdam/AdamW: the cuda test, then AdamW foreach against libtorch's loop, alternated: 2 rounds (the second in reverse), bf16-mixed channels-last"
timeout 120 .gpu/bin/ddpkit_tests --test-suite=cuda --force-colors=0 --no-skip \
  --test-case="cuda: ForeachAdam*" --success=0
echo "ForeachAdam cuda test exit code: $?"
for round in 1 2; do
  order="loop foreach"; ((round % 2 == 0)) && order="foreach loop"
  for opt in $order; do
    flag=""; [[ $opt == foreach ]] && flag=--foreach
    RECORD_TAG=",\"run\":\"adamw-ab\",\"round\":$round" \
      record timeout 120 .gpu/bin/ddpkit_gpu_throughput --device cuda --image-size 224 \
      --batch-size 64 --steps 30 --warmup 10 --precision bf16-mixed --channels-last \
      --optimizer adamw $flag
  done
done
fi
rm -rf "$work"

stamp "report"
"$PY" - "$results" "$tests_rc" > "$OUT/GPU.md" <<'PY'
import json, subprocess, sys, datetime
rows = []
for l in open(sys.argv[1]):
    try:
        rows.append(json.loads(l))
    except ValueError:
        if l.strip():
            rows.append({"error": "unreadable result line: " + l.strip()[:200]})
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
       f"{'passed' if tests_rc == 0 else 'not run' if tests_rc < 0 else f'FAILED (exit {tests_rc})'}.", "",
]
AB_RUNS = ("sgd-ab", "adamw-ab")  # alternated pairs: their own tables
header = ["| data | precision | layout | ddpkit img/s | PyTorch eager img/s | ddpkit / PyTorch |",
          "|---|---|---|---|---|---|"]
table_at = len(out)
def find(impl, data, mode, layout, sgd=None):
    for r in rows:
        if (r.get("impl") == impl and r.get("data") == data and r.get("mode") == mode
                and r.get("layout", "contiguous") == layout and r.get("foreach", True)
                and (sgd is None or r.get("sgd", "loop") == sgd) and r.get("run") not in AB_RUNS):
            return r.get("img_per_s")
    return None
names = {"fp32": "32", "amp": "16-mixed", "bf16": "bf16-mixed"}
for data, layouts, sgd in (("jpeg-folder", ("contiguous",), None),
                           ("tensors", ("contiguous", "channels-last"), "loop")):
    if not any(r.get("data") == data and r.get("run") not in AB_RUNS for r in rows):
        continue  # that part did not run
    for mode in ("fp32", "amp", "bf16"):
        for layout in layouts:
            a = find("ddpkit", data, mode, layout, sgd)
            b = find("pytorch", data, mode, layout)
            ratio = f"{a / b:.2f}" if a and b else "n/a"
            out.append(f"| {data} | {names[mode]} | {layout} | {a or 'failed'} | "
                       f"{b or 'failed'} | {ratio} |")
for r in rows:
    if r.get("impl") == "ddpkit" and r.get("sgd") == "foreach" and r.get("run") not in AB_RUNS:
        loop = find("ddpkit", "tensors", r["mode"], r["layout"], "loop")
        py = find("pytorch", "tensors", r["mode"], r["layout"])
        out.append(f"| tensors | {names[r['mode']]} | {r['layout']}, ddpkit ForeachSGD | "
                   f"{r['img_per_s']} | {py or 'failed'} | "
                   f"{r['img_per_s'] / py if py else float('nan'):.2f} (ForeachSGD / loop: "
                   f"{r['img_per_s'] / loop if loop else float('nan'):.2f}) |")
for r in rows:
    if r.get("impl") == "pytorch" and r.get("foreach") is False:
        base = find("pytorch", "tensors", r["mode"], "contiguous")
        if base:
            out.append(f"| tensors | {names[r['mode']]} | contiguous, SGD without foreach | | "
                       f"{r['img_per_s']} | PyTorch foreach / loop: "
                       f"{base / r['img_per_s']:.2f} |")
if len(out) > table_at:
    out[table_at:table_at] = header
def ab_cells(pairs):
    """Alternated loop/foreach runs: "loop img/s | foreach img/s | median
    ratio (range)" cells over the rounds that have both, or None."""
    import statistics
    by = {}
    for r in pairs:
        by.setdefault(r["round"], {})[r["sgd"]] = r["img_per_s"]
    rounds = sorted(k for k, v in by.items() if "loop" in v and "foreach" in v)
    if not rounds:
        return None
    ratios = [by[k]["foreach"] / by[k]["loop"] for k in rounds]
    return (f"{', '.join(str(by[k]['loop']) for k in rounds)} | "
            f"{', '.join(str(by[k]['foreach']) for k in rounds)} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) |")
ab = [r for r in rows if r.get("run") == "sgd-ab"]
if ab:
    out += ["", "ForeachSGD against libtorch's SGD loop, alternated (img/s per round; "
            "ratio = median of the rounds' foreach / loop):", "",
            "| precision | layout | loop | ForeachSGD | median ratio |", "|---|---|---|---|---|"]
    for mode, layout in (("fp32", "contiguous"), ("bf16", "channels-last")):
        cells = ab_cells(r for r in ab if r["mode"] == mode and r["layout"] == layout)
        if cells:
            out.append(f"| {names[mode]} | {layout} | {cells}")
cells = ab_cells(r for r in rows if r.get("run") == "adamw-ab")
if cells:
    out += ["", "ForeachAdamW against libtorch's AdamW loop, alternated, bf16-mixed "
            "channels-last (img/s per round):", "",
            "| loop | ForeachAdamW | median ratio |", "|---|---|---|", f"| {cells}"]
acc = [r for r in rows if r.get("run") == "accuracy"]
if acc:
    out += ["", "Accuracy at the examples' default epochs (best validation accuracy; "
            "CIFAR-10 also its test accuracy):", "",
            "| example | precision (flag) | epochs | best val_acc (epoch) | final val_acc | test_acc | seconds |",
            "|---|---|---|---|---|---|---|"]
    for r in acc:
        out.append(f"| {r['example']} | {r.get('precision', '?')} ({r.get('flag')}) | {r.get('epochs_run', '?')} | "
                   f"{r.get('best_val_acc', 'failed')} ({r.get('best_epoch', '?')}) | "
                   f"{r.get('final_val_acc', '')} | {r.get('test_acc', '')} | "
                   f"{r.get('total_seconds', '')} |")
for r in rows:
    if r.get("impl") == "ddpkit" and r.get("precision_flag") == "auto" and r.get("precision_run"):
        out += ["", f"`--precision auto` trained at {r.get('precision_run')} here."]
for r in rows:
    if r.get("run") == "flowers-ddp-world1":
        out += ["", f"flowers-resnet34-ddp at world 1 on the GPU (bf16-mixed, "
                f"--memory-format auto): exit {r['exit']}."]
errors = [r["error"] for r in rows if "error" in r]
if errors:
    out += ["", "Runs that failed:", ""] + [f"- {e}" for e in errors]
out += ["", "`tensors`: random batches already on the GPU (the training step alone). "
        "`jpeg-folder`: a generated flower_photos-like JPEG folder (1500 images), "
        "20 training steps plus the validation pass per epoch (300 images), second epoch timed, "
        "ddpkit's bf16-mixed row at --precision auto's choice, "
        "images/s = training images / epoch seconds (ddpkit's `epoch_images_per_second`)."]
print("\n".join(out))
PY
cat "$OUT/GPU.md"
stamp "done"
exit $((tests_rc < 0 ? 0 : tests_rc))
