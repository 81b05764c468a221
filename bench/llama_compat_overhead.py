"""What pydflash.Llama's llama-cpp-python surface costs on top of the engine: the same greedy completion through
`Engine.generate` and through `Llama.create_completion` (one shared load), tokens/s of each and the difference
per token. Prints a markdown table.

    python bench/llama_compat_overhead.py MODEL.gguf [--draft DRAFT_DIR] --device cuda --n-gen 128 --reps 5
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _timing import call_times  # noqa: E402  (bench/_timing.py: this folder is on sys.path when run as a script)


def timed(run, reps: int) -> float:
    """Median seconds of `run()` over reps, after one warm-up."""
    return statistics.median(call_times(run, reps, warmup=1))


def main(argv=None) -> int:
    from pydflash import Llama

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--draft", help="DFlash draft directory (default: AR decoding)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--n-gen", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--prompt", default="The quick brown fox jumps over the lazy dog.")
    args = parser.parse_args(argv)

    llm = Llama(args.model, draft_model_path=args.draft, n_ctx=args.n_gen + 512, device=args.device,
                verbose=True)
    engine = llm._engine          # the engine under the surface: one loaded model for both paths
    ids = llm.tokenize(args.prompt.encode(), add_bos=True)
    out = llm.create_completion(ids, max_tokens=args.n_gen)
    n = out["usage"]["completion_tokens"]
    if out["choices"][0]["finish_reason"] != "length":
        print(f"note: the completion stopped early ({n} tokens)", file=sys.stderr)
    engine_s = timed(lambda: engine.generate(ids, max_tokens=n), args.reps)
    compat_s = timed(lambda: llm.create_completion(ids, max_tokens=n), args.reps)
    compat_stream_s = timed(lambda: list(llm.create_completion(ids, max_tokens=n, stream=True)), args.reps)
    print(f"| model | mode | tokens | Engine.generate tok/s | Llama tok/s | Llama stream tok/s | overhead us/token |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    print(f"| {os.path.basename(args.model)} | {engine.mode} | {n} | {n / engine_s:.1f} | {n / compat_s:.1f} | "
          f"{n / compat_stream_s:.1f} | {1e6 * (compat_stream_s - engine_s) / n:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
