"""Checked wrappers of pydflash's own ggml ops (ggml_ext): bad shapes, types or parent arrays raise here,
before ggml, which would abort the process.
"""
from __future__ import annotations

import math

import numpy as np

from ._ffi import ffi, lib
from .core import Context, Op, Tensor, Type


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


def set_parents(parent: Tensor, values) -> None:
    """Check a parent array with `check_parents` and copy it into the i32 tensor `parent` [n_t, n_s]
    (numpy [n_s, n_t], or [n_t] when n_s is 1). The only way tree ops should receive parent values."""
    arr = check_parents(values)
    n_t, n_s = parent.ne[0], parent.ne[1]
    if parent.type != Type.I32 or parent.ne[2:] != (1, 1):
        raise TypeError(f"parent must be an I32 tensor [n_t, n_s], got {parent.type.name} {parent.shape}")
    if arr.shape != (n_s, n_t):
        raise ValueError(f"parent tensor holds [n_s={n_s}, n_t={n_t}] values, got an array of shape {arr.shape}")
    parent.set(arr)


def _expect(t: Tensor, what: str, type_: Type | tuple[Type, ...], ne: tuple[int, ...]) -> None:
    types = type_ if isinstance(type_, tuple) else (type_,)
    if t.type not in types:
        raise TypeError(f"{what} must be {' or '.join(x.name for x in types)}, got {t.type.name}")
    if t.ne[: len(ne)] != ne or any(n != 1 for n in t.ne[len(ne):]):
        raise ValueError(f"{what} must have ne {ne}, got {t.shape}")


def _expect_rows(t: Tensor, what: str) -> None:
    if t.ne[0] > 1 and t.nb[0] != lib.ggml_type_size(t.type):
        raise ValueError(f"{what} must have contiguous rows (nb[0] = element size), got nb {t.nb}")


def _ptr_or_null(t: Tensor | None):
    return ffi.NULL if t is None else t._ptr


def _expect_contiguous(t: Tensor, what: str) -> None:
    if not lib.ggml_is_contiguous(t._ptr):
        raise ValueError(f"{what} must be contiguous, got ne {t.ne} nb {t.nb}")


def ssm_conv_tree(ctx: Context, sx: Tensor, c: Tensor, parent: Tensor, silu: bool = False) -> Tensor:
    """Causal depthwise conv over a token tree: sx [d_conv-1+n_t, d_inner, n_s], c [d_conv, d_inner],
    parent i32 [n_t, n_s] -> [d_inner, n_t, n_s]. Parent values are checked by `check_parents` when set.
    silu: the silu of the result, `ctx.silu(...)`'s bits, one kernel fewer."""
    d_conv, d_inner = _check_conv_kernel(c)
    n_t = sx.ne[0] - (d_conv - 1)
    if n_t < 1:
        raise ValueError(f"sx needs d_conv-1={d_conv - 1} state columns plus at least one token, has {sx.ne[0]}")
    _expect(sx, "sx", Type.F32, (sx.ne[0], d_inner, sx.ne[2]))
    _expect_rows(sx, "sx")
    _check_conv_parents(parent, n_t, sx.ne[2])
    return Tensor(lib.ggml_ssm_conv_tree(ctx._ptr, sx._ptr, c._ptr, parent._ptr, bool(silu)), ctx)


def _check_conv_kernel(c: Tensor) -> tuple[int, int]:
    """Both forms of ssm_conv_tree: the kernel c f32 [d_conv, d_inner], rows contiguous -> (d_conv, d_inner)."""
    _expect(c, "c (conv kernel)", Type.F32, (c.ne[0], c.ne[1]))
    _expect_rows(c, "c (conv kernel)")
    if c.ne[0] > 16:
        raise ValueError(f"conv kernel size {c.ne[0]} > 16 is not supported")
    return c.ne[0], c.ne[1]


def _check_conv_parents(parent: Tensor, n_t: int, n_s: int) -> None:
    """Both forms of ssm_conv_tree: parent i32 [n_t, n_s], contiguous."""
    _expect(parent, "parent", Type.I32, (n_t, n_s))
    _expect_contiguous(parent, "parent")


def _check_conv_split(state: Tensor, x: Tensor, c: Tensor, parent: Tensor) -> int:
    """The split forms' checks (ssm_conv_tree_split, gdn_conv_tree); returns d_inner."""
    d_conv, d_inner = _check_conv_kernel(c)
    if d_conv < 2:
        raise ValueError(f"the split form needs a conv kernel of at least 2 taps (a state column), got {d_conv}")
    n_t, n_s = x.ne[1], x.ne[2]
    _expect(x, "x", Type.F32, (d_inner, n_t, n_s))
    _expect_rows(x, "x")
    _expect(state, "state", Type.F32, (d_conv - 1, d_inner, n_s))
    _expect_contiguous(state, "state")
    _check_conv_parents(parent, n_t, n_s)
    return d_inner


