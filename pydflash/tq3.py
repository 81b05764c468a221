"""TQ3_0, the 3.5-bit KV-cache type (format in ggml_ext/include/ggml-ext.h).

K and V rows are stored rotated: every 128-value group x is kept as R x, with R a fixed randomised Hadamard
transform, quantised to 3-bit Lloyd-Max levels. Attention over such a cache needs the query rotated the same
way (R is orthogonal, so (R q).(R k) = q.k) and gives the rotated output R o, which is un-rotated afterwards.
`Rotation` holds R on a backend and adds those two steps to a graph; `flash_attn` wraps ggml_flash_attn_ext
with them, so a model switches its cache to TQ3_0 with one call. Writing the cache needs nothing new:
ggml_set_rows / ggml_cpy from f32 or f16 into a TQ3_0 tensor rotate and quantise on the way in.
"""
from __future__ import annotations

import numpy as np

from .ggml import Backend, Context, Tensor, Type, row_size
from .ggml.ext import tq3_0_rotate

GROUP = 128            # values rotated together (the ggml block of TQ3_0)
SUB_BLOCK = 32         # values per 14-byte sub-block
SUB_BLOCK_BYTES = 14
BITS_PER_VALUE = SUB_BLOCK_BYTES * 8 / SUB_BLOCK  # 3.5

# The 8 Lloyd-Max levels for N(0,1) (same constants as TQ3_0_LEVELS_INIT in ggml-ext.h) and their
# mean squared error on N(0,1), both derived in float64 by iterating Lloyd's algorithm.
LEVELS = np.array([-2.151945704536987, -1.3439092785050014, -0.7560052812058783, -0.2450941789442219,
                   0.2450941789442219, 0.7560052812058783, 1.3439092785050014, 2.151945704536987])
LLOYD_MAX_MSE = 0.0345477607885037


def _check_rows(n: int) -> None:
    if n % GROUP:
        raise ValueError(f"TQ3_0 rows must be a multiple of {GROUP} values, not {n}")


def rotate(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Apply R (or R^T with inverse=True) to every 128-value group of the last axis, in float32, with the
    library's own transform."""
    return tq3_0_rotate(x, inverse)


def rotation_matrix() -> np.ndarray:
    """R as a float64 [128, 128] matrix (y = R @ x). Its entries are exactly +-1/sqrt(128); the signs come from
    the library, so this never drifts from the C constants."""
    cols = rotate(np.eye(GROUP, dtype=np.float32))  # row i = R e_i = column i of R
    return np.sign(cols.T.astype(np.float64)) / np.sqrt(GROUP)


def dequantize(raw: np.ndarray, n: int) -> np.ndarray:
    """Decode raw TQ3_0 rows (uint8, last axis = the row's bytes) to float64 values of the rotated domain,
    straight from the documented bit layout (a reference independent of the C decoder)."""
    _check_rows(n)
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    lead = raw.shape[:-1]
    blocks = raw.reshape(-1, SUB_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)[:, 0]
    qs, qh = blocks[:, 2:10], blocks[:, 10:14]
    j = np.arange(SUB_BLOCK)
    low = (qs[:, j % 8] >> (2 * (j // 8))) & 3
    high = (qh[:, j // 8] >> (j % 8)) & 1
    values = d[:, None] * LEVELS[low | (high << 2)]
    return values.reshape(lead + (n,))


def kv_cache_bytes(n_ctx: int, n_layers: int, n_kv_heads: int, head_dim: int, type_: Type = Type.TQ3_0) -> int:
    """Bytes of a K and V cache of n_ctx tokens: n_layers x 2 (K, V) x n_kv_heads rows of head_dim values."""
    return n_layers * 2 * n_ctx * n_kv_heads * row_size(type_, head_dim)


class Rotation:
    """R and R^T as f32 [128, 128] tensors on a backend, and the graph steps that use them.

    Rotating Q costs one mul_mat of 128 multiply-adds per value, negligible next to attention's n_kv x head_dim
    per query row. (Upstream's Hadamard hint on mul_mat computes the bare FWHT but would need two more ops for
    the sign flips.) The output un-rotation can instead be folded into the attention output projection once at
    load time with `fold_into_output_proj`; the Q rotation cannot be folded into W_q because RoPE sits between.
    """

    def __init__(self, backend: Backend):
        self._ctx = Context(n_tensors=2)
        self.r = self._ctx.new_tensor(Type.F32, (GROUP, GROUP), name="tq3_rot")
        self.rt = self._ctx.new_tensor(Type.F32, (GROUP, GROUP), name="tq3_rot_t")
        self._buffer = backend.alloc_tensors(self._ctx)
        r = rotation_matrix()
        # mul_mat(a, b) gives, per column b_j, A @ b_j with A the numpy view of a.
        self.r.set(r.astype(np.float32))
        self.rt.set(np.ascontiguousarray(r.T, dtype=np.float32))

    def _apply(self, ctx: Context, x: Tensor, m: Tensor) -> Tensor:
        _check_rows(x.ne[0])
        if not x.is_contiguous:
            x = ctx.cont(x)
        n = 1
        for s in x.ne:
            n *= s
        y = ctx.mul_mat(m, ctx.reshape_2d(x, GROUP, n // GROUP))
        return ctx.reshape_4d(y, *x.ne)

    def rotate(self, ctx: Context, x: Tensor) -> Tensor:
        """R applied to every 128-value group of x's rows (the query before attending to a TQ3_0 cache).
        A non-contiguous x is copied first: rotate Q while it is still contiguous (before the permute that
        feeds flash attention; its rows are head rows either way) to avoid that copy."""
        return self._apply(ctx, x, self.r)

    def unrotate(self, ctx: Context, x: Tensor) -> Tensor:
        """R^T applied to every 128-value group (the attention output over a TQ3_0 V cache)."""
        return self._apply(ctx, x, self.rt)

    def close(self) -> None:
        self._buffer.close()
        self._ctx.close()


def flash_attn(ctx: Context, rot: Rotation, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float,
               max_bias: float = 0.0, logit_softcap: float = 0.0) -> Tensor:
    """ggml_flash_attn_ext over a cache whose K and/or V are TQ3_0: rotates q when K is TQ3_0 and un-rotates
    the output when V is TQ3_0. Shapes as ggml_flash_attn_ext: q [D, n_q, n_head, n_seq], k/v
    [D, n_kv, n_kv_head, n_seq]; returns f32 [D_v, n_head, n_q, n_seq]."""
    if k.type == Type.TQ3_0:
        q = rot.rotate(ctx, q)
    out = ctx.flash_attn_ext(q, k, v, mask, scale, max_bias, logit_softcap)
    if v.type == Type.TQ3_0:
        out = rot.unrotate(ctx, out)
    return out


def fold_into_output_proj(w_o: np.ndarray) -> np.ndarray:
    """The output projection W_o (numpy [d_model, n_head*head_dim]) with the V un-rotation folded in:
    W_o @ blockdiag(R^T), so that W_o' (R o) = W_o o and `flash_attn`'s un-rotation can be skipped."""
    w_o = np.asarray(w_o)
    _check_rows(w_o.shape[-1])
    r = rotation_matrix()
    groups = w_o.reshape(w_o.shape[0], -1, GROUP).astype(np.float64)
    return np.einsum("ogk,jk->ogj", groups, r).reshape(w_o.shape).astype(w_o.dtype)
