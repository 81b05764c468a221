#!/usr/bin/env python3
"""What bit-exact mode's attention costs: ggml_flash_attn_ordered (fixed order, the KV range not split) against
ggml's flash_attn_ext, f16 K/V at the 27B attention shape (24 query heads, 4 KV heads, head size 256).

Each timed graph holds one attention op per attention layer (16, each over its own cache, so no layer reads the
previous one's from L2), for a decode (1 query) and a verify-sized batch (23 queries), every cell visible.
Prints a markdown table of the median milliseconds per layer.

    python bench/attn_ordered.py [--device cuda] [--ctx 4096 32768] [--n-q 1 23] [--iters 30]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
from _timing import call_times  # bench/_timing.py (this folder is on sys.path when run as a script)

from pydflash import ggml
from pydflash.ggml import Type

N_HEAD, N_HEAD_KV, HEAD_DIM, N_ATTN_LAYERS = 24, 4, 256, 16


def time_attention(backend, ordered: bool, n_ctx: int, n_q: int, n_layers: int, iters: int, warmup: int,
                   rng) -> float:
    """Median milliseconds per layer of one attention of n_q queries over n_ctx f16 cells."""
    ctx = ggml.Context(n_tensors=4 * n_layers + 8, graph_size=4 * n_layers + 8)
    q = ctx.new_tensor(Type.F32, (HEAD_DIM, n_q, N_HEAD)).mark_input()
    mask = ctx.new_tensor(Type.F16, (n_ctx, n_q)).mark_input()
    caches = [(ctx.new_tensor(Type.F16, (HEAD_DIM, n_ctx, N_HEAD_KV)).mark_input(),
               ctx.new_tensor(Type.F16, (HEAD_DIM, n_ctx, N_HEAD_KV)).mark_input()) for _ in range(n_layers)]
    scale = 1.0 / np.sqrt(HEAD_DIM)
    if ordered:
        outs = [ggml.flash_attn_ordered(ctx, q, k, v, mask, scale) for k, v in caches]
    else:
        outs = [ctx.flash_attn_ext(q, k, v, mask, scale, 0.0, 0.0) for k, v in caches]
        for out in outs:
            out.accumulate_f32()
    graph = ctx.graph(outs)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    q.set(rng.standard_normal((N_HEAD, n_q, HEAD_DIM), dtype=np.float32))
    mask.set(np.zeros((n_q, n_ctx), np.float16))
    rows = rng.standard_normal((N_HEAD_KV, n_ctx, HEAD_DIM)).astype(np.float16)
    for k, v in caches:
        k.set(rows)
        v.set(rows)
    times = call_times(lambda: backend.compute(graph), iters, warmup)
    return statistics.median(times) * 1e3 / n_layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--n-q", type=int, nargs="+", default=[1, 23])
    ap.add_argument("--layers", type=int, default=N_ATTN_LAYERS)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    backend = ggml.Backend(args.device)
    rng = np.random.default_rng(0)
    print(f"device: {backend.name}; f16 K/V, {N_HEAD} Q heads, {N_HEAD_KV} KV heads, head {HEAD_DIM}; median of "
          f"{args.iters} after {args.warmup} warm-up, per layer ({args.layers} layers per graph)\n")
    print("| queries | ctx | flash_attn_ext ms | flash_attn_ordered ms | ordered / ext |")
    print("|---|---|---|---|---|")
    for n_q in args.n_q:
        for n_ctx in args.ctx:
            ext = time_attention(backend, False, n_ctx, n_q, args.layers, args.iters, args.warmup, rng)
            ordered = time_attention(backend, True, n_ctx, n_q, args.layers, args.iters, args.warmup, rng)
            print(f"| {n_q} | {n_ctx} | {ext:.4f} | {ordered:.4f} | {ordered / ext:.2f} |")


if __name__ == "__main__":
    main()
