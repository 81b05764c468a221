"""ggml_qmatmul (our quantised W * X for 1..48 columns) against float64 numpy on the weights as gguf-py decodes
them, on the CPU and (with `-m cuda`) on CUDA, where every column must also come out bit-identical whatever the
number of columns around it and whatever number of row tiles the kernel runs; likewise ggml_qmatmul_rms_norm
(the product of RMS-normed columns) against float64 numpy on the normed columns, and ggml_qmatmul_fused's added
tensor and gated columns against ggml's own add after the product and swiglu before it, bit for bit.

Bounds: the CPU kernel dequantises to f32 and sums in float (far below 1e-5 relative error). CUDA quantises
each column of x to 8 bits per 32 values first, as ggml's own vector kernel does; the reference applies the same
rounding (gguf-py's Q8_0 quantiser: scale amax/127, round to nearest), which leaves the f16 rounding of the
per-block scales and sums the kernel uses (2^-11 relative) and rare rounding ties: bound 1e-3, and 5x below the
activation rounding itself, which the test checks so that a kernel skipping x entirely could not pass.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from conftest import rel_err
from pydflash import ggml

TYPES = [ggml.Type.Q4_K, ggml.Type.Q5_K, ggml.Type.Q6_K, ggml.Type.Q8_0]
COLS = [1, 2, 3, 8, 16, 23, 24, 33, 48]
# K: 5 super-blocks (not a multiple of the 8 blocks a CUDA block takes per step); M odd
SHAPES = {ggml.Type.Q8_0: (800, 45), ggml.Type.Q4_K: (1280, 45), ggml.Type.Q5_K: (1280, 37),
          ggml.Type.Q6_K: (1280, 41)}
# For the row-tile cases: more 256-value units of K than the 8 warps of a CUDA block (so warps take several, the
# Q8_0 row ending in a 3-block unit), an odd number of Q6_K super-blocks (rows alternate 4- and 2-byte
# alignment), and M spanning several CUDA blocks at every row-tile count, the last one partial.
SHAPES_TALL = {ggml.Type.Q8_0: (2656, 301), ggml.Type.Q4_K: (2816, 301), ggml.Type.Q5_K: (2816, 269),
               ggml.Type.Q6_K: (2816, 285)}
ROW_TILES = [1, 2, 4, -1, -2]  # negative: the staged kernel (qmatmul_staged.cuh) where the GPU and type have it
EPS = 1e-6                     # of ggml_qmatmul_rms_norm's norm


def rms_normed(x: np.ndarray, norm: np.ndarray) -> np.ndarray:
    """float64 x / sqrt(mean(x^2) + EPS) * norm, per row of x [N, K]."""
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + EPS) * norm.astype(np.float64)


def as_q8(x: np.ndarray) -> np.ndarray:
    """x rounded as the CUDA kernel rounds activations (8-bit values, one scale per 32)."""
    q = gguf_quantize(x.astype(np.float32), GGMLQuantizationType.Q8_0)
    return dequantize(q, GGMLQuantizationType.Q8_0).astype(np.float64)


class QMatmul:
    """One weight matrix on a backend; `run(x)` computes qmatmul(w, x) for x [N, K] (numpy order), `run_mul_mat(x)`
    ggml's mul_mat(w, x)."""

    def __init__(self, backend: ggml.Backend, wtype: ggml.Type, w_data: np.ndarray, K: int, M: int):
        self.backend, self.wtype, self.w_data, self.K, self.M = backend, wtype, w_data, K, M

    def run(self, x: np.ndarray, row_tiles: int = 0, norm: np.ndarray | None = None) -> np.ndarray:
        """norm: qmatmul of the RMS-normed columns times norm (ggml_qmatmul_rms_norm, eps EPS)."""
        if norm is None:
            return self._compute(x, lambda ctx, w, xt, g: ggml.qmatmul(ctx, w, xt, row_tiles=row_tiles))
        return self._compute(x, lambda ctx, w, xt, g: ggml.qmatmul(ctx, w, xt, row_tiles, norm=g, eps=EPS), norm)

    def run_mul_mat(self, x: np.ndarray) -> np.ndarray:
        """On CUDA: ggml's vector kernel up to 8 columns, its MMQ tiles above."""
        return self._compute(x, lambda ctx, w, xt, g: ctx.mul_mat(w, xt))

    def run_normed_by_ggml(self, x: np.ndarray, norm: np.ndarray) -> np.ndarray:
        """qmatmul of ggml's own rms_norm and mul of the columns."""
        return self._compute(x, lambda ctx, w, xt, g: ggml.qmatmul(ctx, w, ctx.mul(ctx.rms_norm(xt, EPS), g)), norm)

    def run_add(self, x: np.ndarray, r: np.ndarray, row_tiles: int = 0, separate: bool = False,
                pad: int = 0) -> np.ndarray:
        """qmatmul(w, x) + r for r [N, M] (numpy order), r a view of a tensor of M + pad rows (columns M + pad floats
        apart): added inside the product (ggml_qmatmul_fused), or by ggml's add after it (separate)."""
        n = x.shape[0]
        ctx = ggml.Context(n_tensors=8, graph_size=8)
        w = ctx.new_tensor(self.wtype, (self.K, self.M), name="w").mark_input()
        xt = ctx.new_tensor(np.float32, (self.K, n), name="x").mark_input()
        rt = ctx.new_tensor(np.float32, (self.M + pad, n), name="r").mark_input()
        rv = ctx.view_2d(rt, self.M, n, rt.nb[1], 0)
        if separate:
            out = ctx.add(ggml.qmatmul(ctx, w, xt, row_tiles), rv)
        else:
            out = ggml.qmatmul(ctx, w, xt, row_tiles, add=rv)
        graph = ctx.graph(out)
        ggml.Allocator(self.backend).allocate(graph)
        w.set(self.w_data)
        xt.set(np.ascontiguousarray(x, dtype=np.float32))
        rt.set(np.ascontiguousarray(np.pad(r, ((0, 0), (0, pad))), dtype=np.float32))
        self.backend.compute(graph)
        return graph.outputs[0].numpy().reshape(n, self.M)

    def run_gated(self, x: np.ndarray, u: np.ndarray, row_tiles: int = 0, separate: bool = False,
                  norm: np.ndarray | None = None, act: str = "silu") -> np.ndarray:
        """qmatmul(w, silu(x) * u) for x, u [N, K] (numpy order), both views of one [N, 2K] tensor as a fused
        gate/up product's halves: gated inside the product (ggml_qmatmul_fused's up), or by ggml's swiglu_split
        before it (separate). norm [G]: u RMS-normed in groups of G values first (inside the product, or by ggml's
        rms_norm and mul). act="sigmoid": sigmoid(x) * u (ggml_qmatmul_sigmoid_gated, or ggml's sigmoid and mul)."""
        n = x.shape[0]
        ctx = ggml.Context(n_tensors=16, graph_size=16)
        w = ctx.new_tensor(self.wtype, (self.K, self.M), name="w").mark_input()
        gu = ctx.new_tensor(np.float32, (2 * self.K, n), name="gate_up").mark_input()
        g = ctx.new_tensor(np.float32, (norm.size if norm is not None else 1,), name="norm").mark_input()
        gate = ctx.view_2d(gu, self.K, n, gu.nb[1], 0)
        up = ctx.view_2d(gu, self.K, n, gu.nb[1], self.K * 4)
        if separate:
            if norm is not None:
                heads = ctx.reshape_3d(ctx.cont(up), norm.size, self.K // norm.size, n)
                up = ctx.reshape_2d(ctx.mul(ctx.rms_norm(heads, EPS), g), self.K, n)
            if act == "sigmoid":   # (up first: the sigmoid and the mul neighbours, which ggml-cuda fuses)
                gated = ctx.mul(up, ctx.sigmoid(gate if self.backend.is_cpu else ctx.cont(gate)))
            else:
                gated = ctx.swiglu_split(gate, up)
            out = ggml.qmatmul(ctx, w, gated, row_tiles)
        else:
            out = ggml.qmatmul(ctx, w, gate, row_tiles, up=up, norm=g if norm is not None else None, eps=EPS,
                               gate=act)
        graph = ctx.graph(out)
        ggml.Allocator(self.backend).allocate(graph)
        w.set(self.w_data)
        gu.set(np.ascontiguousarray(np.concatenate([x, u], axis=1), dtype=np.float32))
        if norm is not None:
            g.set(norm)
        self.backend.compute(graph)
        return graph.outputs[0].numpy().reshape(n, self.M)

    def _compute(self, x: np.ndarray, product, norm: np.ndarray | None = None) -> np.ndarray:
        ctx = ggml.Context(n_tensors=8, graph_size=8)
        w = ctx.new_tensor(self.wtype, (self.K, self.M), name="w").mark_input()
        xt = ctx.new_tensor(np.float32, (self.K, x.shape[0]), name="x").mark_input()
        g = ctx.new_tensor(np.float32, (self.K,), name="norm").mark_input()
        graph = ctx.graph(product(ctx, w, xt, g))
        ggml.Allocator(self.backend).allocate(graph)
        w.set(self.w_data)
        xt.set(np.ascontiguousarray(x, dtype=np.float32))
        if g.is_allocated:   # (a graph that does not read it leaves it unallocated)
            g.set(np.ascontiguousarray(norm if norm is not None else np.zeros(self.K), dtype=np.float32))
        self.backend.compute(graph)
        return graph.outputs[0].numpy().reshape(x.shape[0], self.M)  # numpy() drops a trailing 1


def make(backend, rng, wtype, shapes=SHAPES, row_scale=None):
    K, M = shapes[wtype]
    w = rng.standard_normal((M, K)).astype(np.float32)
    if row_scale is not None:
        w *= row_scale[:, None]
    w_data = ggml.quantize(wtype, w)  # ggml's quantiser; the reference decodes with gguf-py's own code
    w_ref = dequantize(w_data, GGMLQuantizationType(int(wtype))).astype(np.float64)
    assert w_ref.shape == (M, K)
    return QMatmul(backend, wtype, w_data, K, M), w_ref


@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_matches_dequantised_reference(backend, rng, wtype):
    op, w_ref = make(backend, rng, wtype)
    for n in COLS:
        x = rng.standard_normal((n, op.K)).astype(np.float32)
        got = op.run(x)
        assert got.shape == (n, op.M)
        exact = x.astype(np.float64) @ w_ref.T
        if backend.is_cpu:
            err = rel_err(got, exact)
            assert err < 1e-5, f"{wtype.name} N={n}: relative error {err:.2e}"
        else:
            err = rel_err(got, as_q8(x) @ w_ref.T)
            assert err < 1e-3, f"{wtype.name} N={n}: relative error {err:.2e} against q8-rounded x"
            assert rel_err(got, exact) > 5 * err, f"{wtype.name} N={n}: x was not rounded as documented"


@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_rms_norm_matches_normed_reference(backend, rng, wtype):
    """ggml_qmatmul_rms_norm against float64 numpy on the normed columns (columns of very different sizes, as a
    residual stream's are); on the CPU also bit for bit the qmatmul of ggml's own rms_norm and mul."""
    op, w_ref = make(backend, rng, wtype)
    norm = rng.uniform(0.5, 1.5, op.K).astype(np.float32)
    for n in (1, 3, 16, 23, 48):
        x = (rng.standard_normal((n, op.K)) * rng.uniform(0.01, 20.0, (n, 1))).astype(np.float32)
        got = op.run(x, norm=norm)
        xn = rms_normed(x, norm)
        if backend.is_cpu:
            err = rel_err(got, xn @ w_ref.T)
            assert err < 1e-5, f"{wtype.name} N={n}: relative error {err:.2e}"
            assert np.array_equal(got, op.run_normed_by_ggml(x, norm)), f"{wtype.name} N={n}: not ggml's norm"
        else:
            err = rel_err(got, as_q8(xn) @ w_ref.T)
            assert err < 1e-3, f"{wtype.name} N={n}: relative error {err:.2e} against q8-rounded normed x"
            assert rel_err(got, xn @ w_ref.T) > 5 * err, f"{wtype.name} N={n}: x was not rounded as documented"


@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_add_is_the_product_then_ggml_add(backend, rng, wtype):
    """ggml_qmatmul_fused's added tensor (a residual: strided columns, values far larger than the product's, so
    that the rounding of the sum shows) gives the bits of ggml's add after the product, at every column count the
    kernels split differently (the streaming kernel at one column, the staged and tensor-core kernels above), and
    on CUDA at every row-tile count; the sum also matches float64."""
    op, w_ref = make(backend, rng, wtype, SHAPES_TALL)
    tiles = [0] if backend.is_cpu else [0] + ROW_TILES
    for n in (1, 3, 16, 23, 48):
        x = rng.standard_normal((n, op.K)).astype(np.float32)
        r = (rng.standard_normal((n, op.M)) * 300.0).astype(np.float32)
        for rt in tiles:
            fused = op.run_add(x, r, row_tiles=rt, pad=5)
            separate = op.run_add(x, r, row_tiles=rt, separate=True)
            assert np.array_equal(fused, separate), f"{wtype.name} N={n} row_tiles={rt}: not the bits of ggml's add"
        # (CUDA rounds x to 8 bits per 32 values first: the bounds of the product's tests)
        exact = (x.astype(np.float64) if backend.is_cpu else as_q8(x)) @ w_ref.T + r
        err = rel_err(fused, exact)
        assert err < (1e-5 if backend.is_cpu else 1e-3), f"{wtype.name} N={n}: relative error {err:.2e} of the sum"


@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_gated_is_ggml_swiglu_then_the_product(backend, rng, wtype):
    """ggml_qmatmul_fused's up: the columns silu(gate) * up, gated as they are quantised, give the bits of ggml's
    swiglu_split followed by the product, at every column count (and on CUDA every row-tile count); and the
    product of the gated columns matches float64."""
    op, w_ref = make(backend, rng, wtype, SHAPES_TALL)
    tiles = [0] if backend.is_cpu else [0] + ROW_TILES
    for n in (1, 3, 16, 23, 48):
        x = (rng.standard_normal((n, op.K)) * 3.0).astype(np.float32)
        u = rng.standard_normal((n, op.K)).astype(np.float32)
        for rt in tiles:
            fused = op.run_gated(x, u, row_tiles=rt)
            separate = op.run_gated(x, u, row_tiles=rt, separate=True)
            assert np.array_equal(fused, separate), f"{wtype.name} N={n} row_tiles={rt}: not the bits of ggml's swiglu"
        xd = x.astype(np.float64)
        gated = xd / (1.0 + np.exp(-xd)) * u
        err = rel_err(fused, (gated if backend.is_cpu else as_q8(gated.astype(np.float32))) @ w_ref.T)
        assert err < (1e-5 if backend.is_cpu else 1e-3), f"{wtype.name} N={n}: relative error {err:.2e}"


@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_sigmoid_gated_is_ggml_sigmoid_and_mul_then_the_product(backend, rng, wtype):
    """ggml_qmatmul_sigmoid_gated: the columns sigmoid(gate) * up (an attention's output gate), gated as they are
    quantised, give the bits of ggml's sigmoid and mul followed by the product at every column count (and on CUDA
    every row-tile count, and through the f16 kernel where it runs), and the product matches float64."""
    op, w_ref = make(backend, rng, wtype, SHAPES_TALL)
    tiles = [0] if backend.is_cpu else [0] + ROW_TILES
    if not backend.is_cpu and wtype in (ggml.Type.Q4_K, ggml.Type.Q6_K) and ggml.qmatmul_streams(backend._dev):
        tiles.append(ggml.QMATMUL_F16)
    for n in (1, 3, 16, 23, 48):
        x = (rng.standard_normal((n, op.K)) * 3.0).astype(np.float32)
        u = rng.standard_normal((n, op.K)).astype(np.float32)
        for rt in tiles:
            fused = op.run_gated(x, u, row_tiles=rt, act="sigmoid")
            separate = op.run_gated(x, u, row_tiles=rt, separate=True, act="sigmoid")
            assert np.array_equal(fused, separate), f"{wtype.name} N={n} row_tiles={rt}: not ggml's sigmoid and mul"
        xd = x.astype(np.float64)
        gated = u / (1.0 + np.exp(-xd))
        fused = op.run_gated(x, u, act="sigmoid")
        err = rel_err(fused, (gated if backend.is_cpu else as_q8(gated.astype(np.float32))) @ w_ref.T)
        assert err < (1e-5 if backend.is_cpu else 1e-3), f"{wtype.name} N={n}: relative error {err:.2e}"
    with pytest.raises(ValueError, match="sigmoid"):
        op.run_gated(x, u, norm=np.ones(32, np.float32), act="sigmoid")


@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_gated_with_a_group_norm(backend, rng, wtype):
    """ggml_qmatmul_fused's up with a norm: up RMS-normed in groups of G values (a per-head norm), then gated. On the
    CPU the bits of ggml's rms_norm and mul over [G, K/G, N], swiglu_split and the product; on CUDA (a warp's own
    sum of the group's squares) column j is the same alone or among N at every row-tile count, and near float64."""
    op, w_ref = make(backend, rng, wtype, SHAPES_TALL)
    G = 128 if op.K % 128 == 0 else 32
    norm = rng.uniform(0.5, 1.5, G).astype(np.float32)
    tiles = [0] if backend.is_cpu else [0] + ROW_TILES
    x = (rng.standard_normal((48, op.K)) * 3.0).astype(np.float32)
    u = (rng.standard_normal((48, op.K)) * rng.uniform(0.1, 10.0, (48, op.K // G)).repeat(G, axis=1)).astype(np.float32)
    alone = {rt: op.run_gated(x[:1], u[:1], row_tiles=rt, norm=norm) for rt in tiles}
    for n in (1, 3, 16, 23, 48):
        for rt in tiles:
            fused = op.run_gated(x[:n], u[:n], row_tiles=rt, norm=norm)
            if backend.is_cpu:
                separate = op.run_gated(x[:n], u[:n], row_tiles=rt, separate=True, norm=norm)
                assert np.array_equal(fused, separate), f"{wtype.name} N={n}: not the bits of ggml's norm and swiglu"
            else:
                assert np.array_equal(fused[:1], alone[rt]), f"{wtype.name} N={n} row_tiles={rt}: column 0 moved"
        ud = u[:n].astype(np.float64).reshape(n, -1, G)
        normed = (ud / np.sqrt((ud ** 2).mean(axis=2, keepdims=True) + EPS) * norm).reshape(n, op.K)
        xd = x[:n].astype(np.float64)
        gated = xd / (1.0 + np.exp(-xd)) * normed
        err = rel_err(fused, (gated if backend.is_cpu else as_q8(gated.astype(np.float32))) @ w_ref.T)
        assert err < (1e-5 if backend.is_cpu else 1e-3), f"{wtype.name} N={n}: relative error {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "rms_norm"])
@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_column_bit_identical_alone_or_among_n(rng, wtype, normed):
    backend = ggml.Backend("cuda")
    op, _ = make(backend, rng, wtype)
    x = rng.standard_normal((48, op.K)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, op.K).astype(np.float32) if normed else None
    full = op.run(x, norm=norm)
    for n in range(1, 48):
        first_n = op.run(x[:n], norm=norm)
        assert np.array_equal(first_n, full[:n]), f"{wtype.name}: the first {n} of 48 columns differ when N={n}"
    for j in (0, 7, 8, 22, 23, 47):
        alone = op.run(x[j:j + 1], norm=norm)
        assert np.array_equal(alone[0], full[j]), f"{wtype.name}: column {j} alone differs from it among 48"


@pytest.mark.cuda
@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_row_tiles_change_no_bit(rng, wtype):
    """Every forced row-tile count, with the activations staged or not, gives the bits of the kernel's own
    choice, at every column-tile count, on a shape where each count has several CUDA blocks; the results also
    match the float64 reference."""
    backend = ggml.Backend("cuda")
    op, w_ref = make(backend, rng, wtype, SHAPES_TALL)
    x = rng.standard_normal((48, op.K)).astype(np.float32)
    auto = op.run(x)
    err = rel_err(auto, as_q8(x) @ w_ref.T)
    assert err < 1e-3, f"{wtype.name} M={op.M} K={op.K}: relative error {err:.2e} against q8-rounded x"
    for rt in ROW_TILES:
        assert np.array_equal(op.run(x, row_tiles=rt), auto), f"{wtype.name}: row_tiles={rt} changed the result"
        for n in (1, 9, 16, 23, 33):
            got = op.run(x[:n], row_tiles=rt)
            assert np.array_equal(got, auto[:n]), f"{wtype.name}: row_tiles={rt}, N={n} changed the result"
    # the normed product's activations go through the staged layout too
    norm = rng.uniform(0.5, 1.5, op.K).astype(np.float32)
    normed = op.run(x, norm=norm)
    for rt in ROW_TILES:
        for n in (1, 16, 23, 48):
            got = op.run(x[:n], row_tiles=rt, norm=norm)
            assert np.array_equal(got, normed[:n]), f"{wtype.name}: normed, row_tiles={rt}, N={n} changed the result"


STREAM_TYPES = list(ggml.QMATMUL_STREAM_TYPES)


@pytest.mark.cuda
@pytest.mark.parametrize("wtype", STREAM_TYPES, ids=[t.name for t in STREAM_TYPES])
def test_one_column_streaming_kernel_gives_the_mma_bits(rng, wtype):
    """One column at the kernel's own choice (the streaming kernel, qmatmul_stream.cuh) equals the tensor-core
    kernel forced to one row tile, bit for bit: with many more 4-row groups than the GPU holds warps at once (40,001
    rows of one unit: each warp streams several groups through its ring of stage buffers), rows ending mid-chunk
    (11 units: chunks of 8 and 3), a one-unit K (slots 1-7 idle), odd row counts (a last group of one row); and it
    matches the float64 reference."""
    backend = ggml.Backend("cuda")
    if not ggml.qmatmul_streams(backend._dev):
        pytest.skip(f"{backend.name} has no streaming one-column kernel (Hopper and later)")
    for K, M in ((2816, 7001), (256, 40001)):
        op, w_ref = make(backend, rng, wtype, {wtype: (K, M)})
        x = rng.standard_normal((1, K)).astype(np.float32)
        streamed = op.run(x)
        assert np.array_equal(streamed, op.run(x, row_tiles=1)), f"{wtype.name} K={K} M={M}: bits differ"
        err = rel_err(streamed, as_q8(x) @ w_ref.T)
        assert err < 1e-3, f"{wtype.name} K={K} M={M}: relative error {err:.2e} against q8-rounded x"


def q4_k_f16_parts(w_data: np.ndarray, K: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K weights as the f16 kernel rounds them (qmatmul_half.cuh): w [M, K] = round_f16(round_f16(d * sc) * q)
    and the minima dm [M, K / 32] = round_f16(dmin * m) (float64 arrays)."""
    blocks = np.frombuffer(np.ascontiguousarray(w_data).tobytes(), dtype=np.uint8).reshape(M * K // 256, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc_bytes, qs = blocks[:, 4:16].astype(np.int32), blocks[:, 16:]
    sc = np.empty((len(blocks), 8), np.int32)
    mn = np.empty((len(blocks), 8), np.int32)
    sc[:, :4], mn[:, :4] = sc_bytes[:, 0:4] & 63, sc_bytes[:, 4:8] & 63
    sc[:, 4:] = (sc_bytes[:, 8:12] & 15) | ((sc_bytes[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (sc_bytes[:, 8:12] >> 4) | ((sc_bytes[:, 4:8] >> 6) << 4)
    q = np.empty((len(blocks), 8, 32), np.int32)   # sub-block 2j: low nibbles of qs[32j:32j+32], 2j + 1: high
    q[:, 0::2] = (qs.reshape(-1, 4, 32) & 15)
    q[:, 1::2] = (qs.reshape(-1, 4, 32) >> 4)
    dsc = (d * sc.astype(np.float32)).astype(np.float16)
    dm = (dmin * mn.astype(np.float32)).astype(np.float16)
    w = (dsc.astype(np.float32)[:, :, None] * q.astype(np.float32)).astype(np.float16)
    return w.astype(np.float64).reshape(M, K), dm.astype(np.float64).reshape(M, K // 32)


def q6_k_f16_parts(w_data: np.ndarray, K: int, M: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K weights as the f16 kernel rounds them (qmatmul_half.cuh): w [M, K] = round_f16(round_f16(d * sc) * q),
    q the 6-bit value minus 32, sc the 16-value group's int8 scale; no minima (zeros [M, K / 32])."""
    blocks = np.frombuffer(np.ascontiguousarray(w_data).tobytes(), dtype=np.uint8).reshape(M * K // 256, 210)
    ql, qh = blocks[:, :128].astype(np.int32), blocks[:, 128:192].astype(np.int32)
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    q = np.empty((len(blocks), 256), np.int32)   # values 128 hh + 32 c + l
    for hh in range(2):
        for c in range(4):
            lo = (ql[:, 64 * hh + 32 * (c % 2):][:, :32] >> (4 * (c // 2))) & 15
            hi = (qh[:, 32 * hh:32 * hh + 32] >> (2 * c)) & 3
            q[:, 128 * hh + 32 * c:128 * hh + 32 * c + 32] = (lo | (hi << 4)) - 32
    dsc = (d * sc).astype(np.float16).astype(np.float32)   # [blocks, 16]: one per 16 values
    w = (np.repeat(dsc, 16, axis=1) * q.astype(np.float32)).astype(np.float16)
    return w.astype(np.float64).reshape(M, K), np.zeros((M, K // 32))


F16_PARTS = {ggml.Type.Q4_K: q4_k_f16_parts, ggml.Type.Q6_K: q6_k_f16_parts}


def f16_reference(x: np.ndarray, w16: np.ndarray, dm: np.ndarray) -> np.ndarray:
    """What the f16 kernel computes in float64: x rounded to f16, each 32-value sub-block's sum of those rounded to
    f16, sum(w x) - sum(dm * sums)."""
    xh = x.astype(np.float16).astype(np.float64)
    sums = xh.reshape(len(x), -1, 32).sum(axis=2).astype(np.float16).astype(np.float64)
    return xh @ w16.T - sums @ dm.T


def f16_kernel_or_skip(backend):
    if not ggml.qmatmul_streams(backend._dev):
        pytest.skip(f"{backend.name} has no f16 qmatmul kernel (Hopper and later)")


# Shapes of the f16 kernel's cases: few row tiles of 256 rows, each cut over many CUDA blocks (every tile finished
# from several blocks' partial sums); and more items than SMs (blocks running parts of two tiles), rows ending in
# a partial tile. Q6_K: 11 and 5 units a row, so rows start at every even offset from a 16-byte boundary and the
# matrix ends past its last one. Q4_K also: a matrix tall enough for the kernel's 12-warp (192-row) tiles
# (QMH_Q4_K_WIDE_ROWS), ending in a tile of one row; and the 27B's GDN/attention output as the model runs it (40
# tiles of 12 stages on 120 blocks: every tile cut in three segments that end at once).
F16_SHAPES = ((2816, 301), (1280, 7001))
F16_EXTRA_SHAPES = {ggml.Type.Q4_K: ((1280, 24577), (6144, 5120)), ggml.Type.Q6_K: ()}


@pytest.mark.cuda
@pytest.mark.parametrize("wtype", [ggml.Type.Q4_K, ggml.Type.Q6_K], ids=["Q4_K", "Q6_K"])
def test_qmatmul_f16_kernel_matches_its_rounding_and_keeps_columns_apart(rng, wtype):
    """ggml.QMATMUL_F16: within 2e-5 of float64 on its documented roundings (f16 weights and activations, f16
    sub-block sums), 5x further from the unrounded product (so a kernel that skipped a rounding could not pass);
    column j bit-identical alone or among N; plain, RMS-normed and gated columns, and with a residual added."""
    backend = ggml.Backend("cuda")
    f16_kernel_or_skip(backend)
    F16 = ggml.QMATMUL_F16
    for K, M in F16_SHAPES + F16_EXTRA_SHAPES[wtype]:
        op, w_ref = make(backend, rng, wtype, {wtype: (K, M)})
        w16, dm = F16_PARTS[wtype](op.w_data, K, M)
        assert rel_err(w16 - np.repeat(dm, 32, axis=1), w_ref) < 1e-3   # the decoder reads the blocks right
        x = rng.standard_normal((48, K)).astype(np.float32)
        full = op.run(x, row_tiles=F16)
        for n in COLS:
            got = op.run(x[:n], row_tiles=F16)
            assert np.array_equal(got, full[:n]), f"K={K} M={M}: the first {n} of 48 columns differ when N={n}"
            err = rel_err(got, f16_reference(x[:n], w16, dm))
            assert err < 2e-5, f"K={K} M={M} N={n}: relative error {err:.2e} against the f16-rounded product"
            assert rel_err(got, x[:n].astype(np.float64) @ w_ref.T) > 5 * err, f"N={n}: x was not rounded to f16"
        for j in (0, 22, 47):
            assert np.array_equal(op.run(x[j:j + 1], row_tiles=F16)[0], full[j]), f"K={K} M={M}: column {j} alone"
        norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
        normed = op.run(x, row_tiles=F16, norm=norm)
        assert np.array_equal(op.run(x[:1], row_tiles=F16, norm=norm)[0], normed[0]), "normed column 0 alone"
        xn = rms_normed(x, norm).astype(np.float32)
        err = rel_err(normed, f16_reference(xn, w16, dm))
        assert err < 1e-4, f"K={K} M={M}: normed, relative error {err:.2e}"   # (x * scale * norm in f32 first)
        for n in (1, 23, 48):
            r = (rng.standard_normal((n, M)) * 300.0).astype(np.float32)
            assert np.array_equal(op.run_add(x[:n], r, row_tiles=F16, pad=5),
                                  op.run_add(x[:n], r, row_tiles=F16, separate=True)), f"N={n}: not ggml's add"
            u = rng.standard_normal((n, K)).astype(np.float32)
            assert np.array_equal(op.run_gated(x[:n], u, row_tiles=F16),
                                  op.run_gated(x[:n], u, row_tiles=F16, separate=True)), f"N={n}: not ggml's swiglu"


@pytest.mark.cuda
def test_qmatmul_f16_kernel_q4_k_scales_of_one_and_more(rng):
    """Q4_K in the f16 kernel: a weight is one FMA, (M + q) * s - M * s with M = 1024 (low nibbles), exact only while
    1024 * s is finite; warps whose units have a scale d >= 1 take the two-instruction path. Rows scaled by 4,000 in
    whole warps (16 rows), alone among small ones, and none: the same match to the f16 roundings, the same columns."""
    backend = ggml.Backend("cuda")
    f16_kernel_or_skip(backend)
    K, M = 1280, 301
    row_scale = np.where((np.arange(M) // 16) % 3 == 0, 4000.0, 1.0).astype(np.float32)
    row_scale[16 * 4 + 5] = 4000.0
    op, w_ref = make(backend, rng, ggml.Type.Q4_K, {ggml.Type.Q4_K: (K, M)}, row_scale=row_scale)
    w16, dm = q4_k_f16_parts(op.w_data, K, M)
    d = np.frombuffer(op.w_data.tobytes(), np.uint8).reshape(-1, 144)[:, :2].copy().view(np.float16)
    assert (np.abs(d.astype(np.float32)) >= 1.0).any() and (np.abs(d.astype(np.float32)) < 1.0).any()
    x = rng.standard_normal((48, K)).astype(np.float32)
    full = op.run(x, row_tiles=ggml.QMATMUL_F16)
    assert np.isfinite(full).all()
    for n in (1, 23, 48):
        got = op.run(x[:n], row_tiles=ggml.QMATMUL_F16)
        assert np.array_equal(got, full[:n]), f"the first {n} of 48 columns differ when N={n}"
        err = rel_err(got, f16_reference(x[:n], w16, dm))
        assert err < 2e-5, f"N={n}: relative error {err:.2e} against the f16-rounded product"


def bf16_case(backend, rng, K, M):
    """A BF16 weight [M, K] (ggml's conversion) and its values in float64."""
    w = rng.standard_normal((M, K)).astype(np.float32)
    w_data = ggml.quantize(ggml.Type.BF16, w)
    w_ref = dequantize(w_data, GGMLQuantizationType.BF16).astype(np.float64)
    return QMatmul(backend, ggml.Type.BF16, w_data, K, M), w_ref


def as_bf16(x: np.ndarray) -> np.ndarray:
    """x rounded to bf16 (to nearest even), in float64."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def test_qmatmul_bf16_on_the_cpu_is_the_float_product(rng):
    """BF16 weights (a DFlash draft's) on the CPU: its reference kernel (rows converted to f32, float sums) within
    1e-5 of float64, x as given."""
    op, w_ref = bf16_case(ggml.Backend("cpu"), rng, 800, 45)
    for n in (1, 16, 48):
        x = rng.standard_normal((n, op.K)).astype(np.float32)
        err = rel_err(op.run(x), x.astype(np.float64) @ w_ref.T)
        assert err < 1e-5, f"N={n}: relative error {err:.2e}"


@pytest.mark.cuda
def test_qmatmul_bf16_kernel_matches_its_rounding_and_keeps_columns_apart(rng):
    """BF16 weights on CUDA: on Hopper with K a multiple of 256 the f16 kernel's bf16 form, whatever row_tiles says
    (x rounded to bf16, exact products, f32 sums): within 2e-5 of float64 on x so rounded and 5x further from the
    unrounded product; column j alone == among N; normed columns near the float64 normed product, gated and added
    ones the bits of ggml's own swiglu before and add after.
    Elsewhere (K = 800 here) the plain kernel: within 1e-5 of the unrounded product."""
    backend = ggml.Backend("cuda")
    f16_kernel_or_skip(backend)
    for K, M in F16_SHAPES:
        op, w_ref = bf16_case(backend, rng, K, M)
        x = rng.standard_normal((48, K)).astype(np.float32)
        full = op.run(x)
        assert np.array_equal(op.run(x, row_tiles=ggml.QMATMUL_F16), full), "row_tiles changed a bit"
        for n in COLS:
            got = op.run(x[:n])
            assert np.array_equal(got, full[:n]), f"K={K} M={M}: the first {n} of 48 columns differ when N={n}"
            err = rel_err(got, as_bf16(x[:n]) @ w_ref.T)
            assert err < 2e-5, f"K={K} M={M} N={n}: relative error {err:.2e} against the bf16-rounded product"
            assert rel_err(got, x[:n].astype(np.float64) @ w_ref.T) > 5 * err, f"N={n}: x was not rounded to bf16"
        norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
        normed = op.run(x[:23], norm=norm)
        assert np.array_equal(op.run(x[:1], norm=norm)[0], normed[0]), "normed column 0 alone"
        err = rel_err(normed, rms_normed(x[:23], norm) @ w_ref.T)   # (bf16's rounding of the normed x: ~1e-3)
        assert err < 4e-3, f"K={K} M={M}: normed, relative error {err:.2e}"
        for n in (1, 23, 48):
            r = (rng.standard_normal((n, M)) * 300.0).astype(np.float32)
            assert np.array_equal(op.run_add(x[:n], r, pad=5), op.run_add(x[:n], r, separate=True)), f"N={n}: add"
            u = rng.standard_normal((n, K)).astype(np.float32)
            assert np.array_equal(op.run_gated(x[:n], u), op.run_gated(x[:n], u, separate=True)), f"N={n}: swiglu"
    op, w_ref = bf16_case(backend, rng, 800, 45)
    x = rng.standard_normal((23, 800)).astype(np.float32)
    err = rel_err(op.run(x), x.astype(np.float64) @ w_ref.T)
    assert err < 1e-5, f"plain kernel: relative error {err:.2e}"


@pytest.mark.cuda
def test_qmatmul_f16_request_falls_back_where_there_is_none(rng):
    """Q5_K has no f16 kernel: asked for it, ggml_qmatmul gives the int8 kernels' own choice, bit for bit."""
    backend = ggml.Backend("cuda")
    op, _ = make(backend, rng, ggml.Type.Q5_K, SHAPES_TALL)
    x = rng.standard_normal((23, op.K)).astype(np.float32)
    assert np.array_equal(op.run(x, row_tiles=ggml.QMATMUL_F16), op.run(x))


@pytest.mark.cuda
@pytest.mark.parametrize("wtype", TYPES, ids=[t.name for t in TYPES])
def test_qmatmul_error_no_larger_than_ggml_mul_mat(rng, wtype):
    """Against the exact product (float64, x not rounded), ggml_qmatmul's error is at most 10% above that of ggml's
    mul_mat on the same weights and activations, at column counts where the default mode takes one or the other
    (1, 8, 16, 23, 48). Both round x to 8 bits per 32 values (the error they share), so they should be alike; but
    the kernels differ in what they do with the rest (f16 or f32 block scales; for Q4_K/Q5_K's minimums the
    sum of the rounded or of the exact values), and the default mode mixes them. x has a few outlier channels,
    as real models' activations do (their blocks get coarse scales)."""
    backend = ggml.Backend("cuda")
    op, w_ref = make(backend, rng, wtype, SHAPES_TALL)
    for n in (1, 8, 16, 23, 48):
        x = rng.standard_normal((n, op.K)).astype(np.float32)
        x[:, [5, 300, 1000]] *= 30.0
        exact = x.astype(np.float64) @ w_ref.T
        ours, ggmls = rel_err(op.run(x), exact), rel_err(op.run_mul_mat(x), exact)
        print(f"{wtype.name} N={n}: relative error ggml_qmatmul {ours:.3e}, ggml mul_mat {ggmls:.3e}")
        assert ours <= 1.1 * ggmls, f"{wtype.name} N={n}: ggml_qmatmul {ours:.3e} against mul_mat {ggmls:.3e}"


def test_qmatmul_rejects_bad_input():
    ctx = ggml.Context(n_tensors=32)
    w = ctx.new_tensor(ggml.Type.Q4_K, (256, 4))
    with pytest.raises(ValueError, match="1 to 48 columns"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 49)))
    with pytest.raises(ValueError, match="must have ne"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (512, 3)))
    with pytest.raises(ValueError, match="row_tiles must be one of"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 3)), row_tiles=3)
    with pytest.raises(TypeError, match="Q4_K/Q5_K/Q6_K/Q8_0"):
        ggml.qmatmul(ctx, ctx.new_tensor(ggml.Type.F16, (256, 4)), ctx.new_tensor(np.float32, (256, 3)))
    with pytest.raises(ValueError, match="norm must be a contiguous f32 vector of 256"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 3)), norm=ctx.new_tensor(np.float32, (128,)))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 3)), norm=ctx.new_tensor(np.float32, (256,)), eps=-1.0)
    with pytest.raises(ValueError, match=r"qmatmul add must have ne \(4, 3\)"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 3)), add=ctx.new_tensor(np.float32, (4, 2)))
    with pytest.raises(TypeError, match="qmatmul add must be F32"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 3)), add=ctx.new_tensor(np.float16, (4, 3)))
    with pytest.raises(ValueError, match=r"qmatmul up must have ne \(256, 3\)"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 3)), up=ctx.new_tensor(np.float32, (256, 2)))
    with pytest.raises(ValueError, match="norm must be a contiguous f32 vector of a length dividing 256"):
        ggml.qmatmul(ctx, w, ctx.new_tensor(np.float32, (256, 3)), up=ctx.new_tensor(np.float32, (256, 3)),
                     norm=ctx.new_tensor(np.float32, (96,)))


