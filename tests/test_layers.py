"""pydflash.models.layers.linear: which matmul each weight gets. By default (PYDFLASH_QMATMUL unset or auto) ggml's
mul_mat, except where ggml_qmatmul is the faster kernel on GPU weights (Q4_K/Q5_K/Q6_K at 4..24 columns, any
quantised matrix of at most 1024 rows from 9 columns on, and on GPUs with its streaming
kernel Q4_K/Q5_K/Q6_K matrices of more than 1024 rows at one column); with
PYDFLASH_QMATMUL=1 quantised GPU weights with 1..48 columns take ggml_qmatmul, with 0 none does; the CPU keeps
mul_mat (its SIMD kernels) always."""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import ggml
from pydflash.models import layers
from pydflash.models.layers import linear

NOT_QMATMUL_TYPES = [ggml.Type.F32, ggml.Type.F16, ggml.Type.Q4_0, ggml.Type.Q4_1]


def _route(backend: ggml.Backend | None, wtype: ggml.Type, n_cols: int, x_ne2: int = 1, rows: int = 32) -> ggml.Op:
    """The op linear picks for a [256, rows] weight of wtype (allocated on backend, or not at all for None) times
    f32 x [256, n_cols, x_ne2]."""
    wctx = ggml.Context(n_tensors=1)
    w = wctx.new_tensor(wtype, (256, rows), name="w")
    buffer = backend.alloc_tensors(wctx) if backend is not None else None
    ctx = ggml.Context(n_tensors=4)
    op = linear(ctx, w, ctx.new_tensor(np.float32, (256, n_cols, x_ne2))).op
    if buffer is not None:
        buffer.close()
    return op


@pytest.fixture
def qmatmul_on(monkeypatch):
    monkeypatch.setenv("PYDFLASH_QMATMUL", "1")


@pytest.fixture
def qmatmul_default(monkeypatch):
    monkeypatch.delenv("PYDFLASH_QMATMUL", raising=False)


def test_one_column_rule(qmatmul_default, monkeypatch):
    """auto at one column: ggml_qmatmul for Q4_K/Q5_K/Q6_K matrices of more than QMATMUL_SMALL_ROWS rows on a GPU
    with the streaming kernel (layers._streams), ggml's vector kernel everywhere else."""
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    large, small = layers.QMATMUL_SMALL_ROWS + 1, layers.QMATMUL_SMALL_ROWS
    for streams in (True, False):
        monkeypatch.setattr(layers, "_streams", lambda w, streams=streams: streams)
        taken = {wtype: [rows for rows in (small, large) if _route(None, wtype, 1, rows=rows) == ggml.Op.QMATMUL]
                 for wtype in ggml.QMATMUL_TYPES}
        want = [large] if streams else []
        assert taken == {ggml.Type.Q4_K: want, ggml.Type.Q5_K: want, ggml.Type.Q6_K: want, ggml.Type.Q8_0: []}
        assert _route(None, ggml.Type.Q4_K, 2, rows=large) == ggml.Op.MUL_MAT   # two columns: ggml's, either way


def test_streams_is_false_off_a_streaming_gpu():
    """The capability query: no weight buffer, or a CPU one, never takes the streaming kernel (the CPU registry has
    no "ggml_ext_qmatmul_streams" proc address)."""
    wctx = ggml.Context(n_tensors=1)
    w = wctx.new_tensor(ggml.Type.Q4_K, (256, 8), name="w")
    assert layers._streams(w) is False
    buffer = ggml.Backend("cpu").alloc_tensors(wctx)
    assert layers._streams(w) is False
    buffer.close()


@pytest.mark.parametrize("wtype", [*ggml.QMATMUL_TYPES, ggml.Type.F32])
def test_default_cpu_weights_take_mul_mat(qmatmul_default, wtype):
    assert not layers.qmatmul_enabled()
    assert _route(ggml.Backend("cpu"), wtype, 8) == ggml.Op.MUL_MAT


