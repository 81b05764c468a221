"""The target's greedy continuations of training prompts, as token ids: the slow half of draft training's data.

    python tools/gen_continuations.py TARGET.gguf PROMPTS.jsonl OUT.jsonl [--n-gen 256] [--shard 0/2]
                                      [--minutes 8] [--device cuda]

PROMPTS.jsonl: lines {"prompt": text, "source": id, "chat": bool} (tools/prepare_gpu_carry.py writes
.device/train17.jsonl): chat prompts go through the model's chat template, the others (code to complete) are
tokenized raw. OUT.jsonl gets one line per prompt, {"index", "source", "chat", "prompt": ids, "output": ids}, the
target's greedy output after the prompt (up to --n-gen tokens, less where it ends), appended and flushed one at a
time, so a rerun resumes after the prompts already in the file and several processes (--shard i/n, each with its
own OUT) can share one GPU. `pydflash train-draft --continuations` then needs only one prefill per sequence for
the features. Prompts over --max-prompt-tokens are skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def done_indices(path: str) -> set[int]:
    """Indices already in OUT (a line cut off by an interrupted run is dropped, and its prompt redone)."""
    if not os.path.exists(path):
        return set()
    done, keep = set(), []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                done.add(json.loads(line)["index"])
                keep.append(line)
            except (json.JSONDecodeError, KeyError):
                break
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(keep)
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target")
    p.add_argument("prompts")
    p.add_argument("out")
    p.add_argument("--n-gen", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--shard", default="0/1", help="i/n: this process takes the prompts whose index is i mod n")
    p.add_argument("--minutes", type=float, default=0.0, help="stop after this long (0: no limit)")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    shard, n_shards = (int(x) for x in args.shard.split("/"))
    if not 0 <= shard < n_shards:
        raise SystemExit(f"--shard {args.shard}: expected i/n with 0 <= i < n")

    from tqdm import tqdm

    from pydflash.engine import Decoder
    from pydflash.models import load_target
    from pydflash.tokenizer import Tokenizer
    from pydflash.train_draft import prompt_ids, read_prompt_file

    rows = read_prompt_file(args.prompts)
    done = done_indices(args.out)
    todo = [i for i in range(len(rows)) if i % n_shards == shard and i not in done]
    target = load_target(args.target, args.device, n_ctx=args.max_prompt_tokens + args.n_gen + 64)
    tokenizer = Tokenizer(args.target)
    ar = Decoder(target, None, mode="ar", tokenizer=tokenizer)
    t_end = time.time() + 60 * args.minutes if args.minutes > 0 else float("inf")
    n_tokens = n_written = 0
    with open(args.out, "a", encoding="utf-8") as out:
        bar = tqdm(todo, desc=f"continuations {shard}/{n_shards}", unit="seq", file=sys.stderr)
        for i in bar:
            if time.time() > t_end:
                break
            row = rows[i]
            ids = prompt_ids(tokenizer, row["prompt"], row["chat"])
            if not 0 < len(ids) <= args.max_prompt_tokens:
                continue
            new, _ = ar.generate_ids(ids, args.n_gen)
            n_tokens += len(new)
            out.write(json.dumps({"index": i, "source": row["source"], "chat": row["chat"], "prompt": ids,
                                  "output": new}) + "\n")
            out.flush()
            n_written += 1
            bar.set_postfix(tokens=n_tokens)
    print(f"{len(done) + n_written} sequences in {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
