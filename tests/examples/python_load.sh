#!/usr/bin/env bash
# What an example wrote loads in Python's torch with plain torch.load(path)
# (since 2.6 that means weights_only=True) and into torchvision's model:
#   python_load.sh OUT_DIR NUM_CLASSES
# Every weights/model-*.pt is a state dict that torchvision's resnet34
# accepts (strict), as is checkpoints/best.pt's "model" entry.
#   python_load.sh OUT_DIR -
# Any model (cifar10's net): checkpoints/best.pt's and last.pt's "model"
# entries are state dicts of tensors with the same keys and shapes.
set -euo pipefail
out=$1 classes=$2
source "$(dirname "$0")/torch_python.sh"
"$py" - "$out" "$classes" <<'PY'
import glob, sys
import torch
out = sys.argv[1]
if sys.argv[2] == "-":
    seen = None
    for name in ("best.pt", "last.pt"):
        path = f"{out}/checkpoints/{name}"
        sd = torch.load(path)["model"]  # weights_only=True on torch >= 2.6
        bad = [k for k, v in sd.items() if not isinstance(v, torch.Tensor)]
        if not sd or bad:
            sys.exit(f"{path}: 'model' is not a state dict of tensors ({bad or 'empty'})")
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        if seen is not None and shapes != seen:
            sys.exit(f"{path}: keys or shapes differ from best.pt's")
        seen = shapes
        print(f"{path}: torch {torch.__version__} torch.load: {len(sd)} tensors")
    sys.exit(0)
import torchvision
classes = int(sys.argv[2])
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
