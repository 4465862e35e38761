#!/usr/bin/env python3
"""PyTorch 2.11's DDP at 32 / bf16-mixed x NCHW / channels-last, for
ddpkit's numbers to stand beside.

DistributedDataParallel over gloo on loopback, 2 ranks x 1 intra-op
thread, one fixed random batch per rank (no data loading),
torch.autocast("cpu", torch.bfloat16) for bf16-mixed (the loss in
float32), the model and the batch in torch.channels_last for
channels-last. Models: torchvision's resnet34 (10 classes) and the CIFAR
net, SGD(lr 0.01, momentum 0.9), cross entropy; the char LM (ddpkit's
examples/char_lm model: the same layers, written out here), AdamW(3e-3,
weight decay 0.01), cross entropy over every position. Images (sequences)
per second = world x batch / rank 0's median step time, as
benchmarks/ddp_bench.cpp's precision section computes them.

  .venv/bin/python3 scripts/bench_pytorch_precision.py [SIZE] [STEPS] [ROUNDS]
      ResNet-34 at SIZE px, batch 16, the four settings alternating
  .venv/bin/python3 scripts/bench_pytorch_precision.py --one MODEL SIZE BATCH STEPS PREC FMT [--op-profile N LIB]
      one setting (MODEL resnet34 | cifarnet | charlm, SIZE the context for
      charlm; PREC 32 | bf16-mixed; FMT contiguous | channels-last): one
      JSON line (benchmarks/precision_bench.py runs this). With
      --op-profile N LIB, N more steps give the wall time inside outermost
      aten:: operators, by name, measured by LIB (BUILD/benchmarks/
      libddpkit_op_profile.so, built against this torch): the code that
      measures ddpkit's side, so both have the same overhead.
"""
import json
import math
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 96  # benchmarks/ddp_bench.cpp's kCharVocab


class Block(nn.Module):
    """examples/char_lm/char_model.hpp's pre-LayerNorm block."""

    def __init__(self, c, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(c)
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)
        self.ln2 = nn.LayerNorm(c)
        self.mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))

    def attn(self, x):
        b, t, c = x.shape
        h = self.heads
        q, k, v = self.qkv(x).view(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        att = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))
        future = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = torch.softmax(att.masked_fill(future, float("-inf")), -1)
        return self.proj(torch.matmul(att, v).transpose(1, 2).reshape(b, t, c))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharTransformer(nn.Module):
    """examples/char_lm's model at its defaults (embed 64, 4 heads, 2 blocks)."""

    def __init__(self, context, c=64, heads=4, layers=2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, c)
        self.pos = nn.Embedding(context, c)
        self.blocks = nn.Sequential(*[Block(c, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(c)
        self.head = nn.Linear(c, VOCAB)

    def forward(self, x):
        pos = torch.arange(x.size(1))
        return self.head(self.ln_f(self.blocks(self.tok(x) + self.pos(pos))))


def make(model_name, size, batch):
    if model_name == "charlm":
        return (CharTransformer(size), torch.randint(0, VOCAB, (batch, size)),
                torch.randint(0, VOCAB, (batch, size)))
    if model_name == "cifarnet":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_pytorch_ddp import CifarNet
        model = CifarNet(10)
    else:
        import torchvision
        model = torchvision.models.resnet34(num_classes=10)
    return model, torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))


def load_op_profile(lib):
    """benchmarks/op_profile_lib.cpp, built against this torch: the code
    that times ddpkit's operators (ddp_bench --op-profile), for PyTorch's."""
    import ctypes
    so = ctypes.CDLL(lib)
    so.ddpkit_op_profile_torch_version.restype = ctypes.c_char_p
    so.ddpkit_op_profile_start.restype = None
    so.ddpkit_op_profile_stop.restype = ctypes.c_char_p
    built = so.ddpkit_op_profile_torch_version().decode()
    if built != torch.__version__.split("+")[0]:
        raise OSError(f"built against libtorch {built}, but this Python runs torch "
                      f"{torch.__version__}")
    return so


def worker(rank, world, port, model_name, size, batch, steps, prec, fmt, queue,
           op_profile=0, op_profile_lib=None):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model, x, y = make(model_name, size, batch)
    if fmt == "channels-last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    if model_name == "charlm":
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)

    def step():
        opt.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=prec == "bf16-mixed"):
            out = ddp(x)
        F.cross_entropy(out.float().reshape(-1, out.size(-1)), y.reshape(-1)).backward()
        opt.step()

    for _ in range(2):
        step()
    dist.barrier()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    dist.barrier()
    result = {"images_per_s": world * batch / statistics.median(times),
              "step_ms": 1e3 * statistics.median(times)}
    if op_profile > 0:  # more steps, every rank's operators timed
        so = load_op_profile(op_profile_lib)
        so.ddpkit_op_profile_start()
        t0 = time.perf_counter()
        for _ in range(op_profile):
            step()
        total = time.perf_counter() - t0
        ops = json.loads(so.ddpkit_op_profile_stop())
        result.update(
            profiled_steps=op_profile, profiled_step_ms=1e3 * total / op_profile,
            in_ops_ms=1e3 * sum(v[0] for v in ops.values()) / op_profile,
            ops={k: [1e3 * v[0] / op_profile, v[1] / op_profile] for k, v in ops.items()})
        dist.barrier()
    if rank == 0:
        queue.put(result)
        queue.close()
        queue.join_thread()  # the value is sent before the process ends
    sys.stdout.flush()
    os._exit(0)  # not destroy_process_group: it can deadlock in 2.11


