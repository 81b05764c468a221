"""One phase of a speculative step, repeated alone, for a kernel profiler: which kernels a draft step or a verify
of N slots runs, and for how long.

    GGML_CUDA_DISABLE_GRAPHS=1 ncu --profile-from-start off --csv --metrics gpu__time_duration.sum \
        python bench/step_kernels.py TARGET.gguf --draft DRAFT_DIR --phase draft --reps 3 > draft.csv
    python tools/ncu_compare.py draft.csv 3 verify.csv 3

Loads the pair, prefills a random prompt and warms the phase up; only the `--reps` repetitions run between
cudaProfilerStart and cudaProfilerStop, so with `--profile-from-start off` the profiler sees nothing else.
Phases: `ar` (one single-token target step), `verify` (a forward over --slots tree slots, a random best-first
tree), `draft` (one draft proposal), `commit` (the target's commit of the tree's deepest path after one verify:
state, conv window, KV rows moved), `append` (the draft taking that path's features into its context), `steps` (a whole generation of --n-gen
tokens by the engine, budget slots - 1: for a timeline profiler, e.g. `nsys profile --capture-range=cudaProfilerApi
--cuda-graph-trace=node`, where the device waits between a step's graphs). Without a profiler it prints the median
wall time of the phase (CUDA graphs on unless disabled).
"""
from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import statistics
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _cudart():
    """The CUDA runtime the ggml build loaded (for cudaProfilerStart/Stop), or None on a CPU build."""
    for name in ("libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target")
    p.add_argument("--draft", required=True, help="DFlash draft directory (its target layers are captured)")
    p.add_argument("--phase", choices=("ar", "verify", "draft", "commit", "append", "steps"), required=True)
    p.add_argument("--slots", type=int, default=23, help="verify slots (budget + 1)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=64, help="tokens a `steps` repetition generates")
    p.add_argument("--device", default="cuda")
    p.add_argument("--state-type", default="replay", choices=("f32", "f16", "replay"),
                   help="the verify's node states (TargetRuntime.enable_verify)")
    args = p.parse_args(argv)

    from pydflash import ddtree
    from pydflash.api import _load_draft, draft_layer_ids
    from pydflash.engine import Decoder
    from pydflash.models import load_target

    target = load_target(args.target, args.device, n_ctx=args.n_prompt + 1024, n_ubatch=512,
                         capture_layers=draft_layer_ids(args.draft))
    draft = _load_draft(args.draft, target)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), args.n_prompt)]
    target.prefill(prompt, return_logits=False)
    draft.append_from_target()
    target.enable_verify(args.slots, tree=True, state_type=args.state_type)
    budget = args.slots - 1
    logp = np.log(rng.dirichlet(np.ones(8), size=draft.block_size - 1)).astype(np.float32)
    ids = rng.integers(1, min(target.hp.n_vocab, 30000), size=(draft.block_size - 1, 8))
    tree = ddtree.build_tree(np.sort(logp, axis=1)[:, ::-1], ids, budget)
    tokens, parents, depths = ddtree.padded(tree, args.slots)
    tokens[0] = prompt[-1]
    deepest = int(np.argmax(depths))
    path = [deepest]
    while path[-1] != 0:
        path.append(int(parents[path[-1]]))
    path = path[::-1]                       # root first; off the chain of slots 0, 1, 2, ..: KV rows move
    n_past, n_ctx = target.cache.n_past, draft.n_ctx
    if args.phase in ("commit", "append"):
        target.verify(tokens, parents, depths)
    if args.phase == "steps":
        decoder = Decoder(target, draft, mode="ddtree", budget=budget, state_type=args.state_type)

    def run():
        if args.phase == "ar":
            target.step(prompt[-1])
            target.cache.n_past -= 1          # stay at the same position: every repetition is the same step
        elif args.phase == "verify":
            target.verify(tokens, parents, depths)
        elif args.phase == "commit":
            target.cache.n_past = n_past      # the same verify committed again and again
            target.commit(path)
        elif args.phase == "append":
            draft.truncate(n_ctx)
            draft.append_from_target(path)
        elif args.phase == "steps":
            decoder.generate_ids(prompt, args.n_gen)
        else:
            draft.propose(prompt[-1])

    for _ in range(3):
        run()
    cudart = _cudart() if args.device != "cpu" else None
    times = []
    if cudart is not None:
        cudart.cudaProfilerStart()
    for _ in range(args.reps):
        t0 = time.perf_counter()
        run()
        times.append(1e3 * (time.perf_counter() - t0))
    if cudart is not None:
        cudart.cudaProfilerStop()
    if args.phase == "steps":
        print(f"steps: {decoder.last_stats['steps']} speculative steps a repetition", file=sys.stderr)
    what = f" ({args.slots} slots)" if args.phase == "verify" else f" (path of {len(path)} slots)" \
        if args.phase in ("commit", "append") else ""
    print(f"{args.phase}{what}: median "
          f"{statistics.median(times):.3f} ms over {args.reps} repetitions", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
