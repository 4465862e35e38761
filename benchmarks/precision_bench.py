#!/usr/bin/env python3
"""ddpkit and PyTorch side by side at 32 / bf16-mixed x contiguous /
channels-last (issue 32's table).

    python3 benchmarks/precision_bench.py BUILD_DIR [--rounds 1]
        [--models resnet34@64,resnet34@128,resnet34@224,cifarnet@32,charlm@64]
        [--settings 32/contiguous,...] [--op-profile N]
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

With --op-profile N each run adds N steps with the time inside every
outermost ATen operator measured (a RecordFunction callback,
benchmarks/op_profile.hpp, on both sides: PyTorch's process loads it as
BUILD_DIR/benchmarks/libddpkit_op_profile.so), and a
table per model and setting splits each side's step into time inside
operators (kernels both share) and outside them (the framework), with the
operators that take the most time side by side. --settings picks settings,
e.g. 32/contiguous,32/channels-last.
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


def ddpkit_run(binary, model, size, prec, fmt, op_profile=0):
    name = (f"precision/{model}@{size}/b{BATCH[model]}/world:2/prec:{prec}"
            f"/fmt:{fmt.replace('-', '_')}/")
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = [binary, "--sections=precision", f"--op-profile={op_profile}",
                "--benchmark_filter=^" + name,
                "--benchmark_out=" + out.name, "--benchmark_out_format=json"]
        r = subprocess.run(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        if r.returncode != 0:
            sys.exit(f"precision_bench: {' '.join(args)} failed ({r.returncode}):\n"
                     f"{r.stderr[-2000:]}")
        runs = json.load(open(out.name))["benchmarks"]
    if len(runs) != 1:
        sys.exit(f"precision_bench: {name} matched {len(runs)} entries (expected 1)")
    v = runs[0]
    v["ops"] = {k[3:]: [x, v["calls:" + k[3:]]] for k, x in v.items() if k.startswith("op:")}
    return v


def pytorch_run(python, model, size, prec, fmt, op_profile=0, lib=None):
    steps = {"resnet34": 4 if size >= 224 else (6 if size >= 128 else 10)}.get(model, 20)
    args = [python, os.path.join(ROOT, "scripts", "bench_pytorch_precision.py"), "--one",
            model, str(size), str(BATCH[model]), str(steps), prec, fmt]
    if op_profile:
        args += ["--op-profile", str(op_profile), lib]
    r = subprocess.run(args, capture_output=True, text=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        sys.exit(f"precision_bench: {' '.join(args)} failed ({r.returncode}):\n"
                 f"{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def steps_arg(text):
    """--op-profile's value: an integer >= 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a number of steps (an integer >= 0)")
    return int(text)


