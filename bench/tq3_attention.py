#!/usr/bin/env python3
"""Attention timings over TQ3_0 and F16 (optionally Q4_0, Q8_0) K/V caches at the 27B attention shape.

24 query heads, 4 KV heads, head size 256 (Qwen3.5-27B); 1 query token (decode) and 23 (a DDTree verify of
22 nodes plus the root) by default. Each timed graph holds one flash-attention op per attention layer (16,
each over its own cache, so nothing is served from the L2 cache of a previous layer); TQ3_0 includes its
query rotation and output un-rotation (pydflash.tq3.flash_attn). Caches are filled on the device from random
f32 rows. Prints, per query-token count, a markdown table of the median time per layer after warm-up and the
ratio TQ3_0 / F16, plus the cache sizes of the 27B shape at 128K and 256K tokens.

    python bench/tq3_attention.py [--device cuda] [--ctx 2048 ... 262144] [--n-q 1 23] [--types TQ3_0 F16]
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
from _timing import call_times  # bench/_timing.py (this folder is on sys.path when run as a script)

from pydflash import ggml, tq3
from pydflash.ggml import Type

N_HEAD, N_HEAD_KV, HEAD_DIM, N_ATTN_LAYERS = 24, 4, 256, 16
TYPES = [Type.TQ3_0, Type.F16]


def time_decode(backend: ggml.Backend, kv_type: Type, n_ctx: int, n_layers: int, iters: int, warmup: int,
                rng: np.random.Generator, n_q: int = 1) -> float:
    """Median milliseconds per layer of one attention step of n_q query tokens over n_ctx cached tokens."""
    rot = tq3.Rotation(backend)
    cache_ctx = ggml.Context(n_tensors=2 * n_layers)
    caches = [(cache_ctx.new_tensor(kv_type, (HEAD_DIM, n_ctx, N_HEAD_KV)),
               cache_ctx.new_tensor(kv_type, (HEAD_DIM, n_ctx, N_HEAD_KV))) for _ in range(n_layers)]
    cache_buf = backend.alloc_tensors(cache_ctx)

    # fill every cache on the device from one random f32 source (cpy quantises)
    fill_ctx = ggml.Context(n_tensors=4 * n_layers + 4, graph_size=4 * n_layers + 4)
    src = fill_ctx.new_tensor(Type.F32, (HEAD_DIM, n_ctx, N_HEAD_KV)).mark_input()
    fills = [fill_ctx.cpy(src, t) for pair in caches for t in pair]
    fill_graph = fill_ctx.graph(fills)
    fill_alloc = ggml.Allocator(backend)
    fill_alloc.allocate(fill_graph)
    src.set(rng.standard_normal((N_HEAD_KV, n_ctx, HEAD_DIM), dtype=np.float32))
    backend.compute(fill_graph)
    del fill_alloc, fill_graph, fill_ctx

    ctx = ggml.Context(n_tensors=16 * n_layers + 8, graph_size=16 * n_layers + 8)
    q = ctx.new_tensor(Type.F32, (HEAD_DIM, n_q, N_HEAD)).mark_input()
    mask = ctx.new_tensor(Type.F16, (n_ctx, n_q)).mark_input()
    scale = 1.0 / np.sqrt(HEAD_DIM)
    outs = []
    for k, v in caches:
        if kv_type == Type.TQ3_0:
            outs.append(tq3.flash_attn(ctx, rot, q, k, v, mask, scale))
        else:
            outs.append(ctx.flash_attn_ext(q, k, v, mask, scale, 0.0, 0.0))
    graph = ctx.graph(outs)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    q.set(rng.standard_normal((N_HEAD, n_q, HEAD_DIM), dtype=np.float32))
    mask.set(np.zeros((n_q, n_ctx), np.float16))

    times = call_times(lambda: backend.compute(graph), iters, warmup)
    rot.close()
    del cache_buf
    return statistics.median(times) * 1e3 / n_layers


def time_unrotate(backend: ggml.Backend, n_layers: int, iters: int, warmup: int, rng: np.random.Generator,
                  n_q: int) -> float:
    """Median milliseconds per layer of the output un-rotation alone (what folding R^T into the attention output
    projection would save): R^T over the 24 heads x 256 values of n_q tokens, one op per layer on its own input."""
    rot = tq3.Rotation(backend)
    ctx = ggml.Context(n_tensors=8 * n_layers + 8, graph_size=8 * n_layers + 8)
    xs = [ctx.new_tensor(Type.F32, (HEAD_DIM * N_HEAD, n_q)).mark_input() for _ in range(n_layers)]
    graph = ctx.graph([rot.unrotate(ctx, x) for x in xs])
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    for x in xs:
        x.set(rng.standard_normal((n_q, HEAD_DIM * N_HEAD), dtype=np.float32))
    times = call_times(lambda: backend.compute(graph), iters, warmup)
    rot.close()
    return statistics.median(times) * 1e3 / n_layers


def _ctx_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 8192, 32768, 131072, 262144])
    ap.add_argument("--layers", type=int, default=N_ATTN_LAYERS)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--n-q", type=int, nargs="+", default=[1, 23],
                    help="query tokens per step (1: decode; 23: a 22-node tree verify)")
    ap.add_argument("--types", nargs="+", default=[t.name for t in TYPES], help="K/V types (TQ3_0 F16 Q8_0 Q4_0)")
    args = ap.parse_args()
    types = [Type[name.upper()] for name in args.types]

    backend = ggml.Backend(args.device)
    rng = np.random.default_rng(0)
    for n_q in args.n_q:
        print(f"\ndevice: {backend.name}; attention of {n_q} query token(s), {N_HEAD} Q heads, {N_HEAD_KV} KV heads, "
              f"head {HEAD_DIM}; median of {args.iters} after {args.warmup} warm-up, per layer ({args.layers} layers "
              f"per graph)\n")
        print("| K/V type | bits/value | " + " | ".join(f"{_ctx_label(n)} ctx (ms)" for n in args.ctx) + " |")
        print("|---|---|" + "---|" * len(args.ctx))
        ms = {}
        for t in types:
            ms[t] = [time_decode(backend, t, n, args.layers, args.iters, args.warmup, rng, n_q) for n in args.ctx]
            bits = ggml.row_size(t, HEAD_DIM) * 8 / HEAD_DIM
            print(f"| {t.name} | {bits:g} | " + " | ".join(f"{x:.4f}" for x in ms[t]) + " |", flush=True)
        if Type.TQ3_0 in ms and Type.F16 in ms:
            ratios = [a / b for a, b in zip(ms[Type.TQ3_0], ms[Type.F16])]
            print("| TQ3_0 / F16 | | " + " | ".join(f"{r:.2f}x" for r in ratios) + " |")
        if Type.TQ3_0 in ms:
            un = time_unrotate(backend, args.layers, args.iters, args.warmup, rng, n_q)
            print(f"\nof which the output un-rotation (a {tq3.GROUP}x{tq3.GROUP} mul_mat per layer, the part folding it "
                  f"into the output projection would remove): {un:.4f} ms per layer")

    print(f"\nKV cache of the 27B shape ({N_ATTN_LAYERS} attention layers x (K, V) x {N_HEAD_KV} heads x {HEAD_DIM}):\n")
    print("| K/V type | 128K ctx (GiB) | 256K ctx (GiB) |")
    print("|---|---|---|")
    for t in types:
        sizes = [tq3.kv_cache_bytes(n, N_ATTN_LAYERS, N_HEAD_KV, HEAD_DIM, t) / 2**30 for n in (131072, 262144)]
        print(f"| {t.name} | {sizes[0]:.3f} | {sizes[1]:.3f} |")


if __name__ == "__main__":
    main()
