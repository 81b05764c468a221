"""Helpers for the server tests: a real `pydflash serve` subprocess on loopback, an in-process server around a
scripted engine (a model that says exactly what a test needs, e.g. a tool call), and a free port."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`pydflash serve ARGS` on 127.0.0.1 and a free port; ready once /health answers."""

    def __init__(self, *args: str, timeout: float = 120.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(os.devnull, "w")
        cmd = [sys.executable, "-m", "pydflash.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pydflash serve exited {self.proc.returncode}:\n{''.join(self.output)}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"pydflash serve did not answer in {timeout} s:\n{''.join(self.output)}")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ScriptedEngine:
    """An Engine stand-in that 'generates' given text pieces: the server's shaping of tool calls and reasoning
    can be tested on model-shaped output a random-weight model would never produce. One token per piece."""

    mode = "ar"

    def __init__(self, tokenizer, n_ctx: int = 1024):
        self.tokenizer = tokenizer
        self.decoder = type("D", (), {"budget": 0})()
        self.target = type("T", (), {"n_ctx": n_ctx})()
        self.script: list[str] = []
        self.last_tokens: list[int] = []
        self.last_stats: dict = {}
        self.prompts: list[list[int]] = []

    def stream(self, prompt, max_tokens: int = 256, chat: bool = False, **sampling):
        self.prompts.append(list(prompt))
        tokens = self.last_tokens = []
        for piece in self.script[:max_tokens]:
            tokens.append(1)
            yield piece
        self.last_stats = {"new_tokens": len(tokens)}


class InProcessServer:
    """uvicorn serving `app` in a thread of this process, on loopback."""

    def __init__(self, app):
        import uvicorn
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("in-process server did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


class SlowEngine(ScriptedEngine):
    """A ScriptedEngine whose every step takes `step_s` and commits one token 'w ': holds the engine as long as
    a test needs, and records when its generator was closed and how many steps it ran."""

    def __init__(self, tokenizer, step_s: float = 0.05, n_ctx: int = 100_000):
        super().__init__(tokenizer, n_ctx)
        self.step_s = step_s
        self.steps = 0
        self.closed_at: float | None = None

    def stream(self, prompt, max_tokens: int = 256, chat: bool = False, **sampling):
        self.prompts.append(list(prompt))
        self.steps, self.closed_at = 0, None
        tokens = self.last_tokens = []
        try:
            for _ in range(max_tokens):
                time.sleep(self.step_s)
                self.steps += 1
                tokens.append(1)
                yield "w "
            self.last_stats = {"new_tokens": len(tokens)}
        finally:
            self.closed_at = time.monotonic()
