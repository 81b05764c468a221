"""The same code on llama_cpp.Llama and on pydflash.Llama: only the import (and a draft) changes.

    python examples/llama_cpp_dropin.py                            # synthetic pair on the CPU
    python examples/llama_cpp_dropin.py Qwen3.5-27B-Q4_K_M.gguf Qwen3.5-27B-DFlash/
"""
import sys
import tempfile
import time

import llama_cpp

import pydflash
from pydflash.testing import synthetic_pair

PROMPT = "def quicksort(items):"


def complete(llm, max_tokens: int) -> tuple[dict, float]:
    """Existing llama-cpp-python code: a greedy completion, timed."""
    start = time.perf_counter()
    out = llm(PROMPT, max_tokens=max_tokens, temperature=0.0, stop=["\n\n\n"])
    return out, time.perf_counter() - start


def main(target=None, draft=None) -> None:
    synthetic = target is None
    if synthetic:
        target, draft = synthetic_pair(tempfile.mkdtemp(prefix="pydflash-dropin-"))
    max_tokens = 32 if synthetic else 256
    # flash attention is the attention pydflash implements; every layer on the GPU where there is one
    n_ctx = 512 if synthetic else 4096
    reference = llama_cpp.Llama(target, n_ctx=n_ctx, n_gpu_layers=-1, flash_attn=True, verbose=False)
    fast = pydflash.Llama(target, draft_model_path=draft, n_ctx=n_ctx, n_gpu_layers=-1)

    rows = []
    for name, llm in (("llama_cpp.Llama", reference), ("pydflash.Llama", fast)):
        complete(llm, 4)                                   # warm-up
        out, seconds = complete(llm, max_tokens)
        n = out["usage"]["completion_tokens"]
        rows.append((name, n, seconds, out["choices"][0]["text"]))
    print(f"{'':16s} {'tokens':>6s} {'seconds':>8s} {'tok/s':>8s}")
    for name, n, seconds, _ in rows:
        print(f"{name:16s} {n:6d} {seconds:8.2f} {n / seconds:8.1f}")
    print(f"speed-up: {rows[0][2] / rows[1][2]:.2f}x"
          + (" (random draft weights accept almost nothing: expect < 1x here)" if synthetic else ""))
    # Greedy decoding gives the same text; on CUDA a near-tie between two tokens may differ (README).
    print(f"same text: {'yes' if rows[0][3] == rows[1][3] else 'no'}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
