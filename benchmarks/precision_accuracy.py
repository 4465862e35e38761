#!/usr/bin/env python3
"""Does bf16-mixed cost accuracy? The examples' DDP builds trained in 32 and
in bf16-mixed, several seeds each, on a CPU with AMX (where
`--precision auto` chooses bf16-mixed): the evidence behind that rule.

    python3 benchmarks/precision_accuracy.py BUILD_DIR [--seeds 1,2,3]
        [--models cifar10,flowers] [--flowers-args "..."] [--out DIR]
        [--json out.json] [--force]

cifar10: BUILD_DIR/bin/cifar10-ddp at its defaults (the recipe's 30 epochs
with early stopping, the built-in synthetic CIFAR-like set), world 2.
flowers: BUILD_DIR/bin/flowers-resnet34-ddp on its generated flower folder,
world 2, with --flowers-args (default "--image-size 64 --epochs 3": the
recipe's 224 px and 30 epochs take days on a 2-core machine). Each run is
one process pair with one thread each; --seed N sets the model's
initialisation, the split and the sampling. The runs alternate 32 and
bf16-mixed within each seed.

Prints, per model and precision, each seed's best and final validation
accuracy (and test accuracy where the example has a test set), their
mean and range, and whether bf16-mixed's mean lies within 32's range of
seeds (the rule in the README: if bf16-mixed costs accuracy beyond the
seeds' spread, `auto` must not choose it). Refuses to run on a CPU
without AMX (`amx_bf16`), where bf16-mixed is slow and `auto` does not
choose it, unless --force. Not run in CI (minutes to hours).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISIONS = ["32", "bf16-mixed"]


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def run(binary, args, out):
    cmd = [binary, "--world-size", "2", "--out", out, "--overwrite", "--quiet",
           "--no-tensorboard"] + args
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if r.returncode != 0:
        sys.exit(f"precision_accuracy: {' '.join(cmd)} failed "
                 f"({r.returncode}):\n{r.stdout[-3000:]}")
    s = json.load(open(os.path.join(out, "summary.json")))
    return {
        "best_val_acc": s.get("best_val_acc"),
        "final_val_acc": s.get("final_val_acc"),
        "test_acc": s.get("test_acc"),
        "epochs_run": s.get("epochs_run"),
        "precision": s.get("precision"),
        "seconds": round(time.time() - t0, 1),
    }


def spread(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return "-"
    return (f"{statistics.mean(xs):.3f} (range {min(xs):.3f}-{max(xs):.3f})")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build")
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--models", default="cifar10,flowers")
    ap.add_argument("--flowers-args", default="--image-size 64 --epochs 3")
    ap.add_argument("--out", default=None,
                    help="where the runs write (default BUILD/precision-accuracy)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--force", action="store_true",
                    help="run on a CPU without AMX too")
    a = ap.parse_args()
    try:
        seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError:
        sys.exit(f"precision_accuracy: --seeds '{a.seeds}': expected "
                 "comma-separated integers, e.g. 1,2,3")
    models = a.models.split(",")
    for m in models:
        if m not in ("cifar10", "flowers"):
            sys.exit(f"precision_accuracy: --models: '{m}' is not one of "
                     "cifar10, flowers")
    if "amx_bf16" not in cpu_flags() and not a.force:
        sys.exit(f"precision_accuracy: this CPU ({cpu_model()}) has no AMX "
                 "(amx_bf16 in /proc/cpuinfo): --precision auto does not "
                 "choose bf16-mixed here, and bf16-mixed is slow; --force to "
                 "run anyway")
    binaries = {"cifar10": os.path.join(a.build, "bin", "cifar10-ddp"),
                "flowers": os.path.join(a.build, "bin", "flowers-resnet34-ddp")}
    extra = {"cifar10": [], "flowers": a.flowers_args.split()}
    for m in models:
        if not os.access(binaries[m], os.X_OK):
            sys.exit(f"precision_accuracy: {binaries[m]} is missing (build "
                     "the examples' ddp build in BUILD_DIR)")
    out_root = a.out or os.path.join(a.build, "precision-accuracy")
    print(f"CPU: {cpu_model()}; flags: "
          f"{' '.join(sorted(f for f in cpu_flags() if f.startswith(('amx', 'avx512_bf16'))))}")
    results = {}
    for m in models:
        for seed in seeds:
            order = PRECISIONS if seed % 2 else list(reversed(PRECISIONS))
            for p in order:
                out = os.path.join(out_root, f"{m}-{p}-seed{seed}")
                r = run(binaries[m], extra[m] + ["--precision", p, "--seed",
                                                 str(seed)], out)
                results.setdefault(m, {}).setdefault(p, {})[seed] = r
                print(f"{m} {p:10s} seed {seed}: best val_acc "
                      f"{r['best_val_acc']:.4f}, final {r['final_val_acc']:.4f}"
                      + (f", test_acc {r['test_acc']:.4f}"
                         if r["test_acc"] is not None else "")
                      + f" ({r['epochs_run']} epochs, {r['seconds']} s)",
                      flush=True)
    print()
    verdicts = {}
    for m in models:
        print(f"{m} ({' '.join(extra[m]) or 'defaults'}), world 2, seeds "
              f"{a.seeds}:")
        print("| precision | best val_acc per seed | mean (range) | "
              "final val_acc mean (range) | test_acc mean (range) |")
        print("|---|---|---|---|---|")
        for p in PRECISIONS:
            rs = [results[m][p][s] for s in seeds]
            per_seed = ", ".join(f"{r['best_val_acc']:.3f}" for r in rs)
            print(f"| {p} | {per_seed} "
                  f"| {spread([r['best_val_acc'] for r in rs])} "
                  f"| {spread([r['final_val_acc'] for r in rs])} "
                  f"| {spread([r['test_acc'] for r in rs])} |")
        f32 = [results[m]["32"][s]["best_val_acc"] for s in seeds]
        b16 = [results[m]["bf16-mixed"][s]["best_val_acc"] for s in seeds]
        # Accuracies are counts over a validation set, read back as
        # decimals: a mean equal to 32's worst seed is within its range
        # (the tolerance is far below one image).
        within = statistics.mean(b16) >= min(f32) - 1e-6
        verdicts[m] = within
        print(f"bf16-mixed's mean best val_acc {statistics.mean(b16):.4f} is "
              + ("within" if within else "BELOW")
              + f" 32's range over the seeds ({min(f32):.4f}-{max(f32):.4f}); "
              + f"means differ by {statistics.mean(f32) - statistics.mean(b16):+.4f}")
        print()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"cpu": cpu_model(), "seeds": seeds,
                       "flowers_args": a.flowers_args, "results": results,
                       "bf16_within_fp32_range": verdicts}, f, indent=1)


if __name__ == "__main__":
    main()
