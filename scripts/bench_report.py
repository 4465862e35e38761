#!/usr/bin/env python3
"""Turns bench-results/*.json into bench-results/summary.md, summary.json and
SVG charts (speedup, efficiency, all-reduce bandwidth). Standard library only.

  python3 scripts/bench_report.py bench-results

Inputs (any may be missing):
  overhead_ddpkit_r*.json   ddpkit_ddp_bench --sections=overhead (Google Benchmark JSON)
  overhead_pytorch_r*.json  scripts/bench_pytorch_ddp.py
  ddp.json                  ddpkit_ddp_bench --sections=decompose,local,buckets,scaling
  comm.json                 ddpkit_comm_bench
  data.json                 ddpkit_data_bench
  machine.txt               lscpu | head, written by run-benchmarks.sh
"""
import glob
import json
import math
import os
import re
import statistics
import sys

# The reference recipe's own figures (1/2/4/8 GPUs, seconds per epoch).
RECIPE = {1: 9.0, 2: 5.5, 4: 3.0, 8: 2.0}
# Links for the projection: (name, bytes/s, per-message latency seconds).
LINKS = [
    ("NVLink 300 GB/s", 300e9, 5e-6),
    ("100 Gb/s Ethernet", 100e9 / 8, 20e-6),
    ("10 Gb/s Ethernet", 10e9 / 8, 50e-6),
]
PROJ_WORKERS = [2, 4, 8, 16, 32, 64, 128, 256]
# Measured GPU step times for the projection's GPU tables, by model: the H200
# step of ResNet-34 at 224 px, batch 64, float32 NCHW (ddpkit's SingleDevice
# engine, 2905 and 2933 img/s in runs 1 and 2: docs/GPU.md, part 4). A model
# with no measured GPU step gets no GPU table.
GPU_STEP_S = {"resnet34@64/b8": (64 / 2919,
                                 "the H200's measured step for ResNet-34 at "
                                 "224 px, batch 64, float32 NCHW (docs/GPU.md, "
                                 "part 4: 2905-2933 img/s)")}


def load(path):
    with open(path) as f:
        return json.load(f)


def gb_entries(path):
    """Google Benchmark JSON -> list of (name, fields) without the suffixes."""
    if not os.path.exists(path):
        return []
    out = []
    for b in load(path).get("benchmarks", []):
        if b.get("error_occurred"):
            continue
        name = re.sub(r"/(iterations:\d+|manual_time|real_time|min_time:[\d.]+)",
                      "", b["name"])
        out.append((name, b))
    return out


def fmt(x, nd=2):
    return "–" if x is None else f"{x:.{nd}f}"


def spread(xs):
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.median(xs):.3f} (min {min(xs):.3f}, max {max(xs):.3f}, n={len(xs)})"


