"""Greedy agreement of pydflash with llama.cpp (llama-cpp-python) on a real GGUF, on any device.

    python bench/real_model_agreement.py MODEL.gguf --device cuda [--n-gen 64]

For each chat prompt: llama.cpp's greedy continuation and its logits at every step; then pydflash teacher-forced
on llama.cpp's tokens (so one early near-tie does not derail the rest), reporting where our argmax first differs,
llama.cpp's top-2 logit gap there (a near-tie, or a real disagreement), and the per-step max |dlogit|; then
pydflash's own free-running greedy reply, compared with llama.cpp's tokens. llama.cpp runs on the CPU
(llama-cpp-python's wheel), so on CUDA this measures CUDA kernels against CPU kernels.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

try:
    import pydflash  # noqa: F401  (the installed package)
except ImportError:      # running from a source checkout without installing
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PROMPTS = ("Write a Python function that checks whether a string is a palindrome.",
           "Explain the difference between a list and a tuple in Python.",
           "What is 17 * 23? Show your work.",
           "Write a bash one-liner that counts the lines of all .py files in a folder.")


def llama_cpp_greedy(llm, ids, n_gen):
    import llama_cpp

    def last_logits():
        ptr = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).copy()

    llm.reset()
    llm.eval(ids)
    logits, tokens = [], []
    for _ in range(n_gen):
        logits.append(last_logits())
        tokens.append(int(logits[-1].argmax()))
        llm.eval([tokens[-1]])
    return np.stack(logits), tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="auto")
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()

    import pydflash
    from llama_cpp import Llama

    t0 = time.perf_counter()
    engine = pydflash.load(args.model, device=args.device, max_ctx=1024)
    print(f"pydflash load {time.perf_counter() - t0:.2f} s")
    target, tok = engine.target, engine.tokenizer
    llm = Llama(model_path=args.model, n_ctx=1024, n_gpu_layers=0, verbose=False, n_threads=args.threads)
    print("| prompt | first argmax mismatch (teacher-forced) | llama.cpp top-2 gap there | median / max step "
          "max abs dlogit | free-running greedy == llama.cpp |")
    print("|---|---|---|---|---|")
    for text in PROMPTS:
        ids = tok.tokenize(tok.apply_chat_template([{"role": "user", "content": text}]))
        ref_logits, ref = llama_cpp_greedy(llm, ids, args.n_gen)
        target.reset()
        got = np.stack([target.prefill(ids)] + [target.decode(t) for t in ref[:-1]])
        ours = got.argmax(axis=1)
        mismatch = np.flatnonzero(ours != np.array(ref))
        first = int(mismatch[0]) if mismatch.size else None
        gap = "-"
        if first is not None:
            top2 = np.sort(ref_logits[first])[-2:]
            gap = f"{top2[1] - top2[0]:.4f}"
        err = np.abs(got - ref_logits).max(axis=1)
        res = engine.generate(text, max_tokens=args.n_gen, chat=True)
        same = res.tokens == ref[:len(res.tokens)]
        print(f"| {text[:40]} | {'none' if first is None else first} of {args.n_gen} | {gap} | "
              f"{np.median(err):.3f} / {err.max():.3f} | {'yes' if same else 'no'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
