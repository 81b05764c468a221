"""What every route shares: the engine and its worker, the served model's names, the API key, and the steps
of a generating request (check the model, size max_tokens, queue the job, read its events)."""
from __future__ import annotations

import asyncio
import hmac
import os
import time

from .errors import APIError
from .worker import ClientGone, Job, QueueFull, Worker

RETRY_AFTER_S = 2        # what a 503 tells the client to wait


class ServerState:
    def __init__(self, engine, *, alias: str | None = None, api_key: str | None = None, queue_size: int = 16,
                 target_path: str | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.worker = Worker(engine, queue_size)
        name = os.path.basename(os.fspath(target_path)) if target_path else "pydflash"
        self.alias = alias or (name[:-5] if name.endswith(".gguf") else name)
        self.model_names = {self.alias, name}
        self.api_key = api_key
        self.created = int(time.time())

    @property
    def n_ctx(self) -> int:
        return int(self.engine.target.n_ctx)

    @property
    def verify_slots(self) -> int:
        return int(getattr(self.engine.decoder, "budget", 0))

    def authorize(self, request) -> None:
        """With --api-key: `Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic's)."""
        if self.api_key is None:
            return
        given = request.headers.get("x-api-key")
        auth = request.headers.get("authorization", "")
        if given is None and auth.lower().startswith("bearer "):
            given = auth[7:].strip()
        if given is None:
            raise APIError(401, "missing API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                           code="invalid_api_key")
        if not hmac.compare_digest(given.encode(), self.api_key.encode()):
            raise APIError(401, "invalid API key", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model and model not in self.model_names:
            raise APIError(404, f"model {model!r} not found: this server serves {self.alias!r}", param="model",
                           code="model_not_found")

    def max_tokens_for(self, n_prompt: int, requested: int | None) -> int:
        """The request's max_tokens (or, if unset, what the context leaves), checked against the context."""
        room = self.n_ctx - n_prompt - self.verify_slots
        if requested is None:
            if room < 1:
                raise APIError(400, f"the prompt ({n_prompt} tokens) + {self.verify_slots} verify slots leave no room "
                                    f"in the context window of {self.n_ctx} tokens", param="messages")
            return room
        if requested > room:
            slots = f" + {self.verify_slots} verify slots" if self.verify_slots else ""
            raise APIError(400, f"the prompt ({n_prompt} tokens) + max_tokens ({requested}){slots} = "
                                f"{n_prompt + requested + self.verify_slots} tokens exceed the context window of "
                                f"{self.n_ctx} tokens", param="max_tokens")
        return requested

    def start(self, prompt_ids: list[int], max_tokens: int, sampling: dict, stops: list[str]) -> Job:
        job = Job(prompt_ids, max_tokens, sampling, stops, loop=asyncio.get_running_loop())
        try:
            self.worker.submit(job)
        except QueueFull as e:
            raise APIError(503, f"the server is busy: {e}; retry later",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return job

    async def first_event(self, job: Job, request):
        """Wait for the job's first event, so that a refused request (e.g. sampling options the engine does not
        implement) is answered with its error status instead of a stream that starts and then fails. A client
        that leaves meanwhile (in the queue, or during the prefill) cancels the job."""
        watcher = asyncio.ensure_future(_watch_disconnect(request, job))
        try:
            event = await job.events.get()
        except BaseException:
            job.cancelled.set()
            raise
        finally:
            watcher.cancel()
        if event[0] == "error":
            raise as_api_error(event[1])
        return event

    async def events(self, job: Job, first, request=None):
        """The job's events from `first` to ("done", result). Leaving early (a disconnect cancels the stream)
        cancels the job. With `request`, a non-streaming client that disconnects cancels it too."""
        watcher = asyncio.ensure_future(_watch_disconnect(request, job)) if request is not None else None
        try:
            event = first
            while True:
                if event[0] == "error":
                    raise as_api_error(event[1])
                yield event
                if event[0] == "done":
                    return
                event = await job.events.get()
        finally:
            job.cancelled.set()
            if watcher is not None:
                watcher.cancel()

    def health(self) -> dict:
        status = self.worker.status()
        last = self.worker.last_run
        return {"status": "ok", "model": self.alias, "mode": self.engine.mode, "n_ctx": self.n_ctx,
                "busy": status["busy"], "queue_length": status["queue_length"], "queue_size": status["queue_size"],
                "requests": self.worker.totals["requests"], "cancelled": self.worker.totals["cancelled"],
                "prefix_reuse": {"last_reused_tokens": (last.get("timings") or {}).get("reused_tokens"),
                                 "last_prefilled_tokens": (last.get("timings") or {}).get("prefilled_tokens"),
                                 "total_reused_tokens": self.worker.totals["reused_tokens"],
                                 "total_prefilled_tokens": self.worker.totals["prefilled_tokens"]},
                "last_run": last or None}


async def _watch_disconnect(request, job: Job) -> None:
    while not job.cancelled.is_set():
        if await request.is_disconnected():
            job.cancelled.set()
            return
        await asyncio.sleep(0.1)


def as_api_error(error: BaseException) -> APIError:
    if isinstance(error, APIError):
        return error
    if isinstance(error, ClientGone):         # nobody reads this answer
        return APIError(499, str(error))
    if isinstance(error, ValueError):        # the engine refusing a request (sampling options, sizes)
        return APIError(400, str(error))
    return APIError(500, f"internal error: {type(error).__name__}: {error}")