# ---------------------------------------------------------------- overhead
def overhead(res_dir, md, summary):
    def load_ours(pattern):
        table = {}  # (model, round) -> {world: entry}
        for p in sorted(glob.glob(os.path.join(res_dir, pattern))):
            for name, b in gb_entries(p):
                m = re.match(r"overhead/(.+)/world:(\d+)/round:(\d+)", name)
                if m:
                    table.setdefault((m[1], int(m[3])), {})[int(m[2])] = b
        return table
    ours = load_ours("overhead_ddpkit_r*.json")
    # The same binary with DDPKIT_SHM=0: gloo's loopback TCP, as PyTorch uses.
    ours_tcp = load_ours("overhead_ddpkittcp_r*.json")
    theirs = {}
    for p in sorted(glob.glob(os.path.join(res_dir, "overhead_pytorch_r*.json"))):
        for r in load(p):
            theirs.setdefault((r["model"], r["round"]), {})[r["world"]] = r
    if not ours and not theirs:
        return
    md.append("## DDP overhead: step time at world 2 over world 1 (same per-rank batch)\n")
    md.append("One intra-op thread per rank; world 1 is the bare model (ddpkit's "
              "world-1 engine has no reducer; PyTorch: no DDP wrapper). Ratio of "
              "median step times per round; `min` ratio = fastest step over fastest "
              "step (least disturbed by other jobs); CPU ratio = CPU seconds per "
              "step of rank 0, all threads. `ddpkit` uses its shared-memory "
              "all-reduce between ranks on one host (the default); `ddpkit-tcp` is "
              "the same binary with `DDPKIT_SHM=0`, i.e. gloo over loopback TCP "
              "like PyTorch.\n")
    md.append("| model | impl | round | world 1 ms | world 2 ms | ratio (median) | ratio (min) | CPU ratio | wait after backward |")
    md.append("|---|---|---|---|---|---|---|---|---|")
    models = sorted({k[0] for k in ours} | {k[0] for k in theirs})
    result = {}
    for model in models:
        agg = {k: [] for impl in ("ddpkit", "ddpkit-tcp", "pytorch")
               for k in (impl, impl + "_min", impl + "_cpu", impl + "_wait")}
        rounds = sorted({k[1] for k in ours if k[0] == model} |
                        {k[1] for k in ours_tcp if k[0] == model} |
                        {k[1] for k in theirs if k[0] == model})
        for r in rounds:
            for impl, table in (("ddpkit", ours), ("ddpkit-tcp", ours_tcp),
                                ("pytorch", theirs)):
                w = table.get((model, r), {})
                if 1 not in w or 2 not in w:
                    continue
                a, b = w[1], w[2]
                ratio = b["step_ms"] / a["step_ms"]
                rmin = b["step_ms_min"] / a["step_ms_min"]
                cpu = (b["cpu_ms_per_step"] / a["cpu_ms_per_step"]
                       if "cpu_ms_per_step" in a and "cpu_ms_per_step" in b else None)
                agg[impl].append(ratio)
                agg[impl + "_min"].append(rmin)
                if cpu:
                    agg[impl + "_cpu"].append(cpu)
                wait = "–"
                if impl.startswith("ddpkit"):
                    wait = f"{b['wait_ms']:.1f} ms ({100 * b['wait_frac']:.1f}% of step)"
                    agg[impl + "_wait"].append(b["wait_frac"])
                elif "avg_backward_comm_time_ms" in b:
                    wait = (f"PyTorch logs: comm {b['avg_backward_comm_time_ms']:.0f} ms, "
                            f"overlap {b.get('avg_backward_compute_comm_overlap_time_ms', 0):.0f} ms")
                md.append(f"| {model} | {impl} | {r} | {a['step_ms']:.1f} | {b['step_ms']:.1f} | "
                          f"**{ratio:.3f}** | {rmin:.3f} | {fmt(cpu, 3)} | {wait} |")
        result[model] = agg
        first = [ours[k] for k in sorted(ours) if k[0] == model and 1 in ours[k]]
        if first:
            summary.setdefault("_ours_world1", {})[model] = first[0]
    md.append("")
    md.append("Side by side (median over rounds, with min/max):\n")
    md.append("| model | ddpkit ratio | ddpkit-tcp ratio | PyTorch ratio | ddpkit min-step ratio | PyTorch min-step ratio | ddpkit CPU ratio | ddpkit-tcp CPU ratio | PyTorch CPU ratio | ddpkit wait/step | target ≤ 1.10 and ≤ PyTorch |")
    md.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for model, agg in result.items():
        ok = None
        if agg["ddpkit"]:
            o = statistics.median(agg["ddpkit"])
            p = statistics.median(agg["pytorch"]) if agg["pytorch"] else math.inf
            ok = "met" if o <= 1.10 and o <= p else (
                "≤ PyTorch, > 1.10" if o <= p else
                ("≤ 1.10, > PyTorch" if o <= 1.10 else "missed"))
        md.append(f"| {model} | {spread(agg['ddpkit'])} | {spread(agg['ddpkit-tcp'])} | "
                  f"{spread(agg['pytorch'])} | "
                  f"{spread(agg['ddpkit_min'])} | {spread(agg['pytorch_min'])} | "
                  f"{spread(agg['ddpkit_cpu'])} | {spread(agg['ddpkit-tcp_cpu'])} | "
                  f"{spread(agg['pytorch_cpu'])} | "
                  f"{spread(agg['ddpkit_wait'])} | {ok or '–'} |")
    md.append("")
    summary["overhead"] = result