def print_profile(label, rows, top=12):
    """Where the profiled steps went on each side, per step, averaged over
    the rounds: inside outermost ATen operators (the kernels and their
    dispatch, which ddpkit and PyTorch share) and outside them (the
    framework: autograd's engine, DDP's hooks, waits, the interpreter), and
    the operators that take the most time, side by side."""
    def mean(xs):
        return sum(xs) / len(xs)

    sides = {}
    for side in ("ddpkit", "pytorch"):
        profs = [r[side + "_profile"] for r in rows]
        names = set().union(*[p["ops"] for p in profs])
        sides[side] = {
            "step": mean([p["profiled_step_ms"] for p in profs]),
            "in": mean([p["in_ops_ms"] for p in profs]),
            "ops": {n: [mean([p["ops"].get(n, [0, 0])[i] for p in profs]) for i in (0, 1)]
                    for n in names}}
    d, t = sides["ddpkit"], sides["pytorch"]
    print(f"\nop profile, {label}: ms per profiled step, mean of {len(rows)} round(s)")
    print("| | ddpkit | PyTorch | PyTorch - ddpkit |")
    print("|---|---|---|---|")
    for what, dv, tv in (("step", d["step"], t["step"]),
                         ("inside ATen operators", d["in"], t["in"]),
                         ("outside (framework)", d["step"] - d["in"], t["step"] - t["in"])):
        print(f"| {what} | {dv:.1f} | {tv:.1f} | {tv - dv:+.1f} |")
    names = sorted(set(d["ops"]) | set(t["ops"]),
                   key=lambda n: -max(d["ops"].get(n, [0])[0], t["ops"].get(n, [0])[0]))
    print("| operator | ddpkit ms (calls) | PyTorch ms (calls) | PyTorch - ddpkit |")
    print("|---|---|---|---|")

    def cell(side, n):
        ms, calls = side["ops"].get(n, [0, 0])
        return f"{ms:.2f} ({calls:g})"

    for n in names[:top]:
        diff = t["ops"].get(n, [0])[0] - d["ops"].get(n, [0])[0]
        print(f"| {n} | {cell(d, n)} | {cell(t, n)} | {diff:+.2f} |")
    rest = [sum(s["ops"].get(n, [0])[0] for n in names[top:]) for s in (d, t)]
    print(f"| {len(names[top:])} others | {rest[0]:.2f} | {rest[1]:.2f} "
          f"| {rest[1] - rest[0]:+.2f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--models", default="resnet34@64,resnet34@128,resnet34@224,"
                    "cifarnet@32,charlm@64")
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv", "bin", "python3"))
    ap.add_argument("--json", help="write every measurement here")
    ap.add_argument("--settings", default=",".join(f"{p}/{f}" for p, f in SETTINGS),
                    help="which of 32|bf16-mixed / contiguous|channels-last to run")
    ap.add_argument("--op-profile", type=steps_arg, default=0, metavar="N",
                    help="after the timed steps, N more steps with the time inside "
                    "each outermost ATen operator measured on both sides; prints "
                    "where the step goes and which part of the difference is "
                    "operators")
    a = ap.parse_args()
    settings_wanted = []
    for x in a.settings.split(","):
        prec, _, fmt = x.partition("/")
        if (prec, fmt) not in SETTINGS:
            sys.exit(f"precision_bench: --settings entry {x!r}: expected PREC/FMT with "
                     "PREC 32 or bf16-mixed and FMT contiguous or channels-last")
        settings_wanted.append((prec, fmt))
    binary = os.path.join(a.build_dir, "benchmarks", "ddpkit_ddp_bench")
    if not os.access(binary, os.X_OK):
        sys.exit(f"precision_bench: {binary} is not built (configure with "
                 "-DDDPKIT_BUILD_BENCHMARKS=ON)")
    lib = os.path.join(a.build_dir, "benchmarks", "libddpkit_op_profile.so")
    if a.op_profile and not os.path.exists(lib):
        sys.exit(f"precision_bench: --op-profile needs {lib} (the ddpkit_op_profile "
                 "target, built against the same torch as --python)")
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
            settings = [s for s in SETTINGS if s in settings_wanted
                        and (name != "charlm" or s[1] == "contiguous")]
            if r % 2 == 0:
                settings = settings[::-1]
            for prec, fmt in settings:
                sides = ["ddpkit", "pytorch"] if r % 2 else ["pytorch", "ddpkit"]
                row = {"round": r, "model": name, "size": size, "precision": prec,
                       "format": fmt}
                for side in sides:
                    if side == "ddpkit":
                        v = ddpkit_run(binary, name, size, prec, fmt, a.op_profile)
                        row["ddpkit"] = v["images_per_s"]
                        for k in ("forward_ms", "backward_ms", "wait_ms", "optimizer_ms",
                                  "step_ms"):
                            row[k] = v[k]
                    else:
                        v = pytorch_run(a.python, name, size, prec, fmt, a.op_profile, lib)
                        row["pytorch"] = v["images_per_s"]
                        row["pytorch_step_ms"] = v["step_ms"]
                    if a.op_profile:
                        row[side + "_profile"] = {k: v[k] for k in (
                            "profiled_step_ms", "in_ops_ms", "ops")}
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
        if not mine:  # e.g. the char LM with only channels-last asked for
            continue
        print(f"\n{name}@{size}, batch {BATCH[name]} per rank x 2 ranks x 1 thread, "
              f"{unit.get(name, 'images/s')}, {a.rounds} round(s)")
        print("| round | precision | layout | ddpkit | PyTorch | ddpkit / PyTorch "
              "| ddpkit × its 32-contiguous | PyTorch × its 32-contiguous "
              "| ddpkit ms/step: forward / backward (wait) / optimizer |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in range(1, a.rounds + 1):
            base = ([x for x in mine if x["round"] == r and x["precision"] == "32"
                     and x["format"] == "contiguous"] or [None])[0]
            for prec, fmt in SETTINGS:
                x = [y for y in mine if y["round"] == r and y["precision"] == prec
                     and y["format"] == fmt]
                if not x:
                    continue
                x = x[0]
                rel = (f"{x['ddpkit'] / base['ddpkit']:.2f} "
                       f"| {x['pytorch'] / base['pytorch']:.2f}") if base else "- | -"
                print(f"| {r} | {prec} | {fmt} | {x['ddpkit']:.1f} | {x['pytorch']:.1f} "
                      f"| {x['ddpkit'] / x['pytorch']:.2f} "
                      f"| {rel} "
                      f"| {x['step_ms']:.0f}: {x['forward_ms']:.0f} / {x['backward_ms']:.0f} "
                      f"({x['wait_ms']:.1f}) / {x['optimizer_ms']:.1f} |")
        if a.rounds > 1:
            for prec, fmt in SETTINGS:
                q = [x["ddpkit"] / x["pytorch"] for x in mine
                     if x["precision"] == prec and x["format"] == fmt]
                if q:
                    print(f"median ddpkit / PyTorch, {prec} {fmt}: "
                          f"{statistics.median(q):.2f} over {len(q)} rounds")
        if a.op_profile:
            for prec, fmt in SETTINGS:
                x = [y for y in mine if y["precision"] == prec and y["format"] == fmt]
                if x:
                    print_profile(f"{name}@{size} {prec} {fmt}", x)


if __name__ == "__main__":
    main()
