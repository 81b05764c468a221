"""The qwen35 target with a TQ3_0 KV cache against the same target with an F16 cache (DESIGN.md §7).

One tiny model with head size 128 (TQ3_0 rotates 128-value groups): attention layers 1 and 2 of 5. Both
targets follow the F16 run's greedy tokens (teacher forcing), so every step compares the same context.
"""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import ggml
from pydflash.models.qwen35 import Qwen35Target
from pydflash.testing import write_qwen35_gguf

SHAPE = dict(n_layer=5, n_embd=96, n_ff=160, n_head=2, n_head_kv=1, head_dim=128, n_rot=32,
             rope_sections=(6, 5, 5, 0), ssm_d_state=128, ssm_n_group=1, ssm_dt_rank=3, ssm_d_conv=3,
             recurrent_layers=(1, 0, 0, 1, 1), n_vocab=600, seed=3)
N_CTX, N_STEPS = 256, 32


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tq3") / "target.gguf"
    write_qwen35_gguf(path, **SHAPE)
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
    target = Qwen35Target(model, "cpu", n_ctx=N_CTX, kv_type="tq3_0")
    with pytest.raises(ValueError, match="tq3_0 KV cache is not supported yet"):
        target.enable_verify(8)
    small_head = tmp_path / "head64.gguf"
    write_qwen35_gguf(small_head, **{**SHAPE, "head_dim": 64})
    with pytest.raises(ValueError, match="multiple of 128"):
        Qwen35Target(small_head, "cpu", n_ctx=N_CTX, kv_type="tq3_0")
