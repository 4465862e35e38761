#!/usr/bin/env python3
"""Fails when a header under include/ddpkit/ includes a higher layer.

The layers, lowest first (docs/DESIGN.md, "Module map", states the same
order; change both together):

  0  detail/, version.hpp         error types, files, pickle reading, the
                                  libtorch-version shims: no ddpkit
  1  concepts.hpp                 the policy concepts
  2  distributed/, distributed.hpp
                                  environment, rendezvous, groups, collectives
  3  data/, data.hpp | nn/        datasets and loaders | modules (two folders
                                  of one layer: neither includes the other)
  4  parallel/, parallel.hpp |    SingleDevice, DataParallel, DDP engines and
     testing/, testing.hpp        the engine contract | data tests make
  5  train/, train.hpp            the Trainer and its parts
  6  cli.hpp, policies.hpp,       what programs include
     image.hpp, ddpkit.hpp

A header may include its own folder and any lower layer, never a higher one
nor the other folder of its own layer.

  scripts/check-layers.py [INCLUDE_DIR]   (default: include/ of this repo)
"""
import pathlib
import re
import sys

LAYERS = [
    (0, "detail", ["detail/", "version.hpp"]),
    (1, "concepts", ["concepts.hpp"]),
    (2, "distributed", ["distributed/", "distributed.hpp"]),
    (3, "data", ["data/", "data.hpp"]),
    (3, "nn", ["nn/"]),
    (4, "parallel", ["parallel/", "parallel.hpp"]),
    (4, "testing", ["testing/", "testing.hpp"]),
    (5, "train", ["train/", "train.hpp"]),
    (6, "top", ["cli.hpp", "policies.hpp", "image.hpp", "ddpkit.hpp"]),
]


def module_of(rel):
    for rank, name, prefixes in LAYERS:
        if any(rel == p or (p.endswith("/") and rel.startswith(p)) for p in prefixes):
            return rank, name
    return None


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else
                        pathlib.Path(__file__).resolve().parent.parent / "include")
    base = root / "ddpkit"
    if not base.is_dir():
        sys.exit(f"check-layers: {base} is not a folder")
    include = re.compile(r'^\s*#\s*include\s+[<"]ddpkit/([^">]+)[">]')
    problems, headers = [], 0
    for path in sorted(base.rglob("*.hpp")):
        rel = path.relative_to(base).as_posix()
        mine = module_of(rel)
        headers += 1
        if mine is None:
            problems.append(f"{path}: in no layer (add its folder to scripts/check-layers.py and docs/DESIGN.md)")
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            m = include.match(line)
            if not m:
                continue
            theirs = module_of(m.group(1))
            if theirs is None:
                problems.append(f"{path}:{n}: includes ddpkit/{m.group(1)}, which is in no layer")
            elif theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1]):
                problems.append(
                    f"{path}:{n}: {mine[1]} (layer {mine[0]}) includes ddpkit/{m.group(1)} "
                    f"({theirs[1]}, layer {theirs[0]}): a header may include only its own "
                    f"folder and lower layers")
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"check-layers: {len(problems)} include(s) break the layering", file=sys.stderr)
        return 1
    print(f"check-layers: {headers} headers, every ddpkit include goes down or stays in its folder")
    return 0


if __name__ == "__main__":
    sys.exit(main())
