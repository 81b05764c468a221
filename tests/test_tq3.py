"""TQ3_0, the 3.5-bit KV-cache type: format, round trip, cache writes/reads and flash attention.

Oracles are float64 numpy: the rotation matrix R (whose entries are exactly +-1/sqrt(128)), a decoder of the
documented bit layout (pydflash.tq3.dequantize) and a float64 attention. Every op test runs on the CPU and,
with `pytest -m cuda`, on CUDA.
"""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import ggml, tq3
from pydflash.ggml import Type

from conftest import attention_f64, rel_err, run_graph

D = tq3.LLOYD_MAX_MSE
# Norm preservation: each 32-value sub-block keeps its norm exactly before its scale is rounded to f16, so the
# relative norm error is at most f16's relative rounding error 2^-11, plus f32 arithmetic (< 1e-5 over 128).
NORM_BOUND = 2.0 ** -11 + 1e-5


def heavy_tailed_rows(rng, n_rows, n):
    """Rows like real K/V: Student-t(3) values, a few outlier channels 20x larger, row norms spread 100x."""
    x = rng.standard_t(3, size=(n_rows, n))
    x[:, rng.choice(n, size=4, replace=False)] *= 20.0
    return x * np.exp(rng.uniform(-2.3, 2.3, size=(n_rows, 1)))


def rotated(x):
    """R applied to every 128-group of the last axis, float64."""
    r = tq3.rotation_matrix()
    return (np.asarray(x, np.float64).reshape(-1, tq3.GROUP) @ r.T).reshape(np.shape(x))


def unrotated(y):
    r = tq3.rotation_matrix()
    return (np.asarray(y, np.float64).reshape(-1, tq3.GROUP) @ r).reshape(np.shape(y))


# --- format ------------------------------------------------------------------------------------------------

def test_bytes_per_value_is_3_5():
    assert ggml.row_size(Type.TQ3_0, 128) == 56
    assert ggml.row_size(Type.TQ3_0, 256) * 8 / 256 == 3.5 == tq3.BITS_PER_VALUE
    # 27B target: 16 attention layers x (K, V) x 4 KV heads x 256 values per token
    for n_ctx in (1, 4096, 131072, 262144):
        assert tq3.kv_cache_bytes(n_ctx, 16, 4, 256) * 8 == n_ctx * 16 * 2 * 4 * 256 * 3.5
    assert tq3.kv_cache_bytes(131072, 16, 4, 256, Type.F16) == 131072 * 16 * 2 * 4 * 256 * 2


def test_rows_not_multiple_of_128_are_refused():
    with pytest.raises(ValueError):
        ggml.row_size(Type.TQ3_0, 96)
    with pytest.raises(ValueError):
        ggml.Context(1).new_tensor(Type.TQ3_0, (64, 4))
    with pytest.raises(ValueError):
        tq3.rotate(np.zeros(192, np.float32))


def test_rotation_is_the_documented_orthogonal_transform(rng):
    r = tq3.rotation_matrix()
    assert np.array_equal(np.abs(r), np.full((128, 128), 1 / np.sqrt(128)))
    np.testing.assert_allclose(r @ r.T, np.eye(128), atol=1e-12)
    # D2 H D1 / sqrt(128): dividing out the Hadamard pattern leaves a rank-one sign matrix s2 s1^T
    h = np.array([[(-1) ** bin(i & j).count("1") for j in range(128)] for i in range(128)])
    signs = np.sign(r) * h
    assert np.array_equal(signs, np.outer(signs[:, 0], signs[0, :]) * signs[0, 0])
    x = rng.standard_normal((3, 256)).astype(np.float32)
    assert rel_err(tq3.rotate(x), rotated(x)) < 1e-6
    assert rel_err(tq3.rotate(tq3.rotate(x), inverse=True), x) < 1e-6


