#!/usr/bin/python3
"""PyTorch's own DDP timed the way benchmarks/ddp_bench.cpp times ddpkit.

Per model, world 1 (the bare model, like ddpkit's world-1 engine, which has
no reducer) and world 2 (torch.nn.parallel.DistributedDataParallel over gloo
on loopback), one intra-op thread per rank, the same per-rank batch and image
size, SGD(lr 0.01, momentum 0.9), cross entropy, a fixed random batch.
broadcast_buffers=False on both sides (ddpkit's default; PyTorch's default
would add one buffer broadcast per forward).

Needs Debian's PyTorch: run with /usr/bin/python3 (torch + torchvision).

  /usr/bin/python3 scripts/bench_pytorch_ddp.py --out r.json [--quick]
"""
import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F


class CifarNet(nn.Module):
    """ddpkit::nn::CifarNet's layer table (width 32: 620,586 parameters)."""

    def __init__(self, num_classes=10, w=32, dropout=0.25):
        super().__init__()
        layers = []
        for cin, cout in ((3, w), (w, 2 * w), (2 * w, 4 * w)):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                       nn.BatchNorm2d(cout), nn.ReLU(True), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(16 * 4 * w, 256), nn.ReLU(True),
            nn.Dropout(dropout), nn.Linear(256, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))


def make_model(name):
    import torchvision
    if name == "resnet18":
        return torchvision.models.resnet18(num_classes=10)
    if name == "resnet34":
        return torchvision.models.resnet34(num_classes=10)
    if name == "cifarnet":
        return CifarNet(10)
    raise ValueError(name)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank, world, port, spec, out_path):
    torch.set_num_threads(spec["threads"])
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
    torch.manual_seed(1)
    model = make_model(spec["model"])
    if world > 1:
        model = nn.parallel.DistributedDataParallel(
            model, broadcast_buffers=False,
            bucket_cap_mb=spec["bucket_mib"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    torch.manual_seed(1234 + rank)
    b, s = spec["batch"], spec["image"]
    x = torch.randn(b, 3, s, s)
    y = torch.randint(10, (b,))
    if world > 1:
        dist.barrier()
    times = []
    for i in range(spec["warmup"] + spec["steps"]):
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        dt = time.perf_counter() - t0
        if i == spec["warmup"] - 1:
            cpu0 = time.process_time()
        if i >= spec["warmup"]:
            times.append(dt)
    cpu_ms = 1e3 * (time.process_time() - cpu0) / len(times)
    rec = {}
    if world > 1:
        try:  # PyTorch samples these itself (CPU timer; may be absent)
            d = model._get_ddp_logging_data()
            for k in ("avg_backward_comm_time", "avg_backward_compute_time",
                      "avg_backward_compute_comm_overlap_time"):
                if k in d:
                    rec[k + "_ms"] = d[k] / 1e6
        except Exception:  # noqa: BLE001
            pass
    if rank == 0:
        med = statistics.median(times)
        rec.update({
            "step_ms": 1e3 * med,
            "step_ms_mean": 1e3 * statistics.fmean(times),
            "step_ms_min": 1e3 * min(times),
            "cpu_ms_per_step": cpu_ms,
            "step_ms_max": 1e3 * max(times),
            "images_per_s": world * b / med,
            "steps": len(times),
        })
        with open(out_path, "w") as f:
            json.dump(rec, f)
    if world > 1:
        dist.destroy_process_group()


def run_world(world, spec):
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    mp.spawn(rank_main, args=(world, free_port(), spec, path), nprocs=world,
             join=True)
    with open(path) as f:
        rec = json.load(f)
    os.unlink(path)
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--round", type=int, default=1)
    ap.add_argument("--models", default="resnet18@64/b8,cifarnet@32/b32,resnet18@96/b16")
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--bucket-mib", type=float, default=25)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    records = []
    for m in a.models.split(","):
        name, rest = m.split("@")
        image, batch = rest.split("/b")
        steps = 40 if name == "cifarnet" else (6 if int(image) > 64 else 12)
        if not a.quick:
            steps *= 2
        spec = dict(model=name, image=int(image), batch=int(batch),
                    steps=steps, warmup=3, threads=a.threads,
                    bucket_mib=a.bucket_mib)
        for w in (int(x) for x in a.worlds.split(",")):
            rec = run_world(w, spec)
            rec.update(impl="pytorch", model=m, world=w, round=a.round,
                       torch=torch.__version__)
            print(f"pytorch {m} world {w}: {rec['step_ms']:.2f} ms/step",
                  file=sys.stderr)
            records.append(rec)
    with open(a.out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
