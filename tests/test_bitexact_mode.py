"""Bit-exact mode (PYDFLASH_BITEXACT=1, pydflash/models/layers.py) on the CPU: the graphs it builds compute the
same model as the default ones, a tree verify's logits are the very bits that decoding each slot's path gives,
and speculative greedy output equals AR token for token with no near-tie excuse. (On CUDA, where the default
mode is not exact: tests/test_verify_bitexact.py.)"""
from __future__ import annotations

import numpy as np
import pytest

from pydflash.engine import Decoder
from pydflash.models.qwen35 import Qwen35Target
from pydflash.testing import OracleDraft, write_qwen35_gguf

# the root, a 3-deep chain under it, a second branch off the root with a child, a sibling at depth 2
TREE_PARENTS = np.array([-1, 0, 1, 2, 0, 4, 1], np.int32)
# Bit-exact mode swaps kernels, not the model. The one rounding that differs noticeably: ggml's CPU flash attention
# rounds Q to f16 for Q.K (2^-11 relative), ggml_flash_attn_ordered keeps it f32; measured 1.5e-3 of logits of
# O(4) here. A wrong wiring (a layer's conv or state taken from the wrong place) moves them by O(0.1).
MODE_ATOL = 5e-3


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bitexact") / "tiny.gguf"
    write_qwen35_gguf(path, seed=11, recurrent_layers=(True, True, False, True))
    return path


@pytest.fixture(scope="module")
def prompt():
    return [int(t) for t in np.random.default_rng(5).integers(3, 400, size=24)]


@pytest.fixture
def bitexact(monkeypatch):
    monkeypatch.setenv("PYDFLASH_BITEXACT", "1")


def depths_of(parents):
    depths = np.zeros(parents.size, np.int32)
    for s in range(1, parents.size):
        depths[s] = depths[parents[s]] + 1
    return depths


def path_to(slot, tokens, parents):
    out = []
    while slot >= 0:
        out.append(int(tokens[slot]))
        slot = int(parents[slot])
    return out[::-1]


def decoded_logits(target, prompt, tokens, parents):
    """Per slot: the logits after decoding the slot's path (through `parents`) one token at a time."""
    rows = []
    for slot in range(tokens.size):
        target.reset()
        target.prefill(prompt, return_logits=False)
        for token in path_to(slot, tokens, parents):
            logits = target.decode(token)
        rows.append(logits.copy())
    return np.stack(rows)


def verified_logits(target, prompt, tokens, parents):
    target.reset()
    target.prefill(prompt, return_logits=False)
    target.enable_verify(tokens.size)
    target.verify(tokens, parents, depths_of(parents))
    return target.logits_of_slots().copy()


def first_decodes(target, prompt, n=4):
    target.reset()
    rows = [target.prefill(prompt).copy()]
    for _ in range(n):
        rows.append(target.decode(int(np.argmax(rows[-1]))).copy())
    return np.stack(rows)


@pytest.mark.slow
def test_same_model_as_the_default_mode(model, prompt, monkeypatch):
    default = first_decodes(Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64), prompt)
    monkeypatch.setenv("PYDFLASH_BITEXACT", "1")
    exact = first_decodes(Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64), prompt)
    assert np.abs(default).max() > 0.1
    assert np.abs(exact - default).max() < MODE_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("n_prompt", [24, 253])
def test_tree_verify_equals_path_decodes_bit_for_bit(model, bitexact, n_prompt):
    """253: the verify attends 512 cells (its slots reach past the 256-cell bucket), a short path's decode 256."""
    target = Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64)
    prompt = [int(t) for t in np.random.default_rng(n_prompt).integers(3, 400, size=n_prompt)]
    tokens = np.array([17, 50, 3, 99, 7, 9, 11], np.int32)
    got = verified_logits(target, prompt, tokens, TREE_PARENTS)
    want = decoded_logits(target, prompt, tokens, TREE_PARENTS)
    assert np.array_equal(got, want), f"max |verify - decode| per slot {np.abs(got - want).max(axis=1)}"
    # the comparison can fail: slot 6 decoded under slot 4 instead of slot 1 gives other logits
    wrong = decoded_logits(target, prompt, tokens, np.array([-1, 0, 1, 2, 0, 4, 4], np.int32))
    assert np.abs(got[6] - wrong[6]).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("state_type", ["f32", "replay"])
def test_ddtree_equals_ar_token_for_token(model, prompt, bitexact, state_type):
    """No near-tie excuse: in bit-exact mode every verify logit is AR's, so every token is AR's (with every node's
    state stored, or rebuilt at commit)."""
    target = Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64)
    ar, _ = Decoder(target, mode="ar").generate_ids(prompt, 100)
    draft = OracleDraft(prompt + ar, target.hp.n_vocab, block_size=16, error_positions=(27, 40, 41, 58, 80, 99))
    out, stats = Decoder(target, draft, mode="ddtree", budget=22, state_type=state_type).generate_ids(prompt, 100)
    assert out == ar
    assert stats["acceptance_length"] > 4 and stats["off_chain_steps"] > 0


def test_refuses_what_it_cannot_make_exact(model, prompt, bitexact):
    quantised_kv = Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64, kv_type="q8_0")
    with pytest.raises(ValueError, match="PYDFLASH_BITEXACT=1 needs an f16 KV cache.*q8_0"):
        quantised_kv.prefill(prompt)
    target = Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64)
    with pytest.raises(ValueError, match="f32 or replayed states, got state_type 'f16'"):
        target.enable_verify(8, state_type="f16")
    with pytest.raises(ValueError, match="verifies at most 48 slots, got 49"):
        target.enable_verify(49)


def test_switch_values(monkeypatch):
    from pydflash.models import layers
    monkeypatch.setenv("PYDFLASH_BITEXACT", "1")
    assert layers.bitexact_enabled() and layers.qmatmul_enabled()   # bit-exact implies the N-invariant matmul
    monkeypatch.setenv("PYDFLASH_BITEXACT", "yes")
    with pytest.raises(ValueError, match="PYDFLASH_BITEXACT must be 0 or 1, got 'yes'"):
        layers.bitexact_enabled()


@pytest.mark.slow
def test_probe_names_the_first_differing_node(model, prompt, bitexact, monkeypatch):
    """pydflash.probe: with nothing changed every slot agrees on every kept node; with layer 2's FFN output nudged
    in decode graphs only, it names that node for every slot (everything before it agrees)."""
    from pydflash import probe
    chain = [17, 50, 3, 99, 7]
    report = probe.first_divergence(Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64), prompt, chain)
    assert [d.node for d in report] == [None] * len(chain)
    assert min(d.checked for d in report) > 40          # every layer's named nodes took part

    plain = Qwen35Target.gated_ffn

    def nudged(self, ctx, x, prefix, glu, name, add=None):
        out = plain(self, ctx, x, prefix, glu, name + ".raw")
        out = ctx.scale(out, 1.0 + 2.0 ** -10 if name == "l2.ffn_out" and x.ne[1] == 1 else 1.0).named(name)
        return out if add is None else ctx.add(out, add)

    monkeypatch.setattr(Qwen35Target, "gated_ffn", nudged)
    report = probe.first_divergence(Qwen35Target(model, "cpu", n_ctx=512, n_ubatch=64), prompt, chain)
    assert [d.node for d in report] == ["l2.ffn_out"] * len(chain)
    assert all(d.max_abs_diff > 0 for d in report)
    assert "first differing node 'l2.ffn_out'" in probe.describe(report)
