#!/usr/bin/env python3
"""torchvision's ImageFolder + DataLoader on the folder ddpkit's data_bench
reads, with the same training transform (RandomResizedCrop(224),
RandomHorizontalFlip, ToTensor, Normalize), one process, one thread
(torch.set_num_threads(1), num_workers=0), so the images/s compare with
BM_JpegFolderPipeline (one ddpkit worker's work on one thread).

With --ours PATH_TO_data_bench it runs both, alternating, --repeats times,
on the same folder, and prints the ratio per run and its spread:

    DDPKIT_BENCH_JPEG_DIR=/tmp/jpeg ./data_bench --benchmark_filter=Eval  # writes the folder once
    /usr/bin/python3 scripts/bench_torchvision_loader.py /tmp/jpeg --ours ./data_bench --repeats 3

Rates are given per wall-clock second and per CPU second of the process
(time.process_time / CLOCK_PROCESS_CPUTIME_ID): on a shared machine the
CPU-second rate is the steadier measure of work per core.
"""
import argparse
import json
import os
import statistics
import subprocess
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def torchvision_rate(folder, size, batch_size, epochs):
    torch.set_num_threads(1)
    tf = transforms.Compose([
        transforms.RandomResizedCrop(size),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(folder, transform=tf)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=0)
    for _ in loader:  # warm-up epoch (file cache, allocator)
        pass
    images, wall0, cpu0 = 0, time.perf_counter(), time.process_time()
    for _ in range(epochs):
        for x, y in loader:
            images += y.numel()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    return images / wall, images / cpu, images


def ours_rate(binary, folder, min_time):
    env = dict(os.environ, DDPKIT_BENCH_JPEG_DIR=folder)
    out = subprocess.run(
        [binary, "--benchmark_filter=BM_JpegFolderPipeline", "--benchmark_format=json",
         f"--benchmark_min_time={min_time}"],
        env=env, check=True, capture_output=True, text=True).stdout
    rates = {}
    for b in json.loads(out)["benchmarks"]:
        fast = "fast_decode:1" in b["name"]
        rates[fast] = (b["images/s"], b["images/cpu_s"])
    return rates


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="ImageFolder root (one subfolder per class)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--ours", help="path of ddpkit's data_bench binary: run both, side by side")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--min-time", type=float, default=3.0,
                   help="seconds per ddpkit benchmark (Google Benchmark min_time)")
    args = p.parse_args()

    rows = []
    for r in range(args.repeats):
        tv_wall, tv_cpu, n = torchvision_rate(args.folder, args.size, args.batch_size, args.epochs)
        print(f"[{r + 1}] torchvision ImageFolder+DataLoader (num_workers=0, 1 thread, "
              f"{args.size}px): {tv_wall:.1f} images/s wall, {tv_cpu:.1f} images/cpu_s "
              f"over {n} images", flush=True)
        if not args.ours:
            continue
        ours = ours_rate(args.ours, args.folder, args.min_time)
        for fast in (False, True):
            wall, cpu = ours[fast]
            print(f"[{r + 1}] ddpkit ImageNetTrain (fast_decode={int(fast)}, 1 thread): "
                  f"{wall:.1f} images/s wall, {cpu:.1f} images/cpu_s; ratio "
                  f"{wall / tv_wall:.2f}x wall, {cpu / tv_cpu:.2f}x cpu", flush=True)
        rows.append((ours[False][0] / tv_wall, ours[False][1] / tv_cpu,
                     ours[True][0] / tv_wall, ours[True][1] / tv_cpu))
    if rows:
        names = ["accurate wall", "accurate cpu", "fast wall", "fast cpu"]
        for i, name in enumerate(names):
            v = [row[i] for row in rows]
            print(f"ratio ddpkit/torchvision, {name}: min {min(v):.2f}x, "
                  f"median {statistics.median(v):.2f}x, max {max(v):.2f}x over {len(v)} runs")


if __name__ == "__main__":
    main()
