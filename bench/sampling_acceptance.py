"""Acceptance of lossless sampling rules on a trained draft (CPU): sample-and-match against multi-draft rejection.

    python bench/sampling_acceptance.py [--steps 1500] [--train-seqs 256] [--dir /tmp/pydflash-trained-draft]

Trains the small DFlash draft of bench/trained_draft_trees.py (z-lab's `dflash` from PyPI, bench-only), then
samples held-out prompts with pydflash's ddtree engine at T=0.7 and T=1.0 (sample-and-match, the rule in
docs/sampling.md). At every step it also computes, from the target's filtered distribution at every slot:
  - best-first tree + sample-and-match: the exact expected tokens per step, 1 + sum over nodes of the product of
    the target's probabilities along the node's path (the rule the engine runs);
  - a sampled tree + multi-draft rejection (SpecInfer's multi-round rule): each node's children are k i.i.d.
    draws from the draft's distribution at that depth (its top-8, renormalised); at a node, candidate x_i is
    accepted with probability min(1, r(x_i) / q(x_i)), else r <- normalise(max(0, r - q)); all rejected: stop.
    Exact for i.i.d. candidates. The sampled tree gets its own verify forward; tokens per step by Monte Carlo;
  - the same sampled tree + sample-and-match (exact expectation).
Branchings of the sampled trees (children per node by depth) are chosen to use about the same node budget.
Prints markdown.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

SHAPES = {"3,2,1,1 (21 nodes)": (3, 2, 1, 1), "2,1x10 (22 nodes)": (2,) + (1,) * 10,
          "4,2,1 (20 nodes)": (4, 2, 1)}


def sampled_tree(q_ids, q_probs, shape, rng):
    """Children drawn i.i.d. from the draft's depth-d distribution: (tokens, parents, depths) of the slots
    (slot 0 the root) and, per slot, its children's slots in draw order."""
    tokens, parents, depths, kids = [0], [-1], [0], [[]]
    frontier = [0]
    for d, k in enumerate(shape, start=1):
        if d > q_ids.shape[0]:
            break
        nxt = []
        for slot in frontier:
            for tok in rng.choice(q_ids[d - 1], size=k, p=q_probs[d - 1]):
                tokens.append(int(tok))
                parents.append(slot)
                depths.append(d)
                kids.append([])
                kids[slot].append(len(tokens) - 1)
                nxt.append(len(tokens) - 1)
        frontier = nxt
    return np.array(tokens, np.int32), np.array(parents, np.int32), np.array(depths, np.int32), kids


def match_expectation(parents, tokens, probs) -> float:
    """Sample-and-match's expected tokens per step: 1 + sum over first-of-their-token nodes of the path product."""
    total, reach = 1.0, np.zeros(len(parents))
    reach[0] = 1.0
    seen = set()
    for s in range(1, len(parents)):
        key = (int(parents[s]), int(tokens[s]))
        if key in seen:          # a duplicate sibling: the walk can only take the first
            continue
        seen.add(key)
        reach[s] = reach[parents[s]] * probs[parents[s]][tokens[s]]
        total += reach[s]
    return total


def rejection_walk(kids, tokens, probs, q_of, depths, rng) -> int:
    """One multi-round rejection walk over a sampled tree: tokens committed (accepted nodes + 1)."""
    slot, n = 0, 1
    while kids[slot]:
        r = probs[slot].copy()
        q = q_of(int(depths[slot]) + 1)
        nxt = None
        for child in kids[slot]:
            x = int(tokens[child])
            if rng.random() < min(1.0, r[x] / q[x]):
                nxt = child
                break
            r = np.maximum(r - q, 0.0)
            r /= r.sum()
        if nxt is None:
            return n
        slot, n = nxt, n + 1
    return n


