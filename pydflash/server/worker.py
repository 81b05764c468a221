"""One decode at a time: the engine (not thread-safe) runs in a single worker thread that takes jobs from a
bounded FIFO queue and feeds each job's events to its request's asyncio queue.

A job's events: ("text", str) pieces of generated text, stop sequences already cut; then ("done", dict) with
finish_reason, token counts and timings, or ("error", exception). Setting `job.cancelled` (the client went
away) ends the decode at the next committed step; the generator is closed between steps, so the engine is
left between runs and the next job starts at once.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field

from .parsing import StopMatcher


class QueueFull(Exception):
    pass


class ClientGone(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    max_tokens: int
    sampling: dict = field(default_factory=dict)
    stops: list[str] = field(default_factory=list)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def post(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Worker:
    def __init__(self, engine, queue_size: int = 16):
        self.engine = engine
        self.queue_size = queue_size
        self._jobs: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.waiting = 0                   # jobs in the queue, not yet started
        self.busy = False                  # a job is decoding
        self.last_run: dict = {}
        self.totals = {"requests": 0, "cancelled": 0, "reused_tokens": 0, "prefilled_tokens": 0}
        self._thread = threading.Thread(target=self._loop, name="pydflash-engine", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job, or raise QueueFull when queue_size jobs already wait behind a running one."""
        with self._lock:
            if self.waiting + self.busy > self.queue_size:
                raise QueueFull(f"{self.waiting} requests are waiting (queue size {self.queue_size})")
            self.waiting += 1
        self._jobs.put(job)

    def status(self) -> dict:
        with self._lock:
            return {"busy": self.busy, "queue_length": self.waiting, "queue_size": self.queue_size}

    def stop(self) -> None:
        self._jobs.put(None)

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self.waiting -= 1
                self.busy = not job.cancelled.is_set()
            if not self.busy:               # its client left while it waited
                job.post("error", ClientGone("the client disconnected while the request was queued"))
                continue
            try:
                job.post("done", self._run(job))
            except Exception as e:          # noqa: BLE001 - handed to the request, which answers in its API's shape
                job.post("error", e)
            finally:
                with self._lock:
                    self.busy = False

    def _run(self, job: Job) -> dict:
        engine = self.engine
        stopper = StopMatcher(job.stops)
        finish = None
        t0 = time.perf_counter()
        t_first = None
        engine.last_tokens = []
        pieces = engine.stream(job.prompt_ids, max_tokens=job.max_tokens, **job.sampling)
        try:
            for piece in pieces:
                if t_first is None:
                    t_first = time.perf_counter()
                text = stopper.feed(piece)
                if text:
                    job.post("text", text)
                if stopper.hit is not None:
                    finish = "stop"
                    break
                if job.cancelled.is_set():
                    finish = "cancelled"
                    break
        finally:
            pieces.close()
        t_end = time.perf_counter()
        tokens = list(engine.last_tokens)
        stats = engine.last_stats or {}            # the engine keeps them also for a run closed early
        if finish is None:
            rest = stopper.flush()
            if rest:
                job.post("text", rest)
            ended = bool(tokens) and engine.tokenizer.is_end_of_generation(tokens[-1])
            finish = "stop" if ended or len(tokens) < job.max_tokens else "length"
        t_first = t_first or t_end
        decode_s = t_end - t_first
        timings = {
            "prompt_n": len(job.prompt_ids),
            "prompt_ms": (t_first - t0) * 1e3,            # time to the first token
            "predicted_n": len(tokens),
            "predicted_ms": decode_s * 1e3,
            "predicted_per_second": stats.get("decode_tok_s") or
            ((len(tokens) - 1) / decode_s if decode_s > 0 and len(tokens) > 1 else 0.0),
            "acceptance_length": stats.get("acceptance_length"),
            "reused_tokens": stats.get("reused_tokens"),
            "prefilled_tokens": stats.get("prefilled_tokens"),
        }
        result = {"finish_reason": finish, "stop_sequence": stopper.hit, "prompt_tokens": len(job.prompt_ids),
                  "completion_tokens": len(tokens), "timings": timings}
        self._record(result)
        return result

    def _record(self, result: dict) -> None:
        t = result["timings"]
        with self._lock:
            self.last_run = dict(result)
            self.totals["requests"] += 1
            self.totals["cancelled"] += result["finish_reason"] == "cancelled"
            for key in ("reused_tokens", "prefilled_tokens"):
                self.totals[key] += t.get(key) or 0