# ------------------------------------------------------------- decompose
def decompose(entries, md, summary):
    rows = [(n, b) for n, b in entries if n.startswith("decompose/")]
    if not rows:
        return
    ws1 = {m: v[1] for m, v in summary.get("_ours_world1", {}).items()}
    md.append("## Where world 2's extra time goes (ddpkit, world 2)\n")
    md.append("`bare`: both ranks run the model with no communication at all (what "
              "sharing the cores, caches and memory costs); `ddp_nocomm`: the DDP engine "
              "with a strategy that sends nothing (adds the post-accumulate hooks and bucket bookkeeping; gradients are bucket views, so nothing is copied); "
              "`ddp`: the real thing; `flat`: bare model + one flat all-reduce after "
              "backward. CPU = CPU seconds per step of rank 0 (all threads, user + "
              "kernel); sys = kernel part (loopback TCP). On a saturated 2-core machine "
              "every extra CPU millisecond is a wall millisecond.\n")
    md.append("| model | mode | step ms | fastest step ms | wait ms | CPU ms | sys ms | CPU vs world-1 CPU |")
    md.append("|---|---|---|---|---|---|---|---|")
    out = {}
    for n, b in rows:
        m = re.match(r"decompose/(.+)/world:2/mode:(\w+)", n)
        base = ws1.get(m[1])
        r = b["cpu_ms_per_step"] / base["cpu_ms_per_step"] if base else None
        md.append(f"| {m[1]} | {m[2]} | {b['step_ms']:.1f} | {b['step_ms_min']:.1f} | "
                  f"{b['wait_ms']:.1f} | {b['cpu_ms_per_step']:.1f} | {b['sys_ms_per_step']:.1f} | {fmt(r, 3)} |")
        out[n] = {k: b[k] for k in ("step_ms", "step_ms_min", "wait_ms", "cpu_ms_per_step", "sys_ms_per_step")}
    if ws1:
        md.append("")
        md.append("World 1 for reference: " + "; ".join(
            f"{m}: step {v['step_ms']:.1f} ms, CPU {v['cpu_ms_per_step']:.1f} ms, sys {v.get('sys_ms_per_step', 0):.1f} ms"
            for m, v in ws1.items()))
    md.append("")
    summary["decompose"] = out


# ----------------------------------------------------------------- local
def local(entries, md, summary):
    rows = [(n, b) for n, b in entries if n.startswith("local/")]
    if not rows:
        return
    md.append("## Hooks and buckets in one process (no communication)\n")
    md.append("`ddp_engine_world1`: at world size 1 ddpkit creates no reducer (no hooks, "
              "no buckets), so it must equal `bare`. `reducer_hooks_no_comm`: a real "
              "`Reducer` with a communication strategy that sends nothing — gradient "
              "hooks and bucket bookkeeping — i.e. the reducer's own cost.\n")
    md.append("| entry | ms/step | vs bare |")
    md.append("|---|---|---|")
    bare = {}
    for n, b in rows:
        kind, model = n.split("/", 2)[1:]
        t = b["real_time"]
        if kind == "bare":
            bare[model] = t
        ref = bare.get(model)
        md.append(f"| {n} | {t:.2f} | {fmt(t / ref if ref else None, 3)} |")
    md.append("")
    summary["local"] = {n: b["real_time"] for n, b in rows}


