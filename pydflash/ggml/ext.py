"""Checked wrappers of pydflash's own ggml ops (ggml_ext): bad shapes, types or parent arrays raise here,
before ggml, which would abort the process.
"""
from __future__ import annotations

import numpy as np

from ._ffi import ffi, lib
from .core import Context, Tensor, Type


def check_parents(parent: np.ndarray) -> np.ndarray:
    """Validate a parent array [n_s, n_t] (numpy order): each entry is -1 or an earlier index of its row."""
    parent = np.asarray(parent)
    if parent.ndim == 1:
        parent = parent[None, :]
    if parent.ndim != 2 or not np.issubdtype(parent.dtype, np.integer):
        raise ValueError(f"parent must be an integer array [n_t] or [n_s, n_t], got {parent.dtype} {parent.shape}")
    idx = np.arange(parent.shape[1])
    bad = (parent < -1) | (parent >= idx)
    if bad.any():
        s, t = map(int, np.argwhere(bad)[0])
        raise ValueError(f"parent[{s}, {t}] = {int(parent[s, t])}: a node's parent must be -1 or an earlier node")
    return parent.astype(np.int32)


def _expect(t: Tensor, what: str, type_: Type, ne: tuple[int, ...]) -> None:
    if t.type != type_:
        raise TypeError(f"{what} must be {type_.name}, got {t.type.name}")
    if t.ne[: len(ne)] != ne or any(n != 1 for n in t.ne[len(ne):]):
        raise ValueError(f"{what} must have ne {ne}, got {t.shape}")


def ssm_conv_tree(ctx: Context, sx: Tensor, c: Tensor, parent: Tensor) -> Tensor:
    """Causal depthwise conv over a token tree: sx [d_conv-1+n_t, d_inner, n_s], c [d_conv, d_inner],
    parent i32 [n_t, n_s] -> [d_inner, n_t, n_s]. Parent values are checked by `check_parents` when set."""
    d_conv, d_inner = c.ne[0], c.ne[1]
    _expect(c, "c (conv kernel)", Type.F32, (d_conv, d_inner))
    n_t = sx.ne[0] - (d_conv - 1)
    if n_t < 1:
        raise ValueError(f"sx needs d_conv-1={d_conv - 1} state columns plus at least one token, has {sx.ne[0]}")
    _expect(sx, "sx", Type.F32, (sx.ne[0], d_inner, sx.ne[2]))
    _expect(parent, "parent", Type.I32, (n_t, sx.ne[2]))
    if d_conv > 16:
        raise ValueError(f"conv kernel size {d_conv} > 16 is not supported")
    return Tensor(lib.ggml_ssm_conv_tree(ctx._ptr, sx._ptr, c._ptr, parent._ptr), ctx)


def tq3_0_rotate(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """TQ3_0's rotation R (or R^T with inverse=True) of every 128-value group of the last axis, float32,
    computed by the library itself (ggml_ext_tq3_0_rotate)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % 128:
        raise ValueError(f"TQ3_0 rows must be a multiple of 128 values, not {x.shape[-1]}")
    y = np.empty_like(x)
    lib.ggml_ext_tq3_0_rotate(ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y), x.size, inverse)
    return y
