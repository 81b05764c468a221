"""Model state on the device: the attention KV cache and the Gated DeltaNet recurrent and conv states.

All of it lives in one device buffer, allocated once for `n_ctx` positions. Graphs write into it with
`set_rows` (KV) and `cpy` (recurrent state); the host only tracks how many positions are filled.
"""
from __future__ import annotations

import numpy as np

from . import ggml
from .tq3 import Rotation
from .validate import tensor_bytes

KV_TYPES = {"f16": ggml.Type.F16, "q8_0": ggml.Type.Q8_0, "q4_0": ggml.Type.Q4_0, "tq3_0": ggml.Type.TQ3_0}


def kv_type_of(name) -> ggml.Type:
    """A KV-cache type by name ('f16', ...) or as one of those ggml types; anything else is refused (flash
    attention asserts on other types)."""
    if isinstance(name, ggml.Type) and name in KV_TYPES.values():
        return name
    if isinstance(name, str) and name.lower() in KV_TYPES:
        return KV_TYPES[name.lower()]
    raise ValueError(f"kv type {name!r}: expected one of {sorted(KV_TYPES)}")


def hadamard(n: int) -> np.ndarray:
    """The orthonormal n x n Walsh-Hadamard matrix (Sylvester order, symmetric, its own inverse)."""
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