def test_f16_kernel_taken_for_large_q4_k_q6_k_bf16_matrices_from_2_columns_outside_bit_exact_mode(monkeypatch):
    """layers.qmatmul_row_tiles: the f16 kernel for a Q4_K, Q6_K or BF16 weight of at least QMATMUL_F16_MIN_ITEMS
    (256-row tile, 256-value unit) pairs from QMATMUL_F16_MIN_COLS columns (BF16: from one) on a GPU that has it;
    not for Q5_K,
    small matrices, few columns, other GPUs, with PYDFLASH_QMATMUL_F16=0, PYDFLASH_QMATMUL=1 or in bit-exact mode
    (which keep every column's bits whatever N)."""
    from pydflash.models import layers
    ctx = ggml.Context(n_tensors=16)
    big = ctx.new_tensor(ggml.Type.Q4_K, (5120, 34816))   # the 27B's FFN gate/up: 136 x 20 items
    for var in ("PYDFLASH_QMATMUL_F16", "PYDFLASH_BITEXACT", "PYDFLASH_QMATMUL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(layers, "_streams", lambda w: True)
    assert layers.qmatmul_row_tiles(big, 23) == ggml.QMATMUL_F16
    assert layers.qmatmul_row_tiles(big, 2) == ggml.QMATMUL_F16
    assert layers.qmatmul_row_tiles(big, 1) == 0   # one column: the streaming kernel
    for wtype, ne, f16 in ((ggml.Type.Q6_K, (17408, 5120), True),    # FFN down: 20 x 68
                           (ggml.Type.Q4_K, (17408, 5120), True),
                           (ggml.Type.Q6_K, (5120, 248320), True),   # LM head
                           (ggml.Type.Q4_K, (5120, 13312), True),    # attention Q/K: 52 x 20 = 1,040
                           (ggml.Type.Q4_K, (6144, 5120), True),     # GDN output: 20 x 24 = 480
                           (ggml.Type.Q4_K, (5120, 5120), True),     # 20 x 20 = 400
                           (ggml.Type.Q4_K, (5120, 4864), False),    # 19 x 20
                           (ggml.Type.Q6_K, (5120, 1024), False),    # attention V
                           (ggml.Type.BF16, (5120, 17408), True),    # a DFlash draft's FFN gate / up
                           (ggml.Type.BF16, (5120, 6144), True),     # its fused Q/K/V: 24 x 20
                           (ggml.Type.BF16, (4096, 5120), False),    # its attention output: 20 x 16 = 320
                           (ggml.Type.BF16, (5120, 2048), False),    # its fused K/V (context appends): 8 x 20
                           (ggml.Type.BF16, (5120, 1024), False),    # K or V alone
                           (ggml.Type.Q5_K, (5120, 34816), False)):
        assert (layers.qmatmul_row_tiles(ctx.new_tensor(wtype, ne), 23) == ggml.QMATMUL_F16) == f16, (wtype, ne)
    monkeypatch.setenv("PYDFLASH_QMATMUL_F16", "0")
    assert layers.qmatmul_row_tiles(big, 23) == 0
    monkeypatch.delenv("PYDFLASH_QMATMUL_F16")
    monkeypatch.setenv("PYDFLASH_BITEXACT", "1")
    assert layers.qmatmul_row_tiles(big, 23) == 0
    monkeypatch.delenv("PYDFLASH_BITEXACT")
    monkeypatch.setenv("PYDFLASH_QMATMUL", "1")   # every product through ggml_qmatmul, each column's bits kept
    assert layers.qmatmul_row_tiles(big, 23) == 0
    monkeypatch.delenv("PYDFLASH_QMATMUL")
    # the rule as bench/qmatmul.py asks it, from a shape and the device's answer
    assert layers.qmatmul_row_tiles_for(ggml.Type.Q4_K, 5120, 34816, 23, streams=True) == ggml.QMATMUL_F16
    assert layers.qmatmul_row_tiles_for(ggml.Type.Q4_K, 5120, 34816, 1, streams=True) == 0
    assert layers.qmatmul_row_tiles_for(ggml.Type.Q6_K, 5120, 1024, 23, streams=True) == 0
    assert layers.qmatmul_row_tiles_for(ggml.Type.Q4_K, 5120, 34816, 23, streams=False) == 0
    monkeypatch.setattr(layers, "_streams", lambda w: False)
    assert layers.qmatmul_row_tiles(big, 23) == 0
