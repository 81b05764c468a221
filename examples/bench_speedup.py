"""AR against DDTree on a list of prompts: tokens, acceptance length, decode speed and speed-up per prompt.

    python examples/bench_speedup.py                               # synthetic pair (random draft: no speed-up)
    python examples/bench_speedup.py Qwen3.5-27B-Q4_K_M.gguf Qwen3.5-27B-DFlash/ [prompts.txt] [max_tokens]

prompts.txt holds one prompt per line. Both modes share one loaded target; the prompts are chat turns.
"""
import sys
import tempfile

import pydflash
from pydflash.engine import Decoder
from pydflash.testing import synthetic_pair

PROMPTS = [
    "Write a quicksort in Python.",
    "Explain speculative decoding in two sentences.",
    "List the first ten prime numbers.",
]


def main(target=None, draft=None, prompt_file=None, max_tokens=None) -> None:
    synthetic = target is None
    if synthetic:
        target, draft = synthetic_pair(tempfile.mkdtemp(prefix="pydflash-bench-"))
    if draft is None:
        sys.exit("bench_speedup.py needs a draft: TARGET.gguf DRAFT_DIR")
    prompts = PROMPTS
    if prompt_file:
        with open(prompt_file, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip()]
    max_tokens = int(max_tokens or (24 if synthetic else 256))

    ddtree = pydflash.load(target, draft, max_ctx=512 if synthetic else 4096)
    # plain AR decoding over the same loaded target: one copy of the weights for both
    ar = pydflash.Engine(Decoder(ddtree.target, mode="ar", tokenizer=ddtree.tokenizer), ddtree.tokenizer)
    ar.generate("warm-up", max_tokens=4)
    ddtree.generate("warm-up", max_tokens=4)

    print(f"| prompt | tokens | AR tok/s | DDTree tok/s | acceptance length | speed-up | same tokens |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    total = {"ar": 0.0, "dd": 0.0, "n": 0}
    for prompt in prompts:
        ref = ar.generate(prompt, max_tokens=max_tokens, chat=True)
        out = ddtree.generate(prompt, max_tokens=max_tokens, chat=True)
        ar_s, dd_s = ref.stats["decode_tok_s"], out.stats["decode_tok_s"]
        total["ar"] += ref.stats["decode_s"]
        total["dd"] += out.stats["decode_s"]
        total["n"] += len(out.tokens) - 1
        print(f"| {prompt[:40]} | {len(out.tokens)} | {ar_s:.1f} | {dd_s:.1f} | "
              f"{out.stats['acceptance_length']:.2f} | {dd_s / ar_s:.2f}x | "
              f"{'yes' if out.tokens == ref.tokens else 'NO'} |")
    print(f"overall speed-up: {total['ar'] / total['dd']:.2f}x over {total['n']} decoded tokens"
          + (" (random draft weights: acceptance is near 1, so DDTree is slower here)" if synthetic else ""))


if __name__ == "__main__":
    main(*sys.argv[1:5])
