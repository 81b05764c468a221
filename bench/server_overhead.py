"""Server overhead against the engine alone (issue 11, "Measure"): decode tok/s of a 256-token reply streamed
through `pydflash serve`'s OpenAI API against `Engine.stream` in-process, the time to first token of a
~2,000-token prompt, and of a chat's second turn (with whatever prefix reuse the engine does: the `reused_tokens`
the server reports). Prints markdown tables for docs/benchmarks.md.

    python bench/server_overhead.py TARGET.gguf --draft DRAFT_DIR --device cuda [--n-gen 256] [--reps 3]

Both sides time whole replies the same way, so no side depends on what the tokens render as (a synthetic
vocabulary renders most generated tokens as no text): decode tok/s = (N - 1) / (T(N) - T(1)), with T(n) the wall
time of a streamed reply of n tokens to the same prompt, from the call to its end; time to first token = T(1).
The engine side runs first and is freed before the server starts (one model in GPU memory at a time).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import numpy as np


def prompt_ids(n_vocab: int, n: int, seed: int) -> list[int]:
    """Token ids for a synthetic prompt (random ids below the special tokens)."""
    return [int(t) for t in np.random.default_rng(seed).integers(3, min(n_vocab, 30000) - 4, size=n)]


def engine_reply(engine, ids, n: int) -> tuple[float, int]:
    """(wall seconds, new tokens) of one streamed reply of at most n tokens."""
    t0, tokens = time.perf_counter(), 0
    for batch in engine.stream_tokens(ids, max_tokens=n):
        tokens += len(batch)
    return time.perf_counter() - t0, tokens


def decode_rate(reply, ids, n_gen: int, reps: int) -> tuple[float, int]:
    """Median (N - 1) / (T(N) - T(1)) over reps, and N; reply(ids, n) -> (seconds, tokens)."""
    rates, tokens = [], 0
    for _ in range(reps):
        t_one, _ = reply(ids, 1)
        t_all, tokens = reply(ids, n_gen)
        rates.append((tokens - 1) / (t_all - t_one))
    return statistics.median(rates), tokens


def engine_side(args) -> dict:
    import pydflash
    engine = pydflash.load(args.target, args.draft, device=args.device, max_ctx=args.max_ctx, budget=args.budget,
                           mode=args.mode, progress=False)
    ids = prompt_ids(engine.tokenizer.n_vocab, args.prompt_tokens_decode, 1)
    engine_reply(engine, ids, 16)                              # warm-up: graphs built, caches touched
    tok_s, tokens = decode_rate(lambda i, n: engine_reply(engine, i, n), ids, args.n_gen, args.reps)
    long_ids = prompt_ids(engine.tokenizer.n_vocab, args.prompt_tokens, 2)
    ttft, _ = engine_reply(engine, long_ids, 1)
    out = {"tok_s": tok_s, "tokens": tokens, "ttft_s": ttft, "mode": engine.mode}
    del engine
    gc.collect()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_request(url: str, path: str, body: dict) -> tuple[float, int, dict | None]:
    """POST a streamed request and read it to its end: (wall seconds, completion tokens, the final timings)."""
    import httpx
    t0 = time.perf_counter()
    timings = usage = None
    with httpx.stream("POST", url + path, json=dict(body, stream=True, stream_options={"include_usage": True}),
                      timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            timings = chunk.get("timings", timings)
            usage = chunk.get("usage") or usage
    tokens = (usage or {}).get("completion_tokens") or (timings or {}).get("predicted_n", 0)
    return time.perf_counter() - t0, tokens, timings


def server_side(args) -> dict:
    import httpx
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pydflash.cli", "serve", "--target", args.target, "--device", args.device,
           "--port", str(port), "--budget", str(args.budget), "--log-level", "warning"]
    if args.draft:
        cmd += ["--draft", args.draft]
    if args.mode:
        cmd += ["--mode", args.mode]
    if args.max_ctx:
        cmd += ["--max-ctx", str(args.max_ctx)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        deadline = time.monotonic() + 900
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("pydflash serve did not come up")
            time.sleep(0.5)
        from pydflash.tokenizer import Tokenizer
        n_vocab = Tokenizer(args.target).n_vocab
        ids = prompt_ids(n_vocab, args.prompt_tokens_decode, 1)
        def reply(prompt, n):
            seconds, tokens, _ = stream_request(url, "/v1/completions", {"prompt": prompt, "max_tokens": n})
            return seconds, tokens

        reply(ids, 16)                                                                   # warm-up
        tok_s, tokens = decode_rate(reply, ids, args.n_gen, args.reps)
        long_ids = prompt_ids(n_vocab, args.prompt_tokens, 2)
        ttft, _ = reply(long_ids, 1)

        # a chat: turn 1 with a long user message, turn 2 extends it
        text = Tokenizer(args.target).detokenize(prompt_ids(n_vocab, args.prompt_tokens, 3))
        turn1 = [{"role": "user", "content": text}]
        r1 = httpx.post(url + "/v1/chat/completions", json={"messages": turn1, "max_tokens": 32}, timeout=600).json()
        turn2 = turn1 + [{"role": "assistant", "content": r1["choices"][0]["message"]["content"] or ""},
                         {"role": "user", "content": "And then?"}]
        ttft2, _, timings2 = stream_request(url, "/v1/chat/completions", {"messages": turn2, "max_tokens": 1})
        return {"tok_s": tok_s, "tokens": tokens, "ttft_s": ttft, "turn1_prompt":
                r1["usage"]["prompt_tokens"], "turn1_ttft_s": r1["timings"]["prompt_ms"] / 1e3, "turn2_ttft_s": ttft2,
                "turn2_prompt": timings2["prompt_n"], "turn2_reused": timings2.get("reused_tokens")}
    finally:
        proc.terminate()
        proc.wait(30)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target")
    p.add_argument("--draft")
    p.add_argument("--device", default="cuda")
    p.add_argument("--mode")
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--max-ctx", type=int, default=4096)
    p.add_argument("--n-gen", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=2000, help="prompt of the time-to-first-token runs")
    p.add_argument("--prompt-tokens-decode", type=int, default=32, help="prompt of the tok/s runs")
    args = p.parse_args(argv)
    eng = engine_side(args)
    srv = server_side(args)
    ratio = srv["tok_s"] / eng["tok_s"]
    name = os.path.basename(args.target)
    print(f"| model | mode | tokens | Engine.stream tok/s | API stream tok/s | API / engine |")
    print(f"| --- | --- | --- | --- | --- | --- |")
    print(f"| {name} | {eng['mode']} | {srv['tokens']} | {eng['tok_s']:.1f} | {srv['tok_s']:.1f} | {ratio:.3f} |")
    print()
    print(f"| time to first token | engine | API |")
    print(f"| --- | --- | --- |")
    print(f"| {args.prompt_tokens}-token prompt | {eng['ttft_s'] * 1e3:.0f} ms | {srv['ttft_s'] * 1e3:.0f} ms |")
    print(f"| chat turn 1 ({srv['turn1_prompt']} tokens) | | {srv['turn1_ttft_s'] * 1e3:.0f} ms |")
    print(f"| chat turn 2 ({srv['turn2_prompt']} tokens, {srv['turn2_reused'] or 0} reused) | | "
          f"{srv['turn2_ttft_s'] * 1e3:.0f} ms |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