@pytest.mark.parametrize("wtype", [ggml.Type.Q4_K, ggml.Type.Q8_0, ggml.Type.F32])
def test_opt_in_cpu_weights_keep_mul_mat(qmatmul_on, wtype):
    assert layers.qmatmul_enabled()
    assert _route(ggml.Backend("cpu"), wtype, 8) == ggml.Op.MUL_MAT
    assert _route(None, wtype, 8) == ggml.Op.MUL_MAT   # not placed yet: not known to be a GPU's


def test_opt_in_rule_for_device_weights(qmatmul_on, monkeypatch):
    """The type/shape half of the rule, with the weight taken as a GPU's (the CUDA tests below check the buffer
    half on a real one)."""
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    for wtype in ggml.QMATMUL_TYPES:
        assert _route(None, wtype, 1) == ggml.Op.QMATMUL
        assert _route(None, wtype, 48) == ggml.Op.QMATMUL
        assert _route(None, wtype, 49) == ggml.Op.MUL_MAT        # past ggml_qmatmul's column limit
        assert _route(None, wtype, 8, x_ne2=2) == ggml.Op.MUL_MAT  # batched x: not a matrix
    for wtype in NOT_QMATMUL_TYPES:
        assert _route(None, wtype, 8) == ggml.Op.MUL_MAT


def test_default_rule_for_device_weights(qmatmul_default, monkeypatch):
    """auto: ggml_qmatmul for Q4_K/Q5_K/Q6_K at 4..24 columns (where ggml's vector kernel re-decodes the weights per
    column, or its MMQ tiles are slower or leave the residual add and GLU to kernels of their own), and for any
    quantised matrix of at most QMATMUL_SMALL_ROWS rows from 9 columns on (where ggml's stream-k fix-up outweighs
    the product); 0: never."""
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    large, small = layers.QMATMUL_SMALL_ROWS + 1, layers.QMATMUL_SMALL_ROWS
    taken = {wtype: [n for n in range(1, 50) if _route(None, wtype, n, rows=large) == ggml.Op.QMATMUL]
             for wtype in ggml.QMATMUL_TYPES}
    assert taken == {ggml.Type.Q4_K: list(range(4, 25)), ggml.Type.Q5_K: list(range(4, 25)),
                     ggml.Type.Q6_K: list(range(4, 25)), ggml.Type.Q8_0: []}
    for wtype in ggml.QMATMUL_TYPES:
        small_taken = [n for n in range(1, 50) if _route(None, wtype, n, rows=small) == ggml.Op.QMATMUL]
        assert small_taken == sorted(set(taken[wtype]) | set(range(9, 49)))   # 49: past the column limit
    lm_head = 248320                                         # (the 27B's LM head: as any large matrix)
    assert [n for n in range(1, 50) if _route(None, ggml.Type.Q6_K, n, rows=lm_head) == ggml.Op.QMATMUL] == \
        list(range(4, 25))
    for wtype in NOT_QMATMUL_TYPES:
        for rows in (small, large):
            assert all(_route(None, wtype, n, rows=rows) == ggml.Op.MUL_MAT for n in (1, 4, 8, 16))
    monkeypatch.setenv("PYDFLASH_QMATMUL", "auto")
    assert _route(None, ggml.Type.Q4_K, 8, rows=large) == ggml.Op.QMATMUL
    monkeypatch.setenv("PYDFLASH_QMATMUL", "0")
    assert _route(None, ggml.Type.Q4_K, 8, rows=large) == ggml.Op.MUL_MAT
    assert _route(None, ggml.Type.Q4_K, 16, rows=small) == ggml.Op.MUL_MAT
    assert layers.kernel_mode() == "ggml"


