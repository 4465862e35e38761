#!/usr/bin/env python3
"""Markdown tables from benchmarks/multihost_bench.sh's points.tsv.

Medians over rounds. For each DDP point: step and exposed-wait time, scaling
efficiency (images/s over N x one rank alone), communication efficiency
(the bare step at the same layout over the DDP step), and the projection
check for the shaped links with docs/BENCHMARKS.md's model: compute = the
bare step at the same layout (no communication, the same ranks sharing the
same cores), T_comm = bytes crossing one host's link per step / link rate,
where a ring of N ranks over two hosts sends 2(N-1)/N x the gradient bytes
over each host's link (flat), and the two leaders' ring sends 1 x the
gradient bytes (hierarchical); predicted without overlap T = compute +
T_comm, with overlap T = compute + max(0, T_comm - 2/3 compute).
"""
import csv
import math
import os
import statistics
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
from bench_report import RECIPE, ring_time  # noqa: E402

RATE = {"10gbit": 10e9 / 8, "1gbit": 1e9 / 8}
WORLD = {"1x1": 1, "2x1": 2, "2x2": 4}


def main(path):
    rows = defaultdict(list)
    grad = {}
    with open(path) as f:
        for r in csv.DictReader(f, delimiter="\t"):
            key = (r["model"], r["layout"], r["algo"], r["link"], r["mode"])
            rows[key].append(r)
            grad[r["model"]] = float(r["bytes"])
    rounds = max(len(v) for v in rows.values())

    def med(key, field):
        return statistics.median(float(r[field]) for r in rows[key])

    print(f"Medians over {rounds} round(s); times in ms per step.\n")
    print("| model | hosts x ranks | all-reduce | link | step | exposed wait | "
          "scaling eff. | comm. eff. | predicted, no overlap | measured / predicted | "
          "predicted, overlap | measured / predicted |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    errors = {"no": [], "yes": []}
    for model in sorted(grad):
        one = (model, "1x1", "flat", "unshaped", "bare")
        ips1 = med(one, "images_per_s")
        for layout in ("2x1", "2x2"):
            n = WORLD[layout]
            bare = med((model, layout, "flat", "unshaped", "bare"), "step_ms")
            for algo in ("flat", "hierarchical"):
                if layout == "2x1" and algo == "hierarchical":
                    continue  # one rank per host: the same as flat
                for link in ("unshaped", "10gbit", "1gbit"):
                    key = (model, layout, algo, link, "ddp")
                    if key not in rows:
                        continue
                    step = med(key, "step_ms")
                    wait = med(key, "wait_ms")
                    ips = med(key, "images_per_s")
                    cells = ["–"] * 4
                    if link in RATE:
                        crossing = (2 * (n - 1) / n if algo == "flat" else 1.0)
                        comm = 1e3 * crossing * grad[model] / RATE[link]
                        p_no = bare + comm
                        p_ov = bare + max(0.0, comm - 2 / 3 * bare)
                        errors["no"].append(step / p_no)
                        errors["yes"].append(step / p_ov)
                        cells = [f"{p_no:.0f}", f"{step / p_no:.2f}",
                                 f"{p_ov:.0f}", f"{step / p_ov:.2f}"]
                    print(f"| {model} | {layout.replace('x', ' x ')} | {algo} | "
                          f"{link} | {step:.0f} | {wait:.0f} | {ips / (n * ips1):.2f} | "
                          f"{bare / step:.2f} | " + " | ".join(cells) + " |")
    print(f"\nOne rank alone (bare): " + ", ".join(
        f"{m} {med((m, '1x1', 'flat', 'unshaped', 'bare'), 'step_ms'):.0f} ms"
        for m in sorted(grad)) + "; gradient bytes: " + ", ".join(
        f"{m} {grad[m] / 2**20:.1f} MiB" for m in sorted(grad)))
    for kind, label in (("no", "without overlap"), ("yes", "with overlap")):
        e = errors[kind]
        if e:
            print(f"Projection {label}, measured / predicted over the shaped "
                  f"points: median {statistics.median(e):.2f}, range "
                  f"{min(e):.2f}-{max(e):.2f} ({len(e)} points).")


# ------------------------------------------------ projection to GPU clusters
# The recipe: flower_photos split 8:2 -> 2936 training images, batch 16 per
# GPU, drop_last; its plot gives 9 s per epoch on 1 GPU, so one step took
# 9 s / 183 = 49 ms there. ResNet-50's step is scaled from it by forward
# FLOPs at 224 px (4.1 G against 3.6 G): an assumption, not a measurement.
TRAIN_IMAGES, BATCH = 2936, 16
T1_R34 = RECIPE[1] / (TRAIN_IMAGES // BATCH)
MODELS = [  # name, gradient bytes (fp32), one step on one GPU (s)
    ("ResNet-34 (5 classes)", 21.29e6 * 4, T1_R34),
    ("ResNet-50 (1000 classes)", 25.56e6 * 4, T1_R34 * 4.1 / 3.6),
]
NVLINK = (300e9, 5e-6)  # bytes/s per direction, latency per message
NETS = [("100 Gbit/s", 100e9 / 8, 10e-6), ("400 Gbit/s", 400e9 / 8, 10e-6)]
BUCKET = 25 * 2**20


def comm_time(nbytes, hosts, per_host, net, hierarchical):
    """One step's gradient all-reduce, in buckets of 25 MiB (latency per
    bucket): flat = one ring over every GPU, whose slowest edges are the
    host's network link (2(N-1)/N x bytes each); hierarchical = a ring
    inside each host over NVLink, then one between the hosts' leaders."""
    buckets = math.ceil(nbytes / BUCKET)
    n = hosts * per_host
    t = 0.0
    for _ in range(buckets):
        b = nbytes / buckets
        if hosts == 1:
            t += ring_time(b, n, *NVLINK)
        elif hierarchical:
            t += ring_time(b, per_host, *NVLINK) + ring_time(b, hosts, net[1], net[2])
        else:
            t += ring_time(b, n, net[1], net[2])
    return t


def project():
    print("Model, not measurement: step = T1 + T_comm (no overlap) or "
          "T1 + max(0, T_comm - 2/3 T1) (overlap); efficiency = T1 / step.\n")
    for name, nbytes, t1 in MODELS:
        print(f"**{name}**: gradients {nbytes / 1e6:.0f} MB, T1 = {t1 * 1e3:.0f} ms "
              f"per step of batch {BATCH}.\n")
        print("| GPUs | link between hosts | all-reduce | step, no overlap | "
              "efficiency | step, overlap | efficiency | epoch (flowers), overlap | "
              "recipe's epoch |")
        print("|---|---|---|---|---|---|---|---|---|")
        layouts = [(1, g) for g in (1, 2, 4, 8)] + [(h, 8) for h in (2, 4, 8, 16)]
        for hosts, g in layouts:
            nets = [("NVLink only", None, None)] if hosts == 1 else NETS
            for net in nets:
                algos = ["ring"] if hosts == 1 else ["flat", "hierarchical"]
                for algo in algos:
                    tc = comm_time(nbytes, hosts, g, net, algo == "hierarchical")
                    no = t1 + tc
                    ov = t1 + max(0.0, tc - 2 / 3 * t1)
                    n = hosts * g
                    epoch = (TRAIN_IMAGES // (BATCH * n)) * ov
                    recipe = f"{RECIPE[n]:.1f} s" if hosts == 1 and n in RECIPE \
                        and name.startswith("ResNet-34") else ""
                    print(f"| {hosts} x {g} | {net[0]} | {algo} | {no * 1e3:.1f} ms | "
                          f"{100 * t1 / no:.0f}% | {ov * 1e3:.1f} ms | {100 * t1 / ov:.0f}% | "
                          f"{epoch:.2f} s | {recipe} |")
        print()


if __name__ == "__main__":
    if sys.argv[1:] == ["--project"]:
        project()
    else:
        main(sys.argv[1])
