"""Quickstart: load a target (and a DFlash draft), generate, stream, read the stats.

    python examples/quickstart.py                                  # a tiny synthetic pair, nothing to download
    python examples/quickstart.py Qwen3.5-27B-Q4_K_M.gguf Qwen3.5-27B-DFlash/
"""
import sys
import tempfile

import pydflash
from pydflash.testing import synthetic_pair


def main(target=None, draft=None) -> None:
    synthetic = target is None
    if synthetic:   # no model given: write a random-weight target and draft (they decode gibberish)
        target, draft = synthetic_pair(tempfile.mkdtemp(prefix="pydflash-quickstart-"))
    # With a draft the engine runs DDTree speculative decoding; without one, plain autoregressive decoding.
    # max_ctx: KV-cache positions (the tiny synthetic model runs on the CPU: keep its cache small).
    engine = pydflash.load(target, draft, max_ctx=512 if synthetic else 8192)
    print(f"loaded {target} (mode {engine.mode})")
    max_tokens = 24 if synthetic else 256

    # One call: the text, the new token ids and the run's statistics.
    result = engine.generate("Write a quicksort in Python.", max_tokens=max_tokens, chat=True)
    print(f"generate: {len(result.tokens)} tokens: {result.text!r}")

    # Streaming: pieces of text as the engine commits tokens (a speculative step commits several at once).
    print("stream: ", end="")
    for piece in engine.stream("def fibonacci(n):", max_tokens=max_tokens):
        print(piece, end="", flush=True)
    print()

    stats = engine.last_stats   # the last run's numbers
    print(f"stats: acceptance length {stats['acceptance_length']:.2f} tokens/step, {stats['steps']} steps, "
          f"prefill {stats['prefill_tok_s']:.1f} tok/s, decode {stats['decode_tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main(*sys.argv[1:3])
