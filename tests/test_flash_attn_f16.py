"""Flash attention over an f16 KV cache at a tree verify's sizes: ggml_flash_attn_ext as the target's attention
calls it (K and V views of a cache of [head_dim x n_head_kv] cells, a tree mask, f32 accumulation).

On CUDA, up to 256 query rows per KV head (tokens x GQA ratio) of two or more tokens over up to 4,096 cells take
ggml_ext's split-KV kernel (ggml_ext/cuda/fattn_split.cuh); the rest upstream's kernels. The oracle is float64 attention over the f16
values the cache holds.
"""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import ggml

from conftest import attention_f64, rel_err, run_graph


def cache_attention_f64(q, k, v, mask, scale):
    """conftest.attention_f64 over the cache's layout: q [n_q, H, D], k/v [n_kv, Hkv, D], mask [n_q, n_kv] additive ->
    the output [n_q, H, D] and each row's scale sqrt(sum_k p_k |v_k|^2) [n_q, H]: an error of relative size e in
    every term p_k v_k moves the output by at most e times that (the output itself can be much shorter when the
    weights spread)."""
    h, hkv = q.shape[1], k.shape[1]
    out, p = attention_f64(q.transpose(1, 0, 2)[None], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None], mask,
                           scale, weights=True)
    v_sq = np.repeat((v.astype(np.float64) ** 2).sum(axis=-1), h // hkv, axis=1)   # [n_kv, H]
    return out[0], np.sqrt(np.einsum("hqk,kh->qh", p[0], v_sq))


def tree_mask(rng, n_q, n_kv, hole):
    """A verify's mask: every query sees the context before the last n_q cells, a random half of the tree cells
    before its own, and itself. hole: the context minus its first 16 cells is hidden too (whole key slices with
    no visible key, so the merge meets empty partials)."""
    ctx = n_kv - n_q
    mask = np.full((n_q, n_kv), -np.inf)
    mask[:, :ctx] = 0.0
    if hole:
        mask[:, 16:ctx] = -np.inf
    for i in range(n_q):
        mask[i, ctx:ctx + i][rng.random(i) < 0.5] = 0.0
        mask[i, ctx + i] = 0.0
    return mask


def cache_attention(backend, q, k, v, mask, scale):
    """ggml_flash_attn_ext over K/V held like the target's cache: q [n_q, H, D] f32, k/v [n_kv, Hkv, D] f16;
    mask None: no mask tensor (every key visible)."""
    n_q, h, d = q.shape
    n_kv, hkv, _ = k.shape

    def build(ctx, t):
        qq = ctx.permute(t["q"], 0, 2, 1, 3)                     # [D, n_q, H]
        kk = ctx.permute(t["k"], 0, 2, 1, 3)                     # [D, n_kv, Hkv], cells hkv * D apart
        vv = ctx.permute(t["v"], 0, 2, 1, 3)
        out = ctx.flash_attn_ext(qq, kk, vv, t.get("mask"), float(scale), 0.0, 0.0)
        out.accumulate_f32()
        return out

    tensors = {"q": q, "k": k, "v": v}
    if mask is not None:
        tensors["mask"] = mask.astype(np.float16)
    out = run_graph(backend, build, tensors)
    return out.reshape(n_q, h, d)


def inputs(rng, dim, h, hkv, n_q, n_kv, hole=False):
    q = rng.standard_normal((n_q, h, dim)).astype(np.float32)
    k = rng.standard_normal((n_kv, hkv, dim)).astype(np.float16)
    v = rng.standard_normal((n_kv, hkv, dim)).astype(np.float16)
    return q, k, v, tree_mask(rng, n_q, n_kv, hole), 1.0 / np.sqrt(dim)


@pytest.mark.parametrize("dim,h,hkv,n_q,n_kv", [(128, 32, 8, 16, 272), (256, 24, 4, 23, 768)])
def test_flash_attention_f16_no_mask(backend, rng, dim, h, hkv, n_q, n_kv):
    """No mask tensor (the draft's block attention can run so): every key counts for every query."""
    q, k, v, _, scale = inputs(rng, dim, h, hkv, n_q, n_kv)
    out = cache_attention(backend, q, k, v, None, scale)
    ref, row_scale = cache_attention_f64(q, k, v, np.zeros((n_q, n_kv)), scale)
    row_err = np.linalg.norm(out - ref, axis=-1) / row_scale
    assert row_err.max() < (1e-3 if backend.is_cpu else 2e-3)   # bounds as test_flash_attention_f16_cache


# The 27B shape's verify (23 tokens x 6 GQA heads = 138 rows per KV head, 3 row tiles) at a short and a long
# cache, the long one with a hidden stretch; 2 tokens (12 rows, one part-filled tile); 42 tokens (252 rows, the
# kernel's largest); head size 128; and three shapes the kernel leaves to upstream: a cache length that is no
# multiple of 8, 43 tokens (258 rows) and a cache longer than 4,096 cells.
@pytest.mark.parametrize("dim,h,hkv,n_q,n_kv,hole", [
    (256, 24, 4, 23, 768, False),
    (256, 24, 4, 23, 4096, True),
    (256, 24, 4, 2, 64, False),
    (256, 24, 4, 42, 1024, False),
    (128, 16, 2, 23, 520, False),
    (256, 24, 4, 23, 300, False),
    (256, 24, 4, 43, 512, False),
    (256, 24, 4, 23, 4352, True),
])
def test_flash_attention_f16_cache(backend, rng, dim, h, hkv, n_q, n_kv, hole):
    q, k, v, mask, scale = inputs(rng, dim, h, hkv, n_q, n_kv, hole)
    out = cache_attention(backend, q, k, v, mask, scale)
    ref, row_scale = cache_attention_f64(q, k, v, mask, scale)
    # Every row against its scale (a wrong row would hide in the norm of the others). CUDA: Q and the softmax
    # weights rounded to f16 (2^-11 relative each), f32 accumulation. CPU (upstream's kernel): Q rounded to f16 for
    # the dot products with f16 K, and the weighted sum of f16 V kept in f16 (a rounding per key).
    row_err = np.linalg.norm(out - ref, axis=-1) / row_scale
    print(f"dim={dim} h={h} hkv={hkv} n_q={n_q} n_kv={n_kv} hole={hole}: worst row {row_err.max():.2e}")
    assert row_err.max() < (1e-3 if backend.is_cpu else 2e-3)


@pytest.mark.cuda
def test_cuda_split_kernel_is_the_one_taken(monkeypatch, rng):
    """PYDFLASH_FA_SPLIT=0 sends the verify shape to upstream's kernel: both are within the bound of the f64
    reference, and they are different kernels (their roundings differ), so the default really runs ours."""
    cuda = ggml.Backend("cuda")
    q, k, v, mask, scale = inputs(rng, 256, 24, 4, 23, 1024)
    ref, _ = cache_attention_f64(q, k, v, mask, scale)
    monkeypatch.setenv("PYDFLASH_FA_SPLIT", "0")
    upstream = cache_attention(cuda, q, k, v, mask, scale)
    monkeypatch.setenv("PYDFLASH_FA_SPLIT", "1")
    ours = cache_attention(cuda, q, k, v, mask, scale)
    assert rel_err(upstream, ref) < 2e-3
    assert rel_err(ours, ref) < 2e-3
    assert not np.array_equal(ours, upstream)
