"""Graph pieces shared by the target architectures: the weight matmul, norms, the SwiGLU FFN, rotary
embeddings and attention over the KV cache.

Every weight matmul of an architecture's graph goes through `linear`, so that one place decides how a
(quantised) weight meets the activations.
"""
from __future__ import annotations

import math
import os

import numpy as np

from .. import ggml
from ..ggml._ffi import ffi, lib

ROPE_TYPE_NORMAL = 0      # llama: rotate adjacent pairs (x0, x1), (x2, x3), ...
ROPE_TYPE_NEOX = 2        # qwen2/qwen3: rotate halves (x0, x_{d/2}), ...
ROPE_TYPE_IMROPE = 40     # qwen35: interleaved multi-section rope over 4 position axes


def env_switch(name: str, default: str = "0") -> bool:
    """An on/off environment setting: '1' or '0' (unset: `default`); anything else is refused by name."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


# Where ggml_qmatmul beats ggml's mul_mat (H100, docs/benchmarks.md "Which kernel a verify's matmuls take" and
# "A one-column kernel that streams"). By column count and type: at one column, on GPUs where it streams
# (ggml.qmatmul_streams: Hopper), matrices of more than QMATMUL_SMALL_ROWS rows (Q4_K/Q5_K 0.70-0.88x ggml's vector
# kernel's time, Q6_K LM head 0.69x; smaller ones are ggml's); at 2 columns ggml's is faster; at 4-8 columns ggml's
# vector kernel re-decodes every weight per column (ours: Q4_K 0.45-0.90x its time, Q5_K 0.56-0.80x, Q6_K
# 0.57-1.13x); from 9 columns ggml's MMQ tiles take over, and for Q4_K/Q5_K our kernel stays ahead up to 24
# (0.77-0.98x: a verify of a budget-22 tree), level or behind above. Q6_K at 9-24 is level with MMQ alone (the
# 27B FFN down at 23 columns 86 us against 85, its LM head 0.92-0.98x) but takes the residual add and the SwiGLU
# into the product (ggml_qmatmul_fused), which MMQ leaves to kernels of their own: the budget-22 step 0.1-0.3 ms
# faster (thirteenth session). Q8_0 loses there.
QMATMUL_FASTER_COLS = {ggml.Type.Q4_K: range(4, 25), ggml.Type.Q5_K: range(4, 25), ggml.Type.Q6_K: range(4, 25)}
# And by shape: a matrix of at most this many rows fills at most 8 of MMQ's 128-row tiles, so from 9 columns ggml
# splits its K over the SMs (stream-k) and the fix-up pass that adds the pieces costs more than the product (27B
# verify profile: a GDN layer's 96-row beta/alpha matrix 7.8 us + 32.7 us of fix-up; ours 0.30-0.48x, and 0.71-0.93x
# on a 1024-row Q6_K matrix).
QMATMUL_SMALL_ROWS = 1024


def qmatmul_faster(wtype: ggml.Type, n_rows: int, n_cols: int, streams: bool = False) -> bool:
    """Whether ggml_qmatmul is the faster kernel for a quantised GPU weight of n_rows outputs times n_cols columns
    (the `auto` rule of qmatmul_mode); streams: the weight's GPU has its one-column streaming kernel."""
    if n_cols == 1:
        return streams and wtype in ggml.QMATMUL_STREAM_TYPES and n_rows > QMATMUL_SMALL_ROWS
    if n_cols in QMATMUL_FASTER_COLS.get(wtype, ()):
        return True
    return n_cols > 8 and n_rows <= QMATMUL_SMALL_ROWS


def qmatmul_mode() -> str:
    """PYDFLASH_QMATMUL: unset or 'auto' (the default) sends quantised GPU weight matmuls through ggml_qmatmul only
    where it is the faster kernel (qmatmul_faster), '1' wherever it takes them (1..48 columns), '0' never.
    PYDFLASH_BITEXACT=1 implies '1'. Read when a graph is built, so a change applies to graphs built after it."""
    if bitexact_enabled():
        return "1"
    value = os.environ.get("PYDFLASH_QMATMUL", "auto")
    if value not in ("0", "1", "auto"):
        raise ValueError(f"PYDFLASH_QMATMUL must be 0, 1 or auto, got {value!r}")
    return value


