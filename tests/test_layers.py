"""pydflash.models.layers.linear: which matmul each weight gets. The CPU keeps ggml's mul_mat (its SIMD kernels);
quantised weights on a GPU with 1..48 columns take ggml_qmatmul."""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import ggml
from pydflash.models.layers import linear


def _route(backend: ggml.Backend, wtype: ggml.Type, n_cols: int, allocate: bool = True) -> ggml.Op:
    wctx = ggml.Context(n_tensors=1)
    w = wctx.new_tensor(wtype, (256, 32), name="w")
    buffer = backend.alloc_tensors(wctx) if allocate else None
    ctx = ggml.Context(n_tensors=4)
    op = linear(ctx, w, ctx.new_tensor(np.float32, (256, n_cols))).op
    if buffer is not None:
        buffer.close()
    return op


@pytest.mark.parametrize("wtype", [ggml.Type.Q4_K, ggml.Type.Q8_0, ggml.Type.F32])
def test_cpu_weights_keep_ggml_mul_mat(wtype):
    backend = ggml.Backend("cpu")
    assert _route(backend, wtype, 8) == ggml.Op.MUL_MAT
    assert _route(backend, wtype, 8, allocate=False) == ggml.Op.MUL_MAT   # not placed yet: not known to be a GPU's


@pytest.mark.cuda
def test_gpu_quantised_weights_take_qmatmul_up_to_48_columns():
    backend = ggml.Backend("cuda")
    for wtype in ggml.QMATMUL_TYPES:
        assert _route(backend, wtype, 1) == ggml.Op.QMATMUL
        assert _route(backend, wtype, 48) == ggml.Op.QMATMUL
        assert _route(backend, wtype, 49) == ggml.Op.MUL_MAT
    assert _route(backend, ggml.Type.F16, 8) == ggml.Op.MUL_MAT
