"""compare_updates.py INIT A B MAX_REL same|differ LABEL [MAX_ABS]

Compares two runs' updates (B's weights and A's, each minus the initial
weights INIT): ||update_a - update_b|| / ||update_a|| over every
floating-point parameter (running BN statistics excluded) must be <= MAX_REL
("same") or > MAX_REL ("differ"). With MAX_ABS, "same" also needs every
parameter of A and B within MAX_ABS of each other. Each file is a state dict
(weights/model-*.pt) or a checkpoint (its "model" entry). Exit 0 when it
holds."""
import sys

import torch


def load(path):
    obj = torch.load(path)
    return obj["model"] if "model" in obj and isinstance(obj["model"], dict) else obj


init, a, b = (load(p) for p in sys.argv[1:4])
max_rel, want, label = float(sys.argv[4]), sys.argv[5], sys.argv[6]
max_abs = float(sys.argv[7]) if len(sys.argv) > 7 else None
assert list(a) == list(b) == list(init), "different keys"
keys = [k for k in a if a[k].is_floating_point() and "running" not in k]
flat = lambda sd: torch.cat([sd[k].double().flatten() for k in keys])
da, db = flat(a) - flat(init), flat(b) - flat(init)
rel = ((da - db).norm() / da.norm()).item()
worst = (da - db).abs().max().item()
print(f"{label}: updates differ by {rel:.3e} (relative L2 over {len(keys)} "
      f"parameters; must be {'<=' if want == 'same' else '>'} {max_rel}), "
      f"at most {worst:.3e} in one weight"
      f"{f' (must be <= {max_abs})' if max_abs is not None and want == 'same' else ''}; "
      f"update size {da.norm().item():.3e}")
ok = rel <= max_rel if want == "same" else rel > max_rel
if want == "same" and max_abs is not None:
    ok = ok and worst <= max_abs
sys.exit(0 if da.norm() > 0 and db.norm() > 0 and ok else 1)
