"""The draft step's top-k, alone: ggml_top_k_logp against the graph it replaced (ggml_top_k, a full segmented sort
on CUDA, + soft_max + get_rows + log) on the draft's logits shape, f32 [n_vocab, 15].

    python bench/top_k_logp.py --device cuda [--vocab 151936 248320] [--k 8 32] [--reps 200]

Each graph is computed --reps times after warm-up (backend.compute waits for the device); prints a markdown table
of median and p10/p90 microseconds per compute, and checks that both give the same ids.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
from _timing import call_times  # bench/_timing.py (this folder is on sys.path when run as a script)

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

ROWS = 15   # block 16: the draft proposes for positions 1..15


def build(backend, n_vocab: int, k: int, fused: bool):
    from pydflash import ggml
    ctx = ggml.Context(n_tensors=16, graph_size=16)
    logits = ctx.new_tensor(ggml.Type.F32, (n_vocab, ROWS), name="logits").mark_input()
    if fused:
        outs = [ggml.top_k_logp(ctx, logits, k)]
    else:
        top = ctx.top_k(logits, k)
        probs = ctx.reshape_3d(ctx.soft_max(logits), 1, n_vocab, ROWS)
        outs = [top, ctx.log(ctx.get_rows(probs, top))]
    graph = ctx.graph(outs + [logits])   # logits an output, as in the draft: soft_max may not overwrite them
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    return ctx, logits, graph, alloc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--vocab", type=int, nargs="+", default=[151936, 248320])
    ap.add_argument("--k", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()

    from pydflash import ggml
    backend = ggml.Backend(args.device)
    rng = np.random.default_rng(0)
    print("| n_vocab x rows | k | top_k + soft_max + get_rows, us (p10/p90) | top_k_logp, us (p10/p90) |")
    print("|---|---|---|---|")
    for n_vocab in args.vocab:
        x = (rng.standard_normal((ROWS, n_vocab)) * 4).astype(np.float32)
        for k in args.k:
            cells = []
            ids = []
            for fused in (False, True):
                keep = build(backend, n_vocab, k, fused)
                _, logits, graph, _ = keep
                logits.set(x)
                t = sorted(1e6 * s for s in call_times(lambda: backend.compute(graph), args.reps, warmup=5))
                cells.append(f"{statistics.median(t):.1f} ({t[len(t) // 10]:.1f} / {t[len(t) * 9 // 10]:.1f})")
                out = graph.outputs[0].numpy().reshape(ROWS, -1)
                got = np.sort(out[:, :k], axis=1) if not fused else np.sort(out.reshape(ROWS, 2, k)[:, 1], axis=1)
                ids.append(got.astype(np.int64))
            same = "" if np.array_equal(ids[0], ids[1]) else " (ids differ!)"
            print(f"| {n_vocab} x {ROWS} | {k} | {cells[0]} | {cells[1]}{same} |")


if __name__ == "__main__":
    main()
