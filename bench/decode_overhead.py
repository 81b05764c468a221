"""Where the wall time of one AR decode step goes: inside `Backend.compute` (graph launch and the GPU work it
waits for) against everything else (Python, input uploads, the argmax read-back).

    python bench/decode_overhead.py MODEL.gguf --device cuda [--steps 200]

Run it with GGML_CUDA_DISABLE_GRAPHS=1 too, to see what ggml-cuda's CUDA graphs save. Prints one markdown row.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)
    from pydflash.models.qwen35 import Qwen35Target

    target = Qwen35Target(args.model, args.device, n_ctx=1024)
    backend, compute = target.backend, target.backend.compute
    inside = [0.0]

    def timed_compute(graph):
        t = time.perf_counter()
        compute(graph)
        inside[0] += time.perf_counter() - t

    backend.compute = timed_compute
    target.prefill([1, 2, 3], return_logits=False)
    token = target.argmax()
    for _ in range(20):                      # warm-up: graph build, allocation, CUDA graph capture
        token = target.step(token)
    inside[0] = 0.0
    t = time.perf_counter()
    for _ in range(args.steps):
        token = target.step(token)
    total = (time.perf_counter() - t) / args.steps * 1e6
    in_compute = inside[0] / args.steps * 1e6
    graphs = "off" if os.environ.get("GGML_CUDA_DISABLE_GRAPHS") else "on"
    print(f"| {os.path.basename(args.model)} | {backend.name} | CUDA graphs {graphs} | {total:.0f} | "
          f"{in_compute:.0f} | {total - in_compute:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