def qmatmul_enabled() -> bool:
    """ggml_qmatmul for every quantised GPU weight matmul it takes (PYDFLASH_QMATMUL=1 or bit-exact mode)."""
    return qmatmul_mode() == "1"


def bitexact_enabled() -> bool:
    """PYDFLASH_BITEXACT=1: every op of a target graph whose result for one token could depend on how many tokens
    the graph holds takes a form that does not, so a verify slot's logits are the very bits a decode of its path
    gives (docs/benchmarks.md, "Bit-exact mode"): weight matmuls of up to 48 tokens through ggml_qmatmul
    (quantised) or as one matrix-vector product per token (others), decode and verify attention through
    ggml_flash_attn_ordered (f16 KV cache only), and a decode runs the recurrent layers through the tree ops as
    a one-node tree, as a verify does. Slower; off by default. Read when a graph is built."""
    return env_switch("PYDFLASH_BITEXACT")


def kernel_mode() -> str:
    """Which of the modes above graphs built now take (for benchmark reports): 'bit-exact', 'qmatmul' (ggml_qmatmul
    wherever it takes), 'auto' (ggml_qmatmul where it is faster) or 'ggml' (mul_mat only); '+f16' where
    ggml_qmatmul may take its f16 kernel (qmatmul_f16_enabled)."""
    mode = qmatmul_mode()
    if bitexact_enabled():
        return "bit-exact"
    name = {"1": "qmatmul", "0": "ggml", "auto": "auto"}[mode]
    return name + "+f16" if qmatmul_f16_enabled() else name


def _buffer_of(w: ggml.Tensor):
    ptr = w._ptr
    while ptr.view_src != ffi.NULL:
        ptr = ptr.view_src
    return ptr.buffer


def _on_device(w: ggml.Tensor) -> bool:
    """True when the weight lives in a buffer that is not host memory (a GPU backend's)."""
    buffer = _buffer_of(w)
    return buffer != ffi.NULL and not lib.ggml_backend_buffer_is_host(buffer)


def _streams(w: ggml.Tensor) -> bool:
    """True when the device holding the weight runs ggml_qmatmul's one-column streaming kernel."""
    buffer = _buffer_of(w)
    if buffer == ffi.NULL:
        return False
    device = lib.ggml_backend_buft_get_device(lib.ggml_backend_buffer_get_type(buffer))
    return device != ffi.NULL and ggml.qmatmul_streams(device)


def _takes_qmatmul(w: ggml.Tensor, x: ggml.Tensor) -> bool:
    """A quantised (or BF16) matrix in a GPU buffer times 1..48 f32 columns with contiguous rows: what ggml_qmatmul
    takes. The CPU keeps mul_mat (its SIMD kernels are faster than our float reference)."""
    return (w.type in ggml.QMATMUL_TYPES + ggml.QMATMUL_F16_FAMILY_TYPES and w.ne[2:] == (1, 1) and w.is_contiguous
            and x.type == ggml.Type.F32 and x.ne[2:] == (1, 1) and 1 <= x.ne[1] <= ggml.QMATMUL_MAX_COLS
            and x.nb[0] == 4 and _on_device(w))


