#!/usr/bin/env bash
# TensorBoard files as TensorBoard reads them.
#   tensorboard_check.sh check OUT [EVERY]
#     OUT/tb opens in TensorBoard's EventAccumulator; every record's CRCs
#     pass TensorBoard's own record reader; the recipe's per-epoch tags
#     (train/loss, train/acc, val/loss, val/acc, lr) and the throughput
#     tags hold exactly OUT/metrics.jsonl's values (float32), one event per
#     epoch; train/loss_step has no step twice; the settings are there as
#     text. EVERY: the run's --log-every-n-steps; then train/loss_step must
#     hold a finite loss at exactly the steps EVERY, 2·EVERY, ... up to the
#     run's last global step (OUT/checkpoints/last.pt's global_step; without
#     last.pt, at least one event), none with EVERY 0.
#   tensorboard_check.sh kill-resume BINARY OUT ARGS...
#     Runs BINARY --out OUT ARGS, SIGKILLs it half a second into its third
#     epoch (ARGS should make an epoch last a few seconds), runs it again
#     with --resume auto, then does `check OUT EVERY`, EVERY being ARGS'
#     --log-every-n-steps (the examples' default, 50, without it).
set -euo pipefail
source "$(dirname "$0")/torch_python.sh"
"$py" -c "import tensorboard" 2>/dev/null ||
  ddpkit_skip "$py has no tensorboard (run scripts/install-deps.sh)"
mode=$1
shift
every=""
if [[ $mode == check ]]; then
  every=${2:-}
elif [[ $mode == kill-resume ]]; then
  bin=$1 out=$2
  shift 2
  every=50  # ddpkit::cli's default
  prev=""
  for a in "$@"; do
    [[ $prev == --log-every-n-steps ]] && every=$a
    [[ $a == --log-every-n-steps=* ]] && every=${a#*=}
    prev=$a
  done
  rm -rf "$out"
  setsid "$bin" --out "$out" "$@" &
  pid=$!
  for _ in $(seq 1 1200); do
    [[ -f $out/metrics.jsonl ]] && (( $(wc -l < "$out/metrics.jsonl") >= 2 )) && break
    sleep 0.05
  done
  sleep 0.5  # into the third epoch (about 2 s here)
  (( $(wc -l < "$out/metrics.jsonl") == 2 )) || { echo "the first run was not in its third epoch at the kill, as planned"; exit 1; }
  kill -KILL -- -"$pid"
  wait "$pid" 2>/dev/null || true
  echo "killed after $(wc -l < "$out/metrics.jsonl") epochs; resuming"
  "$bin" --out "$out" "$@" --resume auto
  set -- "$out"
else
  echo "usage: tensorboard_check.sh check OUT [EVERY] | kill-resume BINARY OUT ARGS..."
  exit 2
fi
"$py" - "$1" "$every" <<'PY'
import glob, json, math, os, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.compat.tensorflow_stub import errors
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New
from tensorboard.util import tensor_util

out = sys.argv[1]
every = int(sys.argv[2]) if sys.argv[2] else None
files = sorted(glob.glob(os.path.join(out, "tb", "events.out.tfevents.*")))
if not files:
    sys.exit(f"no event files in {out}/tb")
records = 0
for f in files:
    reader = PyRecordReader_New(f)
    while True:
        try:
            reader.GetNext()  # raises DataLossError on a bad CRC
        except errors.OutOfRangeError:
            break
        records += 1
print(f"{len(files)} event file(s), {records} records, every CRC valid")

acc = EventAccumulator(os.path.join(out, "tb"), size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
tags = {"train/loss": "train_loss", "train/acc": "train_acc", "val/loss": "val_loss",
        "val/acc": "val_acc", "lr": "lr", "train/images_per_second": "train_images_per_second",
        "time/train_seconds": "train_seconds", "time/val_seconds": "val_seconds"}
have = set(acc.Tags()["scalars"])
missing = [t for t in tags if t not in have]
if missing:
    sys.exit(f"missing tags {missing}; have {sorted(have)}")
bad = 0
for tag, key in tags.items():
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    if steps != [r["epoch"] for r in rows]:
        print(f"{tag}: steps {steps}, metrics.jsonl epochs {[r['epoch'] for r in rows]}")
        bad += 1
        continue
    for e, r in zip(events, rows):
        want = r[key]
        if not math.isclose(e.value, want, rel_tol=1e-6, abs_tol=1e-30):
            print(f"{tag} epoch {e.step}: TensorBoard {e.value!r}, metrics.jsonl {want!r}")
            bad += 1
print(f"{len(tags)} tags x {len(rows)} epochs compared with metrics.jsonl")
loss_steps = acc.Scalars("train/loss_step") if "train/loss_step" in have else []
steps = [e.step for e in loss_steps]
if len(set(steps)) != len(steps) or steps != sorted(steps):
    print(f"train/loss_step steps repeat or go back: {steps}")
    bad += 1
elif steps:
    print(f"train/loss_step: {len(steps)} events, steps {steps[0]}..{steps[-1]}, none twice")
else:
    print("no train/loss_step events")
if every is not None:
    last = os.path.join(out, "checkpoints", "last.pt")
    if every == 0:
        want = []
    elif os.path.exists(last):
        import torch
        global_step = int(torch.load(last)["global_step"])
        want = list(range(every, global_step + 1, every))
        print(f"--log-every-n-steps {every}, {global_step} steps in all (last.pt): "
              f"{len(want)} train/loss_step events expected")
    else:
        want = list(range(every, every * max(len(steps), 1) + 1, every))
    if steps != want:
        print(f"train/loss_step at steps {steps}, expected {want}")
        bad += 1
    nonfinite = [e.step for e in loss_steps if not math.isfinite(e.value)]
    if nonfinite:
        print(f"train/loss_step not finite at steps {nonfinite}")
        bad += 1
texts = acc.Tags()["tensors"]
if "hparams" not in texts:
    print(f"no hparams text; tensor tags {texts}")
    bad += 1
else:
    text = tensor_util.make_ndarray(acc.Tensors("hparams")[0].tensor_proto).item().decode()
    if "| lr |" not in text:
        print(f"hparams text lacks the lr row: {text!r}")
        bad += 1
sys.exit(1 if bad else 0)
PY
