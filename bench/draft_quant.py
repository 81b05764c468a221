"""What quantizing the draft's matrices at load (draft_type='q8_0' or 'q4_k') does to its proposals: the same draft
loaded as stored (bf16) and quantized on one target, fed the same context (the target's captured features of a
prompt and of its greedy continuation), compared at every step.

    python bench/draft_quant.py TARGET.gguf --draft DRAFT --device cuda [--draft-type q8_0|q4_k] [--n-steps 64]
        [--prompt-tokens 256]

Per step and block position: the logit error of the quantized draft against stored (max |difference| / max |stored
logit|), whether the top-1 proposal agrees, and how many of the top-8 candidates are shared. Then DDTree decoding
with each draft (budget 22) on the same prompt: the tokens must equal plain decoding's (asserted on the CPU; on CUDA
a near-tie may split them, which is reported) and the acceptance lengths are compared. Prints markdown. The
weights' bytes on the device are printed beside (q8_0 holds 34 bytes per 32 values, q4_k 144 per 256, bf16 64 per
32).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOP_K = 8


def compare_proposals(target, drafts: dict, prompt: list[int], n_steps: int) -> dict:
    """Run the target greedily from `prompt`, appending its captured features to every draft; at each step
    compare the drafts' logits for the block after the last token (drafts: "stored" and one quantized draft).
    Returns per-position statistics."""
    stored, quant = drafts["stored"], next(d for name, d in drafts.items() if name != "stored")
    target.reset()
    for d in drafts.values():
        d.reset()
    target.prefill(prompt, return_logits=False)
    feats = target.captured_features()
    for d in drafts.values():
        d.append_features(feats)
    token = target.argmax()
    rel, top1, overlap = [], [], []
    for _ in range(n_steps):
        a, b = stored.logits(token), quant.logits(token)
        rel.append(np.abs(b - a).max(axis=1) / np.abs(a).max(axis=1))
        top1.append(a.argmax(axis=1) == b.argmax(axis=1))
        ka, kb = np.argsort(-a, axis=1)[:, :TOP_K], np.argsort(-b, axis=1)[:, :TOP_K]
        overlap.append([len(set(x) & set(y)) for x, y in zip(ka, kb)])
        target.decode(token)
        feats = target.captured_features()
        for d in drafts.values():
            d.append_features(feats)
        token = target.argmax()
    return {"rel": np.array(rel), "top1": np.array(top1), "overlap": np.array(overlap)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--draft", required=True, help="DFlash draft directory (bf16 as z-lab ships it)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--n-steps", type=int, default=64, help="draft steps compared (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--n-gen", type=int, default=64, help="tokens decoded with each draft (default 64)")
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--draft-type", default="q8_0", choices=["q8_0", "q4_k"],
                    help="the quantized draft compared with the stored one (default q8_0)")
    args = ap.parse_args(argv)

    from pydflash import ggml
    from pydflash.api import draft_layer_ids
    from pydflash.engine import Decoder
    from pydflash.models import load_target
    from pydflash.models.dflash_draft import DFlashDraft
    from pydflash.plan import fmt_bytes

    backend = ggml.Backend(args.device)
    n_ctx = args.prompt_tokens + max(args.n_steps, args.n_gen) + args.budget + 64
    # the prompt in one micro-batch: the features of all its tokens are captured at once
    target = load_target(args.target, backend, n_ctx=n_ctx, n_ubatch=max(512, args.prompt_tokens),
                         capture_layers=draft_layer_ids(args.draft), progress=True)
    quant = args.draft_type
    drafts = {"stored": DFlashDraft(args.draft, target, top_k=TOP_K),
              quant: DFlashDraft(args.draft, target, top_k=TOP_K, weight_type=quant)}
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(1, min(target.hp.n_vocab, 30000), args.prompt_tokens)]
    stats = compare_proposals(target, drafts, prompt, args.n_steps)

    ar = Decoder(target)
    reference, _ = ar.generate_ids(prompt, args.n_gen)
    acceptance, left_at = {}, {}     # left_at: where a CUDA near-tie split a draft's tokens from plain decoding's
    for name, draft in drafts.items():
        draft.reset()
        tokens, run = Decoder(target, draft, mode="ddtree", budget=args.budget).generate_ids(prompt, args.n_gen)
        if tokens != reference:   # lossless on the CPU; CUDA's verify and decode kernels may split a near-tie apart
            first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b),
                         min(len(tokens), len(reference)))   # else one stopped early
            if backend.is_cpu:
                raise AssertionError(f"ddtree with the {name} draft differs from plain decoding at token {first}")
            left_at[name] = first
        acceptance[name] = run["acceptance_length"]

    size = {k: d.weights.buffer.nbytes for k, d in drafts.items()}
    types = sorted({t.type.name for t in drafts[quant].weights.t.values() if t.ne[1] > 1})   # matrices only
    print(f"\n### Draft matrices {quant} vs stored, {os.path.basename(args.target)} + "
          f"{os.path.basename(args.draft.rstrip('/'))}, {backend.name}\n")
    print(f"draft weights on the device: stored {fmt_bytes(size['stored'])}, {quant} {fmt_bytes(size[quant])} "
          f"({size[quant] / size['stored']:.3f}x; quantized matrices: {', '.join(types)})\n")
    print(f"{args.n_steps} steps after a {args.prompt_tokens}-token prompt (target's greedy continuation)\n")
    print("| block position | max logit error / max logit (median, max) | top-1 agreement | top-8 shared |")
    print("|---|---|---|---|")
    rel, top1, overlap = stats["rel"], stats["top1"], stats["overlap"]
    for j in range(rel.shape[1]):
        print(f"| {j + 1} | {np.median(rel[:, j]):.2e}, {rel[:, j].max():.2e} | {top1[:, j].mean():.3f} | "
              f"{overlap[:, j].mean():.2f} / {TOP_K} |")
    print(f"| all | {np.median(rel):.2e}, {rel.max():.2e} | {top1.mean():.3f} | {overlap.mean():.2f} / {TOP_K} |")
    agree = "both equal to plain decoding" if not left_at else "; ".join(
        f"{name} leaves plain decoding at new token {i} (a CUDA near-tie: docs/benchmarks.md, 'Bit-exact mode')"
        for name, i in left_at.items())
    print(f"\nDDTree (budget {args.budget}), {args.n_gen} tokens, {agree}: acceptance length "
          f"stored {acceptance['stored']:.2f}, {quant} {acceptance[quant]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