# The f16 kernel (ggml.QMATMUL_F16; ggml_ext/cuda/qmatmul_shared.cuh): on Hopper, for Q4_K and Q6_K matrices of at
# least QMATMUL_F16_MIN_ITEMS (256-row tile, 256-value K unit) pairs, from QMATMUL_F16_MIN_COLS columns on (H100,
# docs/benchmarks.md "Fewer instructions around the f16 kernel's items": at 23 columns 0.55-0.91x the int8 kernels'
# time on the 27B's FFN gate/up (2,720 items), FFN down (Q6_K, 1,360), GDN input (1,300), attention Q/K (1,040), the
# GDN/attention output (480) and the LM head (19,400); at 2-8 columns, since its weight copies' rework and its
# launches' fixed occupancy (thirtieth and thirty-first sessions), 1.00-1.17x the one-column time on each of them,
# where the int8 kernels took 1.4-1.7x, in bench/qmatmul.py). Smaller
# matrices keep the int8 kernels: the pipeline's start and the tile fix-up weigh more there. One column keeps the
# streaming kernel (faster still, and the decode's bits).
# BF16 (a DFlash draft's matrices) in the kernel's bf16 form (8 warps a block), ggml_qmatmul taking BF16 nowhere
# else: the same item bound (the draft's fused Q/K/V, 480 items, in; its attention output, 320, level either way
# in four A/B pairs; K/V, 80-160, slower there), but from one column: there are no int8 kernels to prefer, and the
# 27B draft's 25,600-wide fc at 1-8 columns ran 2.5x faster than ggml's mul_mat_f (docs/benchmarks.md, eighteenth
# session).
QMATMUL_F16_TYPES = (ggml.Type.Q4_K, ggml.Type.Q6_K, ggml.Type.BF16)
QMATMUL_F16_MIN_ITEMS = 400
QMATMUL_F16_MIN_COLS = 2
QMATMUL_F16_MIN_COLS_BF16 = 1


def qmatmul_f16_enabled() -> bool:
    """ggml_qmatmul's f16 kernel where it is the faster (qmatmul_row_tiles) in the `auto` qmatmul_mode;
    PYDFLASH_QMATMUL_F16=0 keeps the int8 kernels. Not with PYDFLASH_QMATMUL=1 or in bit-exact mode, which promise
    every column's bits whatever the token count: the f16 kernel's results are its own, so one token's decode would
    not equal its verify."""
    return env_switch("PYDFLASH_QMATMUL_F16", default="1") and qmatmul_mode() == "auto"   # (bit-exact mode: "1")


def qmatmul_row_tiles(w: ggml.Tensor, n_cols: int) -> int:
    """ggml.qmatmul's row_tiles for w times n_cols columns: the f16 kernel (ggml.QMATMUL_F16) where it is faster,
    else 0 (the int8 kernels' own choice)."""
    return qmatmul_row_tiles_for(w.type, w.ne[0], w.ne[1], n_cols, _streams(w))


