"""ggml.qmatmul_swiglu_prepared and ggml.qmatmul_prepared (ggml-ext.h): an FFN's gate/up product writing the down
product's input in the f16 kernel's layout, and a product reading that layout as it is. CPU: the layout holds ggml's
own swiglu of the reference product, rounded to f16, with the f32 sums of each run of 32 rounded values; a prepared
product is the reference product of those values. CUDA (Hopper): the gate/up product's f16-kernel tiles write what
the separate preparation would make of their f32 outputs, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from conftest import rel_err
from pydflash import ggml
from pydflash.models import layers, load_target
from pydflash.testing import write_qwen35_gguf

EPS = 1e-6
F16 = ggml.QMATMUL_F16
PITCH = ggml.QMATMUL_HALF_PITCH


def quantized(rng, wtype, rows, K, scale=1.0):
    """A random matrix [rows, K] quantised by ggml: (its bytes, one row each; float64 dequantised by gguf-py)."""
    data = ggml.quantize(wtype, (rng.standard_normal((rows, K)) * scale).astype(np.float32))
    return data, dequantize(data, GGMLQuantizationType(int(wtype))).astype(np.float64)


def run_graph(backend, build, inputs: dict[str, np.ndarray], shapes: dict[str, tuple]):
    """build(ctx, tensors) -> output tensor, the inputs given as (type, ne) in shapes and set from inputs."""
    ctx = ggml.Context(n_tensors=32, graph_size=32)
    tensors = {name: ctx.new_tensor(t, ne, name=name).mark_input() for name, (t, ne) in shapes.items()}
    graph = ctx.graph(build(ctx, tensors))
    ggml.Allocator(backend).allocate(graph)
    for name, value in inputs.items():
        if tensors[name].is_allocated:
            tensors[name].set(value)
    backend.compute(graph)
    return graph.outputs[0].numpy()


def swiglu_prepared(backend, w_gu, K, F, x, norm=None, reader=ggml.Type.Q4_K):
    """ggml.qmatmul_swiglu_prepared of Q4_K w_gu ([2F, K] bytes) and x [N, K] for a reader matrix of that type: the
    layout, f16 [F/256, npad, PITCH]."""
    n = len(x)
    shapes = {"w": (ggml.Type.Q4_K, (K, 2 * F)), "x": (np.float32, (K, n)), "g": (np.float32, (K,))}
    inputs = {"w": w_gu, "x": x, "g": norm if norm is not None else np.ones(K, np.float32)}
    out = run_graph(backend, lambda ctx, t: ggml.qmatmul_swiglu_prepared(
        ctx, t["w"], t["x"], reader, norm=t["g"] if norm is not None else None, eps=EPS), inputs, shapes)
    return out.reshape(F // 256, -1, PITCH)


def gated_by_ggml(backend, w_gu, K, F, x, norm=None):
    """ggml's swiglu_split of the halves of qmatmul(w_gu, x) (normed columns where norm is given): f32 [N, F]."""
    n = len(x)
    shapes = {"w": (ggml.Type.Q4_K, (K, 2 * F)), "x": (np.float32, (K, n)), "g": (np.float32, (K,))}

    def build(ctx, t):
        gu = ggml.qmatmul(ctx, t["w"], t["x"], norm=t["g"] if norm is not None else None, eps=EPS)
        return ctx.swiglu_split(ctx.view_2d(gu, F, n, gu.nb[1], 0), ctx.view_2d(gu, F, n, gu.nb[1], F * 4))
    inputs = {"w": w_gu, "x": x, "g": norm if norm is not None else np.ones(K, np.float32)}
    return run_graph(backend, build, inputs, shapes).reshape(n, F)


