#!/usr/bin/env python3
"""Plots the paged_decode benchmark (Google Benchmark JSON from bench/cuda): effective TB/s per
shape for each codec beside PyTorch SDPA on contiguous KV (the times the benchmark read from
KVKIT_SDPA_CSV), and each quantized codec's time over bf16's at the same shape.

    scripts/plot_decode_bench.py OUT.png RUN.json [GROUP]      (GROUP: 4 or 8, default 8)
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__)
        return 2
    group = sys.argv[3] if len(sys.argv) > 3 else "8"
    with open(sys.argv[2]) as f:
        data = json.load(f)
    runs = data["benchmarks"]
    day = data.get("context", {}).get("date", "")[:10]
    rows = {}
    for r in runs:
        parts = r["name"].split("/")
        if parts[0] != "paged_decode" or "TB/s" not in r:
            continue
        codec, b, l, g, p = parts[1], parts[2], parts[3], parts[4], parts[5]
        if g != "g" + group or p != "p16" or codec.endswith("_hnd"):
            continue
        rows.setdefault(codec, {})[(int(b[1:]), int(l[1:]))] = r
    shapes = sorted(rows["bf16"], key=lambda s: (s[0] * s[1], s[0]))
    labels = [f"B{b}\nL{l}" for b, l in shapes]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    x = range(len(shapes))
    colors = {"bf16": "#3b7dd8", "fp8_e4m3": "#2e9e5b", "int8": "#8e5bd8", "int4_g32": "#d88a3b"}
    for codec, by_shape in rows.items():
        if codec not in colors:
            continue  # the plot keeps one codec of each family
        ax.plot(x, [by_shape.get(s, {}).get("TB/s", float("nan")) for s in shapes], "o-",
                color=colors.get(codec), label=f"kvkit {codec}")
    sdpa = [rows["bf16"][s].get("sdpa_TB/s", float("nan")) for s in shapes]
    ax.plot(x, sdpa, "k--", label="PyTorch SDPA, contiguous bf16")
    memcpy = rows["bf16"][shapes[0]]["memcpy_TB/s"]
    ax.axhline(memcpy, color="grey", linestyle=":", label=f"device memcpy ({memcpy:.2f} TB/s)")
    ax.axhline(4.5, color="red", linestyle="-.", linewidth=0.8, label="target, B*L >= 256k")
    ax.set_ylabel("effective TB/s")
    ax.set_title(f"paged_decode on an NVIDIA H200, {day}: 8 KV heads x 128, group {group}, "
                 "page 16, pages scattered")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(alpha=0.3)
    for codec, target in (("fp8_e4m3", 0.55), ("int8", None), ("int4_g32", 0.35)):
        if codec not in rows:
            continue
        ax2.plot(x, [rows[codec].get(s, {}).get("time_vs_bf16", float("nan")) for s in shapes],
                 "o-", color=colors[codec], label=f"{codec} time / bf16 time")
        if target:
            ax2.axhline(target, color=colors[codec], linestyle=":", linewidth=1,
                        label=f"{codec} target {target}")
    ax2.set_ylabel("time vs bf16")
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(labels, fontsize=7)
    ax2.legend(fontsize=8, ncol=2)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
