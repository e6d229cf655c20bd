#!/usr/bin/env python3
"""Plots the serving simulation's per-step series (examples/serving_sim --csv FILE).

    scripts/plot_serving_sim.py SIM.csv OUT.png
"""
import csv
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def smooth(xs, w=100):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    series = {}
    with open(sys.argv[1]) as f:
        for row in csv.DictReader(f):
            s = series.setdefault(row["system"], {k: [] for k in row if k != "system"})
            for k, v in row.items():
                if k != "system":
                    s[k].append(float(v))
    kvkit = series["kvkit"]
    horizon = int(max(kvkit["step"]) * 1.1)
    labels = {"kvkit": "kvkit scheduler (paged, prefix cache)", "static": "static batching, max_len"}
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for name, s in series.items():
        n = sum(1 for x in s["step"] if x <= horizon)
        steps = s["step"][:n]
        axes[0].plot(steps, smooth(s["running"][:n]), label=labels[name], linewidth=1)
        util = [st / r if r > 0 else 0 for st, r in zip(s["stored_tokens"][:n], s["reserved_tokens"][:n])]
        axes[1].plot(steps, smooth(util), label=labels[name], linewidth=1)
        axes[2].plot(steps, smooth(s["computed_tokens"][:n]), label=labels[name], linewidth=1)
    axes[0].set_ylabel("sequences per step")
    axes[1].set_ylabel("KV memory utilization")
    axes[1].set_ylim(0, 1.05)
    axes[2].set_ylabel("tokens computed per step")
    axes[2].set_xlabel("step (100-step moving averages)")
    end_static = int(max(series["static"]["step"]))
    axes[0].set_title(f"Serving simulation, 2000 requests: kvkit finishes at step {int(max(kvkit['step']))}, "
                      f"static batching at {end_static}")
    for ax in axes:
        ax.legend(fontsize=8, loc="upper right")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
