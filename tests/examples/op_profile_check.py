"""op_profile_check.py BUILD_DIR

Runs benchmarks/precision_bench.py on the CIFAR net (32, contiguous, one
round) with --op-profile 2, which times the outermost ATen operators of
ddpkit's DDP (ddpkit_ddp_bench) and of PyTorch's (this Python, with
BUILD_DIR/benchmarks/libddpkit_op_profile.so loaded), and checks what the
profile claims:
  - on each side the time inside operators is more than 30 % of the step
    and no more than all of it;
  - both sides see the same model: conv2d, convolution_backward,
    batch_norm, native_batch_norm_backward, max_pool2d and
    threshold_backward with the same calls per step, 3 or 4 each;
  - only outermost operators count: convolution, _convolution and
    mkldnn_convolution (inside conv2d) and native_batch_norm (inside
    batch_norm) are not in either profile.
Exit 0 when all hold."""
import json
import os
import subprocess
import sys
import tempfile

root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
build = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "rows.json")
    subprocess.run([sys.executable, os.path.join(root, "benchmarks", "precision_bench.py"),
                    build, "--models", "cifarnet@32", "--settings", "32/contiguous",
                    "--op-profile", "2", "--python", sys.executable, "--json", out],
                   check=True)
    rows = json.load(open(out))
assert len(rows) == 1, rows
failures = []
for side in ("ddpkit", "pytorch"):
    p = rows[0][side + "_profile"]
    frac = p["in_ops_ms"] / p["profiled_step_ms"]
    print(f"{side}: {p['in_ops_ms']:.1f} of {p['profiled_step_ms']:.1f} ms a step inside "
          f"{len(p['ops'])} kinds of operator ({100 * frac:.0f} %)")
    if not 0.3 < frac <= 1.0:
        failures.append(f"{side}: inside operators {100 * frac:.1f} % of the step "
                        "(expected 30-100 %)")
    for nested in ("aten::convolution", "aten::_convolution", "aten::mkldnn_convolution",
                   "aten::native_batch_norm"):
        if nested in p["ops"]:
            failures.append(f"{side}: {nested} counted, though it runs inside another "
                            "operator")
d, t = rows[0]["ddpkit_profile"]["ops"], rows[0]["pytorch_profile"]["ops"]
for op in ("aten::conv2d", "aten::convolution_backward", "aten::batch_norm",
           "aten::native_batch_norm_backward", "aten::max_pool2d", "aten::threshold_backward"):
    calls = (d.get(op, [0, 0])[1], t.get(op, [0, 0])[1])
    print(f"{op}: calls per step ddpkit {calls[0]:g}, PyTorch {calls[1]:g}")
    if calls[0] != calls[1] or calls[0] not in (3, 4):
        failures.append(f"{op}: {calls[0]:g} calls a step in ddpkit, {calls[1]:g} in "
                        "PyTorch (expected the same, 3 or 4)")
for f in failures:
    print("op_profile_check: " + f, file=sys.stderr)
sys.exit(1 if failures else 0)
