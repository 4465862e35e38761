#!/usr/bin/env python3
"""PyTorch 2.11's DDP at 32 / bf16-mixed x NCHW / channels-last, for
scripts/bench-precision.sh's numbers to stand beside.

torchvision's resnet34 (5 classes), DistributedDataParallel over gloo on
loopback, 2 ranks x 1 intra-op thread, batch 16 per rank, SGD(lr 0.01,
momentum 0.9), cross entropy, one fixed random batch (no data loading:
ddpkit's script includes its JPEG pipeline, so compare ratios, not images
per second), torch.autocast("cpu", torch.bfloat16) for bf16-mixed, the
model and the batch in torch.channels_last for channels-last. The four
settings alternate within each round; each prints training images per
second over STEPS steps after 2 warm-up steps.

  .venv/bin/python3 scripts/bench_pytorch_precision.py [SIZE] [STEPS] [ROUNDS]
"""
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
import torchvision


def worker(rank, world, port, size, steps, prec, fmt, queue):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torchvision.models.resnet34(num_classes=5)
    x = torch.randn(16, 3, size, size)
    y = torch.randint(0, 5, (16,))
    if fmt == "channels-last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=prec == "bf16-mixed"):
            out = ddp(x)
        F.cross_entropy(out.float(), y).backward()
        opt.step()

    for _ in range(2):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    if rank == 0:
        queue.put(world * 16 * steps / (time.perf_counter() - t0))
        queue.close()
        queue.join_thread()  # the value is sent before the process ends
    sys.stdout.flush()
    os._exit(0)  # not destroy_process_group: it can deadlock in 2.11


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    print(f"PyTorch {torch.__version__} DDP resnet34: {size} px, batch 16 x 2 ranks "
          f"x 1 thread, {steps} steps after 2 warm-up", flush=True)
    ctx = mp.get_context("spawn")
    settings = [("32", "contiguous"), ("bf16-mixed", "contiguous"),
                ("32", "channels-last"), ("bf16-mixed", "channels-last")]
    for r in range(1, rounds + 1):
        base = None
        for prec, fmt in settings:
            q = ctx.Queue()
            port = free_port()
            ps = [ctx.Process(target=worker, args=(k, 2, port, size, steps, prec, fmt, q))
                  for k in range(2)]
            for p in ps:
                p.start()
            ips = q.get()
            for p in ps:
                p.join()
            base = base or ips
            print(f"round {r}  {prec:<11} {fmt:<14} {ips:8.2f} images/s  x{ips / base:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
