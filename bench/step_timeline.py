"""Where the device waits for the host within DDTree steps: a timeline from CUDA timing events.

    python bench/step_timeline.py TARGET.gguf --draft DRAFT_DIR [--budget 22] [--n-gen 64] [--reps 3]

Runs whole engine generations (as bench/ddtree_step.py) with a CUDA timing event recorded on ggml's stream just
before and just after every graph the step queues (ggml_backend_event_record given a timing-enabled event: ggml's
own events have timing off), and the host clock read at each record. An event's device time, mapped onto the
host clock through one event recorded on an idle stream, is when the stream reached it; where that is no later
than the host's record of it (within --slack-us), the stream had run dry: it waited for the host. Prints, per
interval between consecutive marks of a step (median over the steps): the device time it spans and how much
of it the stream stood idle, and the step's total. Needs CUDA (the runtime the ggml build loaded) and no
profiler; the events cost the host a few microseconds each.
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import os
import statistics
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_kernels import _cudart  # noqa: E402  (bench/ is on sys.path when run as a script)


class TimingEvents:
    """Timing-enabled CUDA events recorded on a ggml backend's stream through ggml_backend_event_record (which only
    reads the event struct's context: the cudaEvent_t)."""

    def __init__(self, backend):
        from pydflash.ggml import core
        self.ffi, self.lib, self.backend = core.ffi, core.lib, backend
        self.rt = _cudart()
        if self.rt is None:
            raise RuntimeError("no CUDA runtime found: this timeline needs a CUDA build and GPU")
        self.rt.cudaEventElapsedTime.argtypes = [ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p]
        self.events: list[tuple[ctypes.c_void_p, object]] = []
        self._pool = [self._new() for _ in range(4096)]    # created ahead: a record costs the record only

    def _new(self):
        ev = ctypes.c_void_p()
        err = self.rt.cudaEventCreate(ctypes.byref(ev))
        if err != 0:
            raise RuntimeError(f"cudaEventCreate failed ({err})")
        struct = self.ffi.new("void *[2]")     # struct ggml_backend_event {device; context}
        struct[1] = self.ffi.cast("void *", ev.value)
        return ev, struct

    def record(self):
        """Record an event now; returns its index."""
        ev, struct = self._pool.pop() if self._pool else self._new()
        self.lib.ggml_backend_event_record(self.ffi.cast("ggml_backend_event_t", struct), self.backend._ptr)
        self.events.append((ev, struct))
        return len(self.events) - 1

    def elapsed_ms(self, i: int, j: int) -> float:
        out = ctypes.c_float()
        err = self.rt.cudaEventElapsedTime(ctypes.byref(out), self.events[i][0], self.events[j][0])
        if err != 0:
            raise RuntimeError(f"cudaEventElapsedTime failed ({err})")
        return out.value

    def clear(self) -> None:
        """Every event back to the pool (the stream has passed them all: synchronize first)."""
        self._pool.extend(self.events)
        self.events.clear()


def _caller() -> str:
    """The pydflash function (outside the ggml wrapper) that queued the graph: names a mark."""
    f = sys._getframe(2)
    while f is not None:
        mod = f.f_globals.get("__name__", "")
        if mod.startswith("pydflash") and not mod.startswith("pydflash.ggml"):
            return f.f_code.co_name
        f = f.f_back
    return "?"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target")
    p.add_argument("--draft", required=True, help="DFlash draft directory (its target layers are captured)")
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--state-type", default="replay", choices=("f32", "f16", "replay"))
    p.add_argument("--slack-us", type=float, default=15.0,
                   help="a mark the stream reached within this long after the host recorded it counts as idle")
    args = p.parse_args(argv)

    from pydflash import ggml
    from pydflash.api import _load_draft, draft_layer_ids
    from pydflash.engine import Decoder
    from pydflash.models import load_target

    target = load_target(args.target, "cuda", n_ctx=args.n_prompt + args.n_gen + 1024, n_ubatch=512,
                         capture_layers=draft_layer_ids(args.draft))
    draft = _load_draft(args.draft, target)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), args.n_prompt)]
    decoder = Decoder(target, draft, mode="ddtree", budget=args.budget, state_type=args.state_type)
    decoder.generate_ids(prompt, min(args.n_gen, 32))       # warm-up: every graph built

    ev = TimingEvents(target.backend)
    marks: list[tuple[str, float, int]] = []     # (label, host time of the record, event index)

    def mark(label: str) -> None:
        t = time.perf_counter()
        marks.append((label, t, ev.record()))

    originals = {}

    def wrap(cls, name, kind):
        f = getattr(cls, name)
        originals[(cls, name)] = f

        def g(self, *a, **k):
            label = f"{_caller()}.{kind}"
            mark(label + ">")
            r = f(self, *a, **k)
            mark("<" + label)
            return r
        setattr(cls, name, g)

    wrap(ggml.Backend, "compute_async", "graph")
    wrap(ggml.Backend, "compute", "graph(wait)")
    wrap(ggml.HostBuffer, "download", "download")

    intervals = collections.defaultdict(list)     # (from, to) -> [(device ms, idle ms, host ms)]
    step_ms, idle_ms = [], []
    for _ in range(args.reps):
        target.backend.synchronize()
        ev.clear()
        marks.clear()
        mark("start")                                # on an idle stream: the device clock's origin
        decoder.generate_ids(prompt, args.n_gen)
        target.backend.synchronize()
        t0 = marks[0][1]
        dev = [t0 + 1e-3 * ev.elapsed_ms(0, i) for _, _, i in marks]   # device times on the host clock
        # a step runs from one verify's start mark to the next's
        starts = [n for n, (label, _, _) in enumerate(marks) if label == "verify.graph>"]
        for a, b in zip(starts, starts[1:]):
            step_ms.append(1e3 * (dev[b] - dev[a]))
            idle = 0.0
            for n in range(a, b):
                span = dev[n + 1] - dev[n]
                dry = dev[n + 1] - marks[n + 1][1] < 1e-6 * args.slack_us   # reached as soon as it was recorded
                gap = max(0.0, min(span, marks[n + 1][1] - dev[n])) if dry else 0.0
                intervals[(marks[n][0], marks[n + 1][0])].append(
                    (1e3 * span, 1e3 * gap, 1e3 * (marks[n + 1][1] - marks[n][1])))
                idle += gap
            idle_ms.append(1e3 * idle)
    for (cls, name), f in originals.items():
        setattr(cls, name, f)

    n_steps = len(step_ms)
    print(f"{n_steps} steps ({args.reps} generations of {args.n_gen} tokens, budget {args.budget}); device ms "
          f"between consecutive marks, median over the steps that have the interval; idle: the stream had run dry\n")
    print("| from | to | steps | device ms | idle ms | host ms |")
    print("|---|---|---|---|---|---|")
    for (a, b), v in intervals.items():     # (in the order a step first met them)
        print(f"| {a} | {b} | {len(v)} | " + " | ".join(f"{statistics.median(x[c] for x in v):.3f}" for c in range(3))
              + " |")
    print(f"\nstep (verify start to verify start): median {statistics.median(step_ms):.3f} ms, of it idle "
          f"{statistics.median(idle_ms):.3f} ms (mean {statistics.mean(idle_ms):.3f}) (min {min(step_ms):.3f}, max {max(step_ms):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
