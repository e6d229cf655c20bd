#!/usr/bin/env python3
"""The peer of the paged_decode benchmark: PyTorch's scaled_dot_product_attention on contiguous
bf16 KV of the same shapes (one query token, 8 KV heads, head dim 128, GQA groups 4 and 8, or
those of KVKIT_DECODE_GROUPS as the benchmark reads it), timed as a back-to-back loop between CUDA
events (median of 7 loops), rotating over up to 256 KV copies for small shapes so no call finds its
keys in L2, as the benchmark's rows rotate over page sets. Each backend's loop runs twice: called
from Python, and captured in a CUDA graph and replayed (where the backend can be captured), which
leaves out Python's cost of a call, several microseconds that would be most of a small shape's
time. The peer is the fastest of these. Writes "B,L,group,seconds,backend" lines (backend with
"+graph" where the replay was the fastest).

    python3 bench/cuda/sdpa_peer.py OUT.csv
"""
import os
import re
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

KV_HEADS, DIM = 8, 128


def groups():
    """The benchmark's groups: KVKIT_DECODE_GROUPS (comma-separated numbers from 1 to 16 in ASCII
    digits, spaces around them allowed; anything else is left out, as the benchmark leaves it out),
    else 4 and 8."""
    out = []
    for item in os.environ.get("KVKIT_DECODE_GROUPS", "").split(","):
        digits = item.strip(" ")
        if not re.fullmatch(r"[0-9]{1,2}", digits):
            continue
        g = int(digits)
        if 1 <= g <= 16 and g not in out:
            out.append(g)
    return out or [4, 8]


def time_calls(fn, calls):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(7):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / calls)
    samples.sort()
    return samples[len(samples) // 2]


def time_graph(fn, calls):
    """Seconds a call of fn in a CUDA graph of calls calls, replayed as time_calls times a loop."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # a first call outside the capture, on a side stream, as capture asks
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    seconds = time_calls(graph.replay, 1) / calls
    del graph
    return seconds


def main(path):
    warnings.filterwarnings("ignore")
    out = open(path, "w")  # a row a shape as it is measured, so a later failure keeps them
    graphs = True  # until a capture fails: one that fails inside CUDA can leave torch's
    # allocator in capture mode, so no later capture is tried
    for group in groups():
        for b in (1, 8, 32, 64, 128):
            for l in (512, 2048, 8192, 32768):
                kv_bytes = 2 * b * KV_HEADS * l * DIM * 2
                rot = max(1, min(256, int(512e6 // kv_bytes) + 1))
                q = [torch.randn(b, KV_HEADS * group, 1, DIM, device="cuda", dtype=torch.bfloat16)
                     for _ in range(rot)]
                k = [torch.randn(b, KV_HEADS, l, DIM, device="cuda", dtype=torch.bfloat16)
                     for _ in range(rot)]
                v = [torch.randn(b, KV_HEADS, l, DIM, device="cuda", dtype=torch.bfloat16)
                     for _ in range(rot)]
                best = None
                eager_graph = {}
                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                                SDPBackend.EFFICIENT_ATTENTION):
                    state = {"i": 0}

                    def call():
                        i = state["i"]
                        state["i"] = (i + 1) % rot
                        return F.scaled_dot_product_attention(q[i], k[i], v[i], enable_gqa=True)
                    try:
                        with sdpa_kernel(backend):
                            once = time_calls(call, 3)
                            calls = max(rot, min(400, int(2e-3 / once)))
                            found = [(time_calls(call, calls), backend.name)]
                    except RuntimeError:
                        continue
                    # The replay's calls a multiple of the copies, so that each replay starts
                    # on the copy read longest ago, as the loop's calls go on rotating.
                    whole = -(-calls // rot) * rot
                    try:
                        if graphs:
                            with sdpa_kernel(backend):
                                found.append((time_graph(call, whole), backend.name + "+graph"))
                    except RuntimeError as e:
                        graphs = False  # this backend keeps its loop's time, the rest too
                        torch.cuda.set_stream(torch.cuda.default_stream())
                        print(f"no graph replays from B={b} L={l} {backend.name} on: {e}",
                              flush=True)
                    for t, name in found:
                        if best is None or t < best[0]:
                            best = (t, name)
                        eager_graph.setdefault(name.removesuffix("+graph"), []).append(t)
                if best is not None:
                    out.write(f"{b},{l},{group},{best[0]:.9f},{best[1]}\n")
                    out.flush()
                    seen = "; ".join(f"{n} " + "/".join(f"{t * 1e6:.1f}" for t in ts)
                                     for n, ts in eager_graph.items())
                    print(f"sdpa B={b} L={l} group={group}: {best[0] * 1e6:.1f} us "
                          f"({(kv_bytes + 4 * b * KV_HEADS * group * DIM) / best[0] / 1e12:.2f} "
                          f"TB/s, {best[1]}; us loop/graph: {seen})", flush=True)
                del q, k, v
                try:
                    torch.cuda.empty_cache()
                except RuntimeError:
                    pass  # the allocator of a failed capture: the copies stay cached
    out.close()


if __name__ == "__main__":
    main(sys.argv[1])