# ------------------------------- side-by-side settings (hooks, SyncBN)
def side_by_side(entries, md, summary, prefix, setting, baseline, title, intro, columns):
    """Entries `prefix/<model>/world:2/<setting>:<value>/round:R`, each row
    with `columns` (counter, header, format) and its step time over the
    `baseline` value's entry of the same round."""
    rows = [(n, b) for n, b in entries if n.startswith(prefix + "/")]
    if not rows:
        return
    md.append(f"## {title}\n")
    if intro:
        md.append(intro + "\n")
    heads = " | ".join(h for _, h, _ in columns)
    md.append(f"| entry | {heads} | step vs {baseline} |")
    md.append("|---|" + "---|" * (len(columns) + 1))
    base, out = {}, {}
    for n, b in rows:
        m = re.match(rf"{prefix}/(.+)/world:2/{setting}:(\w+)/round:(\d+)", n)
        if not m:
            continue
        if m[2] == baseline:
            base[m[3]] = b["step_ms"]
        ref = base.get(m[3])
        cells = " | ".join(f(b.get(k, 0)) for k, _, f in columns)
        md.append(f"| {n} | {cells} | {fmt(b['step_ms'] / ref if ref else None, 3)} |")
        out[n] = {k: b.get(k) for k, _, _ in columns}
    md.append("")
    summary[prefix] = out


def hooks(entries, md, summary):
    side_by_side(entries, md, summary, "comm", "hook", "allreduce",
                 "Communication hooks (world 2, side by side)",
                 "bytes = what the step's gradient collectives carried.",
                 [("bytes_per_step", "bytes per step", human),
                  ("step_ms", "step ms", lambda v: f"{v:.1f}"),
                  ("wait_ms", "wait ms", lambda v: f"{v:.1f}")])


def syncbn(entries, md, summary):
    side_by_side(entries, md, summary, "syncbn", "bn", "plain",
                 "SyncBN vs plain BatchNorm (world 2, side by side)", "",
                 [("step_ms", "step ms", lambda v: f"{v:.1f}"),
                  ("images_per_s", "images/s", lambda v: f"{v:.1f}")])


# --------------------------------------------------------------- buckets
def buckets(entries, comm_entries, md, summary):
    rows = [(n, b) for n, b in entries if n.startswith("buckets/")]
    comm = {n.rsplit("/", 1)[1]: b for n, b in comm_entries if n.startswith("bucketed_comm/")}
    if not rows and not comm:
        return
    md.append("## Bucket cap sweep (ResNet-18 @64, batch 8, world 2)\n")
    md.append("Training step with ddpkit's reducer at each cap (first bucket 1 MiB) against "
              "the bare model followed by one all-reduce of all gradients as one flat "
              "buffer (copy in, all-reduce, copy out). `comm only`: the reducer's bucket "
              "layout all-reduced back to back, against one all-reduce of the flat buffer "
              "(no compute). Target: within 5% of flat at the default 25 MiB.\n")
    md.append("| cap | buckets | step ms | fastest step ms | vs flat step | CPU ms/step | CPU vs flat | wait ms | comm only ms | vs flat comm |")
    md.append("|---|---|---|---|---|---|---|---|---|---|")
    flat = dict(rows).get([n for n, _ in rows if n.endswith("/flat")][0]) if any(
        n.endswith("/flat") for n, _ in rows) else None
    fc = comm.get("flat")
    out = {}
    for n, b in rows:
        key = n.rsplit("/", 1)[1]
        c = comm.get(key)
        vs = b["step_ms"] / flat["step_ms"] if flat else None
        cv = c["real_time"] / fc["real_time"] if c and fc else None
        cpu = b.get("cpu_ms_per_step")
        cpuv = cpu / flat["cpu_ms_per_step"] if flat and cpu and flat.get("cpu_ms_per_step") else None
        md.append(f"| {key} | {int(b['buckets'])} | {b['step_ms']:.1f} | {b['step_ms_min']:.1f} | {fmt(vs, 3)} | "
                  f"{fmt(cpu, 1)} | {fmt(cpuv, 3)} | "
                  f"{b['wait_ms']:.1f} | {fmt(c['real_time'] / 1e3 if c else None, 1)} | {fmt(cv, 3)} |")
        out[key] = {"step_ms": b["step_ms"], "vs_flat": vs, "cpu_vs_flat": cpuv,
                    "comm_ms": c["real_time"] / 1e3 if c else None, "comm_vs_flat": cv}
    md.append("")
    summary["buckets"] = out


