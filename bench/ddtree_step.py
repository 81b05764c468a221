"""Where the time of a DDTree speculative step goes, and the decode speed it implies.

    python bench/ddtree_step.py TARGET.gguf [--draft DRAFT_DIR] --device cuda [--budget 22] [--n-gen 128]

Measures on one target GGUF (e.g. the synthetic 27B-shaped Q4_K_M from `python -m pydflash.testing write-qwen35
OUT.gguf --preset 27b`):
  1. AR decode: ms per single-token step (the baseline).
  2. Verify forward time against tree size (1..40 nodes, random best-first trees), and the commit after it
     (accepted path along the first children, and a path that leaves it so KV rows are moved).
  3. A full generation in ddtree mode: time per step split into draft, verify, commit and Python host work.
     The draft is the real DFlash draft when --draft is given (and the build has it); otherwise an oracle test
     double that replays the AR output with an error every --error-every positions (its draft time is ~0 and is
     reported as not measured).
  4. Projected tok/s at acceptance lengths 8.31, 7.04 and 6.14 (published DDTree figures): AL / (measured step
     time at the budget), against measured AR tok/s. These are projections from measured step times, not
     end-to-end measurements with a trained draft.
Prints markdown.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from _timing import median_ms  # bench/_timing.py (this folder is on sys.path when run as a script)
from _trees import random_tree

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROJECTED_AL = (8.31, 7.04, 6.14)
NODE_COUNTS = (1, 2, 4, 8, 12, 16, 22, 28, 32, 40)


def bench_ar(target, prompt, n_gen):
    target.reset()
    target.prefill(prompt, return_logits=False)
    token, out = target.argmax(), []
    target.step(token)                     # warm the decode graph
    target.reset()
    target.prefill(prompt, return_logits=False)
    token = target.argmax()
    out.append(token)
    t = time.perf_counter()
    for _ in range(n_gen - 1):
        token = target.step(token)
        out.append(token)
    dt = time.perf_counter() - t
    return out, 1e3 * dt / (n_gen - 1)


def bench_verify_sizes(target, prompt, reps, rng, state_type):
    rows = []
    for n in NODE_COUNTS:
        target.enable_verify(n + 1, tree=True, state_type=state_type)
        tokens, parents, depths = random_tree(n, rng, root=1, top_k=min(n, 8))
        target.reset()
        target.prefill(prompt, return_logits=False)
        verify_ms = median_ms(lambda: target.verify(tokens, parents, depths), reps)
        n_past = target.n_past
        chain_path = [0]                           # root, then first children while they are slots 1, 2, ..
        while len(chain_path) <= n and parents[len(chain_path)] == len(chain_path) - 1:
            chain_path.append(len(chain_path))
        leaf = n                                   # the last node: its path usually leaves the first children
        off_path = []
        while leaf >= 0:
            off_path.append(int(leaf))
            leaf = int(parents[leaf])
        off_path = off_path[::-1]

        def commit(path):
            target.cache.n_past = n_past           # commit the same verify again and again (timing only)
            target.commit(path)
        chain_ms = median_ms(lambda: commit(chain_path), reps)
        off_ms = median_ms(lambda: commit(off_path), reps)
        rows.append((n, verify_ms, chain_ms, off_ms, int(depths.max())))
    return rows


def logit_gap(target, prompt, ar_tokens, n):
    """Logits of AR's own next n tokens computed three ways against single-token decode at the same positions:
    an n-slot tree verify (chain-shaped), a chain verify through upstream's GDN op, and a batched prefill of
    prompt + prefix (last token). If all three differ from decode alike, the gap is the batched kernels'
    rounding (GPUs pick other matmul/attention kernels by batch size), not the tree path."""
    target.reset()
    target.prefill(prompt, return_logits=False)
    want = np.stack([target.decode(tok) for tok in ar_tokens[:n]])
    got = {}
    for name, tree in (("tree verify", True), ("chain verify (upstream GDN)", False)):
        target.reset()
        target.prefill(prompt, return_logits=False)
        target.enable_verify(n, tree=tree)
        target.verify(ar_tokens[:n], np.arange(-1, n - 1), np.arange(n))
        got[name] = target.logits_of_slots()
    rows = []
    for k in range(n):
        target.reset()
        rows.append(target.prefill(prompt + ar_tokens[:k + 1]))
    got["batched prefill"] = np.stack(rows)
    top2 = np.sort(want, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    out = {}
    for name, g in got.items():
        gap = np.abs(g - want).max(axis=1)
        flips = g.argmax(1) != want.argmax(1)
        out[name] = {"max": float(gap.max()), "median": float(np.median(gap)), "argmax_differs": int(flips.sum()),
                     "min_margin": float(margin[flips].min()) if flips.any() else float("nan")}
    return out, float(want.std())


def bench_steps(target, draft, prompt, n_gen, budget, seed_chain, state_type):
    from pydflash.engine import Decoder
    decoder = Decoder(target, draft, mode="ddtree", budget=budget, seed_chain=seed_chain, state_type=state_type)
    decoder.generate_ids(prompt, min(n_gen, 32))        # warm-up
    tokens, stats = decoder.generate_ids(prompt, n_gen)
    return tokens, stats


def main(argv=None) -> int:
    from pydflash.api import DRAFT_TYPES, STATE_TYPES   # load's choices; "auto" is load's own
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--draft", help="DFlash draft directory (else an oracle test double; draft time not measured)")
    p.add_argument("--draft-type", default="stored", choices=[t for t in DRAFT_TYPES if t != "auto"],
                   help="the draft's matrices as stored or quantized at load (load's draft_type)")
    p.add_argument("--device", default="auto")
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--seed-chain", action="store_true")
    p.add_argument("--state-type", default="replay", choices=[t for t in STATE_TYPES if t != "auto"],
                   help="the tree nodes' recurrent states (TargetRuntime.enable_verify's state_type; default: "
                        "replay, what load's 'auto' takes)")
    p.add_argument("--f16-states", action="store_true", help="the same as --state-type f16")
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--n-prompt", type=int, default=64)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--error-every", type=int, default=8, help="oracle draft: a wrong top-1 every N positions")
    p.add_argument("--kv", default="f16", choices=["f16", "q8_0", "q4_0"])
    args = p.parse_args(argv)

    from pydflash.api import _load_draft, draft_layer_ids
    from pydflash.models import load_target
    from pydflash.testing import OracleDraft

    capture = draft_layer_ids(args.draft) if args.draft else ()
    n_ctx = -(-(args.n_prompt + args.n_gen + 64) // 256) * 256
    t0 = time.perf_counter()
    target = load_target(args.target, args.device, n_ctx=n_ctx, kv_type=args.kv, n_ubatch=512,
                         capture_layers=capture, progress=True)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), args.n_prompt)]

    ar_tokens, ar_ms = bench_ar(target, prompt, args.n_gen)
    gap = logit_gap(target, prompt, ar_tokens, args.budget + 1)
    state_type = "f16" if args.f16_states else args.state_type
    sizes = bench_verify_sizes(target, prompt, args.reps, rng, state_type)
    if args.draft:
        weight_type = None if args.draft_type == "stored" else args.draft_type
        draft = _load_draft(args.draft, target, weight_type=weight_type)
        draft_kind = f"DFlash draft {os.path.basename(args.draft.rstrip('/'))} ({args.draft_type} matrices)"
    else:
        errors = range(len(prompt), len(prompt) + args.n_gen + 64, args.error_every)
        draft = OracleDraft(prompt + ar_tokens, target.hp.n_vocab, error_positions=errors)
        draft_kind = f"oracle test double (wrong every {args.error_every}th position; draft time not measured)"
    tokens, stats = bench_steps(target, draft, prompt, args.n_gen, args.budget, args.seed_chain, state_type)

    name = os.path.basename(args.target)
    from pydflash.models.layers import kernel_mode   # PYDFLASH_BITEXACT / PYDFLASH_QMATMUL
    print(f"\n### DDTree step on {name}, {target.backend.name}, kv {args.kv}, budget {args.budget}"
          f"{' (top-1 chain seeded)' if args.seed_chain else ''}, {state_type} node states, "
          f"{kernel_mode()} kernels\n")
    print(f"target load {load_s:.1f} s; prompt {args.n_prompt} tokens; {args.n_gen} new tokens; draft: {draft_kind}\n")
    print(f"AR decode: {ar_ms:.2f} ms/token = {1e3 / ar_ms:.1f} tok/s\n")
    gaps, logit_std = gap
    print(f"Logits of AR's next {args.budget + 1} tokens against single-token decode (logit std {logit_std:.3g}):\n")
    print("| computed by | max abs gap | median over positions | argmax differs at | smallest AR top-2 margin there |")
    print("|---|---|---|---|---|")
    for name, g in gaps.items():
        print(f"| {name} | {g['max']:.3g} | {g['median']:.3g} | {g['argmax_differs']} | {g['min_margin']:.3g} |")
    print()

    print("| tree nodes | max depth | verify ms | verify / AR step | commit ms (chain path) | commit ms (moved KV) |")
    print("|---|---|---|---|---|---|")
    for n, verify_ms, chain_ms, off_ms, depth in sizes:
        print(f"| {n} | {depth} | {verify_ms:.2f} | {verify_ms / ar_ms:.2f} | {chain_ms:.2f} | {off_ms:.2f} |")

    steps = stats["steps"]
    per = {k: 1e3 * stats[k] / steps for k in ("draft_s", "verify_s", "commit_s", "host_s")}
    step_ms = sum(per.values())
    same = tokens == ar_tokens
    if not same:
        first = next(i for i, (a, b) in enumerate(zip(tokens, ar_tokens)) if a != b)
        target.reset()
        logits = target.prefill(prompt)
        for tok in ar_tokens[:first]:
            logits = target.decode(tok)
        top2 = np.sort(logits)[-2:]
        print(f"\nfirst difference from AR at new token {first}: AR top-2 margin {top2[1] - top2[0]:.3g}, the "
              f"speculative token's AR logit is {logits.max() - logits[tokens[first]]:.3g} below the max")
    al_note = "this draft's" if args.draft else "oracle-controlled"
    print(f"\nddtree run: {steps} steps, acceptance length {stats['acceptance_length']:.2f} ({al_note}), "
          f"{stats['decode_tok_s']:.1f} tok/s measured, output {'equals' if same else 'DIFFERS from'} AR\n")
    print("| per step | draft | verify | commit | host (Python) | total |\n|---|---|---|---|---|---|")
    print(f"| ms | {per['draft_s']:.2f} | {per['verify_s']:.2f} | {per['commit_s']:.2f} | {per['host_s']:.2f} "
          f"| {step_ms:.2f} |")

    print(f"\nProjections from the measured step time ({step_ms:.2f} ms"
          f"{', draft time not included' if not args.draft else ''}) at published acceptance lengths:\n")
    print("| acceptance length | projected tok/s | AR tok/s (measured) | projected speedup |\n|---|---|---|---|")
    for al in PROJECTED_AL:
        tok_s = al / (step_ms / 1e3)
        print(f"| {al} | {tok_s:.1f} | {1e3 / ar_ms:.1f} | {tok_s * ar_ms / 1e3:.2f}x |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
