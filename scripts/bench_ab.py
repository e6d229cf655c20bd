#!/usr/bin/env python3
"""Compares benchmark builds run alternately in one session (Google Benchmark JSON, as written by
--benchmark_out=F --benchmark_out_format=json). For each row it prints the smallest time of each
build over its runs and each build's ratio to the first (below 1: faster), then the geometric mean
of the ratios. Alternating the builds (a, b, a, b, ...) spreads the machine's drift over all of
them; the smallest of several runs is the least disturbed one.

    scripts/bench_ab.py NAME=RUN.json[,RUN.json...] NAME=RUN.json[,...] [...] [--filter REGEX]

The first build is the baseline. Times are the rows' `us` counter where they have one (the GPU
benchmarks), else their real time. Rows missing from a build are left out of its ratios.
"""
import json
import math
import re
import sys


def load(path):
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    rows = {}
    for row in data.get("benchmarks", []):
        if row.get("run_type") == "aggregate" or row.get("error_occurred"):
            continue
        name = row["name"].split("/iterations:")[0].removesuffix("/manual_time")
        t = float(row["us"]) if "us" in row else float(row["real_time"])
        # A file of several repetitions (--benchmark_repetitions) holds a row per repetition: the
        # smallest, as over runs.
        rows[name] = min(rows.get(name, math.inf), t)
    return rows


def main(argv):
    pattern = None
    builds = []
    args = iter(argv)
    for arg in args:
        if arg == "--filter":
            pattern = re.compile(next(args, ""))
        elif "=" in arg:
            name, files = arg.split("=", 1)
            runs = [load(f) for f in files.split(",") if f]
            if not runs:
                print(f"bench_ab: no runs for {name}", file=sys.stderr)
                return 2
            builds.append((name, runs))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    if len(builds) < 2:
        print(__doc__, file=sys.stderr)
        return 2

    base_name, base_runs = builds[0]
    names = [n for n in base_runs[0] if pattern is None or pattern.search(n)]
    if not names:
        print("bench_ab: no rows to compare", file=sys.stderr)
        return 1
    best = {}
    for build, runs in builds:
        for n in names:
            times = [r[n] for r in runs if n in r]
            if times:
                best[(build, n)] = min(times)

    width = max(len(n) for n in names)
    header = f"{'row':{width}}  {base_name:>10}"
    for build, _ in builds[1:]:
        header += f"  {build:>10}  {'ratio':>6}"
    print(header)
    logs = {build: [] for build, _ in builds[1:]}
    for n in names:
        base = best.get((base_name, n))
        if base is None:
            continue
        line = f"{n:{width}}  {base:10.2f}"
        for build, _ in builds[1:]:
            t = best.get((build, n))
            if t is None:
                line += f"  {'-':>10}  {'-':>6}"
                continue
            line += f"  {t:10.2f}  {t / base:6.3f}"
            logs[build].append(math.log(t / base))
        print(line)
    for build, values in logs.items():
        if values:
            mean = math.exp(sum(values) / len(values))
            print(f"geometric mean {build}/{base_name}: {mean:.4f} over {len(values)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