# --------------------------------------------------------------- scaling
def scaling(entries, md, summary, svg_dir):
    rows = {}
    for n, b in entries:
        m = re.match(r"scaling/(.+)/world:(\d+)", n)
        if m:
            rows.setdefault(m[1], {})[int(m[2])] = b
    if not rows:
        return
    cores = int(next(iter(next(iter(rows.values())).values())).get("cores", 0))
    md.append("## Scaling of CPU processes on this machine (weak: fixed per-worker batch; 1 thread each; all-reduce through shared memory, the default on one host)\n")
    md.append(f"Workers are **CPU processes on a {cores}-core machine**, not GPUs: beyond "
              f"{cores} workers they time-share the cores (4 and 8 oversubscribe them), "
              "so those rows measure oversubscription, not parallel hardware. Speedup = "
              "throughput(N) / throughput(1); efficiency = speedup / N. The last two "
              "columns are the reference recipe's own figures on 1/2/4/8 GPUs (9 / 5.5 / "
              "3 / 2 s per epoch), for reference only: other hardware, another model "
              "size, not comparable with the rows' CPU figures.\n")
    md.append("| model | CPU processes | ms/step | images/s | speedup | efficiency | wait/step | note | recipe on GPUs: speedup | recipe on GPUs: efficiency |")
    md.append("|---|---|---|---|---|---|---|---|---|---|")
    out = {}
    for model, w in rows.items():
        t1 = w.get(1, {}).get("images_per_s")
        out[model] = {}
        for n in sorted(w):
            b = w[n]
            sp = b["images_per_s"] / t1 if t1 else None
            eff = sp / n if sp else None
            note = (f"{n} processes on {cores} cores (oversubscribed)"
                    if n > cores else "")
            rsp = RECIPE[1] / RECIPE[n] if n in RECIPE else None
            md.append(f"| {model} | {n} | {b['step_ms']:.1f} | {b['images_per_s']:.1f} | "
                      f"{fmt(sp)} | {fmt(100 * eff if eff else None, 0)}% | "
                      f"{100 * b['wait_frac']:.0f}% | {note} | {fmt(rsp)} | "
                      f"{fmt(100 * rsp / n if rsp else None, 0)}% |")
            out[model][n] = {"step_ms": b["step_ms"], "images_per_s": b["images_per_s"],
                             "speedup": sp, "efficiency": eff,
                             "grad_bytes": b.get("grad_bytes")}
    md.append("")
    summary["scaling"] = out
    ws = sorted({n for w in rows.values() for n in w})
    series_s = [("ideal", [(n, n) for n in ws])]
    series_e = [("ideal", [(n, 1.0) for n in ws])]
    for model, pts in out.items():
        series_s.append((f"ddpkit {model}", [(n, p["speedup"]) for n, p in sorted(pts.items()) if p["speedup"]]))
        series_e.append((f"ddpkit {model}", [(n, p["efficiency"]) for n, p in sorted(pts.items()) if p["efficiency"]]))
    series_s.append(("recipe (GPUs)", [(n, RECIPE[1] / RECIPE[n]) for n in sorted(RECIPE)]))
    series_e.append(("recipe (GPUs)", [(n, RECIPE[1] / RECIPE[n] / n) for n in sorted(RECIPE)]))
    write_svg(os.path.join(svg_dir, "speedup.svg"), "Speedup vs workers", "workers",
              "speedup", series_s, logx=True, vline=cores)
    write_svg(os.path.join(svg_dir, "efficiency.svg"), "Scaling efficiency vs workers",
              "workers", "efficiency", series_e, logx=True, vline=cores, ymin=0)


