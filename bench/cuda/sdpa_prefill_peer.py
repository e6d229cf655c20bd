#!/usr/bin/env python3
"""The peer of the paged_prefill benchmark: PyTorch's scaled_dot_product_attention on contiguous
bf16 K/V of the same shapes (B sequences of L tokens, the last Q of them queries; 8 KV heads, head
dim 128, GQA group 4), causal with the queries at the end of the keys (a whole prompt when Q = L;
torch's lower-right causal bias where Q < L, a shape left out where this torch lacks it). Each
backend is timed as sdpa_peer.py times it (a loop between CUDA events, median of 7, and a CUDA
graph replay where it can be captured); the peer is the fastest. Writes "B,L,Q,seconds,backend".

    python3 bench/cuda/sdpa_prefill_peer.py OUT.csv
"""
import sys
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdpa_peer import time_calls, time_graph

KV_HEADS, GROUP, DIM = 8, 4, 128
# The benchmark's shapes (bench_paged_prefill.cu): bf16 rows first, then the quantized rows' own.
SHAPES = [(1, 1024, 1024), (1, 4096, 4096), (1, 16384, 16384), (8, 2048, 2048), (8, 4096, 512),
          (64, 2048, 4)]


def causal_mask(q_len, kv_len):
    """is_causal for a whole prompt; the lower-right causal bias for an extend (None: missing)."""
    if q_len == kv_len:
        return {"is_causal": True}
    try:
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return None
    return {"attn_mask": causal_lower_right(q_len, kv_len)}


def main(path):
    warnings.filterwarnings("ignore")
    out = open(path, "w")
    for b, l, nq in SHAPES:
        mask = causal_mask(nq, l)
        if mask is None:
            print(f"sdpa prefill B={b} L={l} Q={nq}: no lower-right causal bias in this torch")
            continue
        q = torch.randn(b, KV_HEADS * GROUP, nq, DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, KV_HEADS, l, DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, KV_HEADS, l, DIM, device="cuda", dtype=torch.bfloat16)
        best = None
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION):
            def call():
                return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **mask)
            try:
                with sdpa_kernel(backend):
                    once = time_calls(call, 2)
                    calls = max(2, min(200, int(5e-3 / once)))
                    found = [(time_calls(call, calls), backend.name)]
                    try:
                        found.append((time_graph(call, calls), backend.name + "+graph"))
                    except RuntimeError:
                        torch.cuda.set_stream(torch.cuda.default_stream())
            except RuntimeError:
                continue
            for t, name in found:
                if best is None or t < best[0]:
                    best = (t, name)
        if best is not None:
            out.write(f"{b},{l},{nq},{best[0]:.9f},{best[1]}\n")
            out.flush()
            pairs = b * nq * (l - nq + (nq + 1) / 2)
            print(f"sdpa prefill B={b} L={l} Q={nq}: {best[0] * 1e6:.1f} us "
                  f"({4 * DIM * KV_HEADS * GROUP * pairs / best[0] / 1e12:.1f} TFLOP/s, {best[1]})",
                  flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    out.close()


if __name__ == "__main__":
    main(sys.argv[1])
