#!/usr/bin/env python3
"""Time ggml_qmatmul (our kernel) next to ggml's mul_mat on the Qwen3.5-27B weight shapes, for 1..48 columns.

    python bench/qmatmul.py --device cuda                 # a markdown table on stdout
    python bench/qmatmul.py --device cuda --shapes ffn_up --cols 1,16
    python bench/qmatmul.py --device cuda --sweep      # every row-tile count per (shape, N): picks the heuristic

Each op runs in a graph of `copies` instances, each over its own copy of the weight (together over 400 MB, so
the weights come from DRAM, not from the 50 MB L2), computed `--warmup` times then `--reps` times; the median
per instance in microseconds. GB/s counts the weight bytes read once (activations and outputs are < 1%). The
weights are one quantised 256-row block of random values tiled over the matrix (quantising 5 GB would take
minutes; the kernels' speed does not depend on the values). Also prints, per shape, the time at N over the
time at N=1 (the issue's targets: <= 1.3 at 16-24 columns, <= 1.6 at 48).

By default ggml_qmatmul runs with the row_tiles the runtime gives it (pydflash.models.layers.qmatmul_row_tiles: on
Hopper the f16 kernel for the large Q4_K / Q6_K matrices from 9 columns, else the int8 kernels' own choice; one
column the streaming kernel): what the model's products take. `--row-tiles R` forces the kernel's 16-row tiles per
warp instead (ggml.qmatmul's row_tiles: 0 lets the int8 kernels choose, 16 the f16 kernel). `--sweep` times
ggml_qmatmul at its own choice and at every forced count, per shape and N, and marks the fastest: the data for the
choice the kernel makes (qmm_auto_row_tiles in ggml_ext/cuda/qmatmul.cu).
"""
from __future__ import annotations

import argparse
import statistics

import numpy as np
from _timing import call_times  # bench/_timing.py (this folder is on sys.path when run as a script)

from pydflash import ggml
from pydflash.models import layers

# name: (K, M, weight type as in the 27B Q4_K_M GGUF)
SHAPES = {
    "ffn_up": (5120, 17408, ggml.Type.Q4_K),
    "ffn_down": (17408, 5120, ggml.Type.Q6_K),
    "gdn_qkv": (5120, 10240, ggml.Type.Q4_K),
    "attn_q": (5120, 12288, ggml.Type.Q4_K),
    "gdn_out": (6144, 5120, ggml.Type.Q4_K),
    "lm_head": (5120, 248320, ggml.Type.Q6_K),
    "ffn_up_q5k": (5120, 17408, ggml.Type.Q5_K),
    "ffn_up_q8_0": (5120, 17408, ggml.Type.Q8_0),
    # as the runtime multiplies them (TargetRuntime.fused_weights: members of one type back to back)
    "ffn_gate_up": (5120, 34816, ggml.Type.Q4_K),
    "gdn_qkv_z_ba": (5120, 16480, ggml.Type.Q4_K),   # qkv, z, beta, alpha
    "attn_qk": (5120, 13312, ggml.Type.Q4_K),
    # the small ones, where ggml's MMQ splits K over the SMs (stream-k) from 9 columns on
    "attn_v": (5120, 1024, ggml.Type.Q6_K),
    "gdn_beta_alpha": (5120, 96, ggml.Type.Q4_K),    # alone where its type is not qkv's
}
COLS = [1, 2, 4, 8, 16, 23, 32, 48]
POOL_BYTES = 400e6


def weight_bytes(K: int, M: int, wtype: ggml.Type) -> np.ndarray:
    rng = np.random.default_rng(0)
    block = ggml.quantize(wtype, rng.standard_normal((256, K)).astype(np.float32))
    reps = (M + 255) // 256
    return np.tile(block.reshape(256, -1), (reps, 1))[:M]


def runtime_row_tiles(backend, K: int, M: int, wtype, n: int) -> int:
    """The row_tiles the model's runtime passes ggml.qmatmul for this product on this backend's device."""
    return layers.qmatmul_row_tiles_for(wtype, K, M, n, ggml.qmatmul_streams(backend._dev))