# Where ggml-ext.h's layout keeps value v of a unit's column (v < 256; 256 + r: run r's sum): a unit is 36 chunks of
# npad x 8 halves, values 32 s + 8 t + 4 p + 2 q + {0, 1} in chunk 4 s + 2 p + q at halves 2 t, 2 t + 1
_V = np.arange(264)
CHUNK = np.where(_V < 256, 4 * (_V // 32) + 2 * ((_V // 4) % 2) + (_V // 2) % 2, 32)
ELEM = np.where(_V < 256, 2 * ((_V // 8) % 4) + _V % 2, _V - 256)


def chunks(layout: np.ndarray) -> np.ndarray:
    """A layout [U, npad, PITCH] as its chunks [U, 36, npad, 8] (a view)."""
    U, npad, _ = layout.shape
    return layout.reshape(U, PITCH // 8, npad, 8)


def butterfly_sum(run: np.ndarray) -> np.float32:
    """The f32 sum of 32 values as a warp's butterfly adds them, one value a lane (offsets 16, 8, 4, 2, 1)."""
    s = run.astype(np.float32)
    for o in (16, 8, 4, 2, 1):
        s = s + s[np.arange(32) ^ o]
    return s[0]


def prepared_layout(values: np.ndarray, sums: bool = True, butterfly: bool = False) -> np.ndarray:
    """The layout of ggml-ext.h for columns values [N, F] (f32): f16 values, the f32 sums of each run of 32 rounded
    values in index order (the CPU's; butterfly: a warp's, CUDA's) rounded to f16 (without sums: zeros), zeros
    elsewhere and in the padding columns."""
    n, F = values.shape
    npad = -(-n // 8) * 8
    out = np.zeros((F // 256, npad, PITCH), np.float16)
    c = chunks(out)
    h = values.astype(np.float16)
    for j in range(n):
        for u in range(F // 256):
            unit = h[j, 256 * u: 256 * u + 256]
            c[u, CHUNK[:256], j, ELEM[:256]] = unit
            for r in range(8 if sums else 0):
                run = unit[32 * r: 32 * r + 32]
                c[u, 32, j, r] = butterfly_sum(run) if butterfly else np.cumsum(run.astype(np.float32),
                                                                                 dtype=np.float32)[-1]
    return out


def prepared_values(layout: np.ndarray, n: int) -> np.ndarray:
    """The f32 columns [n, F] a layout holds."""
    c = chunks(layout)
    return np.stack([c[:, CHUNK[:256], j, ELEM[:256]].reshape(-1) for j in range(n)]).astype(np.float32)


def test_layout_positions_are_a_permutation_of_each_columns_values():
    """Every value and run sum of a column has its own place, none shared with another column's, and the chunks the
    wgmma kernel reads as zeros (33) hold nothing."""
    npad = 16
    at = (CHUNK[:, None] * npad + np.arange(npad)[None, :]) * 8 + ELEM[:, None]   # [264, npad] flat positions
    assert len(np.unique(at)) == at.size and at.max() < npad * PITCH
    assert not np.any(CHUNK == 33)


def qmatmul_prepared(backend, wtype, w, K, M, layout, n, add=None):
    """ggml.qmatmul_prepared of w ([M, K] bytes of wtype) and a layout of n columns (+ add [n, M]): f32 [n, M]."""
    shapes = {"w": (wtype, (K, M)), "xp": (np.float16, ggml.qmatmul_prepared_shape(K, n)),
              "r": (np.float32, (M, n))}
    inputs = {"w": w, "xp": layout, "r": add if add is not None else np.zeros((n, M), np.float32)}
    return run_graph(backend, lambda ctx, t: ggml.qmatmul_prepared(
        ctx, t["w"], t["xp"], n, add=t["r"] if add is not None else None), inputs, shapes).reshape(n, M)


@pytest.mark.parametrize("reader", [ggml.Type.Q4_K, ggml.Type.Q6_K], ids=["for_Q4_K", "for_Q6_K"])
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "rms_norm"])
def test_swiglu_prepared_on_the_cpu_is_ggml_swiglu_rounded_into_the_layout(rng, normed, reader):
    """The CPU reference: every value is ggml's swiglu of the reference product's two halves rounded to f16, each run
    sum the f32 sum of the 32 rounded values in order (for a Q6_K reader, which never reads them: zeros), padding
    and the padding columns zero; the values are within f16 rounding of float64's swiglu of the dequantised
    product."""
    backend = ggml.Backend("cpu")
    K, F = 512, 768
    w_gu, w_ref = quantized(rng, ggml.Type.Q4_K, 2 * F, K, scale=0.05)
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32) if normed else None
    for n in (1, 5, 9, 23):
        x = rng.standard_normal((n, K)).astype(np.float32)
        got = swiglu_prepared(backend, w_gu, K, F, x, norm, reader)
        want = prepared_layout(gated_by_ggml(backend, w_gu, K, F, x, norm), sums=reader == ggml.Type.Q4_K)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"N={n}"
        xd = x.astype(np.float64)
        if normed:
            xd = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + EPS) * norm
        gu = xd @ w_ref.T
        exact = gu[:, :F] / (1.0 + np.exp(-gu[:, :F])) * gu[:, F:]
        err = rel_err(prepared_values(got, n), exact)
        assert err < 1e-3, f"N={n}: relative error {err:.2e} against float64"


@pytest.mark.parametrize("wtype", [ggml.Type.Q4_K, ggml.Type.Q6_K], ids=["Q4_K", "Q6_K"])
def test_qmatmul_prepared_on_the_cpu_is_the_product_of_its_values(rng, wtype):
    """A prepared product on the CPU: the bits of qmatmul (its residual added) on the values the layout holds, and
    within float64 of the dequantised product; padding columns' values are never read."""
    backend = ggml.Backend("cpu")
    K, M = 768, 200
    w, w_ref = quantized(rng, wtype, M, K)
    for n in (1, 7, 8, 9, 23, 48):
        values = rng.standard_normal((n, K)).astype(np.float32)
        layout = prepared_layout(values)
        chunks(layout)[:, :, n:, :] = np.float16(np.nan)   # (padding columns: whatever a GPU left there)
        r = rng.standard_normal((n, M)).astype(np.float32)
        got = qmatmul_prepared(backend, wtype, w, K, M, layout, n, add=r)
        xh = prepared_values(layout, n)
        shapes = {"w": (wtype, (K, M)), "x": (np.float32, (K, n)), "r": (np.float32, (M, n))}
        want = run_graph(backend, lambda ctx, t: ggml.qmatmul(ctx, t["w"], t["x"], add=t["r"]),
                         {"w": w, "x": xh, "r": r}, shapes).reshape(n, M)
        assert np.array_equal(got, want), f"{wtype.name} N={n}: not qmatmul's bits on the layout's values"
        err = rel_err(got, xh.astype(np.float64) @ w_ref.T + r)
        assert err < 1e-5, f"{wtype.name} N={n}: relative error {err:.2e}"


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "rms_norm"])
def test_qmatmul_prepare_on_the_cpu_is_the_layout_of_the_reference_columns(rng, normed):
    """ggml.qmatmul_prepare on the CPU: x's columns (normed: those of ggml's rms_norm and mul, to the bit, as the CPU
    reference norms them) rounded into the layout, padding columns zero."""
    backend = ggml.Backend("cpu")
    K = 768
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
    for n in (1, 9, 23, 48):
        x = (rng.standard_normal((n, K)) * 4.0).astype(np.float32)
        shapes = {"x": (np.float32, (K, n)), "g": (np.float32, (K,))}
        inputs = {"x": x, "g": norm}
        got = run_graph(backend, lambda ctx, t: ggml.qmatmul_prepare(
            ctx, t["x"], norm=t["g"] if normed else None, eps=EPS), inputs, shapes).reshape(K // 256, -1, PITCH)
        cols = x
        if normed:
            cols = run_graph(backend, lambda ctx, t: ctx.mul(ctx.rms_norm(t["x"], EPS), t["g"]), inputs,
                             shapes).reshape(n, K)
        want = prepared_layout(cols)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"N={n}"


def test_prepared_ops_reject_bad_input():
    ctx = ggml.Context(n_tensors=32)
    w_gu = ctx.new_tensor(ggml.Type.Q4_K, (512, 1024))
    x = ctx.new_tensor(np.float32, (512, 9))
    Q4, Q6 = ggml.Type.Q4_K, ggml.Type.Q6_K
    with pytest.raises(ValueError, match="Q4_K matrix"):
        ggml.qmatmul_swiglu_prepared(ctx, ctx.new_tensor(Q6, (512, 1024)), x, Q6)
    with pytest.raises(ValueError, match="multiples of 256"):
        ggml.qmatmul_swiglu_prepared(ctx, ctx.new_tensor(Q4, (512, 768)), x, Q6)   # F = 384
    with pytest.raises(ValueError, match="ne"):
        ggml.qmatmul_swiglu_prepared(ctx, w_gu, ctx.new_tensor(np.float32, (256, 9)), Q6)
    with pytest.raises(ValueError, match="norm"):
        ggml.qmatmul_swiglu_prepared(ctx, w_gu, x, Q6, norm=ctx.new_tensor(np.float32, (256,)))
    with pytest.raises(ValueError, match="Q4_K or Q6_K reader"):
        ggml.qmatmul_swiglu_prepared(ctx, w_gu, x, ggml.Type.Q8_0)
    xp = ggml.qmatmul_swiglu_prepared(ctx, w_gu, x, Q6)
    assert xp.type == ggml.Type.F16 and xp.ne[:3] == ggml.qmatmul_prepared_shape(512, 9) == (PITCH, 16, 2)
    w_down = ctx.new_tensor(Q6, (512, 64))
    assert ggml.qmatmul_prepared(ctx, w_down, xp, 9).ne[:2] == (64, 9)
    with pytest.raises(ValueError, match="Q6_K reader"):   # its run sums left out: a Q4_K matrix would read zeros
        ggml.qmatmul_prepared(ctx, ctx.new_tensor(Q4, (512, 64)), xp, 9)
    xp4 = ggml.qmatmul_swiglu_prepared(ctx, w_gu, x, Q4)
    assert ggml.qmatmul_prepared(ctx, ctx.new_tensor(Q4, (512, 64)), xp4, 9).ne[:2] == (64, 9)
    with pytest.raises(ValueError, match="ne"):
        ggml.qmatmul_prepared(ctx, w_down, xp, 17)   # 24 padded columns, not 16
    with pytest.raises(ValueError, match="columns"):
        ggml.qmatmul_prepared(ctx, w_down, xp, 0)
    with pytest.raises(ValueError, match="Q4_K or Q6_K"):
        ggml.qmatmul_prepared(ctx, ctx.new_tensor(ggml.Type.Q8_0, (512, 64)), xp, 9)
    with pytest.raises(ValueError, match="add"):
        ggml.qmatmul_prepared(ctx, w_down, xp, 9, add=ctx.new_tensor(np.float32, (64, 8)))
    assert ggml.qmatmul_prepare(ctx, x).ne[:3] == xp.ne[:3]
    with pytest.raises(ValueError, match="multiple of 256"):
        ggml.qmatmul_prepare(ctx, ctx.new_tensor(np.float32, (320, 9)))
    with pytest.raises(ValueError, match="norm"):
        ggml.qmatmul_prepare(ctx, x, norm=ctx.new_tensor(np.float32, (511,)))


@pytest.mark.parametrize("switch", ["PYDFLASH_SWIGLU_PREPARED", "PYDFLASH_SHARED_PREP"])
def test_the_target_takes_the_prepared_paths_where_the_f16_kernel_runs(tmp_path, monkeypatch, switch):
    """qwen35 (Q4_K_M-like: the attention's V and the FFN down Q6_K) on the CPU with every product counted as the
    f16 kernel's on a Hopper GPU (as there from 9 columns): each FFN is one swiglu-prepared gate/up product and one
    prepared down product, and the attention layer's Q/K and V products read one preparation of their normed input;
    with the switch at 0 that part goes back to products preparing their own input (as many products), and the
    logits stay within the f16 rounding of the prepared values (2^-11: the CPU reference multiplies f32 columns)."""
    path = str(tmp_path / "q.gguf")
    write_qwen35_gguf(path, n_layer=2, n_embd=256, n_ff=512, n_head=2, n_head_kv=1, head_dim=64,
                      weight_type="Q4_K_M", recurrent_layers=(1, 0), seed=4)
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    monkeypatch.setattr(layers, "_streams", lambda w: True)
    monkeypatch.setattr(layers, "qmatmul_row_tiles", lambda w, n: F16)

    def verify_logits():
        target = load_target(path, "cpu", n_ctx=128, n_ubatch=16)
        target.prefill([int(t) for t in np.random.default_rng(3).integers(0, 400, 20)])
        target.enable_verify(4, tree=True)
        target.verify([7, 5, 9, 11], [-1, 0, 0, 1], [0, 1, 1, 2])
        nodes = target._last.graph.nodes()
        products = [n for n in nodes if n.op == ggml.Op.QMATMUL]
        writes = sum(n.type == ggml.Type.F16 for n in products)           # qmatmul_swiglu_prepared
        reads = sum(n.src[1].type == ggml.Type.F16 for n in products)     # qmatmul_prepared
        shared = [n for n in nodes if n.op == ggml.Op.QMATMUL_PREPARE]
        readers = sum(n.src[1]._ptr == s._ptr for n in products for s in shared)
        return target.logits_of_slots(), (writes, reads, len(shared), readers, len(products))
    monkeypatch.setenv(switch, "1")
    got, counts = verify_logits()
    assert counts[:4] == (2, 4, 1, 2)   # 2 FFNs (each: a write, a read), the attention's Q/K and V read 1 prepare
    monkeypatch.setenv(switch, "0")
    ref, off = verify_logits()
    if switch == "PYDFLASH_SWIGLU_PREPARED":
        assert off == (0, 2, 1, 2, counts[4])   # the same products, each down one gating its input itself
    else:
        assert off == (2, 2, 0, 0, counts[4])   # the same products, Q/K and V each preparing their own
    assert np.abs(got - ref).max() < 5e-3 * ref.std(), "the prepared values stray beyond f16 rounding"


# --- CUDA: the prepared forms against the f16 kernel preparing its own input, bit for bit ---------------------------

def pairs_interleaved(w_gu: np.ndarray, F: int) -> np.ndarray:
    """The rows of [gate; up] ([2F] rows) ordered as the GLU form's tiles hold them: per 8 pairs, their 8 gate rows,
    then their 8 up rows. The f16 kernel over this matrix cuts each row's K where the GLU form cuts its pair's."""
    pairs = np.arange(F).reshape(-1, 8)
    return w_gu[np.concatenate([pairs, pairs + F], axis=1).reshape(-1)]


def separate_chain(backend, w_perm, K, F, wtype, w_down, M, x, norm=None):
    """The f16 kernel over the interleaved gate/up rows (f32 outputs), gate and up taken apart, then the down
    product preparing silu(gate) * up itself (ggml_qmatmul_fused's up): f32 [N, M]."""
    n = len(x)
    shapes = {"w": (ggml.Type.Q4_K, (K, 2 * F)), "x": (np.float32, (K, n)), "g": (np.float32, (K,)),
              "d": (wtype, (F, M))}

    def build(ctx, t):
        gu = ggml.qmatmul(ctx, t["w"], t["x"], F16, norm=t["g"] if norm is not None else None, eps=EPS)
        half = [ctx.reshape_2d(ctx.cont(ctx.view_3d(gu, 8, F // 8, n, 64, gu.nb[1], 32 * h)), F, n) for h in (0, 1)]
        return ggml.qmatmul(ctx, t["d"], half[0], F16, up=half[1])
    inputs = {"w": w_perm, "x": x, "g": norm if norm is not None else np.ones(K, np.float32), "d": w_down}
    return run_graph(backend, build, inputs, shapes).reshape(n, M)


def prepared_chain(backend, w_gu, K, F, wtype, w_down, M, x, norm=None):
    """qmatmul_swiglu_prepared then qmatmul_prepared in one graph: f32 [N, M]."""
    n = len(x)
    shapes = {"w": (ggml.Type.Q4_K, (K, 2 * F)), "x": (np.float32, (K, n)), "g": (np.float32, (K,)),
              "d": (wtype, (F, M))}

    def build(ctx, t):
        xp = ggml.qmatmul_swiglu_prepared(ctx, t["w"], t["x"], wtype, norm=t["g"] if norm is not None else None,
                                          eps=EPS)
        return ggml.qmatmul_prepared(ctx, t["d"], xp, n)
    inputs = {"w": w_gu, "x": x, "g": norm if norm is not None else np.ones(K, np.float32), "d": w_down}
    return run_graph(backend, build, inputs, shapes).reshape(n, M)


@pytest.mark.cuda
@pytest.mark.parametrize("wtype", [ggml.Type.Q4_K, ggml.Type.Q6_K], ids=["Q4_K", "Q6_K"])
def test_a_shared_preparation_gives_the_f16_kernel_its_own_bits(rng, wtype):
    """qmatmul_prepared over qmatmul_prepare's activations (plain and RMS-normed) equals qmatmul with QMATMUL_F16
    preparing for itself, bit for bit, a small matrix (an attention's V) and a large one alike."""
    backend = ggml.Backend("cuda")
    if not ggml.qmatmul_streams(backend._dev):
        pytest.skip(f"{backend.name} has no f16 qmatmul kernel (Hopper and later)")
    K = 1280
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
    for M in (1024, 7001):
        w, _ = quantized(rng, wtype, M, K)
        for n in (1, 9, 23, 48):
            x = rng.standard_normal((n, K)).astype(np.float32)
            shapes = {"w": (wtype, (K, M)), "x": (np.float32, (K, n)), "g": (np.float32, (K,))}
            for g in (None, norm):
                inputs = {"w": w, "x": x, "g": norm}
                got = run_graph(backend, lambda ctx, t: ggml.qmatmul_prepared(ctx, t["w"], ggml.qmatmul_prepare(
                    ctx, t["x"], norm=t["g"] if g is not None else None, eps=EPS), n), inputs, shapes)
                want = run_graph(backend, lambda ctx, t: ggml.qmatmul(
                    ctx, t["w"], t["x"], F16, norm=t["g"] if g is not None else None, eps=EPS), inputs, shapes)
                assert np.array_equal(got, want), f"{wtype.name} M={M} N={n} normed={g is not None}"


@pytest.mark.cuda
def test_qmatmul_prepare_on_cuda_is_the_layout_with_a_warps_sums(rng):
    """ggml.qmatmul_prepare on CUDA: x's columns rounded into the layout to the bit, each run's sum added in a warp
    butterfly's order (qmm_quantize_block; the f16 kernel's GLU form follows the same order), padding columns zero;
    values over six decades, where the order of f32 additions can show. K = 6,144 at 48 columns is more warps of one
    value a lane than an H100 or H200 holds at once, so the preparation takes two values a lane there (the same
    bits by design); at 1, 9 and 23 columns one."""
    backend = ggml.Backend("cuda")
    if not ggml.qmatmul_streams(backend._dev):
        pytest.skip(f"{backend.name} has no f16 qmatmul kernel (Hopper and later)")
    K = 6144
    orders_differ = False
    for n in (1, 9, 23, 48):
        x = (rng.standard_normal((n, K)) * 10.0 ** rng.uniform(-4, 2, (n, K))).astype(np.float32)
        got = run_graph(backend, lambda ctx, t: ggml.qmatmul_prepare(ctx, t["x"]), {"x": x},
                        {"x": (np.float32, (K, n))}).reshape(K // 256, -1, PITCH)
        want = prepared_layout(x, butterfly=True)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), f"N={n}"
        orders_differ |= not np.array_equal(want.view(np.uint16), prepared_layout(x).view(np.uint16))
    assert orders_differ, "no sum told a warp's order from index order: the data cannot catch a change of order"


# (K, F): 8-warp tiles (2F under 24,576 rows: 64 pairs a tile), 12-warp tiles (96 pairs) ending in a partial one
GLU_SHAPES = ((512, 1024), (256, 12544))


@pytest.mark.cuda
@pytest.mark.parametrize("wtype", [ggml.Type.Q4_K, ggml.Type.Q6_K], ids=["down_Q4_K", "down_Q6_K"])
@pytest.mark.parametrize("normed", [False, True], ids=["plain", "rms_norm"])
def test_swiglu_prepared_is_the_separate_preparation_bit_for_bit(rng, wtype, normed):
    """The GLU form's down product equals the f16 kernel over the same pairs' rows with f32 outputs, gated and
    prepared by the down product itself, bit for bit (values and run sums; for a Q6_K down the layout without run
    sums holds the values of the one with them, and zeros for the sums), at every column count; its column j is
    the same alone or among 48; and the whole is within float64 bounds of the f16-rounded SwiGLU (two products,
    each rounding its weights and activations to f16: ~2^-11 each)."""
    backend = ggml.Backend("cuda")
    if not ggml.qmatmul_streams(backend._dev):
        pytest.skip(f"{backend.name} has no f16 qmatmul kernel (Hopper and later)")
    M = 300
    for K, F in GLU_SHAPES:
        w_gu, w_ref = quantized(rng, ggml.Type.Q4_K, 2 * F, K, scale=0.05)
        w_down, d_ref = quantized(rng, wtype, M, F)
        w_perm = pairs_interleaved(w_gu, F)
        norm = rng.uniform(0.5, 1.5, K).astype(np.float32) if normed else None
        x = rng.standard_normal((48, K)).astype(np.float32)
        full = prepared_chain(backend, w_gu, K, F, wtype, w_down, M, x, norm)
        for n in (1, 9, 16, 23, 48):
            got = prepared_chain(backend, w_gu, K, F, wtype, w_down, M, x[:n], norm)
            want = separate_chain(backend, w_perm, K, F, wtype, w_down, M, x[:n], norm)
            assert np.array_equal(got, want), f"K={K} F={F} N={n}: not the separate preparation's bits"
            assert np.array_equal(got, full[:n]), f"K={K} F={F}: the first {n} of 48 columns differ when N={n}"
            if wtype == ggml.Type.Q6_K:   # for a Q6_K reader: the run sums left out, the values those written for Q4_K
                bare = swiglu_prepared(backend, w_gu, K, F, x[:n], norm, ggml.Type.Q6_K)
                summed = swiglu_prepared(backend, w_gu, K, F, x[:n], norm, ggml.Type.Q4_K)
                cb, cs = chunks(bare), chunks(summed)
                assert not cb[:, 32].any() and cs[:, 32, :n].any(), f"K={K} F={F} N={n}: sums"
                assert not cb[:, 33].any() and not cs[:, 33].any(), f"K={K} F={F} N={n}: the zeros chunk"
                assert np.array_equal(cb[:, :32].view(np.uint16), cs[:, :32].view(np.uint16))
        xd = x.astype(np.float64)
        if normed:
            xd = xd / np.sqrt((xd * xd).mean(axis=1, keepdims=True) + EPS) * norm
        gu = xd @ w_ref.T
        gated = gu[:, :F] / (1.0 + np.exp(-gu[:, :F])) * gu[:, F:]
        err = rel_err(full, gated.astype(np.float16).astype(np.float64) @ d_ref.T)
        assert err < 2e-3, f"K={K} F={F}: relative error {err:.2e} against float64"
