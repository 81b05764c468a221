"""What the host spends, call by call, inside DDTree steps: the pieces between a verify's tokens and the draft
forward's launch, and between the proposals and the next verify's launch.

    python bench/step_host_calls.py TARGET.gguf --draft DRAFT_DIR --device cuda [--prompts 512,8192] [--n-gen 128]

Runs whole engine generations (budget-22 trees, as bench/ddtree_step.py) with the step's functions wrapped by a
host clock, one generation per prompt length after a warm-up one (graphs built), and prints per function the mean
microseconds a call and the calls a step, and the median host time from each verify's return to the next graph's
launch (the draft forward's). The wrappers cost the host ~1 us a call themselves; bench/step_timeline.py says what
of it the device waits for. Written for docs/benchmarks.md, twenty-fifth session.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


class CallClock:
    """Host seconds and counts of wrapped functions, and the order of marked calls' starts and ends."""

    def __init__(self):
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.marks: list[tuple[str, float]] = []

    def wrap(self, owner, name: str, mark: bool = False) -> None:
        f, key, clock = getattr(owner, name), f"{getattr(owner, '__name__', owner)}.{name}", self

        def timed(*a, **k):
            t0 = time.perf_counter()
            if mark:
                clock.marks.append((key, t0))
            try:
                return f(*a, **k)
            finally:
                t1 = time.perf_counter()
                clock.seconds[key] += t1 - t0
                clock.calls[key] += 1
                if mark:
                    clock.marks.append((key + " end", t1))
        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.marks.clear()

    def gaps(self, after: str, until: str) -> list[float]:
        """Seconds from each end of `after` to the next start of `until`."""
        out, since = [], None
        for key, t in self.marks:
            if key == after + " end":
                since = t
            elif key == until and since is not None:
                out.append(t - since)
                since = None
        return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--draft", required=True, help="DFlash draft directory (its target layers are captured)")
    p.add_argument("--device", default="auto")
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--prompts", default="512,8192", help="prompt lengths, comma-separated")
    p.add_argument("--n-gen", type=int, default=128)
    args = p.parse_args(argv)

    from pydflash import ddtree, engine
    from pydflash.api import _load_draft, draft_layer_ids
    from pydflash.ggml import core
    from pydflash.models import dflash_draft, load_target, runtime

    prompts = [int(n) for n in args.prompts.split(",")]
    n_ctx = -(-(max(prompts) + 2 * args.n_gen + 64) // 256) * 256
    target = load_target(args.target, args.device, n_ctx=n_ctx, n_ubatch=512,
                         capture_layers=draft_layer_ids(args.draft))
    draft = _load_draft(args.draft, target)
    clock = CallClock()
    for owner, name in ((ddtree, "accept"), (ddtree, "build_tree"), (engine, "commit_step"),
                        (dflash_draft.DFlashDraft, "append_from_target"), (dflash_draft.DFlashDraft, "_step"),
                        (dflash_draft.DraftContextCache, "mask"), (runtime.TargetRuntime, "commit"),
                        (runtime.TargetRuntime, "_upload_verify_masks"), (core.InputBlock, "upload"),
                        (core.Readback, "queue"), (core.Readback, "wait"), (core.Event, "synchronize")):
        clock.wrap(owner, name)
    clock.wrap(core.Backend, "compute_async", mark=True)
    clock.wrap(runtime.TargetRuntime, "verify", mark=True)
    decoder = engine.Decoder(target, draft, mode="ddtree", budget=args.budget)
    rng = np.random.default_rng(0)
    for n_prompt in prompts:
        prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), n_prompt)]
        decoder.generate_ids(prompt, args.n_gen)          # warm-up: this length's graphs built
        clock.clear()
        _, stats = decoder.generate_ids(prompt, args.n_gen)
        steps = stats["steps"]
        gap = np.median(clock.gaps("TargetRuntime.verify", "Backend.compute_async")) * 1e6
        print(f"\nprompt {n_prompt}: {steps} steps; host from a verify's return to the draft's launch: median "
              f"{gap:.1f} us\n| call | us a call | calls a step |\n|---|---|---|")
        for key in sorted(clock.seconds, key=lambda k: -clock.seconds[k] / clock.calls[k]):
            print(f"| {key} | {clock.seconds[key] / clock.calls[key] * 1e6:.1f} | {clock.calls[key] / steps:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