# --- round trip --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gaussian", "heavy_tailed"])
def test_round_trip_distortion_and_norm(rng, kind):
    n_rows = 2048
    x = rng.standard_normal((n_rows, 256)) if kind == "gaussian" else heavy_tailed_rows(rng, n_rows, 256)
    x = x.astype(np.float32)
    raw = ggml.quantize(Type.TQ3_0, x)
    assert raw.shape == (n_rows, 112)
    y_hat = tq3.dequantize(raw, 256)                 # rotated domain
    x_hat = unrotated(y_hat)                         # back in the input's domain
    # Per-group relative MSE, averaged over groups (rows differ in norm by up to 100x in the heavy case).
    # Bound: the rotated coordinates are ~N(0, |x|^2/128), quantised with the 3-bit Lloyd-Max codebook whose
    # distortion on N(0,1) is D = 0.034548; the per-sub-block RMS scale adapts to each block's sample
    # variance, which in expectation can only lower the error below D (measured about 0.031-0.032).
    g, g_hat = x.reshape(-1, 128).astype(np.float64), x_hat.reshape(-1, 128)
    rel_mse = np.mean(np.sum((g_hat - g) ** 2, axis=1) / np.sum(g ** 2, axis=1))
    print(f"{kind}: relative MSE {rel_mse:.5f} (Lloyd-Max D = {D:.5f})")
    assert 0.8 * D < rel_mse < D
    norm_err = np.abs(np.linalg.norm(g_hat, axis=1) / np.linalg.norm(g, axis=1) - 1)
    print(f"{kind}: max relative norm error {norm_err.max():.2e} (bound {NORM_BOUND:.2e})")
    assert norm_err.max() <= NORM_BOUND


def test_quantiser_picks_nearest_level_and_norm_scale(rng):
    x = heavy_tailed_rows(rng, 64, 256).astype(np.float32)
    raw = ggml.quantize(Type.TQ3_0, x)
    y = rotated(x).reshape(-1, 32)
    y_hat = tq3.dequantize(raw, 256).reshape(-1, 32)
    d = raw.reshape(-1, 14)[:, :2].copy().view(np.float16)[:, 0].astype(np.float64)
    idx = np.argmin(np.abs(y_hat[:, :, None] / d[:, None, None] - tq3.LEVELS), axis=2)
    u = y / np.sqrt(np.mean(y ** 2, axis=1, keepdims=True))
    nearest = np.argmin(np.abs(u[:, :, None] - tq3.LEVELS), axis=2)
    midpoints = (tq3.LEVELS[1:] + tq3.LEVELS[:-1]) / 2
    near_tie = np.min(np.abs(u[:, :, None] - midpoints), axis=2) < 1e-5  # f32 vs f64 may round either way
    assert np.all((idx == nearest) | near_tie)
    exact_scale = np.linalg.norm(y, axis=1) / np.linalg.norm(tq3.LEVELS[idx], axis=1)
    # d is the f16 rounding of |y_b| / |levels_b| (computed in f32): within f16's half-ulp, 2^-11 relative
    assert np.max(np.abs(d / exact_scale - 1)) <= 2.0 ** -11 + 1e-6


def test_zero_rows_stay_zero():
    raw = ggml.quantize(Type.TQ3_0, np.zeros((2, 128), np.float32))
    assert np.all(tq3.dequantize(raw, 128) == 0)


# --- cache writes and reads on a backend -------------------------------------------------------------------

def _write_cache(backend, values, rows, n_cache_rows, src_dtype=np.float32):
    """set_rows `values` [n, 256] into a TQ3_0 cache [256, n_cache_rows] at `rows`; returns the raw cache."""
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    cache = ctx.new_tensor(Type.TQ3_0, (256, n_cache_rows), name="cache")
    buf = backend.alloc_tensors(ctx)
    buf.clear(0)
    src = ctx.new_tensor(src_dtype, (256, len(rows)), name="src").mark_input()
    idx = ctx.new_tensor(np.int64, (len(rows),), name="idx").mark_input()
    out = ctx.set_rows(cache, src, idx)
    graph = ctx.graph(out)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    src.set(values.astype(src_dtype))
    idx.set(np.asarray(rows, np.int64))
    backend.compute(graph)
    return cache.numpy().reshape(n_cache_rows, -1), (ctx, buf, cache)


