"""One decode at a time: a client that disconnects mid-stream stops its decode within one step and frees the
engine; a full queue answers 503 with Retry-After in each API's shape; a queued request runs when the engine
frees. The engine is a stand-in whose steps take a known time (a random-weight model may end its reply at
any moment), behind the real app and uvicorn on loopback."""
import json
import threading
import time

import httpx
import pytest

from pydflash.server.app import create_app
from pydflash.testing import write_qwen35_gguf
from pydflash.tokenizer import Tokenizer

from server_helpers import InProcessServer, SlowEngine

LONG = 2000              # steps of STEP_S: far longer than any test waits
STEP_S = 0.05
USER = [{"role": "user", "content": "Hello, world!"}]


class Server(InProcessServer):
    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-queue") / "tiny.gguf"
    write_qwen35_gguf(path, seed=7)
    return SlowEngine(Tokenizer(path), step_s=STEP_S)


@pytest.fixture(scope="module")
def server(engine):
    srv = Server(create_app(engine, alias="tiny", queue_size=1))
    yield srv
    srv.close()


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class OpenStream:
    """A streamed reply whose first chunks were read; close() is the client going away."""

    def __init__(self, ctx, lines):
        self.ctx, self.lines = ctx, lines     # the line iterator must live: closing it closes the connection

    def close(self) -> None:
        self.lines.close()
        self.ctx.__exit__(None, None, None)


def open_stream(server, n_chunks: int, api: str = "openai") -> OpenStream:
    """Start a long streamed reply and read its first n_chunks data lines."""
    path = "/v1/chat/completions" if api == "openai" else "/v1/messages"
    ctx = httpx.stream("POST", server.url + path, timeout=120,
                       json={"model": "tiny", "messages": USER, "max_tokens": LONG, "stream": True})
    response = ctx.__enter__()
    assert response.status_code == 200
    lines = response.iter_lines()
    got = 0
    while got < n_chunks:
        if next(lines).startswith("data:"):
            got += 1
    return OpenStream(ctx, lines)


@pytest.mark.parametrize("api", ["openai", "anthropic"])
def test_disconnect_stops_the_decode_within_one_step(server, engine, api):
    stream = open_stream(server, 4, api)
    assert server.health()["busy"] is True
    stream.close()            # the client goes away mid-stream
    left_at = time.monotonic()
    wait_for(lambda: engine.closed_at is not None, 5, "the decode to stop")
    # noticing the disconnect and closing the generator between steps: at most a step and a little slack
    assert engine.closed_at - left_at < 2 * STEP_S + 0.5
    wait_for(lambda: not server.health()["busy"], 5, "the engine to be freed")
    last = server.health()["last_run"]
    assert last["finish_reason"] == "cancelled" and last["completion_tokens"] == engine.steps < LONG
    t0 = time.monotonic()
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert r.json()["timings"]["prompt_ms"] < 1e3 * (2 * STEP_S + 0.5)   # started at once, not behind the old run
    assert time.monotonic() - t0 < 3 * STEP_S + 1.0


def test_full_queue_answers_503_and_the_queued_request_runs(server):
    running = open_stream(server, 2)                            # holds the engine
    queued: dict = {}

    def wait_in_queue():
        queued["response"] = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                                        json={"messages": USER, "max_tokens": 3})

    waiter = threading.Thread(target=wait_in_queue)
    waiter.start()
    wait_for(lambda: server.health()["queue_length"] == 1, 10, "the second request to queue")
    full = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 3}, timeout=30)
    assert full.status_code == 503 and int(full.headers["retry-after"]) > 0
    assert "busy" in full.json()["error"]["message"]
    full = httpx.post(server.url + "/v1/messages", timeout=30,
                      json={"model": "tiny", "messages": USER, "max_tokens": 3})
    assert full.status_code == 503 and full.json()["error"]["type"] == "overloaded_error"
    assert "retry-after" in full.headers
    running.close()                          # free the engine: the queued request runs
    waiter.join(60)
    assert queued["response"].status_code == 200
    assert queued["response"].json()["usage"]["completion_tokens"] == 3
    health = server.health()
    assert health["busy"] is False and health["queue_length"] == 0
    assert json.dumps(health)                                   # serialisable, as /health must be


def test_non_streaming_client_that_leaves_stops_the_decode(server, engine):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": LONG}, timeout=0.5)
    left_at = time.monotonic()
    wait_for(lambda: engine.closed_at is not None, 5, "the decode to stop")
    assert engine.closed_at - left_at < 2 * STEP_S + 0.5
    wait_for(lambda: not server.health()["busy"], 5, "the engine to be freed")
    assert server.health()["last_run"]["finish_reason"] == "cancelled"


def test_queued_client_that_leaves_never_runs(server, engine):
    running = open_stream(server, 2)
    runs_before = len(engine.prompts)
    with pytest.raises(httpx.ReadTimeout):          # waits in the queue, then gives up
        httpx.post(server.url + "/v1/messages", json={"model": "tiny", "messages": USER, "max_tokens": 5},
                   timeout=0.5)
    assert server.health()["queue_length"] == 1
    running.close()
    wait_for(lambda: not server.health()["busy"] and server.health()["queue_length"] == 0, 5, "the queue to drain")
    time.sleep(3 * STEP_S)
    assert len(engine.prompts) == runs_before            # the abandoned request was dropped, not decoded
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "w w "
