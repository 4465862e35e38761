#!/usr/bin/env python3
"""ddpkit and PyTorch side by side at 32 / bf16-mixed x contiguous /
channels-last (issue 32's table).

    python3 benchmarks/precision_bench.py BUILD_DIR [--rounds 1]
        [--models resnet34@64,resnet34@128,resnet34@224,cifarnet@32,charlm@64]
        [--python .venv/bin/python3] [--json out.json]

For each model and each setting it runs ddpkit's DDP engine
(BUILD_DIR/benchmarks/ddpkit_ddp_bench, the `precision` section) and
PyTorch's DistributedDataParallel (scripts/bench_pytorch_precision.py
--one) on the same model, batch and optimizer: 2 ranks x 1 intra-op thread,
a fixed random batch per rank (no data loading), CPU autocast to bfloat16
for bf16-mixed, model and batch in channels-last for channels-last.
Throughput on both sides is world x batch / rank 0's median step time.
The runs alternate: within a round every setting runs ddpkit then PyTorch,
even rounds PyTorch first and the settings in reverse order, so this
machine's drift falls on both sides alike. It prints, per model, a table
of images (sequences) per second, ddpkit / PyTorch, each setting over 32
contiguous (per side), and ddpkit's step by phase: forward, backward (with
the wait for the last gradient bucket), that wait, the optimizer step.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH = {"resnet34": 16, "cifarnet": 64, "charlm": 32}
SETTINGS = [("32", "contiguous"), ("bf16-mixed", "contiguous"),
            ("32", "channels-last"), ("bf16-mixed", "channels-last")]


def ddpkit_run(binary, model, size, prec, fmt):
    name = (f"precision/{model}@{size}/b{BATCH[model]}/world:2/prec:{prec}"
            f"/fmt:{fmt.replace('-', '_')}/")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = [binary, "--sections=precision", "--benchmark_filter=^" + name,
                "--benchmark_out=" + out.name, "--benchmark_out_format=json"]
        r = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode != 0:
            sys.exit(f"precision_bench: {' '.join(args)} failed ({r.returncode}):\n"
                     f"{r.stderr[-2000:]}")
        runs = json.load(open(out.name))["benchmarks"]
    if len(runs) != 1:
        sys.exit(f"precision_bench: {name} matched {len(runs)} entries (expected 1)")
    return runs[0]


def pytorch_run(python, model, size, prec, fmt):
    steps = {"resnet34": 4 if size >= 224 else (6 if size >= 128 else 10)}.get(model, 20)
    args = [python, os.path.join(ROOT, "scripts", "bench_pytorch_precision.py"), "--one",
            model, str(size), str(BATCH[model]), str(steps), prec, fmt]
    r = subprocess.run(args, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        sys.exit(f"precision_bench: {' '.join(args)} failed ({r.returncode}):\n"
                 f"{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--models", default="resnet34@64,resnet34@128,resnet34@224,"
                    "cifarnet@32,charlm@64")
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python3"))
    ap.add_argument("--json", help="write every measurement here")
    a = ap.parse_args()
    binary = os.path.join(a.build_dir, "benchmarks", "ddpkit_ddp_bench")
    if not os.access(binary, os.X_OK):
        sys.exit(f"precision_bench: {binary} is not built (configure with "
                 "-DDDPKIT_BUILD_BENCHMARKS=ON)")
    if not os.access(a.python, os.X_OK):
        sys.exit(f"precision_bench: {a.python} is not there (--python: a Python "
                 "with torch and torchvision)")
    models = []
    for m in a.models.split(","):
        name, _, size = m.partition("@")
        if name not in BATCH or not size.isdigit():
            sys.exit(f"precision_bench: --models entry {m!r}: expected "
                     "resnet34@SIZE, cifarnet@SIZE or charlm@CONTEXT")
        models.append((name, int(size)))
    rows = []
    for r in range(1, a.rounds + 1):
        for name, size in models:
            settings = [s for s in SETTINGS if name != "charlm" or s[1] == "contiguous"]
            if r % 2 == 0:
                settings = settings[::-1]
            for prec, fmt in settings:
                sides = ["ddpkit", "pytorch"] if r % 2 else ["pytorch", "ddpkit"]
                row = {"round": r, "model": name, "size": size, "precision": prec,
                       "format": fmt}
                for side in sides:
                    if side == "ddpkit":
                        v = ddpkit_run(binary, name, size, prec, fmt)
                        row["ddpkit"] = v["images_per_s"]
                        for k in ("forward_ms", "backward_ms", "wait_ms", "optimizer_ms",
                                  "step_ms"):
                            row[k] = v[k]
                    else:
                        row["pytorch"] = pytorch_run(a.python, name, size, prec, fmt)[
                            "images_per_s"]
                rows.append(row)
                print(f"round {r} {name}@{size} {prec:>10} {fmt:<13} ddpkit "
                      f"{row['ddpkit']:8.2f}/s  PyTorch {row['pytorch']:8.2f}/s  "
                      f"x{row['ddpkit'] / row['pytorch']:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    unit = {"charlm": "sequences/s (x context = tokens/s)"}
    for name, size in models:
        mine = [x for x in rows if x["model"] == name and x["size"] == size]
        print(f"\n{name}@{size}, batch {BATCH[name]} per rank x 2 ranks x 1 thread, "
              f"{unit.get(name, 'images/s')}, {a.rounds} round(s)")
        print("| round | precision | layout | ddpkit | PyTorch | ddpkit / PyTorch "
              "| ddpkit × its 32-contiguous | PyTorch × its 32-contiguous "
              "| ddpkit ms/step: forward / backward (wait) / optimizer |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in range(1, a.rounds + 1):
            base = [x for x in mine if x["round"] == r and x["precision"] == "32"
                    and x["format"] == "contiguous"][0]
            for prec, fmt in SETTINGS:
                x = [y for y in mine if y["round"] == r and y["precision"] == prec
                     and y["format"] == fmt]
                if not x:
                    continue
                x = x[0]
                print(f"| {r} | {prec} | {fmt} | {x['ddpkit']:.1f} | {x['pytorch']:.1f} "
                      f"| {x['ddpkit'] / x['pytorch']:.2f} "
                      f"| {x['ddpkit'] / base['ddpkit']:.2f} "
                      f"| {x['pytorch'] / base['pytorch']:.2f} "
                      f"| {x['step_ms']:.0f}: {x['forward_ms']:.0f} / {x['backward_ms']:.0f} "
                      f"({x['wait_ms']:.1f}) / {x['optimizer_ms']:.1f} |")
        if a.rounds > 1:
            for prec, fmt in SETTINGS:
                q = [x["ddpkit"] / x["pytorch"] for x in mine
                     if x["precision"] == prec and x["format"] == fmt]
                if q:
                    print(f"median ddpkit / PyTorch, {prec} {fmt}: "
                          f"{statistics.median(q):.2f} over {len(q)} rounds")


if __name__ == "__main__":
    main()