# ------------------------------------------------------------ bandwidth
def bandwidth(comm_entries, md, summary, svg_dir):
    pts = {}
    for n, b in comm_entries:
        m = re.match(r"allreduce/bytes:(\d+)/world:(\d+)", n)
        if m:
            pts.setdefault(int(m[2]), []).append((int(m[1]), b["real_time"] * 1e-6))
    if not pts:
        return None
    md.append("## All-reduce time and bandwidth vs message size (ranks on one host: ddpkit's shared-memory path, the default; `DDPKIT_SHM=0` gives gloo over loopback TCP)\n")
    md.append("algbw = bytes / time; busbw = algbw · 2(N−1)/N (the ring's per-link traffic).\n")
    md.append("| bytes | world | time µs | algbw GB/s | busbw GB/s |")
    md.append("|---|---|---|---|---|")
    fit = {}
    for w, xs in sorted(pts.items()):
        xs.sort()
        for nbytes, t in xs:
            md.append(f"| {human(nbytes)} | {w} | {t * 1e6:.0f} | {nbytes / t / 1e9:.3f} | "
                      f"{nbytes / t / 1e9 * 2 * (w - 1) / w:.3f} |")
        # t = 2(N-1)/N · B / bw + 2(N-1)·alpha, fitted on the sizes >= 64 KiB.
        big = [(b, t) for b, t in xs if b >= 65536]
        if len(big) >= 2:
            k = 2 * (w - 1) / w
            X = [k * b for b, _ in big]
            Y = [t for _, t in big]
            mx, my = statistics.fmean(X), statistics.fmean(Y)
            sxx = sum((x - mx) ** 2 for x in X)
            slope = sum((x - mx) * (y - my) for x, y in zip(X, Y)) / sxx
            icpt = my - slope * mx
            small = min(xs)[1]
            fit[w] = {"bandwidth": 1 / slope,
                      "latency": max(icpt, small / 2) / (2 * (w - 1))}
    md.append("")
    if fit:
        for w, f in fit.items():
            md.append(f"Fitted ring model at world {w}: link bandwidth "
                      f"{f['bandwidth'] / 1e9:.2f} GB/s, latency per step "
                      f"{f['latency'] * 1e6:.0f} µs.\n")
    summary["allreduce"] = {w: [(b, t) for b, t in xs] for w, xs in pts.items()}
    summary["allreduce_fit"] = fit
    series = [(f"world {w} algbw", [(b, b / t / 1e9) for b, t in sorted(xs)]) for w, xs in pts.items()]
    write_svg(os.path.join(svg_dir, "bandwidth.svg"), "All-reduce bandwidth vs message size (one host, shared memory)",
              "message bytes", "GB/s", series, logx=True, logy=True, xfmt=human)
    return fit


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:g} {unit}"
        n /= 1024
    return str(n)


# ----------------------------------------------------------- projection
def ring_time(nbytes, n, bw, lat):
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat


