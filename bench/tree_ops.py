#!/usr/bin/env python3
"""Time the tree ops at the Qwen3.5-27B GDN layer shape next to upstream's chain ops, and measure f16 drift.

    python bench/tree_ops.py --device cuda            # timings, a markdown table
    python bench/tree_ops.py --device cuda --drift    # also f16 intermediates vs f32 after 1, 8, 64 rollbacks

Timings: each op alone in a graph, computed `--warmup` times, then `--reps` times, one host-timed
Backend.compute each (it returns when the device is done); the median in ms. Also the median per op of a graph
holding `--copies` instances of it (so launch and host overhead are shared; each instance has its own output).
The tree ops run a 23-node DDTree-shaped tree; upstream ggml_ssm_conv and ggml_gated_delta_net run 23 tokens.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
from _timing import call_times  # bench/_timing.py (this folder is on sys.path when run as a script)

from pydflash import ggml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the tests' input generators, trees and drift measurement
from tree_ref import gdn_inputs, make_tree  # noqa: E402


def time_op(backend: ggml.Backend, build, inputs: dict, persistent, copies: int, warmup: int,
            reps: int) -> float:
    """Median ms per op over `reps` computes of a graph with `copies` instances of the op built by `build`."""
    ctx = ggml.Context(n_tensors=len(inputs) + 4 * copies + 8, graph_size=8 * copies + 16)
    tensors = {n: ctx.new_tensor(a.dtype, a.shape[::-1], name=n).mark_input() for n, a in inputs.items()}
    outs = [build(ctx, tensors, persistent) for _ in range(copies)]
    if not backend.supports(outs[0]):
        raise SystemExit(f"{backend.name} does not support {outs[0].op.name} at this shape")
    graph = ctx.graph(outs)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    for n, a in inputs.items():
        tensors[n].set(a)
    return 1e3 * statistics.median(call_times(lambda: backend.compute(graph), reps, warmup)) / copies


def bench(device: str, n_nodes: int, warmup: int, reps: int, copies: int, n_threads: int | None,
          only: list[str]) -> tuple[str, list[tuple]]:
    rng = np.random.default_rng(0)
    backend = ggml.Backend(device, n_threads=n_threads) if device == "cpu" else ggml.Backend(device)
    S_v, H, H_k, d_inner, d_conv = 128, 48, 16, 10240, 4
    parent = make_tree("ddtree", n_nodes, rng)[None]

    conv = {"sx": rng.standard_normal((1, d_inner, d_conv - 1 + n_nodes)).astype(np.float32),
            "c": rng.standard_normal((d_inner, d_conv)).astype(np.float32)}
    gdn = gdn_inputs(rng, S_v, H, n_nodes, 1, H_k=H_k)

    cache_ctx = ggml.Context(n_tensors=3)
    inter = {dt: cache_ctx.new_tensor(dt, (S_v * S_v, H, n_nodes, 1)) for dt in (np.float32, np.float16)}
    steps = cache_ctx.new_tensor(np.float32, (S_v * H_k + S_v * H + H, n_nodes + 1))   # a replay verify's store
    cache_buf = backend.alloc_tensors(cache_ctx)
    cache_buf.clear(0)

    gdn_args = ("q", "k", "v", "g", "beta", "state")
    cases = [
        ("ssm_conv (upstream, chain)", conv, lambda ctx, t, _: ctx.ssm_conv(t["sx"], t["c"])),
        ("ssm_conv_tree", dict(conv, parent=parent),
         lambda ctx, t, _: ggml.ssm_conv_tree(ctx, t["sx"], t["c"], t["parent"])),
        ("gated_delta_net (upstream, chain)", gdn,
         lambda ctx, t, _: ctx.gated_delta_net(*(t[n] for n in gdn_args), 1)),
        ("gated_delta_net_tree", dict(gdn, parent=parent),
         lambda ctx, t, _: ggml.gated_delta_net_tree(ctx, *(t[n] for n in gdn_args), t["parent"])),
        ("gated_delta_net_tree, o only", dict(gdn, parent=parent),
         lambda ctx, t, _: ggml.gated_delta_net_tree(ctx, *(t[n] for n in gdn_args), t["parent"], o_only=True)),
        ("gated_delta_net_tree_steps, exact (the walk)", dict(gdn, parent=parent),
         lambda ctx, t, st: ggml.gated_delta_net_tree_steps(ctx, *(t[n] for n in gdn_args), t["parent"], st,
                                                             exact=True), steps),
        ("gated_delta_net_tree_steps, chunk form", dict(gdn, parent=parent),
         lambda ctx, t, st: ggml.gated_delta_net_tree_steps(ctx, *(t[n] for n in gdn_args), t["parent"], st,
                                                             exact=False), steps),
        ("gated_delta_net_tree_persist, f32 inter", dict(gdn, parent=parent),
         lambda ctx, t, inter: ggml.gated_delta_net_tree_persist(ctx, *(t[n] for n in gdn_args), t["parent"], inter),
         inter[np.float32]),
        ("gated_delta_net_tree_persist, f16 inter", dict(gdn, parent=parent),
         lambda ctx, t, inter: ggml.gated_delta_net_tree_persist(ctx, *(t[n] for n in gdn_args), t["parent"], inter),
         inter[np.float16]),
    ]
    rows = []
    for name, inputs, build, *persistent in cases:
        if only and not any(o in name for o in only):
            continue
        p = persistent[0] if persistent else None
        one = time_op(backend, build, inputs, p, 1, warmup, reps)
        many = time_op(backend, build, inputs, p, copies, warmup, max(3, reps // copies))
        rows.append((name, one, many))
    del cache_buf
    return backend.name, rows


def drift(device: str, checkpoints: tuple[int, ...]) -> tuple[str, list[tuple]]:
    from test_gated_delta_net_tree import f16_drift
    backend = ggml.Backend(device)
    errs = f16_drift(backend, np.random.default_rng(0), checkpoints, S_v=128, H=48, H_k=16, n_t=23)
    return backend.name, [(n, *errs[n]) for n in checkpoints]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    ap.add_argument("--nodes", type=int, default=23, help="tree nodes (tokens for the chain ops)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--copies", type=int, default=20, help="op instances per graph for the amortised column")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: all)")
    ap.add_argument("--only", nargs="*", default=[], help="time only the rows whose name contains one of these")
    ap.add_argument("--drift", action="store_true", help="also measure f16 intermediates against f32")
    ap.add_argument("--no-timing", action="store_true", help="skip the timings")
    args = ap.parse_args()

    if not args.no_timing:
        name, rows = bench(args.device, args.nodes, args.warmup, args.reps, args.copies, args.threads,
                           args.only)
        print(f"\nTree ops at the 27B GDN layer shape (H_v 48, S_v 128, H_k 16, d_inner 10240, kernel 4), "
              f"{args.nodes} nodes / tokens, on {name}: median ms\n")
        print(f"| op | one op per compute | per op, {args.copies} per compute |")
        print("| --- | ---: | ---: |")
        for op, one, many in rows:
            print(f"| {op} | {one:.4f} | {many:.4f} |")
    if args.drift:
        name, rows = drift(args.device, (1, 8, 64))
        print(f"\nf16 intermediates against f32 at the 27B GDN shape, 23-node DDTree-shaped trees, deepest node "
              f"committed each step, on {name}: relative error ||f16 - f32|| / ||f32||\n")
        print("| rollbacks | committed state | o of that step |")
        print("| ---: | ---: | ---: |")
        for n, state_err, o_err in rows:
            print(f"| {n} | {state_err:.2e} | {o_err:.2e} |")


if __name__ == "__main__":
    main()