def test_set_rows_writes_the_quantiser_output(backend, rng):
    x = heavy_tailed_rows(rng, 40, 256).astype(np.float32)
    rows = rng.permutation(64)[:40]
    raw, _ = _write_cache(backend, x, rows, 64)
    expected = ggml.quantize(Type.TQ3_0, x)
    got = raw[rows]
    untouched = np.setdiff1d(np.arange(64), rows)
    assert np.all(raw[untouched] == 0)
    if backend.is_cpu:
        assert np.array_equal(got, expected)
    else:
        # another device may round a sum differently: allow rare index flips at level midpoints
        y_got, y_exp = tq3.dequantize(got, 256), tq3.dequantize(expected, 256)
        assert np.mean(np.abs(y_got - y_exp) > 1e-3 * np.abs(y_exp).max()) < 1e-3
        assert rel_err(y_got, y_exp) < 1e-2


def test_set_rows_from_f16(backend, rng):
    x = rng.standard_normal((8, 256)).astype(np.float16)
    raw, _ = _write_cache(backend, x, np.arange(8), 8, src_dtype=np.float16)
    expected = ggml.quantize(Type.TQ3_0, x.astype(np.float32))
    assert rel_err(tq3.dequantize(raw, 256), tq3.dequantize(expected, 256)) < 1e-2


def test_cpy_quantises(backend, rng):
    x = heavy_tailed_rows(rng, 12, 256).astype(np.float32)
    src_ctx = ggml.Context(n_tensors=4, graph_size=4)
    src = src_ctx.new_tensor(np.float32, (256, 12)).mark_input()
    out = src_ctx.new_tensor(Type.TQ3_0, (256, 12))
    node = src_ctx.cpy(src, out)
    graph = src_ctx.graph(node)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    src.set(x)
    backend.compute(graph)
    got = tq3.dequantize(node.numpy().reshape(12, -1), 256)
    expected = tq3.dequantize(ggml.quantize(Type.TQ3_0, x), 256)
    assert rel_err(got, expected) < (1e-7 if backend.is_cpu else 1e-2)


def test_get_rows_and_cpy_dequantise(backend, rng):
    # (cpy from a quantised type goes to f32 only: upstream's CPU dup has no quantised -> f16 path)
    x = rng.standard_normal((16, 256)).astype(np.float32)
    raw = ggml.quantize(Type.TQ3_0, x)
    ref = tq3.dequantize(raw, 256)
    rows = np.array([3, 0, 15, 7], np.int32)

    ctx = ggml.Context(n_tensors=8, graph_size=8)
    cache = ctx.new_tensor(Type.TQ3_0, (256, 16), name="cache")
    buf = backend.alloc_tensors(ctx)
    cache.set(raw)
    idx = ctx.new_tensor(np.int32, (4,), name="idx").mark_input()
    got_rows = ctx.get_rows(cache, idx)
    converted = ctx.cpy(cache, ctx.new_tensor(np.float32, (256, 16)))
    graph = ctx.graph([got_rows, converted])
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    idx.set(rows)
    backend.compute(graph)
    assert rel_err(got_rows.numpy(), ref[rows]) < 1e-6
    assert rel_err(converted.numpy(), ref) < 1e-6
    del buf


# --- attention ---------------------------------------------------------------------------------------------

def make_mask(rng, n_q, n_kv):
    """Causal over the last n_q positions plus random holes; every row keeps at least its own position."""
    mask = np.zeros((n_q, n_kv))
    for i in range(n_q):
        pos = n_kv - n_q + i
        mask[i, pos + 1:] = -np.inf
        holes = rng.random(pos) < 0.3
        mask[i, :pos][holes] = -np.inf
    return mask


def attention_inputs(rng, h, hkv, n_q, n_kv, dim):
    """Random Q [1, h, n_q, dim] and K, V [1, hkv, n_kv, dim], a mask (make_mask) and the softmax scale."""
    q = rng.standard_normal((1, h, n_q, dim))
    k = rng.standard_normal((1, hkv, n_kv, dim))
    v = rng.standard_normal((1, hkv, n_kv, dim))
    return q, k, v, make_mask(rng, n_q, n_kv), 1 / np.sqrt(dim)