def run(target, draft, prompts, settings, n_gen, budget, rng):
    from pydflash import ddtree
    from pydflash.engine import Decoder, commit_step, draft_step, make_tree, verify_step
    from pydflash.sampling import Sampler, reference_probs

    decoder = Decoder(target, draft, mode="ddtree", budget=budget)   # sizes the verify; its loop is not used
    eng_draft = decoder.draft
    n_vocab = target.hp.n_vocab
    sums = {"best-first + match (engine)": [], "engine, measured": []}
    for name in SHAPES:
        sums[f"sampled {name} + rejection"] = []
        sums[f"sampled {name} + match"] = []
    for prompt in prompts:
        sampler = Sampler(settings)
        target.enable_sampling(True)
        from pydflash.engine import prefill
        root = prefill(target, eng_draft, prompt, sampler)
        context = prompt + [root]
        while len(context) - len(prompt) < n_gen:
            logp, ids = draft_step(eng_draft, context, 8)
            q = np.exp(logp.astype(np.float64))
            q /= q.sum(1, keepdims=True)

            def q_of(depth, ids=ids, q=q):
                full = np.zeros(n_vocab)
                full[ids[depth - 1]] = q[depth - 1]
                return full

            def slot_probs(toks, pars):
                hist = [context + _path(toks, pars, s) for s in range(len(pars))]
                logits = target.logits_of_slots()
                return [reference_probs(logits[s], settings, hist[s]) for s in range(len(pars))]

            for name, shape in SHAPES.items():
                toks, pars, deps, kids = sampled_tree(ids, q, shape, rng)
                tree = ddtree.Tree(toks[1:], pars, deps, np.zeros(len(toks) - 1, np.float32))
                if tree.n_nodes + 1 > target.n_slots:
                    continue
                verify_step(target, tree, context, sampler)
                padded, _, _ = ddtree.padded(tree, target.n_slots)
                padded[0] = context[-1]
                probs = slot_probs(padded, pars)
                walks = [rejection_walk(kids, padded, probs, q_of, deps, rng) for _ in range(200)]
                sums[f"sampled {name} + rejection"].append(float(np.mean(walks)))
                sums[f"sampled {name} + match"].append(match_expectation(pars, padded, probs))
            tree = make_tree("ddtree", logp, ids, budget, False)
            drawn = verify_step(target, tree, context, sampler)
            tokens, parents, _ = ddtree.padded(tree, target.n_slots)
            tokens[0] = context[-1]
            probs = slot_probs(tokens, parents[:tree.n_nodes + 1])
            sums["best-first + match (engine)"].append(match_expectation(parents[:tree.n_nodes + 1], tokens, probs))
            path, new = ddtree.accept(tree, drawn)
            commit_step(target, eng_draft, path)
            sums["engine, measured"].append(len(new))
            context.extend(new)
    target.enable_sampling(False)
    return {k: float(np.mean(v)) for k, v in sums.items() if v}


def _path(tokens, parents, slot) -> list[int]:
    """The tokens on the tree path from the root's first child down to `slot` (the root itself is committed)."""
    out = []
    while slot > 0:
        out.append(int(tokens[slot]))
        slot = int(parents[slot])
    return out[::-1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/pydflash-trained-draft")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--train-seqs", type=int, default=256)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--n-gen", type=int, default=48)
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--reuse", action="store_true", help="use the draft already trained in --dir")
    p.add_argument("--logit-std", type=float, default=5.0,
                   help="the target's logit spread (trained_draft_trees uses 2.0: so flat that sampled text "
                        "rarely follows any draft; larger is peakier, like a real model's)")
    args = p.parse_args(argv)
    import json

    import trained_draft_trees as tdt
    from pydflash.models.dflash_draft import DFlashDraft
    from pydflash.models.qwen35 import Qwen35Target
    from pydflash.sampling import SamplingParams

    rng = np.random.default_rng(0)
    os.makedirs(args.dir, exist_ok=True)
    if args.reuse:
        target_path, draft_dir = os.path.join(args.dir, "target.gguf"), os.path.join(args.dir, "draft")
        with open(os.path.join(draft_dir, "config.json")) as f:
            config = json.load(f)
    else:
        from pydflash.testing import write_dflash_draft, write_qwen35_gguf
        target_path, draft_dir = os.path.join(args.dir, "target.gguf"), os.path.join(args.dir, "draft")
        write_qwen35_gguf(target_path, seed=21, logit_std=args.logit_std)
        config = write_dflash_draft(draft_dir, target_path, n_layer=2, seed=4)
        layers = config["dflash_config"]["target_layer_ids"]
        target = Qwen35Target(target_path, "cpu", n_ctx=256, n_ubatch=tdt.SEQ_PROMPT + tdt.SEQ_GEN,
                              capture_layers=layers)
        seqs, feats = tdt.sequences(target, args.train_seqs, rng)
        tdt.train(draft_dir, target_path, config, seqs, feats, args.steps, rng)
    layers = config["dflash_config"]["target_layer_ids"]
    target = Qwen35Target(target_path, "cpu", n_ctx=512, n_ubatch=64, capture_layers=layers)
    draft = DFlashDraft(draft_dir, target, top_k=8)
    prompts = [[int(t) for t in rng.integers(3, target.hp.n_vocab - 1, tdt.SEQ_PROMPT)] for _ in range(args.prompts)]
    results = {}
    for t in (0.7, 1.0):
        results[t] = run(target, draft, prompts, SamplingParams(temperature=t, seed=1), args.n_gen, args.budget,
                         np.random.default_rng(1))
    print(f"\n{args.prompts} held-out prompts x {args.n_gen} tokens, draft trained {args.steps} steps on "
          f"{args.train_seqs} sequences; tokens committed per step (expected, or measured where noted)\n")
    print("| rule | T=0.7 | T=1.0 |\n|---|---|---|")
    for k in results[0.7]:
        print(f"| {k} | {results[0.7][k]:.3f} | {results[1.0].get(k, float('nan')):.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
