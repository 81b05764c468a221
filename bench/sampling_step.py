"""What sampling costs: step time with the on-device sampler against greedy, and acceptance length at T=0.7/1.0.

    python bench/sampling_step.py TARGET.gguf [--draft DRAFT_DIR] --device cuda [--budget 22] [--n-gen 64]
    python bench/sampling_step.py --op-only [--n-vocab 248320] --device cuda     (part 1 alone, no model)

On one target GGUF (e.g. the synthetic 27B-shaped Q4_K_M from `python -m pydflash.testing write-qwen35 OUT.gguf
--preset 27b`):
  1. The sampler op alone (ggml_sample_tokens) over budget+1 rows of the target's vocabulary, per setting.
  2. One verify forward of a budget-node tree, and one AR decode step, greedy (argmax) against sampling, per
     setting: the same graph plus the sampler and its few hundred bytes of inputs.
  3. Full ddtree generations (the DFlash draft with --draft, else the oracle double that replays AR's greedy
     output): acceptance length and time per step, greedy against T=0.7 and T=1.0.
Prints markdown. Settings: greedy, T=0.7, T=1.0, T=1.0 with top-k 40, top-p 0.95, min-p 0.05 and the three
penalties (every pass of the op on), and the op's other costly cases: top-p alone (its threshold search is not
narrowed by a top-k) and temperature 0 with penalties. The op-alone table also times the argmax that greedy
graphs end in, over the same logits.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from _timing import median_ms  # bench/_timing.py (this folder is on sys.path when run as a script)
from _trees import random_tree

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from pydflash.sampling import PENALTY_LAST_N, Sampler, SamplingParams  # noqa: E402

SETTINGS = {
    "greedy": SamplingParams(),
    "T=0.7": SamplingParams(temperature=0.7, seed=1),
    "T=1.0": SamplingParams(temperature=1.0, seed=1),
    "T=1.0 all filters + penalties": SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05,
                                                    repeat_penalty=1.1, presence_penalty=0.2,
                                                    frequency_penalty=0.1, seed=1),
    "T=1.0 top-p 0.95": SamplingParams(temperature=1.0, top_p=0.95, seed=1),
    "T=0 + penalties": SamplingParams(temperature=0.0, repeat_penalty=1.1, presence_penalty=0.2, seed=1),
}


def bench_op(backend, n_vocab: int, n_rows: int, reps: int, rng) -> dict:
    """ms of one sample_tokens graph over [n_vocab, n_rows] logits (inputs already on the device), per setting,
    and ("argmax") of the argmax graph over the same logits."""
    from pydflash import ggml
    values = (rng.standard_normal((n_rows, n_vocab)) * 3).astype(np.float32)
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    logits = ctx.new_tensor(ggml.Type.F32, (n_vocab, n_rows)).mark_input()
    hist = ctx.new_tensor(ggml.Type.I32, (PENALTY_LAST_N, n_rows)).mark_input()
    params = ctx.new_tensor(ggml.Type.F32, (8,)).mark_input()
    rand = ctx.new_tensor(ggml.Type.F32, (n_rows,)).mark_input()
    graph = ctx.graph(ggml.sample_tokens(ctx, logits, hist, params, rand))
    ggml.Allocator(backend).allocate(graph)
    logits.set(values)
    hist.set(rng.integers(0, n_vocab, (n_rows, PENALTY_LAST_N)).astype(np.int32))
    rand.set(rng.random(n_rows, dtype=np.float32))
    out = {}
    for name, s in SETTINGS.items():
        params.set(s.vector())

        def run():
            backend.compute(graph)
            graph.outputs[0].numpy()
        out[name] = median_ms(run, reps)

    actx = ggml.Context(n_tensors=4, graph_size=4)
    alogits = actx.new_tensor(ggml.Type.F32, (n_vocab, n_rows)).mark_input()
    agraph = actx.graph(actx.argmax(alogits))
    ggml.Allocator(backend).allocate(agraph)
    alogits.set(values)

    def run_argmax():
        backend.compute(agraph)
        agraph.outputs[0].numpy()
    out["argmax"] = median_ms(run_argmax, reps)
    return out


def print_op_table(op: dict, n_vocab: int, n_rows: int) -> None:
    print(f"| setting | sampler op alone ({n_rows} rows x {n_vocab}) ms |")
    print("|---|---|")
    print(f"| argmax (the greedy graphs' output) | {op['argmax']:.3f} |")
    for s in SETTINGS:
        print(f"| {s} | {op[s]:.3f} |")


def bench_forwards(target, prompt, budget: int, reps: int, rng) -> dict:
    """(verify ms, AR step ms) per setting."""
    tokens, parents, depths = random_tree(budget, rng, root=prompt[-1])
    target.enable_verify(budget + 1, tree=True)
    out = {}
    for name, s in SETTINGS.items():
        target.enable_sampling(not s.greedy)
        sampler = None if s.greedy else Sampler(s)
        target.reset()
        if sampler is not None:
            target.sample_inputs = sampler.for_context(prompt)
        target.prefill(prompt, return_logits=False)

        def verify():
            if sampler is not None:
                target.sample_inputs = sampler.for_tree(prompt, tokens, parents)
            target.verify(tokens, parents, depths)
        verify_ms = median_ms(verify, reps)
        n_past = target.n_past

        def step():
            target.cache.n_past = n_past           # the same position again and again (timing only)
            if sampler is not None:
                target.sample_inputs = sampler.for_context(prompt)
            target.step(prompt[-1])
        out[name] = (verify_ms, median_ms(step, reps))
    target.enable_sampling(False)
    return out


def bench_generate(target, draft, prompt, n_gen: int, budget: int) -> dict:
    from pydflash.engine import Decoder
    decoder = Decoder(target, draft, mode="ddtree", budget=budget)
    out = {}
    for name in ("greedy", "T=0.7", "T=1.0"):
        s = SETTINGS[name]
        decoder.generate_ids(prompt, min(n_gen, 16), sampling=s)      # warm-up: graphs
        _, stats = decoder.generate_ids(prompt, n_gen, sampling=s)
        steps = stats["steps"]
        per_step = 1e3 * sum(stats[k] for k in ("draft_s", "verify_s", "commit_s", "host_s")) / steps
        out[name] = (stats["acceptance_length"], per_step, 1e3 * stats["verify_s"] / steps, stats["decode_tok_s"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target", nargs="?", help="target GGUF (not with --op-only)")
    p.add_argument("--op-only", action="store_true", help="time the sampler op alone (part 1), no model")
    p.add_argument("--n-vocab", type=int, default=248320, help="vocabulary of --op-only (Qwen3.5's by default)")
    p.add_argument("--draft", help="DFlash draft directory (else the oracle double replaying AR's greedy output)")
    p.add_argument("--device", default="auto")
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--n-prompt", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    if args.op_only:
        from pydflash import ggml
        backend = ggml.Backend(args.device)
        print(f"\n### Sampler op alone, {backend.name}\n")
        print_op_table(bench_op(backend, args.n_vocab, args.budget + 1, args.reps, rng), args.n_vocab,
                       args.budget + 1)
        return 0
    if args.target is None:
        p.error("a target GGUF is needed (or --op-only)")

    from pydflash.api import _load_draft, draft_layer_ids
    from pydflash.engine import Decoder
    from pydflash.models import load_target
    from pydflash.testing import OracleDraft

    capture = draft_layer_ids(args.draft) if args.draft else ()
    n_ctx = -(-(args.n_prompt + 2 * args.n_gen + 64) // 256) * 256
    target = load_target(args.target, args.device, n_ctx=n_ctx, n_ubatch=512, capture_layers=capture,
                         progress=True)
    prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), args.n_prompt)]
    name = os.path.basename(args.target)
    print(f"\n### Sampling on {name}, {target.backend.name}, budget {args.budget}\n")

    op = bench_op(target.backend, target.hp.n_vocab, args.budget + 1, args.reps, rng)
    print_op_table(op, target.hp.n_vocab, args.budget + 1)
    fw = bench_forwards(target, prompt, args.budget, args.reps, rng)
    print()
    print("| setting | verify ms | verify vs greedy | AR step ms | AR step vs greedy |")
    print("|---|---|---|---|---|")
    g_verify, g_step = fw["greedy"]
    for s in SETTINGS:
        v, st = fw[s]
        print(f"| {s} | {v:.2f} | {100 * (v / g_verify - 1):+.1f}% | {st:.2f} | "
              f"{100 * (st / g_step - 1):+.1f}% |")

    if args.draft:
        draft, kind = _load_draft(args.draft, target), "DFlash draft " + os.path.basename(args.draft.rstrip("/"))
    else:
        ar, _ = Decoder(target, mode="ar").generate_ids(prompt, args.n_gen)
        draft, kind = OracleDraft(prompt + ar, target.hp.n_vocab), "oracle double (AR's greedy output)"
    gen = bench_generate(target, draft, prompt, args.n_gen, args.budget)
    print(f"\nddtree generation, {args.n_gen} new tokens, draft: {kind}\n")
    print("| setting | acceptance length | ms per step | verify ms per step | decode tok/s |")
    print("|---|---|---|---|---|")
    for s, (al, step_ms, verify_ms, tok_s) in gen.items():
        print(f"| {s} | {al:.2f} | {step_ms:.2f} | {verify_ms:.2f} | {tok_s:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
