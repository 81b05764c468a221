"""Time to first token of a chat's second turn, with and without prefix reuse.

    python bench/prefix_reuse.py TARGET.gguf [--draft DRAFT_DIR] --device cuda [--prompt-len 2000] [--reply 64]
        [--user 64] [--reps 3]

Turn 1 is a --prompt-len token prompt and a --reply token greedy reply; turn 2 is turn 1's prompt, its reply and
--user new tokens (what a chat's next turn sends). Time to first token (TTFT) is the wall time from the call until
the first new token is out: the prefill of turn 2, which with prefix reuse starts from the snapshot taken at the
end of turn 1 (a device-to-device copy of every recurrent state) and prefills only the new tokens. Without reuse
the engine forgets the snapshots first (`Engine.reset`) and prefills turn 2 whole. Also reported: the snapshot's
size and the time of one save (the copy at a turn boundary), and whether turn 2's first --check tokens agree.
Prints markdown.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def first_token(engine, prompt, n_gen):
    """(seconds to the first new token, the run's first n_gen tokens, its stats)."""
    t = time.perf_counter()
    steps = engine.decoder.iter_generate(prompt, n_gen)
    out = list(next(steps))
    ttft = time.perf_counter() - t
    for batch in steps:
        out.extend(batch)
    return ttft, out, engine.last_stats


def run_mode(target, draft, mode, args, rng):
    import pydflash
    engine = pydflash.load(target, draft if mode != "ar" else None, mode=mode, device=args.device,
                           budget=args.budget, tokenizer=False, max_ctx=args.max_ctx)
    n_vocab = engine.target.hp.n_vocab
    rows = []
    for rep in range(args.reps + 1):                  # rep 0 warms up the graphs of every shape
        p1 = [int(t) for t in rng.integers(10, n_vocab - 10, size=args.prompt_len)]
        user = [int(t) for t in rng.integers(10, n_vocab - 10, size=args.user)]
        engine.reset()
        reply = engine.decoder.generate_ids(p1, args.reply)[0]
        p2 = p1 + reply + user
        ttft_reuse, out_reuse, stats = first_token(engine, p2, args.check)
        engine.reset()
        ttft_fresh, out_fresh, fresh_stats = first_token(engine, p2, args.check)
        if rep:
            rows.append((ttft_fresh, ttft_reuse, stats["reused_tokens"], stats["prefilled_tokens"],
                         out_reuse == out_fresh))
    prefix = engine.decoder.prefix
    save_ms = statistics.median(_time_save(prefix, engine.target) for _ in range(5)) * 1e3
    fresh = statistics.median(r[0] for r in rows) * 1e3
    reuse = statistics.median(r[1] for r in rows) * 1e3
    same = all(r[4] for r in rows)
    print(f"| {mode} | {args.prompt_len} + {args.reply} + {args.user} | {fresh:.1f} | {reuse:.1f} | "
          f"{fresh / reuse:.1f}x | {rows[-1][2]} / {rows[-1][3]} | {prefix.snapshot_nbytes / 2**20:.1f} | "
          f"{save_ms:.2f} | {'yes' if same else 'NO'} |", flush=True)


def _time_save(prefix, target):
    tokens = list(prefix.tokens)
    prefix.clear()                                    # so the save copies (an existing key is only touched)
    target.backend.synchronize()
    t = time.perf_counter()
    prefix.save(tokens)
    target.backend.synchronize()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target")
    ap.add_argument("--draft", help="DFlash draft directory: also measure ddtree mode")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--prompt-len", type=int, default=2000, help="turn 1's prompt tokens (default 2000)")
    ap.add_argument("--reply", type=int, default=64, help="turn 1's reply tokens (default 64)")
    ap.add_argument("--user", type=int, default=64, help="turn 2's new tokens (default 64)")
    ap.add_argument("--check", type=int, default=8, help="turn 2's tokens compared, reuse against fresh")
    ap.add_argument("--budget", type=int, default=22)
    ap.add_argument("--max-ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"target {os.path.basename(args.target)}, device {args.device}, median of {args.reps} (after a warm-up)\n")
    print("| mode | turn 1 prompt + reply + turn 2 new | TTFT turn 2 fresh (ms) | TTFT with reuse (ms) | speed-up | "
          "reused / prefilled | snapshot MiB | snapshot save (ms) | same tokens |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    run_mode(args.target, args.draft, "ar", args, rng)
    if args.draft:
        run_mode(args.target, args.draft, "ddtree", args, rng)
    return 0


if __name__ == "__main__":
    sys.exit(main())