def _tq3_attention(backend, q, k, v, mask, scale, kv_type=Type.TQ3_0, softcap=0.0):
    """Write k/v through set_rows into caches of kv_type, attend with tq3.flash_attn; returns the output and the
    raw caches."""
    n_seq, h, n_q, dk = q.shape
    _, hkv, n_kv, dv = v.shape
    rot = tq3.Rotation(backend)
    cctx = ggml.Context(n_tensors=2)
    k_cache = cctx.new_tensor(kv_type, (dk, n_kv * hkv), name="k_cache")
    v_cache = cctx.new_tensor(kv_type, (dv, n_kv * hkv), name="v_cache")
    cbuf = backend.alloc_tensors(cctx)

    inputs = {"k": k.transpose(0, 2, 1, 3).reshape(-1, dk).astype(np.float32),  # rows ordered (token, head)
              "v": v.transpose(0, 2, 1, 3).reshape(-1, dv).astype(np.float32),
              "idx": np.arange(n_kv * hkv, dtype=np.int64),
              "q": q.astype(np.float32), "mask": mask.astype(np.float16)}

    def build(ctx, t):
        wk = ctx.set_rows(k_cache, t["k"], t["idx"])
        wv = ctx.set_rows(v_cache, t["v"], t["idx"])
        kview = ctx.view_3d(wk, dk, hkv, n_kv, k_cache.nb[1], k_cache.nb[1] * hkv, 0)
        vview = ctx.view_3d(wv, dv, hkv, n_kv, v_cache.nb[1], v_cache.nb[1] * hkv, 0)
        kk = ctx.permute(kview, 0, 2, 1, 3)  # [D, n_kv, Hkv]
        vv = ctx.permute(vview, 0, 2, 1, 3)
        return tq3.flash_attn(ctx, rot, t["q"], kk, vv, t["mask"], scale, 0.0, softcap)

    assert n_seq == 1
    inputs["q"] = inputs["q"][0]
    out = run_graph(backend, build, inputs, n_nodes=64)
    raw_k, raw_v = k_cache.numpy().reshape(n_kv * hkv, -1), v_cache.numpy().reshape(n_kv * hkv, -1)
    del cbuf
    rot.close()
    return out, raw_k, raw_v