class HybridCache:
    """KV rows for the attention layers and (conv, S) states for the GDN layers of one sequence.

    k[il], v[il]: [head_dim * n_head_kv, n_ctx] of `kv_type` (one row per position).
    conv[il]:     f32 [(d_conv - 1) * conv_dim]   the last d_conv-1 inputs of the causal conv, channel-major.
    ssm[il]:      f32 [d_v * d_v * n_v_heads]     the delta-rule state S per v head.
    k_all, v_all, conv_all, ssm_all: every attention layer's k[il] / v[il] ([kv_row, n_ctx, n_attn], in the order
    of attn_layers) and every recurrent layer's conv[il] / ssm[il] (columns, in the order of rec_layers) as one
    tensor each; the per-layer tensors are placed on their slices (Buffer.alias), so one op can update all layers
    (a speculative commit).
    With Q8_0 / Q4_0, K and V rows are stored rotated by a Walsh-Hadamard matrix, as llama.cpp does (it spreads
    outliers across the block before quantising): k_rot / v_rot hold those matrices. TQ3_0 rotates inside its
    quantiser (pydflash/tq3.py), so only the query needs rotating and the attention output un-rotating:
    tq3_rotation (a pydflash.tq3.Rotation, in a buffer of its own) does both.
    """

    def __init__(self, backend: ggml.Backend, hp, n_ctx: int, kv_type="f16"):
        self.n_ctx = n_ctx
        self.kv_type = kv_type_of(kv_type)
        self.epoch = 0
        self.n_past = 0
        n_attn = sum(1 for r in hp.recurrent if not r)
        n_rec = hp.n_layer - n_attn
        self._ctx = ggml.Context(n_tensors=6)
        kv_row = hp.head_dim * hp.n_head_kv
        self.k, self.v, self.conv, self.ssm = {}, {}, {}, {}
        self.rec_layers = [il for il in range(hp.n_layer) if hp.recurrent[il]]
        self.attn_layers = [il for il in range(hp.n_layer) if not hp.recurrent[il]]
        self.k_all = self.v_all = self.conv_all = self.ssm_all = None
        if n_attn:
            self.k_all = self._ctx.new_tensor(self.kv_type, (kv_row, n_ctx, n_attn), name="cache.k")
            self.v_all = self._ctx.new_tensor(self.kv_type, (kv_row, n_ctx, n_attn), name="cache.v")
        if n_rec:
            self.conv_all = self._ctx.new_tensor(ggml.Type.F32, ((hp.ssm_d_conv - 1) * hp.conv_dim, n_rec),
                                                 name="cache.conv")
            self.ssm_all = self._ctx.new_tensor(ggml.Type.F32, (hp.ssm_d_v * hp.ssm_d_v * hp.ssm_n_v_heads, n_rec),
                                                name="cache.ssm")
        self.k_rot = self.v_rot = self.tq3_rotation = None
        if self.kv_type == ggml.Type.TQ3_0:
            if hp.head_dim % 128:
                raise ValueError(f"kv type tq3_0 rotates groups of 128 values: head size {hp.head_dim} is not a "
                                 f"multiple of 128")
            self.tq3_rotation = Rotation(backend)
        elif self.kv_type != ggml.Type.F16 and hp.head_dim % 64 == 0:
            n_k = 64   # the largest power of two (>= 64) dividing the head size, like llama.cpp
            while hp.head_dim % (2 * n_k) == 0:
                n_k *= 2
            self.k_rot = self._ctx.new_tensor(ggml.Type.F32, (n_k, n_k), name="cache.k_rot")
            self.v_rot = self._ctx.new_tensor(ggml.Type.F32, (64, 64), name="cache.v_rot")
        self.buffer = backend.alloc_tensors(self._ctx)
        self._layer_ctx = ggml.Context(n_tensors=max(2 * hp.n_layer, 1))
        for per_layer, whole, layers, ne, name in ((self.k, self.k_all, self.attn_layers, (kv_row, n_ctx), "k"),
                                                   (self.v, self.v_all, self.attn_layers, (kv_row, n_ctx), "v"),
                                                   (self.conv, self.conv_all, self.rec_layers, None, "conv"),
                                                   (self.ssm, self.ssm_all, self.rec_layers, None, "ssm")):
            if whole is not None:   # (conv, ssm: one column of the whole)
                parts = self.buffer.alias_slices(self._layer_ctx, whole, ne or (whole.ne[0],),
                                                 [f"cache.l{il}.{name}" for il in layers])
                per_layer.update(zip(layers, parts))
        self.k_words, self.v_words = self._word_views(kv_row, n_ctx)
        self.reset()

    @staticmethod
    def plan_bytes(hp, n_ctx: int, kv_type="f16") -> int:
        """Bytes a cache of n_ctx cells would take, in exact arithmetic (checked against the device first)."""
        kv_type = kv_type_of(kv_type)
        n_attn = sum(1 for r in hp.recurrent if not r)
        n_rec = hp.n_layer - n_attn
        kv_row = hp.head_dim * hp.n_head_kv
        kv = 2 * n_attn * tensor_bytes(kv_type, (kv_row, n_ctx))
        if not n_rec:      # attention-only models have no recurrent sizes
            return kv
        return kv + 4 * n_rec * ((hp.ssm_d_conv - 1) * hp.conv_dim + hp.ssm_d_v * hp.ssm_d_v * hp.ssm_n_v_heads)

    def _word_views(self, kv_row: int, n_ctx: int) -> tuple:
        """k_all and v_all's rows seen as f32 words ([row bytes / 4, n_ctx, n_attn], on the same memory):
        get_rows/set_rows between such views copy quantized rows bit for bit, so a speculative commit moves them
        without a dequantize/requantize round trip (which TQ3_0 would also rotate a second time). (None, None)
        when a row is not a whole number of words (then the rows are moved through f32 values)."""
        row_bytes = ggml.row_size(self.kv_type, kv_row)
        if not self.k or row_bytes % 4:
            return None, None
        self._words_ctx = ggml.Context(n_tensors=2)
        return tuple(self.buffer.alias(self._words_ctx.new_tensor(ggml.Type.F32, (row_bytes // 4,) + t.ne[1:3],
                                                                  name=f"{t.name}.words"), t)
                     for t in (self.k_all, self.v_all))

    def reset(self) -> None:
        """Forget the sequence: zero the states (KV rows past n_past are masked, but zeroed too)."""
        self.buffer.clear(0)
        if self.k_rot is not None:
            self.k_rot.set(hadamard(self.k_rot.ne[0]))
            self.v_rot.set(hadamard(64))
        self.n_past = 0

    @property
    def n_past(self) -> int:
        return self._n_past

    @n_past.setter
    def n_past(self, value: int) -> None:
        # every forward, commit and reset sets n_past: the epoch tells a holder of saved state (the prefix
        # cache) whether anyone has run the model since it last looked
        self._n_past = int(value)
        self.epoch += 1

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes
