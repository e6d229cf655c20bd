#!/usr/bin/env python3
"""Checks one paged_decode benchmark run against the decode targets and prints them as a table.

    scripts/decode_targets.py RUN.json

RUN.json is the --benchmark_out of `kvkit_bench_cuda --benchmark_filter=paged_decode` (run with
KVKIT_SDPA_CSV for the SDPA columns) without any other KVKIT_DECODE_* setting (a run with one is
refused); rows that report an error are left out. Rows are named
paged_decode[_graph]/CODEC/B../L../g../p.. and carry the counters us, TB/s, x_sdpa and (quantized
codecs) time_vs_bf16, over bf16 of the same order (CODEC_hnd rows: over bf16_hnd).
"""
import json
import re
import sys

NAME = re.compile(r"^(paged_decode(?:_graph)?)/([^/]+)/B(\d+)/L(\d+)/g(\d+)/p(\d+)")
MID = [(8, 8192), (32, 2048)]
# A stream row whose host took at least this share of its time to queue each call measured the
# host's launch rate, not the kernel (a B=1 call takes about 6 us, the host 3-5 us to queue it,
# more while the host is busy with something else).
HOST_BOUND = 0.9


def host_bound(row):
    return row.get("host_us", 0.0) >= HOST_BOUND * row["us"]


def load(path):
    rows = {}
    with open(path) as f:
        run = json.load(f)
    # A run with any KVKIT_DECODE_* setting in effect measured other plans or shapes than the
    # library's defaults (runs from 2026-12-07 name them in the context; older runs have no key).
    overrides = run.get("context", {}).get("kvkit_decode_overrides", "none")
    if overrides != "none":
        sys.exit(f"{path}: run with {overrides}; the targets are checked on a run without overrides")
    for bench in run["benchmarks"]:
        m = NAME.match(bench["name"])
        if m and not bench.get("error_occurred"):
            kind, codec, b, l, g, page = m.groups()
            rows[(kind, codec, int(b), int(l), int(g), int(page))] = bench
    return rows