def run(model_name, size, batch, steps, prec, fmt, op_profile=0, op_profile_lib=None):
    """Rank 0's result: images_per_s and step_ms, and with op_profile > 0
    the operator profile of that many more steps."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    ps = [ctx.Process(target=worker,
                      args=(k, 2, port, model_name, size, batch, steps, prec, fmt, q,
                            op_profile, op_profile_lib))
          for k in range(2)]
    for p in ps:
        p.start()
    try:
        res = q.get(timeout=3600)  # a dead worker must not hang the caller
    except Exception:
        for p in ps:
            p.kill()
        sys.exit(f"bench_pytorch_precision: {model_name} {prec} {fmt}: no result "
                 f"(worker exit codes {[p.exitcode for p in ps]})")
    for p in ps:
        p.join()
    return res


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        argv, op_profile, lib = sys.argv[2:], 0, None
        if len(argv) == 9 and argv[6] == "--op-profile":
            if not argv[7].isdigit():
                sys.exit(f"bench_pytorch_precision: --op-profile {argv[7]!r}: expected a "
                         "number of steps (an integer >= 0)")
            argv, op_profile, lib = argv[:6], int(argv[7]), argv[8]
            try:
                load_op_profile(lib)
            except OSError as e:
                sys.exit(f"bench_pytorch_precision: --op-profile library {lib}: {e} "
                         "(build the ddpkit_op_profile target against this torch)")
        if len(argv) != 6:
            sys.exit("usage: bench_pytorch_precision.py --one MODEL SIZE BATCH STEPS PREC FMT "
                     "[--op-profile N LIBDDPKIT_OP_PROFILE.so]")
        m, size, batch, steps, prec, fmt = argv
        if m not in ("resnet34", "cifarnet", "charlm") or prec not in ("32", "bf16-mixed") \
                or fmt not in ("contiguous", "channels-last"):
            sys.exit(f"bench_pytorch_precision: unknown model {m!r}, precision {prec!r} "
                     f"or format {fmt!r} (expected resnet34|cifarnet|charlm, 32|bf16-mixed, "
                     "contiguous|channels-last)")
        res = run(m, int(size), int(batch), int(steps), prec, fmt, op_profile, lib)
        print(json.dumps({"torch": torch.__version__, "model": m, "size": int(size),
                          "batch": int(batch), "precision": prec, "format": fmt, **res}),
              flush=True)
        return
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    print(f"PyTorch {torch.__version__} DDP resnet34: {size} px, batch 16 x 2 ranks "
          f"x 1 thread, {steps} steps after 2 warm-up", flush=True)
    settings = [("32", "contiguous"), ("bf16-mixed", "contiguous"),
                ("32", "channels-last"), ("bf16-mixed", "channels-last")]
    for r in range(1, rounds + 1):
        base = None
        for prec, fmt in settings:
            ips = run("resnet34", size, 16, steps, prec, fmt)["images_per_s"]
            base = base or ips
            print(f"round {r}  {prec:<11} {fmt:<14} {ips:8.2f} images/s  x{ips / base:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
