#!/usr/bin/env python3
"""Plots kvkit's GPU benchmark results (Google Benchmark JSON from bench/cuda) as effective TB/s
per kernel and codec, with the same-run device memcpy and the 3.5 TB/s target as lines.

    scripts/plot_gpu_bench.py OUT.png RUN.json [RUN.json ...]
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
    names, rates, memcpy = [], [], []
    for path in sys.argv[2:]:
        with open(path) as f:
            runs = json.load(f)["benchmarks"]
        for r in runs:
            if "bytes/s" not in r or "memcpy_TB/s" not in r:
                continue
            names.append(r["name"].replace("/manual_time", ""))
            rates.append(r["bytes/s"] / 1e12)
            memcpy.append(r["memcpy_TB/s"])
    fig, ax = plt.subplots(figsize=(10, 0.42 * len(names) + 1.5))
    y = range(len(names))
    ax.barh(y, rates, color=["#3b7dd8" if r >= 3.5 else "#d88a3b" for r in rates])
    ax.axvline(3.5, color="black", linestyle="--", linewidth=1, label="target 3.5 TB/s")
    ax.axvline(sum(memcpy) / len(memcpy), color="grey", linestyle=":", linewidth=1.5,
               label=f"device memcpy, same runs ({sum(memcpy) / len(memcpy):.2f} TB/s)")
    ax.set_yticks(list(y))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("effective TB/s (bytes read + written)")
    ax.set_title("kvkit page kernels on an NVIDIA H200, 2026-11-30")
    for i, r in enumerate(rates):
        ax.text(r + 0.03, i, f"{r:.2f}", va="center", fontsize=7)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[1], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