def span(values, fmt="{:.2f}"):
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}-{fmt.format(hi)}"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rows = load(sys.argv[1])
    if not rows:
        sys.exit(f"{sys.argv[1]}: no measured paged_decode rows (did the run find a GPU?)")
    stream = {k[1:]: v for k, v in rows.items() if k[0] == "paged_decode"}
    graph = {k[1:]: v for k, v in rows.items() if k[0] == "paged_decode_graph"}
    out = []

    large = [(k, v) for k, v in stream.items()
             if k[0] == "bf16" and k[4] == 16 and k[1] * k[2] >= 256 * 1024]
    tbs = [v["TB/s"] for _, v in large]
    met = sum(t >= 4.5 for t in tbs)
    sdpa = [v["x_sdpa"] for _, v in large if "x_sdpa" in v]
    out.append(("bf16 >= 4.5 TB/s at B*L >= 256k (page 16)",
                f"{span(tbs)} TB/s; {met} of {len(tbs)} rows; SDPA time / ours {span(sdpa)}",
                "yes" if tbs and met == len(tbs) else ("partly" if met else "no")))

    mid = []
    for b, l in MID:
        for g in (4, 8):
            v = stream.get(("bf16", b, l, g, 16))
            if v:
                gv = graph.get(("bf16", b, l, g, 16))
                mid.append((f"B={b}/L={l} g{g}", v["TB/s"], gv["TB/s"] if gv else None))
    text = "; ".join(f"{n} {t:.2f}" + (f" (graph {gt:.2f})" if gt else "") for n, t, gt in mid)
    met = sum(t >= 4.0 for _, t, _ in mid)
    out.append((">= 4.0 TB/s at the mid shapes (bf16)", text or "-",
                "yes" if mid and met == len(mid) else ("partly" if met else "no")))

    small = []
    for g in (4, 8):
        v = stream.get(("bf16", 1, 2048, g, 16))
        if v:
            gv = graph.get(("bf16", 1, 2048, g, 16))
            small.append((g, v["us"], gv["us"] if gv else None, v.get("host_us")))
    # host_us (runs from 2026-12-02 on): the host's time to queue a call; near "us", the loop
    # measured the host's launch rate rather than the kernel.
    text = "; ".join(f"g{g} {u:.2f} us" + (f" (graph {gu:.2f})" if gu else "") +
                     (f" (host {hu:.2f} a call" + (", host-bound)" if hu >= HOST_BOUND * u else ")")
                      if hu else "") for g, u, gu, hu in small)
    met = sum(u <= 6.0 for _, u, _, _ in small)
    out.append(("B=1, L=2048 <= 6 us a call (bf16)", text or "-",
                "yes" if small and met == len(small) else ("partly" if met else "no")))

    spreads = []
    for (codec, b, l, g, page) in sorted(stream):
        if codec != "bf16" or page != 16:
            continue
        # Every page size the run has for the shape (1, 8, 16, 32 and 64 before 2026-12-03,
        # 09:00 UTC; 2 and 4 as well since).
        # Host-bound rows are named beside the spread and left out of it.
        found = {p: stream[(codec, b, l, g, p)] for p in (1, 2, 4, 8, 16, 32, 64)
                 if (codec, b, l, g, p) in stream}
        times = {p: v["us"] for p, v in found.items() if not host_bound(v)}
        skipped = "".join(f", without p{p}: host-bound, {v['host_us']:.2f} us to queue a call"
                          f" of {v['us']:.2f}" for p, v in found.items() if host_bound(v))
        if len(times) >= 5:
            slowest = max(times, key=times.get)
            spreads.append((f"B={b}/L={l} g{g}",
                            max(times.values()) / min(times.values()) - 1.0, slowest, skipped))
    met = sum(s <= 0.05 for _, s, _, _ in spreads)
    out.append(("page sizes 1-64 within 5% (bf16; pN: the slowest)",
                "; ".join(f"{n} {100 * s:.1f}% (p{p}{x})" for n, s, p, x in spreads) or "-",
                "yes" if spreads and met == len(spreads) else ("partly" if met else "no")))

    # The _hnd rows (runs from 2026-12-02, 20:00 on) are HND caches, compared with bf16_hnd.
    for codec, target in (("fp8_e4m3", 0.55), ("int4_g32", 0.35), ("fp8_e4m3_hnd", 0.55),
                          ("int4_g32_hnd", 0.35)):
        base = "bf16_hnd" if codec.endswith("_hnd") else "bf16"
        # A row whose loop, or its bf16 peer's, was bound by the host's launch rate compares
        # two launch rates, not two kernels: named and left out of the count.
        ratios, skipped = {}, []
        for k, v in stream.items():
            if k[0] != codec or k[4] != 16 or "time_vs_bf16" not in v:
                continue
            peer = stream.get((base,) + k[1:])
            if host_bound(v) or (peer is not None and host_bound(peer)):
                skipped.append(f"B={k[1]}/L={k[2]} g{k[3]}")
            else:
                ratios[k] = v["time_vs_bf16"]
        if not ratios and not skipped and codec.endswith("_hnd"):
            continue  # a run without HND rows
        big = [r for k, r in ratios.items() if k[1] * k[2] >= 256 * 1024]
        midr = [r for k, r in ratios.items() if (k[1], k[2]) in MID]
        met = sum(r <= target for r in ratios.values())
        left_out = f" (host-bound, left out: {', '.join(skipped)})" if skipped else ""
        out.append((f"{codec} time <= {target} x bf16",
                    f"B*L >= 256k {span(big)}; mid {span(midr)}; {met} of {len(ratios)} rows"
                    + left_out,
                    "yes" if ratios and met == len(ratios) else ("partly" if met else "no")))

    print("| target | measured | met? |")
    print("|---|---|---|")
    for row in out:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
