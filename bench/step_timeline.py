"""Where the device waits for the host within DDTree steps: a timeline from CUDA timing events.

    python bench/step_timeline.py TARGET.gguf --draft DRAFT_DIR [--budget 22] [--n-gen 64] [--reps 2]

Runs whole engine generations (as bench/ddtree_step.py) with a CUDA timing event recorded on ggml's stream just
before and just after every graph the step queues and every copy into page-locked memory
(ggml_backend_event_record given a timing-enabled event: ggml's own events have timing off), and reads the host
clock at each record and whenever a wait for the device returns. Prints, per interval between consecutive marks of
a step (median over the steps): the device time it spans and the host time between the two records. A graph's
interval ("X.graph>" to "<X.graph") is the graph's run on the device; the others are the stream's time between
graphs: small copies, and waiting for the host to queue the next work (their sum, per step, is printed too). Host
rows "woke" give the host time from a wait's return to the next record (what the host does before queueing more).
Needs CUDA (the runtime the ggml build loaded) and no profiler; each record costs the host a few microseconds.
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
    marks: list[tuple[str, float, int | None]] = []   # (label, host time, event index; None: a host-only mark)

    def mark(label: str, device: bool = True) -> None:
        t = time.perf_counter()
        marks.append((label, t, ev.record() if device else None))

    originals = {}

    def wrap(cls, name, kind, device=True):
        f = getattr(cls, name)
        originals[(cls, name)] = f

        def g(self, *a, **k):
            label = f"{_caller()}.{kind}"
            if device:
                mark(label + ">")
            r = f(self, *a, **k)
            mark("<" + label, device)
            return r
        setattr(cls, name, g)

    wrap(ggml.Backend, "compute_async", "graph")
    wrap(ggml.Backend, "compute", "graph(wait)")
    wrap(ggml.HostBuffer, "download", "download")
    wrap(ggml.Event, "synchronize", "woke", device=False)
    wrap(ggml.Backend, "synchronize", "woke", device=False)

    device_rows = collections.defaultdict(list)   # (from, to) -> [(device ms, host ms)]
    host_rows = collections.defaultdict(list)     # (woke, next record) -> [host ms]
    step_ms, between_ms = [], []
    for _ in range(args.reps):
        target.backend.synchronize()
        ev.clear()
        marks.clear()
        mark("start")                                # the device clock's origin
        decoder.generate_ids(prompt, args.n_gen)
        target.backend.synchronize()
        timed = [(label, t, 1e-3 * ev.elapsed_ms(0, i)) for label, t, i in marks if i is not None]
        # a step runs from one verify's start mark to the next's
        starts = [n for n, (label, _, _) in enumerate(timed) if label == "verify.graph>"]
        first, last = timed[starts[0]][1], timed[starts[-1]][1]
        for a, b in zip(starts, starts[1:]):
            step_ms.append(1e3 * (timed[b][2] - timed[a][2]))
            between = 0.0
            for n in range(a, b):
                (la, ha, da), (lb, hb, db) = timed[n], timed[n + 1]
                device_rows[(la, lb)].append((1e3 * (db - da), 1e3 * (hb - ha)))
                if not (la.endswith(".graph>") or la.endswith(".graph(wait)>")):
                    between += db - da
            between_ms.append(1e3 * between)
        for n, (label, t, i) in enumerate(marks):
            if i is None and first <= t < last:
                nxt = next((m for m in marks[n + 1:] if m[2] is not None), None)
                if nxt is not None:
                    host_rows[(label, nxt[0])].append(1e3 * (nxt[1] - t))
    for (cls, name), f in originals.items():
        setattr(cls, name, f)

    print(f"{len(step_ms)} steps ({args.reps} generations of {args.n_gen} tokens, budget {args.budget}); medians "
          f"over the steps that have the interval\n")
    print("| from | to | steps | device ms | host ms |")
    print("|---|---|---|---|---|")
    for (a, b), v in device_rows.items():     # (in the order a step first met them)
        print(f"| {a} | {b} | {len(v)} | {statistics.median(x[0] for x in v):.3f} | "
              f"{statistics.median(x[1] for x in v):.3f} |")
    for (a, b), v in host_rows.items():
        print(f"| {a} | {b} | {len(v)} | - | {statistics.median(v):.3f} |")
    print(f"\nstep (verify start to verify start): median {statistics.median(step_ms):.3f} ms (min "
          f"{min(step_ms):.3f}, max {max(step_ms):.3f}); the stream between graphs: median "
          f"{statistics.median(between_ms):.3f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
