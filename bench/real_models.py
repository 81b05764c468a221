"""Real GGUF models on one device, pydflash beside llama.cpp: load time, AR decode and prefill speed.

    python bench/real_models.py gemma3-270m qwen2.5-coder-1.5b /path/to/other.gguf --device cuda \
        --llama-bench path/to/llama-bench

Each model is a path or a name from pydflash/real_models.py (fetched on first use). Per model: the load time of
the target, AR greedy decode (tg: --n-gen single-token steps after a --n-depth token prompt, 0 = one start token
as llama-bench's tg test) and a prefill of --n-prompt tokens (pp), each the mean of --reps runs after a warm-up;
with --llama-bench, llama-bench on the same file (`-p N_PROMPT -n N_GEN -r REPS -fa 1 -ngl 99`, as
bench/ar_decode.py runs it). Prints one markdown table.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ar_decode  # noqa: E402  (the timing loops: bench_pydflash, bench_llama)


def resolve(model: str) -> str:
    """A path as given; a name from pydflash.real_models.MODELS fetched (or found in the cache)."""
    from pydflash.real_models import MODELS, fetch
    if Path(model).is_file():
        return model
    if model in MODELS:
        return str(fetch(model))
    raise SystemExit(f"{model}: neither a file nor a model of pydflash.real_models ({', '.join(MODELS)})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("models", nargs="+", help="GGUF paths or pydflash.real_models names")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--n-depth", type=int, default=0, help="prompt tokens before the timed decode")
    p.add_argument("--n-prompt", type=int, default=512)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--kv", default="f16", choices=["f16", "q8_0", "q4_0"])
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--llama-bench", help="path to llama-bench (tools/build_llama_bench.sh builds it)")
    args = p.parse_args(argv)
    if args.n_depth + args.n_gen > args.n_ctx or args.n_prompt > args.n_ctx:
        p.error("--n-depth + --n-gen and --n-prompt must fit in --n-ctx")

    rows = []
    for model in args.models:
        path = resolve(model)
        run = argparse.Namespace(**vars(args), model=path, n_ubatch=max(args.n_prompt, 1))
        print(f"{model}: pydflash", file=sys.stderr, flush=True)
        ours = ar_decode.bench_pydflash(run)
        ref = None
        if args.llama_bench:
            print(f"{model}: llama-bench", file=sys.stderr, flush=True)
            ref = ar_decode.bench_llama(run)
        rows.append((os.path.basename(path), ours, ref))

    tg = f"tg{args.n_gen}" + (f" @ d{args.n_depth}" if args.n_depth else "")
    pp = f"pp{args.n_prompt}"
    print(f"\n| model | device | load s | pydflash {tg} tok/s | llama.cpp {tg} tok/s | ratio | pydflash {pp} tok/s "
          f"| llama.cpp {pp} tok/s | ratio |\n|---|---|---|---|---|---|---|---|---|")
    for name, ours, ref in rows:
        def cell(key, ours=ours, ref=ref):
            if ref is None or not ref.get(key):
                return "-", "-"
            return f"{ref[key]:.1f}", f"{ours[key] / ref[key]:.3f}"
        ref_tg, ratio_tg = cell("tok_s")
        ref_pp, ratio_pp = cell("pp_tok_s")
        print(f"| {name} | {ours['device']} | {ours['load_s']:.1f} | {ours['tok_s']:.1f} ± {ours['tok_s_std']:.1f} "
              f"| {ref_tg} | {ratio_tg} | {ours['pp_tok_s']:.1f} | {ref_pp} | {ratio_pp} |")
    print(f"\nkv {args.kv}, {args.reps} repetitions after a warm-up; load: the target only (weights uploaded, "
          "no draft)")
    if rows and rows[0][2]:
        print(f"reference: `{rows[0][2]['cmd']}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
