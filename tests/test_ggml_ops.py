"""Upstream ggml ops driven from Python, each against a float64 numpy reference.

These are the ops the target and draft graphs are built from; the same tests run on CUDA with `-m cuda`.
Tolerances: float32 arithmetic lands far below 1e-5 relative error; where ggml converts activations to a
lower-precision type before a dot product (F16, Q8_0, Q8_K), that rounding sets the bound instead.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from conftest import rel_err, run_graph
from pydflash import ggml

# --- mul_mat -----------------------------------------------------------------------------------------------

from gguf.quants import quantize as gguf_quantize


def as_f16(a):
    return a.astype(np.float16).astype(np.float64)


def as_q8_0(a):
    return dequantize(gguf_quantize(a, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0).astype(np.float64)


# (weight type, how ggml rounds the activations before the dot product (emulated in the reference), bound)
MUL_MAT_CASES = [
    (ggml.Type.F32, None, 1e-5),
    (ggml.Type.F16, as_f16, 1e-5),
    (ggml.Type.Q8_0, as_q8_0, 1e-4),  # round-half ties may differ between ggml's SIMD and gguf-py: rare, 1 step
    # activations go to Q8_K, which gguf-py cannot produce: the bound is that rounding (8 bits a 256-block),
    # still 10x below the Q4_K weight rounding, which the test checks so a wrong decode cannot pass
    (ggml.Type.Q4_K, None, 1e-2),
]


# ggml-cuda multiplies F32 matrices on tensor cores in TF32 (10-bit mantissa inputs, 2^-11 relative rounding):
# measured 7.5e-4 on an H100
CUDA_F32_MATMUL_BOUND = 2e-3


@pytest.mark.parametrize("wtype,round_x,bound", MUL_MAT_CASES, ids=[c[0].name for c in MUL_MAT_CASES])
def test_mul_mat_matches_dequantised_reference(backend, rng, wtype, round_x, bound):
    n_in, n_out, n_tok = 512, 96, 7
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    if wtype == ggml.Type.F32:
        w_data, w_ref = w, w.astype(np.float64)
    elif wtype == ggml.Type.F16:
        w_data = w.astype(np.float16)
        w_ref = w_data.astype(np.float64)
    else:
        w_data = ggml.quantize(wtype, w)  # ggml's quantiser; the reference decodes with gguf-py's own code
        w_ref = dequantize(w_data, GGMLQuantizationType(int(wtype))).astype(np.float64)
        assert w_ref.shape == w.shape

    # built by hand: run_graph makes inputs from numpy dtypes, and quantised weights have none
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    weight = ctx.new_tensor(wtype, (n_in, n_out), name="w").mark_input()
    xt = ctx.new_tensor(np.float32, (n_in, n_tok), name="x").mark_input()
    graph = ctx.graph(ctx.mul_mat(weight, xt))
    ggml.Allocator(backend).allocate(graph)
    weight.set(w_data)
    xt.set(x)
    backend.compute(graph)
    y = graph.outputs[0].numpy()

    x_ref = round_x(x) if round_x else x.astype(np.float64)
    ref = x_ref @ w_ref.T
    err = rel_err(y, ref)
    if wtype == ggml.Type.F32 and not backend.is_cpu:
        bound = CUDA_F32_MATMUL_BOUND
    assert err < bound, f"{wtype.name}: relative error {err:.2e} over {bound:.0e}"
    if wtype == ggml.Type.Q4_K:
        weight_rounding = rel_err(x.astype(np.float64) @ w.T.astype(np.float64), ref)
        assert err < weight_rounding / 5, f"error {err:.2e} too close to the weight rounding {weight_rounding:.2e}"


# --- rms_norm ----------------------------------------------------------------------------------------------

def test_rms_norm(backend, rng):
    eps = 1e-6
    x = (rng.standard_normal((5, 384)) * rng.uniform(0.1, 10, (5, 1))).astype(np.float32)
    y = run_graph(backend, lambda ctx, t: ctx.rms_norm(t["x"], eps), {"x": x})
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64**2).mean(axis=1, keepdims=True) + eps)
    assert rel_err(y, ref) < 1e-6


# --- rope_multi (IMROPE, as Qwen3.5 uses it) -------------------------------------------------------------

GGML_ROPE_TYPE_IMROPE = 40  # ggml.h: GGML_ROPE_TYPE_MROPE (8) | 32


def imrope_reference(x, pos, n_dims, sections, base):
    """x [n_tok, n_head, head_dim]; pos [4, n_tok] (axis-major: t, h, w, e). NEOX pairs (j, j + n_dims/2) of
    the first n_dims dims rotate; pair j takes its position from axis t, h or w interleaved (j % 3), each
    axis only while j < 3 * its section, else the fourth axis; the other dims pass through."""
    x = x.astype(np.float64)
    out = x.copy()
    half = n_dims // 2
    for j in range(half):
        sector = j % sum(sections)
        axis = 3
        for a in range(3):
            if sector % 3 == a and sector < 3 * sections[a]:
                axis = a
        theta = pos[axis].astype(np.float64) * base ** (-2.0 * j / n_dims)  # [n_tok]
        c, s = np.cos(theta)[:, None], np.sin(theta)[:, None]
        x0, x1 = x[:, :, j], x[:, :, j + half]
        out[:, :, j] = x0 * c - x1 * s
        out[:, :, j + half] = x0 * s + x1 * c
    return out


def test_rope_multi_imrope(backend, rng):
    n_tok, n_head, head_dim, n_dims, sections, base = 9, 3, 256, 64, [11, 11, 10, 0], 1e7
    x = rng.standard_normal((n_tok, n_head, head_dim)).astype(np.float32)
    # different positions per axis, so a wrong axis choice or an interleaved (not axis-major) layout shows
    pos = np.stack([rng.permutation(1000)[:n_tok] for _ in range(4)]).astype(np.int32)  # [4, n_tok]

    def build(ctx, t):
        return ctx.rope_multi(t["x"], t["pos"], None, n_dims, sections, GGML_ROPE_TYPE_IMROPE, 0, base, 1.0, 0.0,
                              1.0, 0.0, 0.0)

    y = run_graph(backend, build, {"x": x, "pos": pos.reshape(-1)})
    ref = imrope_reference(x, pos, n_dims, sections, base)
    assert rel_err(y, ref) < 1e-5
    # text positions (p, p, p, 0) reduce to plain NEOX rope with the same position on every rotated pair
    p = np.arange(n_tok, dtype=np.int32) + 7
    text_pos = np.stack([p, p, p, np.zeros_like(p)])
    y = run_graph(backend, build, {"x": x, "pos": text_pos.reshape(-1)})
    assert rel_err(y, imrope_reference(x, np.stack([p, p, p, p]), n_dims, sections, base)) < 1e-5


# (n_dims, sections, whether every rotated pair reads one of the three axes that hold a text token's position)
TEXT_ROPE_CASES = [(64, (11, 11, 10, 0), True), (32, (6, 5, 5, 0), True), (16, (3, 3, 2, 0), True),
                   (16, (4, 2, 2, 0), False), (128, (24, 20, 20, 0), False)]


@pytest.mark.parametrize("n_dims,sections,neox", TEXT_ROPE_CASES, ids=[str(c[1]) for c in TEXT_ROPE_CASES])
def test_imrope_at_text_positions_is_neox_rope_where_the_target_says(backend, rng, n_dims, sections, neox):
    """ggml's IMROPE at text positions (p, p, p, 0) against its NEOX rope at p: bit for bit the same exactly
    where Qwen35HParams.text_rope_is_neox says so (the qwen35 target then ropes with NEOX, which ggml-cuda fuses
    with the norm before it and the cache write after it); where a pair reads the fourth axis (0), different."""
    from types import SimpleNamespace

    from pydflash.models.qwen35 import Qwen35HParams
    hp = SimpleNamespace(n_rot=n_dims, rope_sections=sections)
    assert Qwen35HParams.text_rope_is_neox.func(hp) == neox
    n_tok, n_head, head_dim, base = 7, 2, 2 * n_dims, 1e6
    x = rng.standard_normal((n_tok, n_head, head_dim)).astype(np.float32)
    p = (np.arange(n_tok) * 37 + 5).astype(np.int32)
    imrope = run_graph(backend, lambda ctx, t: ctx.rope_multi(t["x"], t["pos"], None, n_dims, list(sections),
                                                              GGML_ROPE_TYPE_IMROPE, 0, base, 1.0, 0.0, 1.0, 0.0, 0.0),
                       {"x": x, "pos": np.concatenate([p, p, p, np.zeros_like(p)])})
    neox_rope = run_graph(backend, lambda ctx, t: ctx.rope_ext(t["x"], t["pos"], None, n_dims, 2, 0, base, 1.0,
                                                               0.0, 1.0, 0.0, 0.0), {"x": x, "pos": p})
    assert np.array_equal(imrope, neox_rope) == neox


# --- flash_attn_ext with a mask ----------------------------------------------------------------------------

@pytest.mark.parametrize("n_q,n_kv", [(1, 37), (5, 128)])
def test_flash_attn_ext_masked_gqa(backend, rng, n_q, n_kv):
    d, n_head, n_head_kv = 128, 8, 2
    scale = 1.0 / np.sqrt(d)
    q = rng.standard_normal((n_q, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_head_kv, n_kv, d)).astype(np.float16)
    # causal-style mask over the kv positions plus random holes; every query keeps at least one key
    mask = np.where(rng.random((n_q, n_kv)) < 0.3, -np.inf, 0.0)
    mask[:, 0] = 0.0

    def build(ctx, t):
        qq = ctx.permute(t["q"], 0, 2, 1, 3)  # [d, n_q, n_head]
        return ctx.flash_attn_ext(qq, t["k"], t["v"], t["mask"], float(scale), 0.0, 0.0)

    y = run_graph(backend, build, {"q": q, "k": k, "v": v, "mask": mask.astype(np.float16)})
    # result is [d, n_head, n_q] in ggml order -> numpy [n_q, n_head, d]
    rep = n_head // n_head_kv
    ref = np.empty((n_q, n_head, d))
    for h in range(n_head):
        kh, vh = k[h // rep].astype(np.float64), v[h // rep].astype(np.float64)
        s = q[:, h].astype(np.float64) @ kh.T * scale + mask
        p = np.exp(s - s.max(axis=1, keepdims=True))
        ref[:, h] = (p / p.sum(axis=1, keepdims=True)) @ vh
    # K/V are f16 inputs (exact in the reference too); ggml rounds Q and the softmax weights to f16 on the
    # way, which is where the 2e-3 comes from
    assert rel_err(y.reshape(n_q, n_head, d), ref) < 2e-3


# --- ssm_conv and gated_delta_net -----------------------------------------------------------------------------

def test_ssm_conv(backend, rng):
    d_conv, d_inner, n_t, n_s = 4, 256, 6, 2  # CUDA's kernel takes d_inner in multiples of 128
    sx = rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(np.float32)
    c = rng.standard_normal((d_inner, d_conv)).astype(np.float32)
    y = run_graph(backend, lambda ctx, t: ctx.ssm_conv(t["sx"], t["c"]), {"sx": sx, "c": c})
    ref = np.empty((n_s, n_t, d_inner))
    for t in range(n_t):
        ref[:, t] = np.einsum("sdk,dk->sd", sx[:, :, t:t + d_conv].astype(np.float64), c.astype(np.float64))
    assert rel_err(y, ref) < 1e-6


def gated_delta_net_reference(q, k, v, g, beta, state):
    """Delta rule in float64. q, k [n_s, n_t, H_k, S]; v [n_s, n_t, H, S]; g, beta [n_s, n_t, H];
    state [n_s, H, S(v index j), S(k index i)] (ggml stores S[i][j] transposed). Returns o [n_s, n_t, H, S]
    and the final state in the same layout as `state`."""
    n_s, n_t, H, S = v.shape
    h_k = q.shape[2]
    o = np.empty((n_s, n_t, H, S))
    final = np.empty_like(state, dtype=np.float64)
    for s in range(n_s):
        for h in range(H):
            M = state[s, h].astype(np.float64).T  # M[i, j]
            for t in range(n_t):
                kk, qq = k[s, t, h % h_k].astype(np.float64), q[s, t, h % h_k].astype(np.float64)
                M = M * np.exp(g[s, t, h])
                delta = (v[s, t, h] - M.T @ kk) * beta[s, t, h]
                M = M + np.outer(kk, delta)
                o[s, t, h] = M.T @ qq / np.sqrt(S)
            final[s, h] = M.T
    return o, final


def test_gated_delta_net(backend, rng):
    n_s, n_t, H, h_k, S = 2, 5, 4, 2, 64
    q = rng.standard_normal((n_s, n_t, h_k, S)).astype(np.float32)
    k = rng.standard_normal((n_s, n_t, h_k, S))
    k = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(np.float32)  # the model L2-normalises k
    v = rng.standard_normal((n_s, n_t, H, S)).astype(np.float32)
    g = -rng.uniform(0.01, 1.0, (n_s, n_t, H)).astype(np.float32)  # log-decay, < 0
    beta = rng.uniform(0.1, 0.9, (n_s, n_t, H)).astype(np.float32)
    state = (rng.standard_normal((n_s, H, S, S)) * 0.1).astype(np.float32)

    def build(ctx, t):
        return ctx.gated_delta_net(t["q"], t["k"], t["v"], ctx.reshape_4d(t["g"], 1, H, n_t, n_s),
                                   ctx.reshape_4d(t["beta"], 1, H, n_t, n_s), t["state"], 1)

    out = run_graph(backend, build, {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state}).reshape(-1)
    o_ref, state_ref = gated_delta_net_reference(q, k, v, g, beta, state)
    n_o = o_ref.size
    assert rel_err(out[:n_o].reshape(o_ref.shape), o_ref) < 1e-5
    assert rel_err(out[n_o:].reshape(state_ref.shape), state_ref) < 1e-5


# --- cpy into strided rows -------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["ne0_one", "matrix", "transposed"])
def test_cpy_into_strided_rows(backend, rng, source):
    """ggml_cpy of a [w, n] block of values into n rows of a wider store, w columns in: each row gets its values and
    nothing else changes (copies are exact). The source as ne (1, w, n) (the replay verify's gate and beta), as a
    matrix, or as a transposed view. On CUDA the first and last took the transposed kernel, which writes its
    destination densely (vendor/patches/0003), so every row's values landed in the first rows."""
    w, n, row, col = 6, 9, 20, 5
    values = rng.standard_normal((n, w)).astype(np.float32)   # row s: the w values for store row s
    fill = np.float32(-7.0)
    store_ctx = ggml.Context(n_tensors=1)
    store = store_ctx.new_tensor(ggml.Type.F32, (row, n + 1), name="store")
    store_buf = backend.alloc_tensors(store_ctx)  # noqa: F841 (keeps the store's memory alive)
    store.set(np.full((n + 1, row), fill, np.float32))

    ctx = ggml.Context(n_tensors=8, graph_size=8)
    if source == "transposed":
        src = ctx.new_tensor(ggml.Type.F32, (n, w), name="src").mark_input()   # [w, n] values, stored transposed
        data = np.ascontiguousarray(values.T)
        view = ctx.transpose(src)
    else:
        ne = (1, w, n) if source == "ne0_one" else (w, n)
        src = ctx.new_tensor(ggml.Type.F32, ne, name="src").mark_input()
        data = values.reshape(ne[::-1])
        view = src
    out = ctx.cpy(view, ctx.view_2d(store, w, n, store.nb[1], col * 4))
    graph = ctx.graph(out)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    src.set(data)
    backend.compute(graph)

    want = np.full((n + 1, row), fill, np.float32)
    want[:n, col:col + w] = values
    assert np.array_equal(store.numpy(), want)