def ssm_conv_tree_split(ctx: Context, state: Tensor, x: Tensor, c: Tensor, parent: Tensor,
                        silu: bool = False) -> Tensor:
    """`ssm_conv_tree` over state [d_conv-1, d_inner, n_s] (contiguous: each channel's cached inputs, oldest
    first) and the new inputs x [d_inner, n_t, n_s] (rows contiguous, e.g. a row range of a projection's output)
    where they are: the result of ssm_conv_tree(concat(state, transpose(x)), c, parent, silu), bit for bit,
    without the concatenated copy."""
    _check_conv_split(state, x, c, parent)
    return Tensor(lib.ggml_ssm_conv_tree_split(ctx._ptr, state._ptr, x._ptr, c._ptr, parent._ptr, bool(silu)), ctx)


def gdn_conv_tree(ctx: Context, state: Tensor, x: Tensor, c: Tensor, parent: Tensor, *, qk: int, head_dim: int,
                  eps: float, inputs: Tensor | None = None,
                  gates: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
                  ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """A Gated DeltaNet layer's conv step in one op: `ssm_conv_tree_split(..., silu=True)`, its first qk channels
    (the q and k heads) L2-normed per head of head_dim channels as llama.cpp normalises them (rms_norm with
    eps / head_dim, scaled by 1 / sqrt(head_dim): `layers.l2_norm`'s bits); with `inputs` (f32 [d_inner, n_t,
    n_s], rows contiguous) x copied there by the op itself (so `inputs` must be memory of its own, outside the graph
    allocator's); with gates = (beta, alpha, dt_bias, a) (one sequence) the layer's gates too, `gdn_gates`' values.
    Returns (conv [d_inner, n_t, n_s], g, beta_gate), the last two [H, n_t] contiguous, or None without gates."""
    d_inner = _check_conv_split(state, x, c, parent)
    if head_dim < 1 or qk < 0 or qk % head_dim or qk > d_inner:
        raise ValueError(f"qk={qk} channels must be a multiple of head_dim={head_dim}, at most d_inner={d_inner}")
    n_t, n_s = x.ne[1], x.ne[2]
    if inputs is not None:
        _expect(inputs, "inputs", Type.F32, (d_inner, n_t, n_s))
        _expect_rows(inputs, "inputs")
    gate_ptrs = [ffi.NULL] * 4
    if gates is not None:
        if n_s != 1:
            raise ValueError(f"gdn_conv_tree computes the gates of one sequence, got n_s={n_s}")
        beta, alpha, dt_bias, a = gates
        H = beta.ne[0]
        _check_gates(beta, alpha, dt_bias, a, H, n_t)
        gate_ptrs = [t._ptr for t in gates]
    out = Tensor(lib.ggml_gdn_conv_tree(ctx._ptr, state._ptr, x._ptr, c._ptr, parent._ptr, qk, head_dim,
                                        eps / head_dim, 1.0 / math.sqrt(head_dim),
                                        inputs._ptr if inputs is not None else ffi.NULL, *gate_ptrs), ctx)
    if gates is None:
        return out, None, None
    conv = ctx.view_3d(out, d_inner, n_t, 1, d_inner * 4, d_inner * n_t * 4, 0)
    at = d_inner * n_t * 4
    return conv, ctx.view_2d(out, H, n_t, H * 4, at), ctx.view_2d(out, H, n_t, H * 4, at + H * n_t * 4)


def tq3_0_rotate(x: np.ndarray, inverse: bool = False) -> np.ndarray:
    """TQ3_0's rotation R (or R^T with inverse=True) of every 128-value group of the last axis, float32,
    computed by the library itself (ggml_ext_tq3_0_rotate)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % 128:
        raise ValueError(f"TQ3_0 rows must be a multiple of 128 values, not {x.shape[-1]}")
    y = np.empty_like(x)
    lib.ggml_ext_tq3_0_rotate(ffi.from_buffer("float[]", x), ffi.from_buffer("float[]", y), x.size, inverse)
    return y

def _check_gdn_tree(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                    parent: Tensor) -> tuple[int, int, int, int]:
    """The checks of ggml_gated_delta_net_tree(_persist); returns (S_v, H_v, n_t, n_s)."""
    S_v, H, n_t, n_s = v.ne
    _expect(v, "v", Type.F32, (S_v, H, n_t, n_s))
    for t, what in ((q, "q"), (k, "k")):
        if t.type != Type.F32:
            raise TypeError(f"{what} must be F32, got {t.type.name}")
        if t.ne[0] != S_v or t.ne[2] != n_t or H % t.ne[1] or n_s % t.ne[3]:
            raise ValueError(f"{what} must be [S_v={S_v}, H_k, n_t={n_t}, n_s_qk] with H_k dividing H_v={H} and "
                             f"n_s_qk dividing n_s={n_s}, got ne {t.ne}")
        _expect_rows(t, what)
    _expect_rows(v, "v")
    if g.ne[0] not in (1, S_v):
        raise ValueError(f"g must be [1 or S_v={S_v}, H_v, n_t, n_s], got ne {g.ne}")
    _expect(g, "g", Type.F32, (g.ne[0], H, n_t, n_s))
    _expect(beta, "beta", Type.F32, (1, H, n_t, n_s))
    _expect(state, "state", Type.F32, (S_v, S_v, H, n_s))
    _expect(parent, "parent", Type.I32, (n_t, n_s))
    for t, what in ((g, "g"), (beta, "beta"), (state, "state"), (parent, "parent")):
        _expect_contiguous(t, what)
    return S_v, H, n_t, n_s


def gated_delta_net_tree(ctx: Context, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                         parent: Tensor, o_only: bool = False) -> Tensor:
    """The gated delta rule over a token tree. Shapes as `ctx.gated_delta_net` (q, k [S_v, H_k, n_t, n_s_qk],
    v [S_v, H_v, n_t, n_s], g [1 or S_v, H_v, n_t, n_s], beta [1, H_v, n_t, n_s], state [S_v, S_v, H_v, n_s])
    plus parent i32 [n_t, n_s] (set it with `set_parents`). Returns f32 [S_v*H_v, n_t*n_s*(2+S_v)]: o
    [S_v, H_v, n_t, n_s], then every node's state [S_v*S_v, H_v, n_t, n_s], then every node's delta
    beta (v - S^T k) [S_v, H_v, n_t, n_s] (what `gated_delta_net_path` rebuilds a node's state from). o_only:
    the caller reads only o and the deltas, so of the node states only those a later node reloads are sure to
    be written (the same o and deltas; on CUDA the other stores are skipped)."""
    _check_gdn_tree(q, k, v, g, beta, state, parent)
    op = lib.ggml_gated_delta_net_tree_o if o_only else lib.ggml_gated_delta_net_tree
    return Tensor(op(ctx._ptr, q._ptr, k._ptr, v._ptr, g._ptr, beta._ptr, state._ptr, parent._ptr), ctx)


def gated_delta_net_tree_steps(ctx: Context, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                               parent: Tensor, steps: Tensor, exact: bool) -> Tensor:
    """`gated_delta_net_tree` for a verify whose commit replays the accepted path (`gated_delta_net_path`): no node
    state is kept. One sequence. Returns f32 [S_v*H_v, n_t*(1+S_v)], o [S_v, H_v, n_t] first (then scratch), and
    writes node t's key (H_k heads), delta (H_v heads) and log-decay into column t of `steps`, f32 [S_v*H_k +
    S_v*H_v + g.ne[0]*H_v, >= n_t], rows contiguous, in a buffer of its own (as `gated_delta_net_tree_persist`'s
    inter). exact: `gated_delta_net_tree`'s bits; otherwise CUDA computes all nodes at once (scalar decay, at most
    32 nodes: the chunk form, docs/gdn-tree-chunk.md), equal within f32 rounding."""
    S_v, H, n_t, n_s = _check_gdn_tree(q, k, v, g, beta, state, parent)
    if n_s != 1:
        raise ValueError(f"gated_delta_net_tree_steps takes one sequence, got n_s={n_s}")
    width = S_v * k.ne[1] + S_v * H + g.ne[0] * H
    _expect(steps, "steps", Type.F32, (width, steps.ne[1]))
    _expect_rows(steps, "steps")
    if steps.ne[1] < n_t:
        raise ValueError(f"steps holds {steps.ne[1]} columns, the tree has n_t={n_t}")
    _expect_persistent(steps, "steps")
    return Tensor(lib.ggml_gated_delta_net_tree_steps(ctx._ptr, q._ptr, k._ptr, v._ptr, g._ptr, beta._ptr, state._ptr,
                                                      parent._ptr, steps._ptr, bool(exact)), ctx)


def gated_delta_net_path(ctx: Context, state: Tensor, k: Tensor, g: Tensor, delta: Tensor,
                         steps: Tensor | None = None) -> Tensor:
    """The state after a path of L tree nodes, rebuilt from the state before it and the path's keys k [S_v, H_k, L,
    n_s_k], log-decays g [1 or S_v, H_v, L, n_s] and deltas [S_v, H_v, L, n_s] (each with contiguous rows; deltas:
    `gated_delta_net_tree`'s last part): f32 [S_v, S_v, H_v, n_s], the very bits of the tree op's state after the
    last node (ggml-ext.h: ggml_gated_delta_net_path). A step with g = 0 and delta = 0 changes nothing. Each value
    is read before it is written, so the result may be placed on `state` (Buffer.alias: an in-place commit).
    steps: i32 [L, n_s]; then k, g and delta hold candidate steps (their ne[2] any count n, e.g. views of
    `gated_delta_net_tree_steps`' store) and step l of sequence s is candidate steps[l, s] (outside 0..n-1: a step
    that changes nothing)."""
    S_v, _, H, n_s = state.ne
    _expect(state, "path state", Type.F32, (S_v, S_v, H, n_s))
    _expect_contiguous(state, "path state")
    L = delta.ne[2]
    _expect(delta, "path delta", Type.F32, (S_v, H, L, n_s))
    _expect_rows(delta, "path delta")
    if k.type != Type.F32 or k.ne[0] != S_v or k.ne[2] != L or H % k.ne[1] or n_s % k.ne[3]:
        raise ValueError(f"path k must be F32 [S_v={S_v}, H_k, L={L}, n_s_k] with H_k dividing H_v={H} and n_s_k "
                         f"dividing n_s={n_s}, got {k.type.name} ne {k.ne}")
    _expect_rows(k, "path k")
    if g.ne[0] not in (1, S_v):
        raise ValueError(f"path g must be [1 or S_v={S_v}, H_v, L, n_s], got ne {g.ne}")
    _expect(g, "path g", Type.F32, (g.ne[0], H, L, n_s))
    _expect_rows(g, "path g")
    if steps is None:
        return Tensor(lib.ggml_gated_delta_net_path(ctx._ptr, state._ptr, k._ptr, g._ptr, delta._ptr), ctx)
    _expect(steps, "path steps", Type.I32, (steps.ne[0], n_s))
    _expect_contiguous(steps, "path steps")
    return Tensor(lib.ggml_gated_delta_net_path_steps(ctx._ptr, state._ptr, k._ptr, g._ptr, delta._ptr, steps._ptr),
                  ctx)


def _expect_persistent(t: Tensor, what: str) -> None:
    """An op that writes into one of its sources needs it in a buffer of its own, allocated before the graph."""
    root = t._ptr
    while root.view_src != ffi.NULL:
        root = root.view_src
    if root.buffer == ffi.NULL:
        raise ValueError(f"{what} must be allocated in a persistent buffer (Backend.alloc_tensors) before the graph "
                         "is built: the graph allocator would put it in scratch memory and its contents would be lost")


def gated_delta_net_tree_persist(ctx: Context, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                                 state: Tensor, parent: Tensor, inter: Tensor) -> Tensor:
    """`gated_delta_net_tree` whose node states are written to (and parent states read from) `inter`, an
    f32 or f16 tensor [S_v*S_v, H_v, n_t_max >= n_t, n_s] (or a contiguous view of one) that must already live in
    a buffer of its own (a cache buffer of the computing backend, see `Backend.alloc_tensors`), never in graph
    scratch. Returns o only,
    f32 [S_v, H_v, n_t, n_s]. Read `inter` back in a later graph."""
    S_v, H, n_t, n_s = _check_gdn_tree(q, k, v, g, beta, state, parent)
    _expect(inter, "inter", (Type.F32, Type.F16), (S_v * S_v, H, inter.ne[2], n_s))
    if inter.ne[2] < n_t:
        raise ValueError(f"inter holds {inter.ne[2]} node states per sequence, the tree has n_t={n_t}")
    _expect_contiguous(inter, "inter")
    _expect_persistent(inter, "inter")
    return Tensor(lib.ggml_gated_delta_net_tree_persist(ctx._ptr, q._ptr, k._ptr, v._ptr, g._ptr, beta._ptr,
                                                        state._ptr, parent._ptr, inter._ptr), ctx)


# Weight types ggml_qmatmul takes (its int8 kernels'), and its column limit (ggml-ext.h: GGML_EXT_QMATMUL_MAX_COLS).
QMATMUL_TYPES = (Type.Q4_K, Type.Q5_K, Type.Q6_K, Type.Q8_0)
# Weight types it takes as well, on CUDA through the f16 kernel's family only (ggml-ext.h: BF16, in bf16 on Hopper
# where K is a multiple of 256; elsewhere a slow plain kernel, which pydflash does not route to).
QMATMUL_F16_FAMILY_TYPES = (Type.BF16,)
QMATMUL_MAX_COLS = 48
# Values of qmatmul's row_tiles (ggml-ext.h): 0 = the kernel chooses; negative: activations staged in shared memory;
# QMATMUL_F16: the f16 kernel (GGML_EXT_QMATMUL_F16).
QMATMUL_F16 = 16
QMATMUL_ROW_TILES = (0, 1, 2, 4, -1, -2, QMATMUL_F16)
# Weight types of qmatmul's streaming one-column kernel (ggml_ext/cuda/qmatmul_stream.cuh).
QMATMUL_STREAM_TYPES = (Type.Q4_K, Type.Q5_K, Type.Q6_K)
_streams: dict[int, bool] = {}


def qmatmul_streams(device) -> bool:
    """Whether ggml_qmatmul multiplies one column of a QMATMUL_STREAM_TYPES weight on `device` (a
    ggml_backend_dev_t) with its streaming kernel (Hopper and later: the CUDA registry answers through the
    proc address "ggml_ext_qmatmul_streams"); elsewhere one column takes its tensor-core kernel, slower than
    ggml's own vector kernel."""
    key = int(ffi.cast("uintptr_t", device))
    if key not in _streams:
        ask = lib.ggml_backend_reg_get_proc_address(lib.ggml_backend_dev_backend_reg(device),
                                                    b"ggml_ext_qmatmul_streams")
        _streams[key] = ask != ffi.NULL and bool(ffi.cast("bool (*)(ggml_backend_dev_t)", ask)(device))
    return _streams[key]


QMATMUL_GATES = ("silu", "sigmoid")   # how qmatmul's up gates x (ggml-ext.h: enum ggml_ext_qmatmul_gate)


def qmatmul(ctx: Context, w: Tensor, x: Tensor, row_tiles: int = 0, norm: Tensor | None = None,
            eps: float = 0.0, add: Tensor | None = None, up: Tensor | None = None, gate: str = "silu") -> Tensor:
    """W * X for a quantised weight w [K, M] (Q4_K, Q5_K, Q6_K, Q8_0, or BF16, contiguous) and f32 x [K, N] with
    1 <= N <= 48 columns -> f32 [M, N], the product `ctx.mul_mat(w, x)` computes. On CUDA column j of the result
    is bit-identical whatever N is (ggml-ext.h says how); the CPU kernel is a float reference.

    row_tiles: on CUDA, how many 16-row tiles of w each warp multiplies with each activation fragment it loads
    (0: the kernel chooses; 1, 2, 4 force it, for benchmarks; -1, -2 force it with the activations staged in
    shared memory: Hopper, K-quants, N > 8). It changes the speed, never the result. QMATMUL_F16 takes the f16
    kernel instead (Hopper, Q4_K/Q6_K, K a multiple of 256; elsewhere as 0): f16 weights and activations, f32 sums,
    a result of its own (column j still bit-identical whatever N is), faster from 2 columns on large matrices.
    BF16 weights always take its bf16 form (bf16 activations) on Hopper where K is a multiple of 256.
    norm (f32 [K]): multiply the RMS-normed columns instead, W * (rms_norm(x, eps) * norm)
    (ggml_qmatmul_rms_norm: on CUDA the norm is computed as the columns are quantised).
    add (f32 [M, N], rows contiguous; a residual): return W * X + add, added as each output is stored
    (ggml_qmatmul_fused: the bits of `ctx.add` after the product, one kernel fewer).
    up (f32 [K, N], rows contiguous): multiply the gated columns silu(x) * up instead, gated as they are quantised
    (ggml_qmatmul_fused: the bits of `ctx.swiglu_split(x, up)` before the product). With up, norm (f32 [G], G
    dividing K; on CUDA a multiple of 32) norms up in groups of G values first: silu(x) * (rms_norm(up group, eps)
    * norm), a per-head norm (on the CPU the bits of ggml's rms_norm and mul on [G, K/G, N]). gate="sigmoid"
    gates sigmoid(x) * up instead, without a norm (ggml_qmatmul_sigmoid_gated: the bits of `ctx.sigmoid(x)` times
    up; an attention's output gate)."""
    if row_tiles not in QMATMUL_ROW_TILES:
        raise ValueError(f"qmatmul row_tiles must be one of {QMATMUL_ROW_TILES}, got {row_tiles}")
    if w.type not in QMATMUL_TYPES + QMATMUL_F16_FAMILY_TYPES:
        names = '/'.join(t.name for t in QMATMUL_TYPES + QMATMUL_F16_FAMILY_TYPES)
        raise TypeError(f"qmatmul weight must be {names}, got {w.type.name}")
    K, M = w.ne[0], w.ne[1]
    if w.ne[2:] != (1, 1):
        raise ValueError(f"qmatmul weight must be a matrix [K, M], got ne {w.ne}")
    _expect_contiguous(w, "qmatmul weight")
    n = x.ne[1]
    _expect(x, "qmatmul x", Type.F32, (K, n))
    _expect_rows(x, "qmatmul x")
    if not 1 <= n <= QMATMUL_MAX_COLS:
        raise ValueError(f"qmatmul takes 1 to {QMATMUL_MAX_COLS} columns of x, got {n}")
    if gate not in QMATMUL_GATES:
        raise ValueError(f"qmatmul gate must be one of {QMATMUL_GATES}, got {gate!r}")
    if gate == "sigmoid" and (up is None or norm is not None):
        raise ValueError("qmatmul gate='sigmoid' needs up and takes no norm")
    if norm is None and add is None and up is None:
        return Tensor(lib.ggml_qmatmul(ctx._ptr, w._ptr, x._ptr, row_tiles), ctx)
    if up is not None:
        _expect(up, "qmatmul up", Type.F32, (K, n))
        _expect_rows(up, "qmatmul up")
    if norm is not None:
        size = math.prod(norm.ne)
        if norm.type != Type.F32 or not norm.is_contiguous or (K % size if up is not None else size != K):
            what = f"of a length dividing {K} (up's groups)" if up is not None else f"of {K} values"
            raise ValueError(f"qmatmul norm must be a contiguous f32 vector {what}, got {norm.type.name} ne {norm.ne}")
        if not eps >= 0.0:
            raise ValueError(f"qmatmul eps must be >= 0, got {eps}")
    if add is not None:
        _expect(add, "qmatmul add", Type.F32, (M, n))
        _expect_rows(add, "qmatmul add")
    if gate == "sigmoid":
        return Tensor(lib.ggml_qmatmul_sigmoid_gated(ctx._ptr, w._ptr, x._ptr, up._ptr, _ptr_or_null(add), row_tiles),
                      ctx)
    return Tensor(lib.ggml_qmatmul_fused(ctx._ptr, w._ptr, x._ptr, _ptr_or_null(up), _ptr_or_null(norm), eps,
                                         _ptr_or_null(add), row_tiles), ctx)


# The f16 kernel's activations as a tensor (ggml-ext.h, GGML_EXT_QMATMUL_HALF_PITCH): F16 [PITCH, npad, K / 256]
QMATMUL_HALF_PITCH = 288


def qmatmul_prepared_shape(K: int, n_cols: int) -> tuple[int, int, int]:
    """ne of the prepared activations of n_cols columns of K values (K a multiple of 256): per 256-value unit and
    column 256 f16 values and the f16 sums of their runs of 32, laid out in 8x8 chunks (ggml-ext.h,
    GGML_EXT_QMATMUL_HALF_AT); columns rounded up to a multiple of 8."""
    return QMATMUL_HALF_PITCH, -(-n_cols // 8) * 8, K // 256


def _expect_column_norm(norm: Tensor | None, eps: float, K: int, what: str) -> None:
    """A norm of whole columns of K values (qmatmul_prepare's, qmatmul_swiglu_prepared's), if given, and its eps."""
    if norm is None:
        return
    if norm.type != Type.F32 or not norm.is_contiguous or math.prod(norm.ne) != K:
        raise ValueError(f"{what} norm must be a contiguous f32 vector of {K} values, "
                         f"got {norm.type.name} ne {norm.ne}")
    if not eps >= 0.0:
        raise ValueError(f"{what} eps must be >= 0, got {eps}")


def qmatmul_prepare(ctx: Context, x: Tensor, norm: Tensor | None = None, eps: float = 0.0) -> Tensor:
    """The prepared activations (F16 `qmatmul_prepared_shape(K, N)`) of x f32 [K, N] (K a multiple of 256, 1 <= N
    <= 48, rows contiguous), RMS-normed first with norm f32 [K] (as qmatmul's norm) where given: what qmatmul's
    f16 kernel prepares for itself, as a tensor several `qmatmul_prepared` products read."""
    K, n = x.ne[0], x.ne[1]
    _expect(x, "qmatmul_prepare x", Type.F32, (K, n))
    _expect_rows(x, "qmatmul_prepare x")
    if K % 256 or not 1 <= n <= QMATMUL_MAX_COLS:
        raise ValueError(f"qmatmul_prepare takes K a multiple of 256 and 1 to {QMATMUL_MAX_COLS} columns, "
                         f"got ne {x.ne}")
    _expect_column_norm(norm, eps, K, "qmatmul_prepare")
    return Tensor(lib.ggml_qmatmul_prepare(ctx._ptr, x._ptr, _ptr_or_null(norm), eps), ctx)


def qmatmul_swiglu_prepared(ctx: Context, w: Tensor, x: Tensor, reader: Type, norm: Tensor | None = None,
                            eps: float = 0.0) -> Tensor:
    """An FFN's gate/up product handing the down product its input: w Q4_K [K, 2F] (F gate rows, then F up rows; F
    and K multiples of 256), x f32 [K, N] as qmatmul's (with norm f32 [K]: its RMS-normed columns, as qmatmul's
    norm) -> the columns silu(W_gate x) * (W_up x) prepared (F16 `qmatmul_prepared_shape(F, N)`), for
    `qmatmul_prepared` of a `reader` matrix (Q4_K, or Q6_K: which never reads the run sums, so they are left out).
    On CUDA (Hopper only) the f16 kernel writes them as it stores its tiles: no kernel between the two products
    (ggml-ext.h says which bits)."""
    if w.type != Type.Q4_K or w.ne[2:] != (1, 1) or w.ne[0] % 256 or w.ne[1] % 512:
        raise ValueError(f"qmatmul_swiglu_prepared takes a Q4_K matrix [K, 2F], K and F multiples of 256, "
                         f"got {w.type.name} ne {w.ne}")
    _expect_contiguous(w, "qmatmul_swiglu_prepared weight")
    if reader not in (Type.Q4_K, Type.Q6_K):
        raise ValueError(f"qmatmul_swiglu_prepared prepares for a Q4_K or Q6_K reader, got {Type(reader).name}")
    K, n = w.ne[0], x.ne[1]
    _expect(x, "qmatmul_swiglu_prepared x", Type.F32, (K, n))
    _expect_rows(x, "qmatmul_swiglu_prepared x")
    if not 1 <= n <= QMATMUL_MAX_COLS:
        raise ValueError(f"qmatmul_swiglu_prepared takes 1 to {QMATMUL_MAX_COLS} columns of x, got {n}")
    _expect_column_norm(norm, eps, K, "qmatmul_swiglu_prepared")
    return Tensor(lib.ggml_qmatmul_swiglu_prepared(ctx._ptr, w._ptr, x._ptr, _ptr_or_null(norm), eps, int(reader)),
                  ctx)


def _without_run_sums(xp: Tensor) -> bool:
    """xp is a qmatmul_swiglu_prepared result for a Q6_K reader (ggml-ext.h: op_params[3] the form, [4] the sums)."""
    params = xp._ptr.op_params
    return xp.op == Op.QMATMUL and params[3] == lib.GGML_EXT_QMATMUL_FORM_SWIGLU_PREPARED and params[4] == 0


def qmatmul_prepared(ctx: Context, w: Tensor, xp: Tensor, n_cols: int, add: Tensor | None = None) -> Tensor:
    """W * X for w Q4_K or Q6_K [K, M] (K a multiple of 256) and prepared activations xp (F16
    `qmatmul_prepared_shape(K, n_cols)`, e.g. qmatmul_swiglu_prepared's) of n_cols columns -> f32 [M, n_cols], plus
    add (f32 [M, n_cols], rows contiguous) where given, as qmatmul's. On CUDA (Hopper only) the f16 kernel
    (QMATMUL_F16) reads xp as it is."""
    if w.type not in (Type.Q4_K, Type.Q6_K) or w.ne[2:] != (1, 1) or w.ne[0] % 256:
        raise ValueError(f"qmatmul_prepared takes a Q4_K or Q6_K matrix [K, M], K a multiple of 256, "
                         f"got {w.type.name} ne {w.ne}")
    _expect_contiguous(w, "qmatmul_prepared weight")
    if not 1 <= n_cols <= QMATMUL_MAX_COLS:
        raise ValueError(f"qmatmul_prepared takes 1 to {QMATMUL_MAX_COLS} columns, got {n_cols}")
    _expect(xp, "qmatmul_prepared xp", Type.F16, qmatmul_prepared_shape(w.ne[0], n_cols))
    _expect_contiguous(xp, "qmatmul_prepared xp")
    if w.type == Type.Q4_K and _without_run_sums(xp):
        raise ValueError("qmatmul_prepared: xp was prepared for a Q6_K reader (no run sums); a Q4_K matrix needs them")
    if add is not None:
        _expect(add, "qmatmul_prepared add", Type.F32, (w.ne[1], n_cols))
        _expect_rows(add, "qmatmul_prepared add")
    return Tensor(lib.ggml_qmatmul_prepared(ctx._ptr, w._ptr, xp._ptr, n_cols, _ptr_or_null(add)), ctx)


def _check_gates(beta: Tensor, alpha: Tensor, dt_bias: Tensor, a: Tensor, H: int, n: int) -> None:
    """gdn_gates' inputs (and gdn_conv_tree's gates): beta, alpha f32 [H, n] rows contiguous, dt_bias, a f32 [H]."""
    for t, what in ((beta, "gdn_gates beta"), (alpha, "gdn_gates alpha")):
        _expect(t, what, Type.F32, (H, n))
        _expect_rows(t, what)
    for t, what in ((dt_bias, "gdn_gates dt_bias"), (a, "gdn_gates a")):
        _expect(t, what, Type.F32, (H,))
        _expect_contiguous(t, what)


def gdn_gates(ctx: Context, beta: Tensor, alpha: Tensor, dt_bias: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
    """A Gated DeltaNet layer's gates from its beta and alpha projections f32 [H, n] (rows contiguous, possibly
    strided: views of a fused projection) and dt_bias, a f32 [H]: (g, beta_gate), each f32 [H, n] contiguous,
    g = softplus(alpha + dt_bias) * a and beta_gate = sigmoid(beta), one op (ggml-ext.h: ggml_gdn_gates)."""
    H, n = beta.ne[0], beta.ne[1]
    _check_gates(beta, alpha, dt_bias, a, H, n)
    out = Tensor(lib.ggml_gdn_gates(ctx._ptr, beta._ptr, alpha._ptr, dt_bias._ptr, a._ptr), ctx)
    plane = H * n * 4
    return ctx.view_2d(out, H, n, H * 4, 0), ctx.view_2d(out, H, n, H * 4, plane)


def argmax_first(ctx: Context, x: Tensor) -> Tensor:
    """The index of the largest value of every row of x f32 [n, n_rows] (rows contiguous): i32 [n_rows], the lowest
    index among equal maxima (ggml-ext.h). On CUDA the rows are split over many blocks, so one row costs a few
    microseconds where ggml_argmax (one block per row) takes ~0.1 ms at a 248K-token vocabulary."""
    _expect(x, "argmax_first x", Type.F32, (x.ne[0], x.ne[1]))
    _expect_rows(x, "argmax_first x")
    return Tensor(lib.ggml_argmax_first(ctx._ptr, x._ptr), ctx)


TOP_K_LOGP_MAX_K = 32   # GGML_EXT_TOP_K_LOGP_MAX_K


def top_k_logp(ctx: Context, logits: Tensor, k: int) -> Tensor:
    """The k most likely tokens of every row of logits f32 [n_vocab, n_rows] (rows contiguous) with their
    log-probabilities, best first: f32 [k, 2, n_rows], [:, 0] the log-probs, [:, 1] the ids as exact floats
    (ggml-ext.h: larger logit first, equal logits by lower id). One pass over the row on CUDA, where ggml_top_k
    sorts the whole row and the log-probs took a full softmax."""
    _expect(logits, "top_k_logp logits", Type.F32, (logits.ne[0], logits.ne[1]))
    _expect_rows(logits, "top_k_logp logits")
    n_vocab = logits.ne[0]
    if not 1 <= k <= TOP_K_LOGP_MAX_K:
        raise ValueError(f"top_k_logp k must be in 1..{TOP_K_LOGP_MAX_K}, got {k}")
    if n_vocab < k:
        raise ValueError(f"top_k_logp logits rows have {n_vocab} values, fewer than k = {k}")
    if n_vocab >= 1 << 24:
        raise ValueError(f"top_k_logp logits rows have {n_vocab} values; ids must stay exact floats (< 2^24)")
    return Tensor(lib.ggml_top_k_logp(ctx._ptr, logits._ptr, int(k)), ctx)


SAMPLE_N_PARAMS = 8   # GGML_EXT_SAMPLE_N_PARAMS: the length of the params tensor of sample_tokens/sample_probs


def _check_sample(logits: Tensor, hist: Tensor, params: Tensor) -> None:
    n_vocab, n_rows = logits.ne[0], logits.ne[1]
    _expect(logits, "logits", Type.F32, (n_vocab, n_rows))
    _expect_rows(logits, "logits")
    _expect(hist, "hist", Type.I32, (hist.ne[0], n_rows))
    _expect_contiguous(hist, "hist")
    _expect(params, "params", Type.F32, (SAMPLE_N_PARAMS,))
    _expect_contiguous(params, "params")


def sample_tokens(ctx: Context, logits: Tensor, hist: Tensor, params: Tensor, rand: Tensor) -> Tensor:
    """Filter every row of logits f32 [n_vocab, n_rows] and draw one token per row: i32 [n_rows].
    hist i32 [n_hist, n_rows]: each row's recent tokens for the penalties (-1: none); params f32 [8]
    (pydflash.sampling.SamplingParams.vector); rand f32 [n_rows]: one uniform in [0, 1) per row. The rule is
    ggml_sample_tokens' in ggml_ext/include/ggml-ext.h (and docs/sampling.md)."""
    _check_sample(logits, hist, params)
    _expect(rand, "rand", Type.F32, (logits.ne[1],))
    _expect_contiguous(rand, "rand")
    return Tensor(lib.ggml_sample_tokens(ctx._ptr, logits._ptr, hist._ptr, params._ptr, rand._ptr), ctx)


def sample_probs(ctx: Context, logits: Tensor, hist: Tensor, params: Tensor) -> Tensor:
    """The distribution `sample_tokens` draws from, f32 [n_vocab, n_rows] (tests and diagnostics)."""
    _check_sample(logits, hist, params)
    return Tensor(lib.ggml_sample_probs(ctx._ptr, logits._ptr, hist._ptr, params._ptr), ctx)


def flash_attn_ordered(ctx: Context, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Attention in one fixed order of float operations (ggml-ext.h): q f32 [D, n_q, H_q], k and v f16
    [D, n_kv, H_kv] (H_kv dividing H_q), mask f16 [n_kv, >= n_q] (added to the scores; -inf removes a cell, which
    is then never read) -> f32 [D, H_q, n_q], the layout of `ctx.flash_attn_ext`. Each query's row is the same
    bits whatever the number of queries and wherever its unmasked cells sit (decode vs tree verify)."""
    D, n_q, H_q = q.ne[0], q.ne[1], q.ne[2]
    n_kv, H_kv = k.ne[1], k.ne[2]
    _expect(q, "q", Type.F32, (D, n_q, H_q))
    _expect(k, "k", Type.F16, (D, n_kv, H_kv))
    _expect(v, "v", Type.F16, (D, n_kv, H_kv))
    if H_kv < 1 or H_q % H_kv:
        raise ValueError(f"the K/V heads ({H_kv}) must divide the query heads ({H_q})")
    if mask.ne[1] < n_q:
        raise ValueError(f"mask must have a row for each of the {n_q} queries, has {mask.ne[1]}")
    _expect(mask, "mask", Type.F16, (n_kv, mask.ne[1]))
    for t, what in ((q, "q"), (k, "k"), (v, "v"), (mask, "mask")):
        if t.nb[0] != lib.ggml_type_size(t.type):
            raise ValueError(f"{what} must have contiguous rows (nb[0] = element size), got nb {t.nb}")
    return Tensor(lib.ggml_flash_attn_ordered(ctx._ptr, q._ptr, k._ptr, v._ptr, mask._ptr, float(scale)), ctx)
