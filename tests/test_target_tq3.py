"""The qwen35 target with a TQ3_0 KV cache against the same target with an F16 cache.

One tiny model with head size 128 (TQ3_0 rotates 128-value groups): attention layers 1 and 2 of 5. Both
targets follow the F16 run's greedy tokens (teacher forcing), so every step compares the same context.
"""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import ggml
from pydflash.engine import Decoder
from pydflash.kv import kv_type_of
from pydflash.models.qwen35 import Qwen35Target
from pydflash.testing import OracleDraft, write_qwen35_gguf

SHAPE = dict(n_layer=5, n_embd=96, n_ff=160, n_head=2, n_head_kv=1, head_dim=128, n_rot=32,
             rope_sections=(6, 5, 5, 0), ssm_d_state=128, ssm_n_group=1, ssm_dt_rank=3, ssm_d_conv=3,
             recurrent_layers=(1, 0, 0, 1, 1), n_vocab=600, seed=3)
N_CTX, N_STEPS = 256, 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tq3") / "target.gguf"
    write_qwen35_gguf(path, **SHAPE)
    return path


@pytest.fixture(scope="module")
def model_conv4(tmp_path_factory):
    """The same shape with a conv kernel of 4: the CUDA tree conv (a verify's GDN layers) takes only that size."""
    path = tmp_path_factory.mktemp("tq3") / "target-conv4.gguf"
    write_qwen35_gguf(path, **dict(SHAPE, ssm_d_conv=4))
    return path


def teacher_forced_logits(path, kv_type, prompt, tokens, device="cpu"):
    target = Qwen35Target(path, device, n_ctx=N_CTX, kv_type=kv_type)
    out = [np.asarray(target.prefill(prompt), np.float64).ravel()]
    for t in tokens:
        out.append(np.asarray(target.decode(t), np.float64).ravel())
    return np.stack(out)


def greedy_path(path, prompt, device="cpu"):
    target = Qwen35Target(path, device, n_ctx=N_CTX, kv_type="f16")
    tokens = [int(np.argmax(target.prefill(prompt)))]
    for _ in range(N_STEPS - 1):
        tokens.append(int(np.argmax(target.decode(tokens[-1]))))
    return tokens


# On CUDA the same comparison runs through the TQ3_0 decode attention kernel and the CUDA set_rows quantiser;
# both caches see the same (TF32) matmul rounding, so the bounds are the CPU's.
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_tq3_0_cache_against_f16(model, device):
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, 450, 45)]
    tokens = greedy_path(model, prompt, device)
    ref = teacher_forced_logits(model, "f16", prompt, tokens, device)
    tq3 = teacher_forced_logits(model, "tq3_0", prompt, tokens, device)
    q4 = teacher_forced_logits(model, "q4_0", prompt, tokens, device)
    err_tq3 = np.linalg.norm(tq3 - ref, axis=1) / np.linalg.norm(ref, axis=1)
    err_q4 = np.linalg.norm(q4 - ref, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"{device}: relative logit error vs F16 cache: tq3_0 max {err_tq3.max():.2e} median {np.median(err_tq3):.2e}; "
          f"q4_0 max {err_q4.max():.2e} median {np.median(err_q4):.2e}")
    # 3-bit Lloyd-Max distortion on N(0,1) is 0.0345, blockwise 4-bit about 0.01: TQ3_0's error should be about
    # sqrt(3.5) ~ 1.9x Q4_0's (measured 2.1e-2 vs 9.4e-3 max, 1.3e-2 vs 6.5e-3 median). Bounds: 3x Q4_0's
    # median, and 5e-2 at any step.
    assert np.median(err_tq3) < 3 * np.median(err_q4)
    assert err_tq3.max() < 5e-2
    assert err_tq3.min() > 0  # the cache really is quantised (an F16 cache in disguise would give 0)

    # greedy agreement: a different argmax is only allowed where F16's top-2 margin is within the perturbation
    flips = 0
    for step in range(len(ref)):
        if tq3[step].argmax() != ref[step].argmax():
            flips += 1
            top2 = np.sort(ref[step])[-2:]
            perturbation = np.abs(tq3[step] - ref[step]).max()
            assert top2[1] - top2[0] < 2 * perturbation, f"step {step}: argmax flipped at a clear margin"
    print(f"teacher-forced greedy agreement with F16: {len(ref) - flips}/{len(ref)}")
    assert flips <= len(ref) // 10   # measured 0 of 33


