"""Command line: `pydflash info` (build and device check). More subcommands arrive with the engine."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np


def cmd_info(args: argparse.Namespace) -> int:
    """Print what this build is and prove it computes: a graph through an upstream op and one of ours."""
    from . import __version__, ggml
    from .ggml import _ffi

    print(f"pydflash {__version__}")
    print(f"ggml libraries: {_ffi.LIB_DIR} (ggml_ext ABI {_ffi.lib.ggml_ext_abi_version()})")
    for dev in ggml.devices():
        print(f"device {dev['name']:8s} {dev['kind']:5s} {dev['memory_total'] / 2**30:7.1f} GiB  {dev['description']}")
    backend = ggml.Backend(args.device)
    rng = np.random.default_rng(0)
    sx = rng.standard_normal((1, 128, 3 + 8)).astype(np.float32)
    c = rng.standard_normal((128, 4)).astype(np.float32)
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    t_sx = ctx.new_tensor(np.float32, sx.shape[::-1]).mark_input()
    t_c = ctx.new_tensor(np.float32, c.shape[::-1]).mark_input()
    t_p = ctx.new_tensor(np.int32, (8, 1)).mark_input()
    # a chain tree must reproduce the upstream op exactly
    diff = ctx.sub(ggml.ssm_conv_tree(ctx, t_sx, t_c, t_p), ctx.ssm_conv(t_sx, t_c))
    graph = ctx.graph(diff)
    ggml.Allocator(backend).allocate(graph)
    t_sx.set(sx)
    t_c.set(c)
    t_p.set(np.arange(8, dtype=np.int32) - 1)
    start = time.perf_counter()
    backend.compute(graph)
    elapsed = time.perf_counter() - start
    max_diff = float(np.abs(graph.outputs[0].numpy()).max())
    ok = max_diff == 0.0
    print(f"self-check on {backend.name}: ssm_conv_tree(chain) - ssm_conv = {max_diff} "
          f"({elapsed * 1e3:.2f} ms) {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pydflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="show the build and devices, and run a self-check graph")
    info.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default: auto)")
    info.set_defaults(func=cmd_info)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
