"""Acceptance length and decode speed of speculative decoding by sampling temperature, on a target and a draft.

    python bench/acceptance_by_temperature.py TARGET.gguf --draft DRAFT_DIR --device cuda \
        [--datasets humaneval,gsm8k] [--n-prompts 10] [--temperatures 0,0.7,1.0] [--n-gen 128] [--seed 0]

Each prompt (chat-templated, from pydflash.datasets) is decoded once per temperature with the same seed; the
table gives, per temperature, the mean tokens committed per verify step (acceptance length) and decode tok/s
(prefill excluded), with the AR tok/s of the same target for reference. T=0 is greedy (the exact path of the
lossless tests); T>0 uses sample-and-match (docs/sampling.md): the acceptance it measures is what a sampled
target leaves of the draft's proposals.
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="auto")
    p.add_argument("--datasets", default="humaneval,gsm8k")
    p.add_argument("--n-prompts", type=int, default=10, help="prompts per dataset")
    p.add_argument("--temperatures", default="0,0.7,1.0")
    p.add_argument("--n-gen", type=int, default=128)
    p.add_argument("--budget", type=int, default=22)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    import pydflash
    from pydflash.datasets import load_prompts

    temps = [float(t) for t in args.temperatures.split(",")]
    prompts = [pr for name in args.datasets.split(",") for pr in load_prompts(name, args.n_prompts, seed=args.seed)]
    spec = pydflash.load(args.target, args.draft, device=args.device, mode="ddtree", budget=args.budget,
                         max_ctx=4096)
    ar = pydflash.load(args.target, device=args.device, max_ctx=4096)
    rows = []
    ar_rates = []
    for pr in prompts:
        res = ar.generate(pr.text, max_tokens=args.n_gen, chat=True)
        ar_rates.append(res.stats["decode_tok_s"])
    for t in temps:
        lengths, rates = [], []
        for i, pr in enumerate(prompts):
            res = spec.generate(pr.text, max_tokens=args.n_gen, chat=True, temperature=t, seed=args.seed + i)
            lengths.append(res.stats["acceptance_length"])
            rates.append(res.stats["decode_tok_s"])
        rows.append((t, statistics.mean(lengths), statistics.mean(rates)))
        print(f"T={t}: acceptance length {rows[-1][1]:.2f}, {rows[-1][2]:.1f} tok/s", flush=True)
    ar_tok_s = statistics.mean(ar_rates)
    print(f"\n{len(prompts)} prompts ({args.datasets}), n_gen {args.n_gen}, budget {args.budget}, "
          f"device {spec.target.backend.name}; AR (greedy) {ar_tok_s:.1f} tok/s\n")
    print("| temperature | acceptance length | ddtree tok/s | vs AR greedy |")
    print("|---|---|---|---|")
    for t, length, rate in rows:
        print(f"| {t:g} | {length:.2f} | {rate:.1f} | {rate / ar_tok_s:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
