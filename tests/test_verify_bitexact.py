"""On CUDA in bit-exact mode (PYDFLASH_BITEXACT=1, pydflash/models/layers.py), a verify's logits are, slot for
slot, the very bits that decoding the slot's path token by token gives, so greedy speculative decoding equals AR
token for token, with no near-tie excuse. Run on the GPU machine: `pytest -m cuda -s tests/test_verify_bitexact.py`.
The model is the 27B shape (Q4_K/Q6_K weights, 5120 wide, 248K vocabulary) cut to 4 layers: 3 GDN + 1 attention.

In the default mode verify and decode differ on CUDA (H100, 2026-11-22: max |diff| 0.03-0.08 per slot with ggml's
mul_mat or with ggml_qmatmul alone; docs/benchmarks.md, "Bit-exact mode"): flash attention, the recurrent ops and
the weight matmuls take other kernels for one token than for several. When a test here fails, its message names
the first graph node where verify and decode part (pydflash.probe), so one GPU run localises the gap.
"""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import probe
from pydflash.engine import Decoder
from pydflash.models.qwen35 import Qwen35Target
from pydflash.testing import OracleDraft, preset_27b, write_qwen35_gguf
from test_bitexact_mode import TREE_PARENTS, decoded_logits, verified_logits
from test_engine import BLOCK, CUDA_SHAPE

pytestmark = [pytest.mark.cuda, pytest.mark.slow]


@pytest.fixture(scope="module")
def q27(tmp_path_factory):
    path = tmp_path_factory.mktemp("q27") / "q27_4layers.gguf"
    write_qwen35_gguf(path, preset_27b(n_layer=4))
    return path


@pytest.fixture
def bitexact(monkeypatch):
    monkeypatch.setenv("PYDFLASH_BITEXACT", "1")   # read when the graphs are built, i.e. after this


def where_they_part(target, prompt, chain) -> str:
    return "first differing graph node per slot (pydflash.probe):\n" + probe.describe(
        probe.first_divergence(target, prompt, chain))


def test_cuda_verify_logits_equal_decode_logits_bit_for_bit(q27, bitexact):
    target = Qwen35Target(str(q27), "cuda", n_ctx=256, n_ubatch=32)
    rng = np.random.default_rng(15)
    prompt = rng.integers(0, 5000, 40)
    chain = rng.integers(0, 5000, 8)

    target.prefill(prompt, return_logits=False)
    target.enable_verify(len(chain))
    target.verify(chain, parents=np.arange(-1, len(chain) - 1), depths=np.arange(len(chain)))
    verified = target.logits_of_slots().copy()

    target.reset()
    target.prefill(prompt, return_logits=False)
    diffs = []
    for i, token in enumerate(chain):
        decoded = target.decode(int(token))
        diffs.append(float(np.abs(decoded - verified[i]).max()))
    print(f"max |verify - decode| per slot: {diffs}")
    if any(d != 0.0 for d in diffs):
        pytest.fail(f"verify and decode logits differ: max abs diff per slot {diffs}\n"
                    + where_they_part(target, prompt, chain))


def test_cuda_tree_verify_equals_path_decodes_across_a_kv_bucket(q27, bitexact):
    """A branching tree whose verify attends 512 cells (the prompt ends 3 cells short of the 256-cell bucket) while
    the decodes of its short paths attend 256: the slots' cells sit apart in the verify, together in a decode."""
    target = Qwen35Target(str(q27), "cuda", n_ctx=512, n_ubatch=64)
    rng = np.random.default_rng(16)
    prompt = [int(t) for t in rng.integers(0, 5000, 253)]
    tokens = rng.integers(0, 5000, TREE_PARENTS.size).astype(np.int32)
    got = verified_logits(target, prompt, tokens, TREE_PARENTS)
    want = decoded_logits(target, prompt, tokens, TREE_PARENTS)
    diffs = np.abs(got - want).max(axis=1)
    print(f"max |verify - decode| per tree slot: {diffs.tolist()}")
    assert not diffs.any(), f"tree verify and path decodes differ: max abs diff per slot {diffs.tolist()}"


@pytest.mark.parametrize("state_type", ["f32", "replay"])
def test_cuda_greedy_ddtree_equals_ar_token_for_token(q27, bitexact, state_type):
    """The 27B-shaped model with the oracle draft (wrong guesses planted at known positions), over a KV bucket,
    with every node's state stored or rebuilt at commit."""
    target = Qwen35Target(str(q27), "cuda", n_ctx=512, n_ubatch=64)
    prompt = [int(t) for t in np.random.default_rng(17).integers(0, 5000, 200)]
    ar, _ = Decoder(target, mode="ar").generate_ids(prompt, 128)
    errors = tuple(len(prompt) + e for e in (3, 16, 17, 34, 56, 57, 75, 106))
    draft = OracleDraft(prompt + ar, target.hp.n_vocab, block_size=BLOCK, error_positions=errors)
    out, stats = Decoder(target, draft, mode="ddtree", budget=22, state_type=state_type).generate_ids(prompt, 128)
    first = next((i for i, (a, b) in enumerate(zip(out, ar)) if a != b), None)
    assert out == ar, f"ddtree leaves AR at token {first}"
    assert stats["acceptance_length"] > 4 and stats["off_chain_steps"] > 0


@pytest.mark.parametrize("mode,budget", [("chain", 15), ("ddtree", 22), ("ddtree", 40)])
def test_cuda_lossless_exact(tmp_path, mode, budget, bitexact):
    """tests/test_engine.py's CUDA lossless run (f32 weights: every matmul through ggml's matrix-vector kernel,
    one column per token), with the top-2 margin excuse dropped: tokens compared exactly, as on the CPU."""
    path = tmp_path / "b.gguf"
    write_qwen35_gguf(path, **CUDA_SHAPE)
    target = Qwen35Target(path, "cuda", n_ctx=512, n_ubatch=64)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 400, size=24)]
    ar, _ = Decoder(target, mode="ar").generate_ids(prompt, 136)
    draft = OracleDraft(prompt + ar, target.hp.n_vocab, block_size=BLOCK,
                        error_positions=(27, 40, 41, 58, 80, 81, 82, 99, 130))
    out, stats = Decoder(target, draft, mode=mode, budget=budget).generate_ids(prompt, 136)
    assert out == ar
    assert stats["acceptance_length"] > 4