# On CUDA (Ampere and newer), up to 256 query rows per KV head (n_q x 4 here) take the TQ3_0 tensor-core kernel
# (ggml_ext/cuda/tq3_0_fattn.cu), more the f16 path.
@pytest.mark.parametrize("n_q,n_kv", [(1, 256), (1, 2048), (3, 512), (8, 1024), (16, 512)])
def test_flash_attention_tq3(backend, rng, n_q, n_kv):
    h, hkv, dim = 8, 2, 256
    q, k, v, mask, scale = attention_inputs(rng, h, hkv, n_q, n_kv, dim)
    out, raw_k, raw_v = _tq3_attention(backend, q, k, v, mask, scale)
    out = out.reshape(n_q, h, dim)

    # 1. exactness: float64 attention over exactly the values the cache holds (un-rotated back)
    k_hat = unrotated(tq3.dequantize(raw_k, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    v_hat = unrotated(tq3.dequantize(raw_v, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    ref_cache = attention_f64(q, k_hat, v_hat, mask, scale)[0]
    # CPU: f32 dot products and accumulators, ~1e-6. CUDA: Q, K, V and the softmax weights are read as f16
    # (2^-11 relative rounding each; f32 accumulation), giving ~1e-3.
    bound = 2e-5 if backend.is_cpu else 5e-3
    err_cache = rel_err(out, ref_cache)
    # 2. quality: against attention over the original float K/V. V's distortion gives an output error of about
    # sqrt(D) (zero-mean independent V: the noise averages over the keys like the signal does). K's distortion
    # adds N(0, D |q|^2 scale^2) = N(0, D) to each logit here, perturbing the weights by a relative sqrt(D) as
    # well: about sqrt(2 D) = 0.263 in all, asserted with 10% for sampling.
    err_float = rel_err(out, attention_f64(q, k, v, mask, scale)[0])
    print(f"n_q={n_q} n_kv={n_kv}: vs dequantised cache {err_cache:.2e}, vs float K/V {err_float:.3f}")
    assert err_cache < bound
    assert err_float < 1.1 * np.sqrt(2 * D)


# Shapes of the CUDA kernel's cases: 27B decode (6 rows per KV head: one warp per 16 rows), a 23-token tree
# verify (138 rows: 4 warps share each dequantised tile), 24 rows (2 warps), head size 128, lengths that are no
# multiple of the 16-key tile, one key, a long masked stretch (whole key slices with no visible key, so the
# merge sees empty partials), and 258 rows (past the kernel: upstream's f16 path).
@pytest.mark.parametrize("dim,h,hkv,n_q,n_kv,hole", [
    (256, 24, 4, 1, 4099, False),
    (256, 24, 4, 1, 4099, True),
    (256, 24, 4, 23, 2053, False),
    (256, 24, 4, 23, 3001, True),
    (256, 24, 4, 4, 37, False),
    (128, 16, 2, 1, 1, False),
    (128, 16, 2, 1, 17, False),
    (128, 16, 2, 23, 300, False),
    (256, 24, 4, 43, 700, False),
])
def test_flash_attention_tq3_kernel_shapes(backend, rng, dim, h, hkv, n_q, n_kv, hole):
    q, k, v, mask, scale = attention_inputs(rng, h, hkv, n_q, n_kv, dim)
    if hole:
        mask[:, 16:n_kv - 64] = -np.inf  # every row keeps keys 0..15 and the last 64 (its own among them)
    out, raw_k, raw_v = _tq3_attention(backend, q, k, v, mask, scale)
    k_hat = unrotated(tq3.dequantize(raw_k, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    v_hat = unrotated(tq3.dequantize(raw_v, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    ref = attention_f64(q, k_hat, v_hat, mask, scale)[0]
    # bounds as test_flash_attention_tq3: f32 on the CPU; f16 Q, K, V and weights on CUDA
    err = rel_err(out.reshape(n_q, h, dim), ref)
    print(f"dim={dim} h={h} hkv={hkv} n_q={n_q} n_kv={n_kv} hole={hole}: vs dequantised cache {err:.2e}")
    assert err < (2e-5 if backend.is_cpu else 5e-3)
    # every row individually (a wrong row would hide in the norm of the others)
    row_err = np.linalg.norm(out.reshape(n_q, h, dim) - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert row_err.max() < (1e-4 if backend.is_cpu else 2e-2)


def test_flash_attention_tq3_softcap(backend, rng):
    h, hkv, dim, n_q, n_kv, softcap = 8, 2, 256, 2, 512, 5.0
    q = 3 * rng.standard_normal((1, h, n_q, dim))  # large logits, so the cap matters
    k = rng.standard_normal((1, hkv, n_kv, dim))
    v = rng.standard_normal((1, hkv, n_kv, dim))
    mask = make_mask(rng, n_q, n_kv)
    scale = 1 / np.sqrt(dim)
    out, raw_k, raw_v = _tq3_attention(backend, q, k, v, mask, scale, softcap=softcap)
    k_hat = unrotated(tq3.dequantize(raw_k, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    v_hat = unrotated(tq3.dequantize(raw_v, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    ref = attention_f64(q, k_hat, v_hat, mask, scale, softcap)[0]
    # same bounds as test_flash_attention_tq3 (f32 on the CPU; f16 tiles possible on CUDA)
    assert rel_err(out.reshape(n_q, h, dim), ref) < (2e-5 if backend.is_cpu else 5e-3)


def test_rotation_helper_in_graph(backend, rng):
    x = rng.standard_normal((3, 5, 256)).astype(np.float32)
    rot = tq3.Rotation(backend)
    got_r, got_back = run_graph(backend, lambda ctx, t: [rot.rotate(ctx, t["x"]),
                                                         rot.unrotate(ctx, rot.rotate(ctx, t["x"]))], {"x": x})
    # the rotation is a mul_mat: f32 on the CPU, TF32 tensor cores on CUDA (2^-11 relative inputs; 2.3e-4 measured)
    bound = 1e-6 if backend.is_cpu else 2e-3
    assert rel_err(got_r, rotated(x)) < bound
    assert rel_err(got_back, x) < bound
    rot.close()


def test_fold_unrotation_into_output_projection(rng):
    w_o = rng.standard_normal((64, 512))
    o = rng.standard_normal(512)
    np.testing.assert_allclose(tq3.fold_into_output_proj(w_o) @ rotated(o), w_o @ o, rtol=1e-10, atol=1e-10)


@pytest.mark.cuda
@pytest.mark.parametrize("copy_mib", ["0", None])   # "0": the TQ3_0 kernel at any size; None: upstream's f16 path
@pytest.mark.parametrize("n_q,n_kv", [(48, 700), (512, 1031)])
def test_cuda_attention_prefill_sizes(monkeypatch, rng, copy_mib, n_q, n_kv):
    """A prefill micro-batch of the 27B attention shape: 288 and 3,072 query rows per KV head. Past 256 rows
    upstream's kernels take TQ3_0 through an f16 copy of K and V, except over a long cache, where the tensor-core
    TQ3_0 kernel takes every row tile by tile (PYDFLASH_TQ3_FA_COPY_MIB=0 makes any cache long); both against the
    float64 reference over the dequantised cache, with test_flash_attention_tq3_kernel_shapes' CUDA bounds."""
    if copy_mib is not None:
        monkeypatch.setenv("PYDFLASH_TQ3_FA_COPY_MIB", copy_mib)
    h, hkv, dim = 24, 4, 256
    q, k, v, mask, scale = attention_inputs(rng, h, hkv, n_q, n_kv, dim)
    out, raw_k, raw_v = _tq3_attention(ggml.Backend("cuda"), q, k, v, mask, scale)
    k_hat = unrotated(tq3.dequantize(raw_k, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    v_hat = unrotated(tq3.dequantize(raw_v, dim)).reshape(n_kv, hkv, dim).transpose(1, 0, 2)[None]
    ref = attention_f64(q, k_hat, v_hat, mask, scale)[0]
    got = out.reshape(n_q, h, dim)
    assert rel_err(got, ref) < 5e-3
    row_err = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    assert row_err.max() < 2e-2


@pytest.mark.cuda
@pytest.mark.parametrize("n_q,n_kv", [(1, 4096), (2, 1024), (12, 512), (23, 4096)])
def test_cuda_attention_matches_cpu(rng, n_q, n_kv):
    """The 27B attention shape (24 Q heads, 4 KV heads, head 256): all take the CUDA TQ3_0 kernel (6 to 138 query
    rows per KV head; 23 tokens is a tree verify). Bound: the CPU computes in f32 throughout; the kernel rounds
    Q, K, V and the softmax weights to f16 (2^-11 relative each) and accumulates in f32."""
    cuda, cpu = ggml.Backend("cuda"), ggml.Backend("cpu")
    h, hkv, dim = 24, 4, 256
    q, k, v, mask, scale = attention_inputs(rng, h, hkv, n_q, n_kv, dim)
    out_cpu, raw_k_cpu, _ = _tq3_attention(cpu, q, k, v, mask, scale)
    out_gpu, raw_k_gpu, _ = _tq3_attention(cuda, q, k, v, mask, scale)
    # the two quantisers sum in different orders: a scale may round to the neighbouring f16 (2^-10 relative)
    # and a value right at a level midpoint may flip; anything larger is a real difference
    k_cpu, k_gpu = tq3.dequantize(raw_k_cpu, dim), tq3.dequantize(raw_k_gpu, dim)
    flips = np.mean(np.abs(k_cpu - k_gpu) > 2e-3 * np.abs(k_cpu).max())
    err = rel_err(out_gpu, out_cpu)
    print(f"n_q={n_q} n_kv={n_kv}: CUDA vs CPU attention {err:.2e}; K values that differ {flips:.1e}")
    assert flips < 1e-3
    # plus the Q rotation before the kernel, a TF32 mul_mat on CUDA (2^-11 relative; 4e-4 measured on an H100)
    assert err < 5e-3