def qmatmul_row_tiles_for(wtype: ggml.Type, K: int, M: int, n_cols: int, streams: bool) -> int:
    """qmatmul_row_tiles for a K x M matrix of wtype on a device that does (streams: ggml.qmatmul_streams) or does
    not run the one-column streaming kernel and the f16 kernel (bench/qmatmul.py times what the runtime picks)."""
    items = -(-M // 256) * (K // 256)
    min_cols = QMATMUL_F16_MIN_COLS_BF16 if wtype == ggml.Type.BF16 else QMATMUL_F16_MIN_COLS
    if (streams and qmatmul_f16_enabled() and wtype in QMATMUL_F16_TYPES and K % 256 == 0
            and items >= QMATMUL_F16_MIN_ITEMS and n_cols >= min_cols):
        return ggml.QMATMUL_F16
    return 0


def norm_in_qmatmul_enabled() -> bool:
    """Products that ggml_qmatmul takes compute a Normed input's norm themselves (ggml_qmatmul_rms_norm): on the
    H100 the 27B shape's decode 3.5% faster than a separate norm and quantisation, its budget-22 verify 0.5 ms
    (docs/benchmarks.md, fourteenth session). PYDFLASH_NORM_IN_QMATMUL=0 keeps the norm as its own op."""
    return env_switch("PYDFLASH_NORM_IN_QMATMUL", default="1")


def head_norm_in_qmatmul_enabled() -> bool:
    """A Gated input whose up is RMS-normed per head (qwen35's GDN output gate) is normed where ggml_qmatmul
    quantises it too (ggml_qmatmul_fused's up with a norm): one kernel fewer per recurrent layer (H100, twentieth
    session: the 27B's budget-22 verify and its decode ~0.15 ms faster, docs/benchmarks.md).
    PYDFLASH_HEAD_NORM_IN_QMATMUL=0 runs ggml's rms_norm and mul before the product."""
    return env_switch("PYDFLASH_HEAD_NORM_IN_QMATMUL", default="1")


def conv_split_enabled() -> bool:
    """A tree verify's recurrent conv reads the conv state and the projection's rows where they are
    (ggml_ssm_conv_tree_split: the same bits without the concatenated copy; on the H100 the 27B shape's budget-22
    verify 0.55 ms faster, docs/benchmarks.md, thirteenth session). PYDFLASH_CONV_SPLIT=0 concatenates them first,
    as before."""
    return env_switch("PYDFLASH_CONV_SPLIT", default="1")


def gdn_conv_fused_enabled() -> bool:
    """A tree verify's recurrent conv also L2-norms the q and k heads, stores the slots' conv inputs and computes
    the gates (ggml.gdn_conv_tree: the bits of the separate conv, norm, copy and gdn_gates; three kernels fewer per
    recurrent layer). PYDFLASH_GDN_CONV_FUSED=0 keeps the four ops apart; bit-exact mode does too (the same bits,
    but its verify keeps the conv node a decode has, which pydflash.probe compares)."""
    return env_switch("PYDFLASH_GDN_CONV_FUSED", default="1") and not bitexact_enabled()


def gdn_chunk_enabled() -> bool:
    """A replayed-states verify (state_type 'replay') lets CUDA compute a recurrent layer's tree in the delta rule's
    chunk form, every node at once (ggml.gated_delta_net_tree_steps, docs/gdn-tree-chunk.md), instead of walking it
    node by node; equal within f32 rounding, not bit for bit. PYDFLASH_GDN_CHUNK=0 keeps the walk; bit-exact mode
    always does (a decode's one-node tree walks)."""
    return env_switch("PYDFLASH_GDN_CHUNK", default="1") and not bitexact_enabled()


class _Deferred:
    """An input of linear that ggml_qmatmul may compute itself from its operands (`qmatmul`); any other reader gets
    it as a tensor, built once (`tensor`, from `_build`). It reads like that tensor where linear decides: the shape
    and type of `like` (the first operand)."""

    def __init__(self, ctx: ggml.Context, like: ggml.Tensor):
        self.ctx, self._like, self._tensor = ctx, like, None

    @property
    def type(self) -> ggml.Type:
        return self._like.type

    @property
    def ne(self) -> tuple[int, int, int, int]:
        return self._like.ne

    @property
    def nb(self) -> tuple[int, int, int, int]:
        return self._like.nb

    def tensor(self) -> ggml.Tensor:
        if self._tensor is None:
            self._tensor = self._build()
        return self._tensor


class Normed(_Deferred):
    """rms_norm(h, eps) * weight as the input of projections (linear, TargetRuntime.project): a product that
    ggml_qmatmul takes computes the norm where it quantises the activations (ggml_qmatmul_rms_norm: one kernel
    instead of a norm and a quantisation; norm_in_qmatmul_enabled)."""

    def __init__(self, ctx: ggml.Context, h: ggml.Tensor, weight: ggml.Tensor, eps: float, name: str):
        super().__init__(ctx, h)
        self.h, self.weight, self.eps, self.name = h, weight, eps, name

    def _build(self) -> ggml.Tensor:
        return rms_norm(self.ctx, self.h, self.weight, self.eps, self.name)

    def fuses_into(self, w: ggml.Tensor) -> bool:
        """Whether linear(ctx, w, self) takes ggml_qmatmul_rms_norm."""
        return (self.h.is_contiguous and self.weight.type == ggml.Type.F32 and self.weight.is_contiguous
                and norm_in_qmatmul_enabled() and uses_qmatmul(w, self))

    def qmatmul(self, ctx: ggml.Context, w: ggml.Tensor, add: ggml.Tensor | None) -> ggml.Tensor:
        return ggml.qmatmul(ctx, w, self.h, qmatmul_row_tiles(w, self.h.ne[1]), norm=self.weight, eps=self.eps,
                            add=add)


class Gated(_Deferred):
    """silu(gate) * up (ggml's swiglu_split) as the input of a projection (linear): a product that ggml_qmatmul
    takes gates the columns where it quantises them (ggml_qmatmul_fused's up: the same bits, one kernel fewer).
    act="sigmoid": sigmoid(gate) * up instead (ggml's sigmoid then mul: an attention's output gate;
    ggml_qmatmul_sigmoid_gated), without head_norm.

    head_norm (weight, eps, name): up is first RMS-normed per head of len(weight) values and scaled by the weight
    (rms_norm over [head, heads, n], named `name` where built): with PYDFLASH_HEAD_NORM_IN_QMATMUL=1 inside the
    product as well (ggml_qmatmul_fused's up with a norm), else as ggml's ops before the gated product."""

    def __init__(self, ctx: ggml.Context, gate: ggml.Tensor, up: ggml.Tensor,
                 head_norm: tuple[ggml.Tensor, float, str] | None = None, act: str = "silu", name: str | None = None):
        if act not in ggml.QMATMUL_GATES or (act == "sigmoid" and head_norm is not None):
            raise ValueError(f"Gated takes act silu (with or without head_norm) or sigmoid, got {act!r}")
        super().__init__(ctx, gate)
        self.gate, self.up, self.head_norm, self.act, self.name = gate, up, head_norm, act, name
        self._normed_up = None

    def _up(self) -> ggml.Tensor:
        """up as the gate multiplies it: with head_norm, the normed heads (ggml's rms_norm and mul, built once)."""
        if self.head_norm is None:
            return self.up
        if self._normed_up is None:
            weight, eps, name = self.head_norm
            heads = self.ctx.reshape_3d(self.up, weight.ne[0], self.up.ne[0] // weight.ne[0], self.up.ne[1])
            self._normed_up = self.ctx.reshape_2d(rms_norm(self.ctx, heads, weight, eps, name), *self.up.ne[:2])
        return self._normed_up

    def _build(self) -> ggml.Tensor:
        if self.act == "sigmoid":
            # up first, so that the sigmoid and the mul are neighbours in the graph (ggml-cuda fuses them); a strided
            # gate copied first (ggml-cuda's sigmoid alone, where it does not fuse, takes contiguous tensors only)
            gate = self.gate if self.gate.is_contiguous else self.ctx.cont(self.gate)
            out = self.ctx.mul(self.up, self.ctx.sigmoid(gate))
        else:
            out = self.ctx.swiglu_split(self.gate, self._up())
        return out if self.name is None else out.named(self.name)

    def _norm_inside(self) -> bool:
        if self.head_norm is None or not head_norm_in_qmatmul_enabled():
            return False
        weight = self.head_norm[0]
        return (weight.type == ggml.Type.F32 and weight.is_contiguous and weight.ne[0] % 32 == 0
                and self.up.ne[0] % weight.ne[0] == 0)

    def fuses_into(self, w: ggml.Tensor) -> bool:
        """Whether linear(ctx, w, self) gates inside ggml_qmatmul."""
        return self.up.type == ggml.Type.F32 and self.up.ne == self.gate.ne and self.up.nb[0] == 4 \
            and uses_qmatmul(w, self)

    def qmatmul(self, ctx: ggml.Context, w: ggml.Tensor, add: ggml.Tensor | None) -> ggml.Tensor:
        row_tiles = qmatmul_row_tiles(w, self.gate.ne[1])
        if self._norm_inside():
            weight, eps, _ = self.head_norm
            return ggml.qmatmul(ctx, w, self.gate, row_tiles, up=self.up, norm=weight, eps=eps, add=add)
        return ggml.qmatmul(ctx, w, self.gate, row_tiles, up=self._up(), add=add, gate=self.act)


def swiglu_prepared_enabled() -> bool:
    """An FFN whose gate/up and down products both take the f16 kernel has the gate/up product write the down
    product's input (swiglu_down): no kernel between the two (ggml.qmatmul_swiglu_prepared).
    PYDFLASH_SWIGLU_PREPARED=0 keeps the SwiGLU where the down product prepares its activations (Gated)."""
    return env_switch("PYDFLASH_SWIGLU_PREPARED", default="1")


def swiglu_down(ctx: ggml.Context, w_gate_up: ggml.Tensor, x: ggml.Tensor | Normed, w_down: ggml.Tensor,
                add: ggml.Tensor | None) -> ggml.Tensor | None:
    """w_down (silu(gate x) * (up x)) + add for a fused gate/up matrix w_gate_up [K, 2F] (F gate rows, then F up
    rows) through ggml.qmatmul_swiglu_prepared and ggml.qmatmul_prepared, where both products take the f16 kernel
    at x's column count (Hopper; the gate/up Q4_K) and swiglu_prepared_enabled; else None (the caller goes the
    Gated way)."""
    F = w_gate_up.ne[1] // 2
    if not (swiglu_prepared_enabled() and w_gate_up.type == ggml.Type.Q4_K and w_gate_up.ne[1] == 2 * F
            and w_down.type in (ggml.Type.Q4_K, ggml.Type.Q6_K) and w_down.ne[0] == F and F % 256 == 0
            and w_down.is_contiguous and _takes_qmatmul(w_gate_up, x)):
        return None
    n = x.ne[1]
    if qmatmul_row_tiles(w_gate_up, n) != ggml.QMATMUL_F16 or qmatmul_row_tiles(w_down, n) != ggml.QMATMUL_F16:
        return None
    if isinstance(x, Normed) and x.fuses_into(w_gate_up):
        xp = ggml.qmatmul_swiglu_prepared(ctx, w_gate_up, x.h, w_down.type, norm=x.weight, eps=x.eps)
    else:
        xp = ggml.qmatmul_swiglu_prepared(ctx, w_gate_up, x.tensor() if isinstance(x, _Deferred) else x, w_down.type)
    return ggml.qmatmul_prepared(ctx, w_down, xp, n, add=add)


def shared_prep_enabled() -> bool:
    """A Normed input that several products read is prepared once for all of them where they can read it
    (prepared_for). PYDFLASH_SHARED_PREP=0 lets each product prepare its own."""
    return env_switch("PYDFLASH_SHARED_PREP", default="1")


def prepared_for(ctx: ggml.Context, x: Normed, ws: list[ggml.Tensor]) -> ggml.Tensor | None:
    """The activations of x prepared once (ggml.qmatmul_prepare, normed) for the products ws, which then read them
    through ggml.qmatmul_prepared: where there are several, every one is a Q4_K or Q6_K matrix the f16 kernel runs
    (Hopper, K a multiple of 256; small ones too, which alone would keep the int8 kernels) and one of them takes
    it at x's column count by qmatmul_row_tiles (an attention's Q/K matrix and its Q6_K V); else None."""
    n = x.ne[1]
    if not (shared_prep_enabled() and len(ws) > 1 and x.h.ne[0] % 256 == 0 and all(x.fuses_into(w) for w in ws)
            and any(qmatmul_row_tiles(w, n) == ggml.QMATMUL_F16 for w in ws)
            and all(w.type in (ggml.Type.Q4_K, ggml.Type.Q6_K) and _streams(w) for w in ws)):
        return None
    return ggml.qmatmul_prepare(ctx, x.h, norm=x.weight, eps=x.eps)


def uses_qmatmul(w: ggml.Tensor, x: ggml.Tensor) -> bool:
    """Whether linear(ctx, w, x) takes ggml_qmatmul (else ggml's mul_mat) in the current qmatmul_mode."""
    mode = qmatmul_mode()
    if mode == "0" or not _takes_qmatmul(w, x):
        return False
    f16 = qmatmul_row_tiles(w, x.ne[1]) == ggml.QMATMUL_F16
    if w.type in ggml.QMATMUL_F16_FAMILY_TYPES:   # (only through the f16 kernel's family)
        return f16
    return mode == "1" or f16 or qmatmul_faster(w.type, w.ne[1], x.ne[1], x.ne[1] == 1 and _streams(w))


def linear(ctx: ggml.Context, w: ggml.Tensor, x: ggml.Tensor | Normed | Gated, add: ggml.Tensor | None = None,
           name: str | None = None) -> ggml.Tensor:
    """w^T x for a weight w [n_in, n_out] (ggml order) and activations x [n_in, ...] -> [n_out, ...], plus `add`
    (a residual of the result's shape) where given.

    ggml's mul_mat, except quantised GPU weights that ggml_qmatmul takes (qmatmul_mode): by default where it is
    the faster kernel, with PYDFLASH_QMATMUL=1 for every 1..48 columns (then every column is bit-identical
    whatever the number of columns; ggml-ext.h says how). The weight must be allocated when the graph is built
    (model weights always are). x may be a Normed or Gated input (normed or gated inside ggml_qmatmul where it
    takes the product). ggml_qmatmul adds `add` as it stores each output (the bits of a separate add, one kernel
    fewer); otherwise the product, named `name`, is followed by ggml's add. Without `add`, the product is named
    `name`."""
    if isinstance(x, _Deferred):
        if x.fuses_into(w):
            out = x.qmatmul(ctx, w, add)
            return out if add is not None or name is None else out.named(name)
        x = x.tensor()
    if uses_qmatmul(w, x):
        out = ggml.qmatmul(ctx, w, x, qmatmul_row_tiles(w, x.ne[1]), add=add)
        return out if add is not None or name is None else out.named(name)
    if bitexact_enabled() and x.ne[1] <= ggml.QMATMUL_MAX_COLS and x.ne[2:] == (1, 1) and x.is_contiguous:
        # tokens as a batch of single columns: ggml then takes its matrix-vector kernel for every token count
        # (its kernel choice, and so the rounding, depends on the column count). One token goes the same way, so
        # that no graph fuses the product with its neighbours (CUDA fuses a 1-column FFN with its GLU). Prefill
        # micro-batches over 48 tokens keep mul_mat: verify sizes are at most 48.
        out = ctx.mul_mat(w, ctx.reshape_3d(x, x.ne[0], 1, x.ne[1]))
        out = ctx.reshape_2d(out, out.ne[0], x.ne[1])
    else:
        out = ctx.mul_mat(w, x)
    if name is not None:
        out = out.named(name)
    return out if add is None else ctx.add(out, add)


def row_ranges(ctx: ggml.Context, y: ggml.Tensor, rows: list[int]) -> list[ggml.Tensor]:
    """A fused product's output [sum(rows), n] as its members' consecutive row ranges, [rows[i], n] each (views,
    contiguous only for n = 1; y itself for a single member)."""
    if len(rows) == 1:
        return [y]
    out, offset = [], 0
    for r in rows:
        out.append(ctx.view_2d(y, r, y.ne[1], y.nb[1], offset))
        offset += r * y.nb[0]
    return out


def heads(ctx: ggml.Context, y: ggml.Tensor, head_dim: int, n_head: int, n: int) -> ggml.Tensor:
    """[head_dim * n_head, n] (a projection's output, or a row range of a fused one: TargetRuntime.project) seen
    as [head_dim, n_head, n]."""
    if y.is_contiguous:
        return ctx.reshape_3d(y, head_dim, n_head, n)
    return ctx.view_3d(y, head_dim, n_head, n, head_dim * 4, y.nb[1], 0)


def rms_norm(ctx: ggml.Context, x: ggml.Tensor, weight: ggml.Tensor, eps: float, name: str) -> ggml.Tensor:
    """RMS norm over ne[0], times a weight vector."""
    return ctx.mul(ctx.rms_norm(x, eps), weight).named(name)


def l2_norm(ctx: ggml.Context, x: ggml.Tensor, eps: float) -> ggml.Tensor:
    # llama.cpp's form: rms_norm with eps/d, scaled by 1/sqrt(d)  ==  x / sqrt(sum x^2 + eps)
    d = x.ne[0]
    return ctx.scale(ctx.rms_norm(x, eps / d), 1.0 / math.sqrt(d))


def rope(ctx: ggml.Context, x: ggml.Tensor, pos: ggml.Tensor, *, n_rot: int, mode: int, base: float,
         n_ctx_train: int, freq_scale: float = 1.0) -> ggml.Tensor:
    """Rotary embedding of x [head_dim, n_head, n] at positions pos (i32 [n]), no YaRN extension."""
    return ctx.rope_ext(x, pos, None, n_rot, mode, n_ctx_train, base, freq_scale, 0.0, 1.0, 32.0, 1.0)


def attention(ctx: ggml.Context, cache, il: int, q: ggml.Tensor, k: ggml.Tensor, v: ggml.Tensor, inputs,
              scale: float | None = None, mask: ggml.Tensor | None = None) -> ggml.Tensor:
    """Write this batch's K/V rows into the cache of layer il, then attend q over the first n_kv cells.

    q [hd, n_head, n], k and v [hd, n_head_kv, n] (roped already); inputs: the runtime's graph inputs
    (kv_rows: the cells to write, kq_mask: f16 [n_kv, n], n_tokens, n_kv). mask: another mask of that shape
    (a sliding-window layer's `inputs.kq_mask_swa`); None: inputs.kq_mask. Returns [hd * n_head, n]."""
    hd, n_head, n_head_kv = q.ne[0], q.ne[1], k.ne[1]
    n, n_kv = inputs.n_tokens, inputs.n_kv
    if cache.k_rot is not None:   # quantised KV: rotate Q, K and V like llama.cpp before quantising
        q = hadamard_rotate(ctx, q, cache.k_rot)
        k = hadamard_rotate(ctx, k, cache.k_rot)
        v = hadamard_rotate(ctx, v, cache.v_rot)
    elif cache.tq3_rotation is not None:   # TQ3_0 rotates K and V as it quantises them: Q follows
        q = cache.tq3_rotation.rotate(ctx, q)
        if not v.is_contiguous:           # (a fused QKV's V view: TQ3_0's row writer reads whole rows)
            v = ctx.cont(v)
    kv_row = hd * n_head_kv
    k_cache, v_cache = cache.k[il], cache.v[il]
    # write this batch's rows, then read the first n_kv cells through views of the writes (so the reads
    # depend on them)
    k_written = ctx.set_rows(k_cache, ctx.view_2d(k, kv_row, n, k.nb[2], 0), inputs.kv_rows)
    v_written = ctx.set_rows(v_cache, ctx.view_2d(v, kv_row, n, v.nb[2], 0), inputs.kv_rows)
    kt = ctx.view_3d(k_written, hd, n_head_kv, n_kv, ggml.row_size(cache.kv_type, hd), k_cache.nb[1], 0)
    vt = ctx.view_3d(v_written, hd, n_head_kv, n_kv, ggml.row_size(cache.kv_type, hd), v_cache.nb[1], 0)
    scale = 1.0 / math.sqrt(hd) if scale is None else scale
    if bitexact_enabled() and cache.kv_type != ggml.Type.F16:
        raise ValueError(f"PYDFLASH_BITEXACT=1 needs an f16 KV cache (ggml_flash_attn_ordered reads f16), "
                         f"got kv_type {cache.kv_type.name.lower()}")
    kq_mask = inputs.kq_mask if mask is None else mask
    if bitexact_enabled() and (inputs.tree or n == 1):   # a prefill is the same forward in both: ggml's kernel
        out = ggml.flash_attn_ordered(ctx, ctx.permute(q, 0, 2, 1, 3), ctx.permute(kt, 0, 2, 1, 3),
                                      ctx.permute(vt, 0, 2, 1, 3), kq_mask, scale)
    else:
        out = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), ctx.permute(kt, 0, 2, 1, 3),
                                 ctx.permute(vt, 0, 2, 1, 3), kq_mask, scale, 0.0, 0.0)
        out.accumulate_f32()
    out = ctx.reshape_2d(out.named(f"l{il}.attn"), hd * n_head, n)    # [hd n_head, n]
    if cache.v_rot is not None:
        out = hadamard_rotate(ctx, out, cache.v_rot)
    elif cache.tq3_rotation is not None:   # attention over rotated V gives the rotated output
        out = cache.tq3_rotation.unrotate(ctx, out)
    return out


def hadamard_rotate(ctx: ggml.Context, x: ggml.Tensor, rot: ggml.Tensor) -> ggml.Tensor:
    """x @ H per group of H's size along ne[0] (H symmetric and orthonormal)."""
    m = rot.ne[0]
    n_elem = int(np.prod(x.ne))
    flat = ctx.reshape_2d(x if x.is_contiguous else ctx.cont(x), m, n_elem // m)
    y = ctx.mul_mat(rot, flat).hint_src0_hadamard()
    return ctx.reshape_4d(y, *x.ne)