def projection(summary, fit, md):
    sc = summary.get("scaling")
    if not sc:
        return
    md.append("## Projection (a model, not a measurement)\n")
    md.append("Per-step time at N workers, each with its own device (compute per worker "
              "= the measured 1-worker step time T1 here), gradients averaged by a ring "
              "all-reduce: T_comm = 2(N−1)/N · bytes / bandwidth + 2(N−1) · latency. "
              "No overlap: T = T1 + T_comm. Overlap: communication hides behind "
              "backward (taken as 2/3 of T1), T = T1 + max(0, T_comm − 2/3·T1). "
              "Efficiency = T1 / T.\n")
    links = list(LINKS)
    if fit and 2 in fit:
        links.append(("this machine's all-reduce (fitted)", fit[2]["bandwidth"], fit[2]["latency"]))
    proj = {}
    for model, pts in sc.items():
        if 1 not in pts or not pts[1].get("grad_bytes"):
            continue
        t1 = pts[1]["step_ms"] / 1e3
        nbytes = pts[1]["grad_bytes"]
        md.append(f"**{model}**: T1 = {t1 * 1e3:.1f} ms, gradients {nbytes / 2**20:.1f} MiB.\n")
        md.append("| link | overlap | " + " | ".join(f"N={n}" for n in PROJ_WORKERS) + " |")
        md.append("|---|---|" + "---|" * len(PROJ_WORKERS))
        proj[model] = {}
        for name, bw, lat in links:
            for ov in (False, True):
                cells = []
                for n in PROJ_WORKERS:
                    tc = ring_time(nbytes, n, bw, lat)
                    t = t1 + (max(0.0, tc - 2 / 3 * t1) if ov else tc)
                    cells.append(f"{t * 1e3:.0f} ms / {100 * t1 / t:.0f}%")
                    proj[model].setdefault(name, {})[f"{n}{'o' if ov else ''}"] = t
                md.append(f"| {name} | {'yes' if ov else 'no'} | " + " | ".join(cells) + " |")
        md.append("")
        # The same bytes with a measured GPU step, where the link starts to
        # matter.
        if model not in GPU_STEP_S:
            md.append(f"No GPU step measured for {model}: no GPU projection.\n")
            continue
        tg, what = GPU_STEP_S[model]
        md.append(f"Same gradients with the step a GPU measured, {tg * 1e3:.1f} ms ({what}). "
                  "How far to trust it: the link times are nominal bandwidths "
                  "with no contention, overlap is assumed to hide communication "
                  "behind 2/3 of the step, and the model was checked only against "
                  "this machine's loopback (the table below), never on GPU hosts "
                  "(NCCL with two or more ranks has not run).\n")
        md.append("| link | overlap | " + " | ".join(f"N={n}" for n in PROJ_WORKERS) + " |")
        md.append("|---|---|" + "---|" * len(PROJ_WORKERS))
        for name, bw, lat in LINKS:
            for ov in (False, True):
                cells = []
                for n in PROJ_WORKERS:
                    tc = ring_time(nbytes, n, bw, lat)
                    t = tg + (max(0.0, tc - 2 / 3 * tg) if ov else tc)
                    cells.append(f"{t * 1e3:.1f} ms / {100 * tg / t:.0f}%")
                md.append(f"| {name} | {'yes' if ov else 'no'} | " + " | ".join(cells) + " |")
        md.append("")
    # Check against this machine: N workers share the cores and gloo's copies
    # need CPU too, so nothing overlaps once the cores are full.
    if fit and 2 in fit:
        md.append("Check against what was measured here (cores shared: compute = "
                  "T1 · max(1, N / cores); loopback ring with the fitted bandwidth and "
                  "latency; no overlap, because gloo's copies need the same busy cores):\n")
        md.append("| model | workers | predicted ms/step | measured ms/step | measured / predicted |")
        md.append("|---|---|---|---|---|")
        for model, pts in sc.items():
            if 1 not in pts:
                continue
            t1 = pts[1]["step_ms"] / 1e3
            cores = 2
            for n in sorted(pts):
                if n == 1:
                    continue
                pred = t1 * max(1, n / cores) + ring_time(pts[1]["grad_bytes"], n,
                                                          fit[2]["bandwidth"], fit[2]["latency"])
                meas = pts[n]["step_ms"] / 1e3
                md.append(f"| {model} | {n} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {meas / pred:.2f} |")
        md.append("")
    summary["projection"] = proj


# ------------------------------------------------------------------ SVG
PALETTE = ["#888888", "#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"]


