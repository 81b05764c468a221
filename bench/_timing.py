"""The timing loop the bench scripts share: untimed warm-up calls, then the wall time of each timed call.

A call that computes a ggml graph returns when the device is done (Backend.compute synchronises), so wall time
is device time plus launch and host overhead, the way a user sees it."""
from __future__ import annotations

import statistics
import time


def call_times(fn, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of `reps` calls of fn, after `warmup` untimed calls (graph build, allocation, caches)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def median_ms(fn, reps: int, warmup: int = 1) -> float:
    """Median milliseconds of `reps` calls of fn after `warmup` untimed ones."""
    return 1e3 * statistics.median(call_times(fn, reps, warmup))
