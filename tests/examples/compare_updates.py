"""compare_updates.py INIT A B MAX_REL same|differ LABEL

Compares two runs' updates (B's weights/model-0.pt and A's, each minus the
initial weights INIT): ||update_a - update_b|| / ||update_a|| over every
floating-point parameter (running BN statistics excluded) must be <= MAX_REL
("same") or > MAX_REL ("differ"). Exit 0 when it holds."""
import sys

import torch

init, a, b = (torch.load(p) for p in sys.argv[1:4])
max_rel, want, label = float(sys.argv[4]), sys.argv[5], sys.argv[6]
assert list(a) == list(b) == list(init), "different keys"
keys = [k for k in a if a[k].is_floating_point() and "running" not in k]
flat = lambda sd: torch.cat([sd[k].double().flatten() for k in keys])
da, db = flat(a) - flat(init), flat(b) - flat(init)
rel = ((da - db).norm() / da.norm()).item()
print(f"{label}: updates differ by {rel:.3e} (relative L2 over {len(keys)} "
      f"parameters; must be {'<=' if want == 'same' else '>'} {max_rel}); "
      f"update size {da.norm().item():.3e}")
ok = rel <= max_rel if want == "same" else rel > max_rel
sys.exit(0 if da.norm() > 0 and ok else 1)
