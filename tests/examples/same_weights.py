#!/usr/bin/env python3
"""same_weights.py A B: the "model" state dicts of two checkpoints are equal
bit for bit (loaded with Python's default torch.load, weights_only=True);
prints the largest difference, exits 1 when they differ."""
import sys

import torch

a, b = (torch.load(p)["model"] for p in sys.argv[1:3])
assert a.keys() == b.keys(), "different keys"
worst = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
same = all(torch.equal(a[k], b[k]) for k in a)
print(f"final weights: {len(a)} tensors, max abs difference {worst:g}, bit-identical: {same}")
sys.exit(0 if same else 1)