def write_svg(path, title, xlabel, ylabel, series, logx=False, logy=False,
              vline=None, ymin=None, xfmt=None):
    W, H, L, R, T, B = 720, 440, 70, 200, 40, 50
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts]
    if not xs:
        return
    fx = (lambda v: math.log2(v)) if logx else (lambda v: v)
    fy = (lambda v: math.log10(v)) if logy else (lambda v: v)
    x0, x1 = fx(min(xs)), fx(max(xs))
    y0 = fy(min(ys)) if ymin is None else ymin
    y1 = fy(max(ys))
    if logy:
        y0, y1 = math.floor(y0), math.ceil(y1)
    else:
        y0 = min(y0, 0)
        y1 = y1 * 1.1 if y1 > 0 else 1
    x1 = x1 if x1 > x0 else x0 + 1

    def px(v):
        return L + (fx(v) - x0) / (x1 - x0) * (W - L - R)

    def py(v):
        return H - B - (fy(v) - y0) / (y1 - y0) * (H - T - B)

    o = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
         f'font-family="sans-serif" font-size="12">',
         f'<rect width="{W}" height="{H}" fill="white"/>',
         f'<text x="{W / 2 - R / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
         f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="black"/>',
         f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="black"/>',
         f'<text x="{(L + W - R) / 2}" y="{H - 12}" text-anchor="middle">{xlabel}</text>',
         f'<text x="16" y="{(T + H - B) / 2}" text-anchor="middle" '
         f'transform="rotate(-90 16 {(T + H - B) / 2})">{ylabel}</text>']
    for xv in sorted(set(xs)):
        X = px(xv)
        lab = xfmt(xv) if xfmt else f"{xv:g}"
        o.append(f'<line x1="{X}" y1="{H - B}" x2="{X}" y2="{H - B + 5}" stroke="black"/>')
        o.append(f'<text x="{X}" y="{H - B + 18}" text-anchor="middle" font-size="10">{lab}</text>')
    nt = 5
    for i in range(nt + 1):
        v = y0 + (y1 - y0) * i / nt
        Y = H - B - i / nt * (H - T - B)
        lab = f"{10 ** v:g}" if logy else f"{v:.2g}"
        o.append(f'<line x1="{L - 5}" y1="{Y}" x2="{W - R}" y2="{Y}" stroke="#eeeeee"/>')
        o.append(f'<text x="{L - 8}" y="{Y + 4}" text-anchor="end">{lab}</text>')
    if vline and logx and min(xs) <= vline <= max(xs):
        X = px(vline)
        o.append(f'<line x1="{X}" y1="{T}" x2="{X}" y2="{H - B}" stroke="#999" stroke-dasharray="4 4"/>')
        o.append(f'<text x="{X + 4}" y="{T + 12}" fill="#666">{vline} cores</text>')
    for i, (name, pts) in enumerate(series):
        if not pts:
            continue
        c = PALETTE[i % len(PALETTE)]
        dash = ' stroke-dasharray="6 4"' if i == 0 or "recipe" in name else ""
        d = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        o.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for x, y in pts:
            o.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"/>')
        ly = T + 16 + 18 * i
        o.append(f'<line x1="{W - R + 12}" y1="{ly - 4}" x2="{W - R + 32}" y2="{ly - 4}" stroke="{c}" stroke-width="2"{dash}/>')
        o.append(f'<text x="{W - R + 38}" y="{ly}">{name}</text>')
    o.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(o))


def data_section(entries, md):
    if not entries:
        return
    md.append("## Data pipeline (ddpkit_data_bench)\n")
    md.append("| entry | ms/iter | images/s |")
    md.append("|---|---|---|")
    for n, b in entries:
        md.append(f"| {n} | {b['real_time']:.2f} | {b.get('images/s', 0):.0f} |")
    md.append("")


def main():
    res = sys.argv[1] if len(sys.argv) > 1 else "bench-results"
    md, summary = ["# ddpkit benchmark results\n"], {}
    mach = os.path.join(res, "machine.txt")
    if os.path.exists(mach):
        md.append("Machine:\n\n```\n" + open(mach).read().strip() + "\n```\n")
    ddp = gb_entries(os.path.join(res, "ddp.json"))
    comm = gb_entries(os.path.join(res, "comm.json"))
    overhead(res, md, summary)
    decompose(ddp, md, summary)
    local(ddp, md, summary)
    buckets(ddp, comm, md, summary)
    hooks(ddp, md, summary)
    syncbn(ddp, md, summary)
    fit = bandwidth(comm, md, summary, res)
    scaling(ddp, md, summary, res)
    projection(summary, fit, md)
    data_section(gb_entries(os.path.join(res, "data.json")), md)
    with open(os.path.join(res, "summary.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    summary.pop("_ours_world1", None)
    with open(os.path.join(res, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print("\n".join(md))


if __name__ == "__main__":
    main()