def test_f16_kernel_takes_large_q4_k_and_q6_k_matrices_up_to_48_columns(qmatmul_default, monkeypatch):
    """auto on a GPU with the f16 kernel (layers._streams): Q4_K and Q6_K matrices of at least QMATMUL_F16_MIN_ITEMS
    (256-row tile, K unit) pairs go to ggml_qmatmul at every column count up to its 48-column limit (the f16 kernel
    from 2 columns, the streaming kernel at one), Q5_K
    keeps 4..24, BF16 goes only where the f16 kernel's family takes it (from one column: it has no int8 kernels);
    PYDFLASH_QMATMUL_F16=0 gives the int8 rule back (and BF16 to mul_mat)."""
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    monkeypatch.setattr(layers, "_streams", lambda w: True)
    monkeypatch.delenv("PYDFLASH_QMATMUL_F16", raising=False)
    rows = 256 * layers.QMATMUL_F16_MIN_ITEMS   # (K = 256: one unit a row)
    def taken(wtype, rows=rows):
        return [n for n in range(1, 50) if _route(None, wtype, n, rows=rows) == ggml.Op.QMATMUL]
    assert taken(ggml.Type.Q4_K) == list(range(1, 49))
    assert taken(ggml.Type.Q6_K) == list(range(1, 49))
    assert taken(ggml.Type.Q5_K) == [1] + list(range(4, 25))
    assert taken(ggml.Type.Q4_K, rows - 256) == [1] + list(range(4, 25))
    assert taken(ggml.Type.BF16) == list(range(1, 49))   # BF16: through the f16 kernel's family only
    assert taken(ggml.Type.BF16, rows - 256) == []
    assert layers.kernel_mode() == "auto+f16"
    monkeypatch.setenv("PYDFLASH_QMATMUL_F16", "0")
    assert taken(ggml.Type.Q4_K) == [1] + list(range(4, 25))
    assert taken(ggml.Type.BF16) == []
    assert layers.kernel_mode() == "auto"
    monkeypatch.delenv("PYDFLASH_QMATMUL_F16")
    monkeypatch.setenv("PYDFLASH_QMATMUL", "1")   # every int8 type at every column count; BF16 still never
    assert taken(ggml.Type.Q4_K) == list(range(1, 49))
    assert taken(ggml.Type.BF16) == []


def test_bad_switch_value_is_named(monkeypatch):
    monkeypatch.setenv("PYDFLASH_QMATMUL", "yes")
    with pytest.raises(ValueError, match="PYDFLASH_QMATMUL must be 0, 1 or auto, got 'yes'"):
        _route(ggml.Backend("cpu"), ggml.Type.Q4_K, 8)


@pytest.mark.cuda
def test_default_gpu_weights_take_qmatmul_where_faster(qmatmul_default):
    """The rule on a real GPU weight: one column takes ggml_qmatmul where the device streams (Hopper: the real
    capability query, not a stand-in), and for the stream types only."""
    backend = ggml.Backend("cuda")
    large = layers.QMATMUL_SMALL_ROWS + 256
    streams = ggml.qmatmul_streams(backend._dev)
    for wtype in ggml.QMATMUL_TYPES:
        one_column = ggml.Op.QMATMUL if streams and wtype in ggml.QMATMUL_STREAM_TYPES else ggml.Op.MUL_MAT
        assert _route(backend, wtype, 1, rows=large) == one_column
        assert _route(backend, wtype, 1, rows=layers.QMATMUL_SMALL_ROWS) == ggml.Op.MUL_MAT
        assert _route(backend, wtype, 32, rows=large) == ggml.Op.MUL_MAT
        assert _route(backend, wtype, 16) == ggml.Op.QMATMUL          # 32 rows: ggml would split K (stream-k)
    assert _route(backend, ggml.Type.Q4_K, 8, rows=large) == ggml.Op.QMATMUL
    assert _route(backend, ggml.Type.Q4_K, 23, rows=large) == ggml.Op.QMATMUL
    assert _route(backend, ggml.Type.Q8_0, 8, rows=large) == ggml.Op.MUL_MAT


@pytest.mark.cuda
def test_opt_in_gpu_quantised_weights_take_qmatmul_up_to_48_columns(qmatmul_on):
    backend = ggml.Backend("cuda")
    for wtype in ggml.QMATMUL_TYPES:
        assert _route(backend, wtype, 1) == ggml.Op.QMATMUL
        assert _route(backend, wtype, 48) == ggml.Op.QMATMUL
        assert _route(backend, wtype, 49) == ggml.Op.MUL_MAT
    assert _route(backend, ggml.Type.F16, 8) == ggml.Op.MUL_MAT
