#!/usr/bin/env bash
# What an example wrote loads in Python's torch with plain torch.load(path)
# (since 2.6 that means weights_only=True) and into torchvision's model:
#   python_load.sh OUT_DIR NUM_CLASSES
# Every weights/model-*.pt is a state dict that torchvision's resnet34
# accepts (strict), as is checkpoints/best.pt's "model" entry.
set -euo pipefail
out=$1 classes=$2
source "$(dirname "$0")/torch_python.sh"
"$py" - "$out" "$classes" <<'PY'
import glob, sys
import torch, torchvision
out, classes = sys.argv[1], int(sys.argv[2])
weights = sorted(glob.glob(f"{out}/weights/model-*.pt"))
if not weights:
    sys.exit(f"no {out}/weights/model-*.pt")
files = [(p, lambda obj: obj) for p in weights]
files.append((f"{out}/checkpoints/best.pt", lambda obj: obj["model"]))
for path, pick in files:
    obj = torch.load(path)  # the default: weights_only=True on torch >= 2.6
    sd = pick(obj)
    model = torchvision.models.resnet34(num_classes=classes)
    model.load_state_dict(sd)  # strict: every key, every shape
    print(f"{path}: torch {torch.__version__} torch.load + resnet34.load_state_dict: "
          f"{len(sd)} entries, {type(sd).__name__}")
PY