def time_op(backend, op: str, K: int, M: int, wtype, n: int, w_data: np.ndarray, warmup: int, reps: int,
            row_tiles: int = 0) -> float:
    copies = max(1, min(32, int(POOL_BYTES // w_data.nbytes) + 1))
    ctx = ggml.Context(n_tensors=3 * copies + 4, graph_size=4 * copies + 8)
    x = ctx.new_tensor(np.float32, (K, n), name="x").mark_input()
    ws = [ctx.new_tensor(wtype, (K, M), name=f"w{i}").mark_input() for i in range(copies)]
    outs = [ggml.qmatmul(ctx, w, x, row_tiles) if op == "qmatmul" else ctx.mul_mat(w, x) for w in ws]
    graph = ctx.graph(outs)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    for w in ws:
        w.set(w_data)
    x.set(np.random.default_rng(1).standard_normal((n, K)).astype(np.float32))
    times = call_times(lambda: backend.compute(graph), reps, warmup)
    alloc.close()
    ctx.close()
    return 1e6 * statistics.median(times) / copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--cols", default=",".join(map(str, COLS)))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--row-tiles", type=int, default=None, choices=ggml.QMATMUL_ROW_TILES,
                    help="force qmatmul's row tiles per warp (0: the int8 kernels choose; default: as the runtime)")
    ap.add_argument("--sweep", action="store_true", help="time every row-tile count per (shape, N)")
    args = ap.parse_args()
    backend = ggml.Backend(args.device)
    cols = [int(c) for c in args.cols.split(",")]
    if args.sweep:
        sweep(backend, args.shapes.split(","), cols, args.warmup, args.reps)
        return
    print(f"device: {backend.name}; us per matmul (median of {args.reps}); GB/s of weight bytes\n")
    print("| shape | type | N | qmatmul us | GB/s | mul_mat us | GB/s | qmatmul / mul_mat | qmatmul N / N=1 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        K, M, wtype = SHAPES[name]
        w_data = weight_bytes(K, M, wtype)
        gb = w_data.nbytes / 1e9
        t1 = None
        for n in cols:
            rt = runtime_row_tiles(backend, K, M, wtype, n) if args.row_tiles is None else args.row_tiles
            tq = time_op(backend, "qmatmul", K, M, wtype, n, w_data, args.warmup, args.reps, rt)
            tm = time_op(backend, "mul_mat", K, M, wtype, n, w_data, args.warmup, args.reps)
            t1 = tq if n == 1 else t1
            rel = f"{tq / t1:.2f}" if t1 else "-"
            print(f"| {name} {M}x{K} | {wtype.name} | {n} | {tq:.1f} | {gb / tq * 1e6:.0f} | {tm:.1f} | "
                  f"{gb / tm * 1e6:.0f} | {tq / tm:.2f} | {rel} |", flush=True)


def sweep(backend, shapes: list[str], cols: list[int], warmup: int, reps: int) -> None:
    forced = [rt for rt in ggml.QMATMUL_ROW_TILES if rt]
    print(f"device: {backend.name}; qmatmul us per matmul (median of {reps}) at the kernel's own row-tile choice "
          f"and at each forced count; * marks the fastest\n")
    print("| shape | type | N | auto | " + " | ".join(f"rt={rt}" for rt in forced) + " | best / auto |")
    print("|---|---|---|---|" + "---|" * len(forced) + "---|")
    for name in shapes:
        K, M, wtype = SHAPES[name]
        w_data = weight_bytes(K, M, wtype)
        for n in cols:
            auto = time_op(backend, "qmatmul", K, M, wtype, n, w_data, warmup, reps)
            times = [time_op(backend, "qmatmul", K, M, wtype, n, w_data, warmup, reps, rt) for rt in forced]
            best = min(times)
            cells = " | ".join(f"{t:.1f}{'*' if t == best else ''}" for t in times)
            print(f"| {name} {M}x{K} | {wtype.name} | {n} | {auto:.1f} | {cells} | {best / auto:.2f} |", flush=True)


if __name__ == "__main__":
    main()