def test_tq3_0_cache_is_3_5_bits_per_value(model):
    target = Qwen35Target(model, "cpu", n_ctx=N_CTX, kv_type="tq3_0")
    assert sorted(target.cache.k) == [1, 2]
    for il in (1, 2):
        for t in (target.cache.k[il], target.cache.v[il]):
            assert t.type == ggml.Type.TQ3_0
            n_values = t.ne[0] * t.ne[1]
            assert t.nbytes * 8 == n_values * 3.5


def test_tq3_0_cache_limits_are_explicit(model, tmp_path):
    small_head = tmp_path / "head64.gguf"
    write_qwen35_gguf(small_head, **{**SHAPE, "head_dim": 64})
    with pytest.raises(ValueError, match="multiple of 128"):
        Qwen35Target(small_head, "cpu", n_ctx=N_CTX, kv_type="tq3_0")


# --- speculative decoding over a quantized cache ---------------------------------------------------------------

SPEC_PROMPT = 20
SPEC_GEN = 90
SPEC_ERRORS = (26, 33, 34, 47, 60, 61, 75, 88)    # oracle mistakes: its right token comes second there


def cache_rows(target, n):
    """The raw bytes of the first n K and V rows of every attention layer."""
    return {(il, kv): t.numpy().view(np.uint8).reshape(t.ne[1], -1)[:n].copy() for il in target.cache.k
            for kv, t in (("k", target.cache.k[il]), ("v", target.cache.v[il]))}


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["tq3_0", "q4_0"])
def test_speculative_over_quantized_cache_equals_ar(model, kv):
    """chain and ddtree with a quantized KV cache give AR's tokens with the same cache type, token for token, and
    leave the same cache bytes behind: commit moves accepted rows (compacting off-chain ones) bit for bit.
    (f16 is tests/test_engine.py's case; q8_0 moves rows like q4_0: test_commit_moves_rows_bit_for_bit.)"""
    prompt = [int(t) for t in np.random.default_rng(7).integers(0, 450, SPEC_PROMPT)]
    target = Qwen35Target(model, "cpu", n_ctx=N_CTX, kv_type=kv, n_ubatch=32)
    ar, _ = Decoder(target, mode="ar").generate_ids(prompt, SPEC_GEN)
    n_ar = target.n_past
    ar_rows = cache_rows(target, n_ar)
    for mode in ("chain", "ddtree"):
        draft = OracleDraft(prompt + ar, target.hp.n_vocab, block_size=16, error_positions=SPEC_ERRORS)
        out, stats = Decoder(target, draft, mode=mode, budget=12).generate_ids(prompt, SPEC_GEN)
        first_diff = next((i for i, (a, b) in enumerate(zip(out, ar)) if a != b), None)
        assert out == ar, f"{mode} over {kv}: first difference at new token {first_diff}"
        assert stats["acceptance_length"] > 2
        if mode == "ddtree":
            assert stats["off_chain_steps"] > 0       # some steps accepted through a second-rank sibling
        n = min(n_ar, target.n_past)
        rows = cache_rows(target, n)
        for key, want in ar_rows.items():
            assert np.array_equal(rows[key], want[:n]), f"{mode} over {kv}: cache rows of {key} differ from AR's"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kv", ["tq3_0", "q4_0", "q8_0", "f16"])
def test_commit_moves_rows_bit_for_bit(model, model_conv4, kv, device):
    """An off-chain commit moves the accepted slots' KV rows to consecutive cells as raw bytes (TQ3_0 would be
    rotated twice, Q8_0/Q4_0 re-quantized, through f32); the cache stays of its type (TQ3_0: 3.5 bits/value)."""
    target = Qwen35Target(model if device == "cpu" else model_conv4, device, n_ctx=N_CTX, kv_type=kv, n_ubatch=32)
    target.enable_verify(8)
    target.prefill([5, 6, 7])
    parents = np.array([-1, 0, 0, 2, 3, 1, 5, 6])
    target.verify(np.arange(10, 18), parents, np.array([0, 1, 1, 2, 3, 2, 3, 4]))
    written = cache_rows(target, 3 + 8)
    target.commit([0, 2, 3, 4])                          # slots 2, 3, 4 move to cells 4, 5, 6
    after = cache_rows(target, 3 + 8)
    for key, rows in written.items():
        assert np.array_equal(after[key][:4], rows[:4])  # the prompt and the root stay
        assert np.array_equal(after[key][4:7], rows[[5, 6, 7]]), f"{kv}: moved rows of {key} changed"
        assert not np.array_equal(rows[4], rows[5])       # the move is visible: distinct rows
    assert target.n_past == 7
    for t in list(target.cache.k.values()) + list(target.cache.v.values()):
        assert t.type == kv_type_of(kv)
        if kv == "tq3_0":
            assert t.nbytes * 8 == t.ne[0] * t.ne[1] * 3.5
