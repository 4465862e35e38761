#!/usr/bin/env bash
# flowers_weights_freeze.sh OUT BINARY [args...]
# The recipe's transfer learning: Python writes torchvision's resnet34 state
# dict (1000 classes, as torchvision ships it); BINARY --weights it
# --freeze-layers trains; then
#   - OUT has class_indices.json, weights/model-{0,1}.pt, checkpoints/
#     last.pt and best.pt;
#   - every parameter but fc.* equals the given weights (loaded and frozen),
#   - fc.* has the 5 classes' shape (the 1000-class fc was skipped) and
#     changed between epoch 0 and epoch 1 (it trains).
set -euo pipefail
out=$1 bin=$2
shift 2
source "$(dirname "$0")/torch_python.sh"
rm -rf "$out"
mkdir -p "$out"
"$py" -c '
import sys, torch, torchvision
torch.manual_seed(3)
torch.save(torchvision.models.resnet34().state_dict(), sys.argv[1])
' "$out/tv_r34.pth"
"$bin" --out "$out/run" --weights "$out/tv_r34.pth" --freeze-layers "$@"
for f in class_indices.json weights/model-0.pt weights/model-1.pt \
         checkpoints/last.pt checkpoints/best.pt; do
  [[ -f $out/run/$f ]] || { echo "missing $out/run/$f"; exit 1; }
done
"$py" - "$out" <<'PY'
import json, sys, torch
out = sys.argv[1]
given = torch.load(f"{out}/tv_r34.pth")
e0, e1 = torch.load(f"{out}/run/weights/model-0.pt"), torch.load(f"{out}/run/weights/model-1.pt")
classes = json.load(open(f"{out}/run/class_indices.json"))
assert len(classes) == 5, classes
params = [k for k in given if "running" not in k and "num_batches" not in k]
frozen = [k for k in params if not k.startswith("fc.")]
for k in frozen:
    for e in (e0, e1):
        assert torch.equal(e[k], given[k]), f"{k} is not the given weight (frozen layers must not train)"
assert e1["fc.weight"].shape == (5, 512), e1["fc.weight"].shape
assert not torch.equal(e0["fc.weight"], e1["fc.weight"]), "fc did not train"
print(f"{len(frozen)} frozen parameters equal the given torchvision weights after 2 epochs; "
      f"fc {tuple(e1['fc.weight'].shape)} trained (|d| = {(e1['fc.weight'] - e0['fc.weight']).abs().max().item():.3e}); "
      f"class_indices.json: {len(classes)} classes")
PY

# Passed: the run folder goes (a flowers checkpoint is 170 MB; CI ran out of
# disk keeping them all). DDPKIT_KEEP_TEST_RUNS=1 keeps it; a failed check
# has exited before this line.
[[ ${DDPKIT_KEEP_TEST_RUNS:-0} == 1 ]] || rm -rf "$out"
