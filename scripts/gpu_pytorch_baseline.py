#!/usr/bin/env python3
"""PyTorch eager twin of ddpkit's GPU throughput runs (scripts/gpu-check.sh).

torchvision's resnet34 (5 classes), the flowers recipe's optimizer (SGD,
momentum 0.9, weight decay 0.005), cross-entropy, at --precision 32,
16-mixed (torch.autocast float16 + torch.amp.GradScaler; --amp is its
alias) or bf16-mixed (torch.autocast bfloat16, no scaler), NCHW or
--channels-last (model and inputs). Two data settings:

  --data tensors        random batches already on the device (the step alone)
  --data folder=DIR     an ImageFolder of JPEGs (flowers-resnet34's generated
                        folder), the recipe's transforms, DataLoader workers,
                        one training pass of --steps batches then the
                        validation pass over --val-images images: the same
                        definition as ddpkit's images_per_second (training
                        images / epoch seconds, validation included)

Prints one JSON object per run.
"""
import argparse
import json
import sys
import time

import torch
import torchvision


FOREACH = None  # torch.optim's default: multi-tensor kernels on CUDA


def build(device, amp, channels_last=False):
    torch.manual_seed(0)
    model = torchvision.models.resnet34(num_classes=5).to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.001, momentum=0.9,
                          weight_decay=0.005, foreach=FOREACH)
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    return model, opt, scaler


AUTOCAST = {"32": None, "16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}
PRECISION = "32"
LAYOUT = torch.contiguous_format


def autocast():
    dtype = AUTOCAST[PRECISION]
    return torch.autocast("cuda", dtype=dtype or torch.float16,
                          enabled=dtype is not None)


def train_step(model, opt, scaler, x, y, amp):
    opt.zero_grad(set_to_none=True)
    x = x.contiguous(memory_format=LAYOUT)
    with autocast():
        out = model(x)
    loss = torch.nn.functional.cross_entropy(out.float(), y)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


def run_tensors(args, device):
    model, opt, scaler = build(device, args.amp, args.channels_last)
    model.train()
    xs = [torch.randn(args.batch_size, 3, args.image_size, args.image_size,
                      device=device).contiguous(memory_format=LAYOUT)
          for _ in range(4)]
    ys = [torch.randint(0, 5, (args.batch_size,), device=device)
          for _ in range(4)]
    for i in range(args.warmup):
        train_step(model, opt, scaler, xs[i % 4], ys[i % 4], args.amp)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for i in range(args.steps):
        train_step(model, opt, scaler, xs[i % 4], ys[i % 4], args.amp)
    torch.cuda.synchronize(device)
    secs = time.perf_counter() - t0
    return {"seconds": round(secs, 4),
            "img_per_s": round(args.steps * args.batch_size / secs, 1)}


def run_folder(args, device, root):
    from torchvision import transforms as T
    norm = T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    train_tf = T.Compose([T.RandomResizedCrop(args.image_size),
                          T.RandomHorizontalFlip(), T.ToTensor(), norm])
    val_tf = T.Compose([T.Resize(int(args.image_size * 256 / 224)),
                        T.CenterCrop(args.image_size), T.ToTensor(), norm])
    train_set = torchvision.datasets.ImageFolder(root, train_tf)
    val_set = torchvision.datasets.ImageFolder(root, val_tf)
    g = torch.Generator().manual_seed(0)
    val_idx = torch.randperm(len(val_set), generator=g)[:args.val_images].tolist()
    loader = torch.utils.data.DataLoader(
        train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
        num_workers=args.workers, pin_memory=True, persistent_workers=True)
    val_loader = torch.utils.data.DataLoader(
        torch.utils.data.Subset(val_set, val_idx), batch_size=args.batch_size,
        num_workers=args.workers, pin_memory=True, persistent_workers=True)
    model, opt, scaler = build(device, args.amp, args.channels_last)

    def epoch():
        model.train()
        n = 0
        t0 = time.perf_counter()
        while n < args.steps:
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                train_step(model, opt, scaler, x, y, args.amp)
                n += 1
                if n >= args.steps:
                    break
        model.eval()
        with torch.no_grad(), autocast():
            for x, y in val_loader:
                x = x.to(device, non_blocking=True).contiguous(memory_format=LAYOUT)
                model(x).argmax(1).eq(
                    y.to(device, non_blocking=True)).sum()
        torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    epoch()  # warm-up epoch: workers start, cuDNN picks its algorithms
    secs = epoch()
    return {"seconds": round(secs, 4),
            "img_per_s": round(args.steps * args.batch_size / secs, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="tensors")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--val-images", type=int, default=0)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--precision", default="32", choices=sorted(AUTOCAST))
    p.add_argument("--amp", action="store_true", help="--precision 16-mixed")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--no-foreach", action="store_true",
                   help="SGD's per-parameter loop instead of its multi-tensor "
                        "kernels (what libtorch's C++ SGD does)")
    args = p.parse_args()
    global PRECISION, LAYOUT, FOREACH
    if args.no_foreach:
        FOREACH = False
    if args.amp:
        args.precision = "16-mixed"
    args.amp = args.precision == "16-mixed"  # the GradScaler's switch
    PRECISION = args.precision
    if args.channels_last:
        LAYOUT = torch.channels_last
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA device is visible")
    device = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = False  # as libtorch's default
    if args.data == "tensors":
        r = run_tensors(args, device)
        data = "tensors"
    elif args.data.startswith("folder="):
        r = run_folder(args, device, args.data[len("folder="):])
        data = "jpeg-folder"
    else:
        sys.exit(f"error: --data '{args.data}' must be tensors or folder=DIR")
    r.update({"impl": "pytorch", "data": data,
              "mode": {"32": "fp32", "16-mixed": "amp", "bf16-mixed": "bf16"}[args.precision],
              "layout": "channels-last" if args.channels_last else "contiguous",
              "foreach": not args.no_foreach,
              "device": "cuda",
              "image_size": args.image_size, "batch_size": args.batch_size,
              "steps": args.steps, "torch": torch.__version__})
    print(json.dumps(r))


if __name__ == "__main__":
    main()
