"""A budget-N tree verify against one AR step, medians of many: the quick A/B of a kernel or graph change.

    python bench/verify_ar.py TARGET.gguf --device cuda [--budget 22] [--verify-reps 60] [--ar-reps 40]

One process per setting (run it once with and once without an environment switch, alternating): loads the target
once, prefills a random 64-token prompt, verifies one random best-first tree of `--budget` nodes (plus the root)
again and again at that position (nothing committed), then times single-token AR steps. ddtree_step.py measures the
same two things among many; this is the part to repeat. Prints one line.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from _timing import call_times  # bench/_timing.py (this folder is on sys.path when run as a script)
from _trees import random_tree

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--device", default="auto")
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--verify-reps", type=int, default=60)
    p.add_argument("--ar-reps", type=int, default=40)
    p.add_argument("--state-type", default="replay", help="the tree nodes' recurrent states (enable_verify's "
                   "state_type; default: replay, what load's 'auto' takes)")
    args = p.parse_args(argv)

    from pydflash.models import load_target
    target = load_target(args.target, args.device, n_ctx=256, kv_type="f16", n_ubatch=512)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), 64)]
    tokens, parents, depths = random_tree(args.budget, rng, root=1)
    target.enable_verify(args.budget + 1, tree=True, state_type=args.state_type)
    target.reset()
    target.prefill(prompt, return_logits=False)
    verify = call_times(lambda: target.verify(tokens, parents, depths), args.verify_reps, warmup=5)

    target.reset()
    target.prefill(prompt, return_logits=False)
    last = [target.argmax()]

    def step():
        last[0] = target.step(last[0])
    ar = call_times(step, args.ar_reps, warmup=3)
    v, a = 1e3 * np.median(verify), 1e3 * np.median(ar)
    print(f"{os.path.basename(args.target)} on {target.backend.name}: verify of {args.budget + 1} slots (depth "
          f"{int(depths.max())}) {v:.3f} ms (p10 {1e3 * np.percentile(verify, 10):.3f}), AR step {a:.3f} ms, "
          f"verify / AR {v / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
