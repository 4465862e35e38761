#!/usr/bin/env python3
"""torchvision's ImageFolder + DataLoader on the folder ddpkit's data_bench
reads, with the same training transform (RandomResizedCrop(224),
RandomHorizontalFlip, ToTensor, Normalize), one process, one thread
(num_workers=0), so the images/s compare with BM_JpegFolderPipeline.

    DDPKIT_BENCH_JPEG_DIR=/tmp/jpeg ./data_bench   # writes the folder once
    python3 scripts/bench_torchvision_loader.py /tmp/jpeg
"""
import argparse
import time

import torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", help="ImageFolder root (one subfolder per class)")
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()

    torch.set_num_threads(1)
    tf = transforms.Compose([
        transforms.RandomResizedCrop(args.size),
        transforms.RandomHorizontalFlip(),
        transforms.ToTensor(),
        transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
    ])
    ds = datasets.ImageFolder(args.folder, transform=tf)
    loader = DataLoader(ds, batch_size=args.batch_size, shuffle=True, num_workers=0)
    for _ in loader:  # warm-up epoch (file cache, allocator)
        pass
    images, start = 0, time.perf_counter()
    for _ in range(args.epochs):
        for x, y in loader:
            images += y.numel()
    dt = time.perf_counter() - start
    print(f"torchvision ImageFolder+DataLoader (num_workers=0, 1 thread, {args.size}px): "
          f"{images / dt:.1f} images/s over {images} images")


if __name__ == "__main__":
    main()
