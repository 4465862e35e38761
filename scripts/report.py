#!/usr/bin/env python3
"""Draws the recipe's pictures from ddpkit output folders (standard library only).

    scripts/report.py runs/cifar10-single runs/cifar10-ddp --out report/

Writes report/accuracy.svg (validation accuracy per epoch, one line per run),
report/epoch_time.svg (mean seconds per epoch against world size) and
report/report.md (a table of the runs, linking both pictures).
"""
import argparse
import json
import os
import sys

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf"]


def load_run(folder):
    metrics, summary = [], {}
    path = os.path.join(folder, "metrics.jsonl")
    if not os.path.isfile(path):
        sys.exit(f"error: {path} does not exist (is {folder} a ddpkit output folder?)")
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"error: {path}:{n}: not JSON ({e})")
    spath = os.path.join(folder, "summary.json")
    if os.path.isfile(spath):
        with open(spath) as f:
            summary = json.load(f)
    label = f"{summary.get('example', os.path.basename(folder))} {summary.get('mode', '')}"
    if summary.get("mode") == "ddp":
        label += f" x{summary.get('world_size', '?')}"
    if summary.get("bn") == "syncbn":
        label += " SyncBN"
    return {"folder": folder, "metrics": metrics, "summary": summary, "label": label.strip()}


def svg_chart(title, xlabel, ylabel, series, width=640, height=400):
    """series: list of (label, [(x, y), ...]). Returns SVG text."""
    pts = [p for _, s in series for p in s]
    if not pts:
        return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="60"><text x="10" y="30">{title}: no data</text></svg>'
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(0.0, min(p[1] for p in pts)), max(p[1] for p in pts)
    if x1 == x0:
        x1 = x0 + 1
    if y1 == y0:
        y1 = y0 + 1
    y1 *= 1.05
    L, R, T, B = 60, 170, 40, 50
    W, H = width - L - R, height - T - B
    sx = lambda x: L + (x - x0) / (x1 - x0) * W
    sy = lambda y: T + H - (y - y0) / (y1 - y0) * H
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="15">{title}</text>',
           f'<line x1="{L}" y1="{T + H}" x2="{L + W}" y2="{T + H}" stroke="black"/>',
           f'<line x1="{L}" y1="{T}" x2="{L}" y2="{T + H}" stroke="black"/>',
           f'<text x="{L + W / 2}" y="{height - 12}" text-anchor="middle">{xlabel}</text>',
           f'<text x="16" y="{T + H / 2}" text-anchor="middle" transform="rotate(-90 16 {T + H / 2})">{ylabel}</text>']
    for i in range(6):
        yv = y0 + (y1 - y0) * i / 5
        out.append(f'<line x1="{L - 4}" y1="{sy(yv):.1f}" x2="{L + W}" y2="{sy(yv):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{L - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{yv:.3g}</text>')
    xs = sorted({p[0] for p in pts})
    step = max(1, len(xs) // 10)
    for xv in xs[::step]:
        out.append(f'<text x="{sx(xv):.1f}" y="{T + H + 16}" text-anchor="middle">{xv:g}</text>')
    for k, (label, s) in enumerate(series):
        c = COLORS[k % len(COLORS)]
        s = sorted(s)
        if len(s) > 1:
            d = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s)
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{d}"/>')
        for x, y in s:
            out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="3" fill="{c}"/>')
        out.append(f'<rect x="{L + W + 12}" y="{T + 8 + 18 * k}" width="12" height="3" fill="{c}"/>')
        out.append(f'<text x="{L + W + 30}" y="{T + 13 + 18 * k}">{label}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="ddpkit output folders (each with metrics.jsonl)")
    ap.add_argument("--out", default="report", help="where to write the SVGs and report.md")
    a = ap.parse_args()
    runs = [load_run(r) for r in a.runs]
    os.makedirs(a.out, exist_ok=True)
    acc = [(r["label"], [(m["epoch"], m["val_acc"]) for m in r["metrics"]]) for r in runs]
    with open(os.path.join(a.out, "accuracy.svg"), "w") as f:
        f.write(svg_chart("Validation accuracy per epoch", "epoch", "val_acc", acc))
    by_example = {}
    for r in runs:
        ws = r["summary"].get("world_size", 1)
        secs = [m["seconds"] for m in r["metrics"]]
        if secs:
            by_example.setdefault(r["summary"].get("example", "run"), []).append((ws, sum(secs) / len(secs)))
    with open(os.path.join(a.out, "epoch_time.svg"), "w") as f:
        f.write(svg_chart("Seconds per epoch against world size", "world size", "seconds / epoch",
                          sorted(by_example.items())))
    lines = ["| run | mode | world size | epochs | best val_acc | final val_acc | test_acc | s/epoch | train images/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        s, ms = r["summary"], r["metrics"]
        spe = sum(m["seconds"] for m in ms) / len(ms) if ms else 0
        test = s.get("test_acc")
        lines.append(f"| {os.path.basename(os.path.normpath(r['folder']))} | {s.get('mode', '?')} | {s.get('world_size', '?')} | {len(ms)} | "
                     f"{s.get('best_val_acc', 0):.4f} | {s.get('final_val_acc', 0):.4f} | "
                     f"{'%.4f' % test if test is not None else '–'} | {spe:.1f} | {s.get('train_images_per_second', s.get('images_per_second', 0)):.0f} |")
    md = "# ddpkit runs\n\n![accuracy](accuracy.svg)\n\n![epoch time](epoch_time.svg)\n\n" + "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "report.md"), "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main()
