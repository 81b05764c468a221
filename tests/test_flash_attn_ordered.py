"""ggml_flash_attn_ordered (the attention of bit-exact mode) against float64 numpy, and the property it exists for:
a query's output row is the same bits alone or among many queries, and wherever its unmasked cells sit among
removed ones (a decode's consecutive cells vs a tree verify's spread ones). CPU in CI, CUDA with `-m cuda`."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_err, run_graph
from pydflash import ggml

TOL = 1e-5   # f32 dot products, exp and a running sum over <= 300 cells against float64


def attend(backend, q, k, v, mask, scale):
    """q f32 [H_q, n_q, D], k/v f16 [H_kv, n_kv, D], mask f16 [n_q, n_kv] (numpy order) -> f32 [n_q, H_q, D]."""
    def build(ctx, t):
        out = ggml.flash_attn_ordered(ctx, t["q"], t["k"], t["v"], t["mask"], scale)
        assert backend.supports(out)
        return out
    H_q, n_q, D = q.shape
    return run_graph(backend, build, {"q": q, "k": k, "v": v, "mask": mask}).reshape(n_q, H_q, D)


def reference(q, k, v, mask, scale):
    q, k, v, mask = (np.asarray(a, np.float64) for a in (q, k, v, mask))
    H_q, n_q, D = q.shape
    ratio = H_q // k.shape[0]
    out = np.zeros((n_q, H_q, D))
    for i in range(n_q):
        keep = np.isfinite(mask[i])
        for h in range(H_q):
            if not keep.any():
                continue
            s = scale * k[h // ratio][keep] @ q[h, i] + mask[i][keep]
            p = np.exp(s - s.max())
            out[i, h] = p @ v[h // ratio][keep] / p.sum()
    return out


def inputs(rng, D, n_q, n_kv, H_q=6, H_kv=2):
    q = rng.standard_normal((H_q, n_q, D)).astype(np.float32)
    k = rng.standard_normal((H_kv, n_kv, D)).astype(np.float16)
    v = rng.standard_normal((H_kv, n_kv, D)).astype(np.float16)
    return q, k, v


@pytest.mark.parametrize("D", [64, 128, 256])
def test_against_float64(backend, rng, D):
    """Causal rows with holes, a soft (finite) mask value, and a query that sees no cell (its output is 0)."""
    n_q, n_kv = 5, 300                                 # several chunks of D cells, the last one partial
    q, k, v = inputs(rng, D, n_q, n_kv)
    mask = np.where(np.arange(n_kv)[None, :] <= 200 + 20 * np.arange(n_q)[:, None], 0.0, -np.inf)
    mask[:, rng.integers(0, 200, 40)] = -np.inf
    mask[1, 3] = -0.5
    mask[4, :] = -np.inf
    mask = mask.astype(np.float16)
    scale = 1.0 / np.sqrt(D)
    got = attend(backend, q, k, v, mask, scale)
    want = reference(q, k, v, mask, scale)
    assert not got[4].any()
    assert rel_err(got, want) < TOL


def test_query_alone_or_among_many_is_bit_identical(backend, rng):
    """Each query's row computed in a graph of 7 queries equals, bit for bit, the row computed alone."""
    D, n_q, n_kv = 256, 7, 512
    q, k, v = inputs(rng, D, n_q, n_kv)
    mask = np.where(np.arange(n_kv)[None, :] <= 300 + np.arange(n_q)[:, None], 0.0, -np.inf).astype(np.float16)
    together = attend(backend, q, k, v, mask, 0.0625)
    for i in range(n_q):
        alone = attend(backend, np.ascontiguousarray(q[:, i:i + 1]), k, v, mask[i:i + 1], 0.0625)
        assert np.array_equal(alone[0], together[i]), f"query {i}"


def test_removed_cells_do_not_change_a_bit(backend, rng):
    """The same 90 visible (K, V) cells, consecutive at the start of 256 cells (a decode) or spread over 700 cells
    among removed ones whose K/V are NaN (a tree verify's other branches, an unwritten tail): the same bits, and
    the removed cells are never read."""
    D, n_vis = 128, 90
    q, k_vis, v_vis = inputs(rng, D, 1, n_vis)
    dense_k = np.full((2, 256, D), np.nan, np.float16)
    dense_v = dense_k.copy()
    dense_k[:, :n_vis], dense_v[:, :n_vis] = k_vis, v_vis
    dense_mask = np.where(np.arange(256) < n_vis, 0.0, -np.inf).astype(np.float16)[None, :]

    cells = np.sort(rng.choice(700, n_vis, replace=False))       # ascending: the order of the visible cells kept
    spread_k = np.full((2, 700, D), np.nan, np.float16)
    spread_v = spread_k.copy()
    spread_k[:, cells], spread_v[:, cells] = k_vis, v_vis
    spread_mask = np.full((1, 700), -np.inf, np.float16)
    spread_mask[0, cells] = 0.0

    dense = attend(backend, q, dense_k, dense_v, dense_mask, 0.1)
    spread = attend(backend, q, spread_k, spread_v, spread_mask, 0.1)
    assert np.isfinite(dense).all()
    assert np.array_equal(dense, spread)
    assert rel_err(dense, reference(q, k_vis, v_vis, np.zeros((1, n_vis)), 0.1)) < TOL


def test_wrapper_checks():
    ctx = ggml.Context(n_tensors=16)
    q = ctx.new_tensor(np.float32, (64, 3, 4))
    k16 = ctx.new_tensor(np.float16, (64, 256, 2))
    k32 = ctx.new_tensor(np.float32, (64, 256, 2))
    k3 = ctx.new_tensor(np.float16, (64, 256, 3))
    mask = ctx.new_tensor(np.float16, (256, 3))
    short_mask = ctx.new_tensor(np.float16, (256, 2))
    with pytest.raises(TypeError, match="k must be F16"):
        ggml.flash_attn_ordered(ctx, q, k32, k16, mask, 1.0)
    with pytest.raises(ValueError, match="K/V heads"):
        ggml.flash_attn_ordered(ctx, q, k3, k3, mask, 1.0)
    with pytest.raises(ValueError, match="a row for each of the 3 queries"):
        ggml.flash_attn_ordered(ctx, q, k16, k16, short_mask, 1.0)
    out = ggml.flash_attn_ordered(ctx, q, k16, k16, mask, 1.0)
    assert out.ne == (64, 4, 3, 1)
