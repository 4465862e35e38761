#!/usr/bin/env python3
"""What checkpoints cost a training step: synchronous vs asynchronous
checkpoints, and none, side by side, alternated round by round.

    python3 benchmarks/checkpoint_bench.py BUILD [--rounds 3] [--every 4]
        [--image-size 64] [--steps 24] [--example flowers-resnet34-single]

Each round runs the example three ways (the built-in synthetic flowers at
--image-size, one epoch of --steps batches of 16, one thread):
  none   no mid-epoch checkpoints (only the epoch-end one),
  sync   --checkpoint-every N: the step writes last.pt itself,
  async  --checkpoint-every N --async-checkpoint: the step copies the
         state, a background thread writes it.
From each summary.json it takes checkpoint_ms (blocking: the training
thread's time on checkpoints while training; background; drain: the fit's
end waiting for the last background write, reported apart as it stalls no
step; each per checkpoint file) and step_ms.total (ms per training step,
rank 0), and prints
min/median/max over the rounds with the ratios that matter: async's
blocking time over its background write (target <= 0.10) and async's
step over none's (steps overlapping a background write; target <= 1.3).
Name the CPU (/proc/cpuinfo) beside the numbers.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(binary, out, args):
    cmd = [binary, "--out", out, "--overwrite", "--quiet", "--threads", "1",
           "--workers", "0", "--no-tensorboard", "--precision", "32"] + args
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("build")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--example", default="flowers-resnet34-single")
    a = p.parse_args()
    binary = os.path.join(a.build, "bin", a.example)
    if not os.access(binary, os.X_OK):
        sys.exit(f"error: {binary} is not an executable (build the examples "
                 "first)")
    common = ["--epochs", "1", "--batch-size", "16", "--image-size",
              str(a.image_size), "--max-steps", str(a.steps)]
    modes = {
        "none": [],
        "sync": ["--checkpoint-every", str(a.every)],
        "async": ["--checkpoint-every", str(a.every), "--async-checkpoint"],
    }
    rows = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for m, extra in modes.items():
                s = run(binary, os.path.join(tmp, m), common + extra)
                ck = s.get("checkpoint_ms", {})
                n = max(1, s.get("checkpoints_written", 1))
                rows[m].append({
                    "step_ms": s["step_ms"]["total"],
                    "blocking_ms": ck.get("blocking", 0) / n,
                    "background_ms": ck.get("background", 0) / n,
                    "drain_ms": ck.get("drain", 0),
                    "written": s.get("checkpoints_written", 0),
                })
                print(f"round {r + 1} {m}: {rows[m][-1]}", flush=True)

    def stat(xs):
        return (f"min {min(xs):.1f} median {statistics.median(xs):.1f} "
                f"max {max(xs):.1f}")

    print()
    for m in modes:
        print(f"{m:5s} step ms {stat([x['step_ms'] for x in rows[m]])}; "
              f"per checkpoint: blocking ms "
              f"{stat([x['blocking_ms'] for x in rows[m]])}, background ms "
              f"{stat([x['background_ms'] for x in rows[m]])}; drain at "
              f"the end ms {stat([x['drain_ms'] for x in rows[m]])}; files "
              f"{rows[m][0]['written']}")
    ratio_block = [x["blocking_ms"] / x["background_ms"]
                   for x in rows["async"] if x["background_ms"] > 0]
    ratio_step = [x["step_ms"] / y["step_ms"]
                  for x, y in zip(rows["async"], rows["none"])]
    ratio_sync = [x["step_ms"] / y["step_ms"]
                  for x, y in zip(rows["sync"], rows["none"])]
    print(f"async blocking / background write, per round: "
          f"{', '.join(f'{x:.3f}' for x in ratio_block)} (target <= 0.10)")
    print(f"async step / none step, per round: "
          f"{', '.join(f'{x:.2f}' for x in ratio_step)} (target <= 1.3)")
    print(f"sync step / none step, per round: "
          f"{', '.join(f'{x:.2f}' for x in ratio_sync)}")


if __name__ == "__main__":
    main()
