"""Autoregressive greedy decode speed of a pydflash target (any supported architecture) on one GGUF and device, like llama-bench's tg test.

    python bench/ar_decode.py MODEL.gguf --device cuda --n-gen 128 --reps 5 [--llama-bench path/to/llama-bench]

Each repetition starts from an empty cache, runs a --n-depth token prompt (0 = none, llama-bench's default), then
times --n-gen single-token steps (the argmax is the only thing copied back per step), the engine's way (`ahead`:
TargetRuntime.decode_ahead, the next step queued while a token is read back, on models without recurrent layers)
and one step at a time (`step`). With --llama-bench, the same
test runs through llama.cpp's own benchmark on the same file (flash attention on, all layers on the GPU) and the
table gets its tokens/s and our ratio to it. --n-prompt N also times a prefill of N tokens (llama-bench's pp test)
per repetition. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def bench_pydflash(args) -> dict:
    from pydflash.models import load_target
    from pydflash.sampling import Sampler, SamplingParams

    t0 = time.perf_counter()
    target = load_target(args.model, args.device, n_ctx=args.n_ctx, kv_type=args.kv, n_ubatch=args.n_ubatch,
                         progress=True)
    temperature = getattr(args, "temperature", 0.0)     # (bench/real_models.py's runs have none: greedy)
    target.enable_sampling(temperature > 0)
    load_s = time.perf_counter() - t0
    ways = ("ahead", "step") if target.decodes_ahead else ("step",)
    rates, pp_rates = {way: [] for way in ways}, []
    for rep in range(args.reps + 1):          # the first run warms up (graph build, allocation, CUDA graphs)
        if args.n_prompt:
            target.reset()
            target.backend.synchronize()
            t = time.perf_counter()
            target.prefill(list(range(1, args.n_prompt + 1)), return_logits=False)
            target.backend.synchronize()
            if rep:
                pp_rates.append(args.n_prompt / (time.perf_counter() - t))
        for way in ways:
            target.reset()
            token = 1
            if args.n_depth:
                target.prefill(list(range(1, args.n_depth + 1)), return_logits=False)
                token = target.argmax()
            sampler = Sampler(SamplingParams(temperature=temperature, top_p=0.95, seed=rep)) if temperature else None
            target.backend.synchronize()
            t = time.perf_counter()
            if way == "ahead":    # the engine's AR: the next step queued while the host reads a token
                for token in target.decode_ahead(token, args.n_gen, sampler):
                    pass
            else:                 # one step at a time, its token read before the next is queued
                for _ in range(args.n_gen):
                    if sampler is not None:
                        target.sample_inputs = sampler.for_context(())
                    token = target.step(token)
            dt = time.perf_counter() - t
            if rep:
                rates[way].append(args.n_gen / dt)
    best = rates[ways[0]]
    return {"load_s": load_s, "tok_s": statistics.mean(best), "decode": ways[0],
            "tok_s_std": statistics.stdev(best) if len(best) > 1 else 0.0, "n_graphs": target.n_graphs,
            "tok_s_step": statistics.mean(rates["step"]), "device": target.backend.name,
            "pp_tok_s": statistics.mean(pp_rates) if pp_rates else None}


def bench_llama(args) -> dict:
    cmd = [args.llama_bench, "-m", args.model, "-p", str(args.n_prompt), "-n", str(args.n_gen), "-r", str(args.reps),
           "-fa", "1", "-ngl", "99", "-o", "json", "-ctk", args.kv, "-ctv", args.kv]
    if args.n_depth:
        cmd += ["-d", str(args.n_depth)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    runs = [r for r in json.loads(out) if r.get("n_gen")]
    pp = [r for r in json.loads(out) if r.get("n_prompt") and not r.get("n_gen")]
    return {"tok_s": runs[0]["avg_ts"], "tok_s_std": runs[0].get("stddev_ts", 0.0), "cmd": " ".join(cmd),
            "pp_tok_s": pp[0]["avg_ts"] if pp else None}


def bench_llama_cpp_python(args) -> dict:
    """llama.cpp through llama-cpp-python in this process (its CPU wheel): the same tg test, token by token."""
    import numpy as np
    import llama_cpp
    types = {"f16": 1, "q8_0": 8, "q4_0": 2}
    llm = llama_cpp.Llama(args.model, n_ctx=args.n_ctx, n_batch=args.n_ubatch, n_threads=os.cpu_count(),
                          flash_attn=True, type_k=types[args.kv], type_v=types[args.kv], verbose=False)
    n_vocab = llm.n_vocab()
    rates, pp_rates = [], []
    for rep in range(args.reps + 1):
        if args.n_prompt:
            llm.reset()
            llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
            t = time.perf_counter()
            llm.eval(list(range(1, args.n_prompt + 1)))
            if rep:
                pp_rates.append(args.n_prompt / (time.perf_counter() - t))
        llm.reset()
        llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
        token = 1
        if args.n_depth:
            llm.eval(list(range(1, args.n_depth + 1)))
        t = time.perf_counter()
        for _ in range(args.n_gen):
            llm.eval([token])
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(n_vocab,))
            token = int(logits.argmax())
        dt = time.perf_counter() - t
        if rep:
            rates.append(args.n_gen / dt)
    return {"tok_s": statistics.mean(rates), "tok_s_std": statistics.stdev(rates) if len(rates) > 1 else 0.0,
            "cmd": "llama-cpp-python Llama.eval per token (CPU wheel)", "pp_tok_s": statistics.mean(pp_rates) if pp_rates else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="auto")
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--n-depth", type=int, default=0)
    p.add_argument("--n-prompt", type=int, default=0, help="also time a prefill of this many tokens (0: no)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--kv", default="f16", choices=["f16", "q8_0", "q4_0", "tq3_0"])
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--n-ubatch", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample (top-p 0.95, seeded) instead of greedy decoding; llama-bench stays its own tg test")
    p.add_argument("--llama-bench", help="path to llama-bench built from the same pinned llama.cpp")
    p.add_argument("--llama-cpp-python", action="store_true",
                   help="compare with llama.cpp via llama-cpp-python in-process instead (CPU runs)")
    args = p.parse_args(argv)
    if args.n_depth + args.n_gen > args.n_ctx or args.n_prompt > args.n_ctx:
        p.error("--n-depth + --n-gen and --n-prompt must fit in --n-ctx")

    ours = bench_pydflash(args)
    ref = bench_llama(args) if args.llama_bench else bench_llama_cpp_python(args) if args.llama_cpp_python else None
    name = os.path.basename(args.model)
    print("\n| engine | model | device | test | tok/s | ratio |\n|---|---|---|---|---|---|")
    from pydflash.models.layers import kernel_mode   # PYDFLASH_BITEXACT / PYDFLASH_QMATMUL
    test = f"tg{args.n_gen}" + (f" @ d{args.n_depth}" if args.n_depth else "") + f" kv {args.kv}"
    test += f" T={args.temperature:g}" if args.temperature else ""
    test += "" if kernel_mode() == "ggml" else f" {kernel_mode()}"
    ratio = f"{ours['tok_s'] / ref['tok_s']:.3f}" if ref else "-"
    print(f"| pydflash ({ours['decode']}) | {name} | {ours['device']} | {test} | {ours['tok_s']:.2f} ± "
          f"{ours['tok_s_std']:.2f} | {ratio} |")
    if ours["decode"] != "step":
        ratio = f"{ours['tok_s_step'] / ref['tok_s']:.3f}" if ref else "-"
        print(f"| pydflash (step) | {name} | {ours['device']} | {test} | {ours['tok_s_step']:.2f} | {ratio} |")
    if ref:
        engine = "llama.cpp (llama-bench)" if args.llama_bench else "llama.cpp (llama-cpp-python)"
        print(f"| {engine} | {name} | {ours['device']} | {test} | {ref['tok_s']:.2f} ± "
              f"{ref['tok_s_std']:.2f} | 1.000 |")
        print(f"\nreference: `{ref['cmd']}`")
    if args.n_prompt:
        ref_pp = f", reference {ref['pp_tok_s']:.1f} tok/s" if ref and ref.get("pp_tok_s") else ""
        print(f"\nprefill pp{args.n_prompt}: pydflash {ours['pp_tok_s']:.1f} tok/s{ref_pp}")
    print(f"\npydflash: load {ours['load_s']:.1f} s, {ours['n_graphs']} graphs built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
