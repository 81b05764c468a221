"""Seeded against unseeded DDTree trees, measured with a *trained* draft on a tiny synthetic target (CPU).

    python bench/trained_draft_trees.py [--steps 1500] [--dir /tmp/pydflash-trained-draft]

Random draft weights accept nothing and the oracle test double's log-probs are set by hand, so neither says
which tree policy accepts more. This script trains a small DFlash draft (z-lab's PyTorch model from PyPI
`dflash`, a test/bench-only dependency) to predict a tiny random qwen35 target's own greedy continuations from
the target's captured hidden states, as DFlash drafts are trained, writes it in z-lab format, and then decodes
held-out prompts with pydflash's engine: chain, and ddtree with and without top-1 chain seeding, at several
budgets. It prints the acceptance lengths (and checks every output equals AR). A tiny target and draft are not
the 27B pair: the numbers show how the policies compare for a draft whose confidence was learned, nothing more.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SEQ_PROMPT, SEQ_GEN = 16, 80


def make_pair(out: str):
    from pydflash.testing import write_dflash_draft, write_qwen35_gguf
    target = os.path.join(out, "target.gguf")
    write_qwen35_gguf(target, seed=21)
    config = write_dflash_draft(os.path.join(out, "draft"), target, n_layer=2, seed=4)
    return target, os.path.join(out, "draft"), config


def sequences(target, n_seq: int, rng):
    """Prompts and the target's greedy continuations, with the captured features of every position."""
    seqs, feats = [], []
    for _ in range(n_seq):
        prompt = [int(t) for t in rng.integers(3, target.hp.n_vocab - 1, SEQ_PROMPT)]
        target.reset()
        logits = target.prefill(prompt)
        out = []
        for _ in range(SEQ_GEN):
            out.append(int(np.argmax(logits)))
            logits = target.decode(out[-1])
        seq = prompt + out
        target.reset()
        target.prefill(seq, return_logits=False)
        seqs.append(seq)
        feats.append(target.captured_features().reshape(len(seq), -1).copy())
    return np.array(seqs), np.stack(feats)


def train(draft_dir, target_path, config, seqs, feats, steps: int, rng):
    import torch
    from dflash import model as zlab
    from transformers import Qwen3Config
    from pydflash.gguf_io import GGUFFile

    def target_matrix(name):
        gf = GGUFFile(target_path)
        info = gf.tensors[name]
        return torch.from_numpy(np.frombuffer(gf.data(info).tobytes(), np.float32).reshape(info.ne[1], info.ne[0])
                                .copy())

    torch.manual_seed(0)
    model = zlab.DFlashDraftModel(Qwen3Config(**config)).float().train()
    embed, head = target_matrix("token_embd.weight"), target_matrix("output.weight")
    block = model.block_size
    mask = model.mask_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    seqs_t, feats_t = torch.from_numpy(seqs), torch.from_numpy(feats)
    n_seq, length = seqs.shape
    batch = 16
    t0 = time.time()
    for step in range(steps):
        a = int(rng.integers(4, length - block))          # the root's position; context = positions 0..a-1
        rows = torch.from_numpy(rng.integers(0, n_seq, batch))
        tokens = torch.full((batch, block), mask)
        tokens[:, 0] = seqs_t[rows, a]
        noise = torch.nn.functional.embedding(tokens, embed)
        pos = torch.arange(0, a + block)[None].expand(batch, -1)
        out = model(position_ids=pos, noise_embedding=noise, target_hidden=feats_t[rows, :a])
        logits = model.compute_logits(out[:, 1:, :], lambda h: h @ head.T)
        want = seqs_t[rows, a + 1: a + block]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 250 == 0 or step == steps - 1:
            with torch.no_grad():
                hit = (logits.argmax(-1) == want).float().mean(0)
            print(f"step {step}: loss {loss.item():.3f}, top-1 hit at depth 1/4/8/15: "
                  f"{hit[0]:.2f}/{hit[3]:.2f}/{hit[7]:.2f}/{hit[14]:.2f} ({time.time() - t0:.0f} s)", file=sys.stderr)
    save(model, draft_dir)


def save(model, draft_dir):
    from pydflash.testing import bf16_bits, write_safetensors
    specs = {}
    for name, value in model.state_dict().items():
        arr = value.detach().float().numpy()
        specs[name] = (np.uint16, arr.shape, lambda arr=arr: bf16_bits(arr))
    write_safetensors(os.path.join(draft_dir, "model.safetensors"), specs, {"format": "pt"})


def evaluate(target_path, draft_dir, config, budgets, n_prompts: int, n_gen: int, rng, train_prompts=None):
    from pydflash.engine import Decoder
    from pydflash.models.dflash_draft import DFlashDraft
    from pydflash.models.qwen35 import Qwen35Target
    layers = config["dflash_config"]["target_layer_ids"]
    target = Qwen35Target(target_path, "cpu", n_ctx=512, n_ubatch=64, capture_layers=layers)
    draft = DFlashDraft(draft_dir, target, top_k=8)
    prompts = [[int(t) for t in rng.integers(3, target.hp.n_vocab - 1, SEQ_PROMPT)] for _ in range(n_prompts)]
    prompts = [list(map(int, p)) for p in train_prompts] + prompts if train_prompts is not None else prompts
    refs = [Decoder(target, mode="ar").generate_ids(p, n_gen)[0] for p in prompts]
    runs = [("chain", min(b, 15), False) for b in budgets] + [("ddtree", b, s) for b in budgets for s in (False, True)]
    print("| mode | budget | top-1 chain seeded | acceptance length | output equals AR |\n|---|---|---|---|---|")
    seen = set()
    for mode, budget, seed in runs:
        if (mode, budget, seed) in seen:
            continue
        seen.add((mode, budget, seed))
        committed, steps, same = 0, 0, True
        for p, ref in zip(prompts, refs):
            out, stats = Decoder(target, draft, mode=mode, budget=budget, seed_chain=seed).generate_ids(p, n_gen)
            committed += sum(stats["committed_per_step"])
            steps += stats["steps"]
            same &= out == ref
        print(f"| {mode} | {budget} | {'yes' if seed else 'no' if mode == 'ddtree' else '-'} | "
              f"{committed / steps:.2f} | {'yes' if same else 'NO'} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/pydflash-trained-draft")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--train-seqs", type=int, default=96)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--budgets", default="4,8,15,22")
    p.add_argument("--eval-on-train", action="store_true",
                   help="decode training prompts instead (checks the pipeline: a memorised draft accepts deep)")
    args = p.parse_args(argv)
    from pydflash.models.qwen35 import Qwen35Target

    rng = np.random.default_rng(0)
    os.makedirs(args.dir, exist_ok=True)
    target_path, draft_dir, config = make_pair(args.dir)
    layers = config["dflash_config"]["target_layer_ids"]
    target = Qwen35Target(target_path, "cpu", n_ctx=256, n_ubatch=SEQ_PROMPT + SEQ_GEN, capture_layers=layers)
    seqs, feats = sequences(target, args.train_seqs, rng)
    print(f"{len(seqs)} training sequences of {seqs.shape[1]} tokens; features {feats.shape}", file=sys.stderr)
    train(draft_dir, target_path, config, seqs, feats, args.steps, rng)
    with open(os.path.join(draft_dir, "config.json")) as f:
        assert json.load(f) == config
    train_prompts = seqs[:args.prompts, :SEQ_PROMPT] if args.eval_on_train else None
    evaluate(target_path, draft_dir, config, [int(b) for b in args.budgets.split(",")],
             0 if args.eval_on_train else args.prompts, args.n_gen, rng, train_prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
