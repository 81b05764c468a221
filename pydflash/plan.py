"""The device-memory plan of a target (and draft): bytes per part, and the context / KV type that fit.

Any architecture pydflash loads is planned (pydflash.models.target_classes); an attention-only one (llama,
qwen2, qwen3) has no recurrent parts. Everything is computed from hyperparameters and file headers (no GPU, no
weights read), so `pydflash plan --target T --draft D --vram 24GiB` answers "does it fit" before a card is
rented, and `load` uses the same numbers (plan_for_load) to pick `max_ctx="auto"` / `kv_type="auto"` and to
refuse what cannot fit.

Parts (exact unless marked):
  target weights       the GGUF's tensor bytes (tied LM head counted once)
  KV cache             attention layers x (K, V) x cells (n_ctx rounded up to the 256-cell bucket) x row bytes
  recurrent states     per GDN layer the conv window ((d_conv-1) x conv_dim f32) and the state (S x S x H f32)
  verify stores        per GDN layer, every verify slot's state (f32 or f16; 'replay': its key, decay and delta)
                       and conv input (f32)
  prefix snapshots     saved recurrent states for prefix reuse (pydflash.prefix_cache), as many as load keeps
  captured features    the draft's target layers, f32 x n_ubatch tokens
  draft weights        matrices as stored (bf16) or quantized at load (draft_type q8_0, q4_k), norms widened to f32
  draft context ring   per draft layer, K and V (f16) of block + window rows, rounded up to the bucket
  compute (estimate)   the largest forward's scratch: see `compute_estimate`
  reserve              a fixed margin for the CUDA libraries' workspaces and allocator slack
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, replace

from . import ggml
from .kv import KV_TYPES, kv_type_of
from .models.dflash_draft import DEFAULT_WINDOW, draft_matrix_type
from .models.runtime import KV_BUCKET, kv_cells, replay_width   # the target's KV cells: whole KV_BUCKETs

AUTO_KV_ORDER = ("f16", "q8_0", "q4_0", "tq3_0")   # kv_type="auto": the first one the context fits in
RESERVE = 512 << 20             # cuBLAS workspaces, CUDA graph memory, allocator rounding
DRAFT_WINDOW = DEFAULT_WINDOW   # the draft's context ring, in positions
DEFAULT_UBATCH = 512            # the longest prefill micro-batch (a verify needs budget + 1 of them) ...
LONG_PROMPT_UBATCH = 2048       # ... or this, where memory allows: prompts past 16K tokens use it
PREFIX_SNAPSHOTS = 4            # load's default prefix-reuse bound: saved recurrent states ...
PREFIX_BYTES = 1 << 30          # ... and their bytes in all
GiB = 1 << 30


class PlanError(ValueError):
    """A requested context or KV type does not fit the memory: the message names the numbers."""


def parse_size(text) -> int:
    """'24GiB', '24GB', '80G', '512MiB' or a plain byte count -> bytes (GB = 10^9, GiB and G = 2^30)."""
    if isinstance(text, (int, float)):
        return int(text)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", str(text), re.IGNORECASE)
    if not m or (m.group(3) and not m.group(2)):
        raise ValueError(f"size {text!r}: expected a number with an optional unit (e.g. 24GiB, 24GB, 512MiB)")
    value, unit, binary, b = float(m.group(1)), m.group(2).lower(), m.group(3), m.group(4)
    power = "kmgt".index(unit) + 1 if unit else 0
    base = 1024 if (binary or (unit and not b)) else 1000
    return int(value * base ** power)


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class DraftShape:
    """What the plan needs of a DFlash draft: its hyperparameters' sizes and its weights' bytes on the device."""
    n_layer: int
    n_embd: int
    n_ff: int
    kv_row: int                 # head_dim x n_head_kv
    block_size: int
    n_feat: int                 # target layers captured
    weight_bytes: int
    window: int = DRAFT_WINDOW

    @classmethod
    def from_hparams(cls, hp, stored_itemsize: int = 2, window: int = DRAFT_WINDOW,
                     matrix_type: str | None = None, path: str = "draft") -> "DraftShape":
        """Weights from the draft's tensor list: matrices `stored_itemsize` bytes per value, or quantized to
        matrix_type at load ('q8_0' or 'q4_k', each matrix to the type DFlashWeights gives it: draft_matrix_type),
        norms f32."""
        def matrix_bytes(name, ne):
            if matrix_type is None:
                return _count(ne) * stored_itemsize
            return ggml.row_size(draft_matrix_type(matrix_type, name, ne[0], path), ne[0]) * (_count(ne) // ne[0])
        nbytes = sum(_count(ne) * 4 if len(ne) == 1 else matrix_bytes(name, ne)
                     for name, ne in hp.tensor_shapes().items())
        return cls(hp.n_layer, hp.n_embd, hp.n_ff, hp.head_dim * hp.n_head_kv, hp.block_size, hp.n_feat, nbytes,
                   window)

    @classmethod
    def from_path(cls, path, window: int = DRAFT_WINDOW, matrix_type: str | None = None) -> "DraftShape":
        """From a z-lab folder (config.json + the safetensors header) or a llama.cpp dflash GGUF header;
        matrix_type: None (as stored) or the type load quantizes the matrices to."""
        from .models.dflash_draft import DFlashHParams, read_safetensors_header, _resolve_zlab
        path = os.fspath(path)
        if path.endswith(".gguf"):             # matrices as stored (any type), norms widened to f32
            from .gguf_io import GGUFFile
            gf = GGUFFile(path)
            shape = cls.from_hparams(DFlashHParams.from_gguf(gf), 2, window, matrix_type, path)
            if matrix_type is not None:
                return shape
            nbytes = sum(4 * _count(t.ne) if len(t.ne) == 1 else t.nbytes for t in gf.tensors.values())
            return replace(shape, weight_bytes=nbytes)
        import json
        config_path, weights_path = _resolve_zlab(path)
        with open(config_path, encoding="utf-8") as f:
            hp = DFlashHParams.from_config(json.load(f), config_path)
        tensors, _ = read_safetensors_header(weights_path)
        itemsizes = {t.nbytes // max(1, _count(t.ne)) for t in tensors.values() if _count(t.ne) > 1}
        return cls.from_hparams(hp, max(itemsizes) if itemsizes else 2, window, matrix_type, weights_path)


def _count(ne) -> int:
    n = 1
    for s in ne:
        n *= s
    return n


@dataclass
class MemoryPlan:
    n_ctx: int
    kv_type: str
    parts: dict = field(default_factory=dict)     # name -> bytes, in print order
    n_ubatch: int = 512                           # the longest prefill micro-batch planned for
    prefix_snapshots: int = 0                     # recurrent-state snapshots planned for prefix reuse
    vram: int | None = None                       # the memory it was fitted to (None: not fitted)
    draft_type: str | None = None                 # the draft's matrices quantized at load to this (None: as stored)
    state_type: str = "f32"                       # the verify's node states (TargetRuntime.enable_verify)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def table(self) -> str:
        width = max(len(k) for k in self.parts)
        lines = [f"memory plan: n_ctx {self.n_ctx}, kv_type {self.kv_type}, prefill micro-batch up to {self.n_ubatch}"
                 + (f", draft matrices {self.draft_type}" if self.draft_type else "")]
        lines += [f"  {name:<{width}}  {fmt_bytes(n):>11}" for name, n in self.parts.items()]
        lines.append(f"  {'total':<{width}}  {fmt_bytes(self.total):>11}")
        if self.vram is not None:
            lines.append(f"  {'device memory':<{width}}  {fmt_bytes(self.vram):>11}  "
                         f"({fmt_bytes(self.vram - self.total)} left)")
        return "\n".join(lines)


def kv_bytes(hp, n_ctx: int, kv_type) -> int:
    """K and V rows of every attention layer for n_ctx positions (cells rounded up to the bucket)."""
    n_attn = sum(1 for r in hp.recurrent if not r)
    return n_attn * 2 * kv_cells(n_ctx) * ggml.row_size(kv_type_of(kv_type), hp.head_dim * hp.n_head_kv)


def compute_estimate(hp, n_ctx: int, kv_type, n_ubatch: int, n_slots: int, draft: DraftShape | None) -> int:
    """The largest forward's scratch (an estimate; `bench/long_context.py` measures the real peak):
    a prefill micro-batch's f16 mask over every cell, one layer's widest activations (FFN gate, up and product,
    residual stream and norm, GDN projections) for n_ubatch tokens, the logits (every verify slot's), and for a
    quantized cache the f16 copy of one layer's K and V that CUDA's batched flash attention makes. The draft
    adds its logits and their softmax over the block, and its context append's activations."""
    cells = kv_cells(n_ctx)
    n = max(n_ubatch, n_slots)
    mask = n * cells * 2
    activations = n * 4 * (3 * hp.n_ff + 4 * hp.n_embd + _projection_width(hp))
    logits = hp.n_vocab * 4 * max(1, n_slots)
    staging = 0
    if kv_type_of(kv_type) != ggml.Type.F16:
        staging = 2 * cells * hp.head_dim * hp.n_head_kv * 2
    total = mask + activations + logits + staging
    if draft is not None:
        total += 2 * hp.n_vocab * (draft.block_size - 1) * 4
        total += n_ubatch * 4 * (draft.n_embd * (draft.n_feat + 2) + 3 * draft.n_ff)
    return total


def _projection_width(hp) -> int:
    """Values per token of a layer's input projections: a GDN layer's conv input and gate (the widest in a
    hybrid model), else attention's Q, K and V."""
    if any(hp.recurrent):
        return hp.conv_dim + hp.value_dim
    return (hp.n_head + 2 * hp.n_head_kv) * hp.head_dim


def recurrent_state_bytes(hp) -> int:
    """The recurrent state of every GDN layer (conv window and delta-rule state, f32); 0 for attention only."""
    n_rec = sum(1 for r in hp.recurrent if r)
    if not n_rec:
        return 0
    return n_rec * ((hp.ssm_d_conv - 1) * hp.conv_dim * 4 + hp.ssm_d_v * hp.ssm_d_v * hp.ssm_n_v_heads * 4)


def prefix_snapshot_count(hp, snapshots: int, max_bytes: int | None) -> int:
    """How many recurrent-state snapshots prefix reuse keeps: PrefixCache's bound (pydflash.prefix_cache), at most
    `snapshots` and `max_bytes` in all (an attention-only model's snapshots hold nothing)."""
    per = recurrent_state_bytes(hp)
    return min(snapshots, snapshots if max_bytes is None else max_bytes // max(per, 1))


def memory_plan(hp, weight_bytes: int, n_ctx: int, kv_type="f16", *, draft: DraftShape | None = None,
                n_ubatch: int = 512, n_slots: int = 0, state_type: str = "f32", prefix_snapshots: int = 0,
                reserve: int = RESERVE) -> MemoryPlan:
    """Bytes per part for a target of hyperparameters `hp` (any architecture's HParams) with `weight_bytes` of
    weights, n_ctx KV positions of kv_type, a verify of n_slots slots (0: AR only), prefix_snapshots saved
    recurrent states (prefix_snapshot_count) and optionally a draft."""
    kv_name = _kv_name(kv_type)
    if kv_name == "tq3_0" and hp.head_dim % 128:
        raise PlanError(f"kv type tq3_0 rotates groups of 128 values: head size {hp.head_dim} is not a multiple "
                        f"of 128")
    n_rec = sum(1 for r in hp.recurrent if r)
    if not n_rec:
        store_bytes = 0
    elif state_type == "replay":    # per slot its key, delta and decay, plus one zero column (TargetRuntime.commit)
        store_bytes = n_slots * hp.conv_dim * 4 + (n_slots + 1) * replay_width(hp) * 4 if n_slots else 0
    else:
        state_bytes = 2 if state_type == "f16" else 4
        store_bytes = n_slots * (hp.ssm_d_v ** 2 * hp.ssm_n_v_heads * state_bytes + hp.conv_dim * 4)
    parts = {
        "target weights": int(weight_bytes),
        f"KV cache ({kv_name}, {kv_cells(n_ctx)} cells)": kv_bytes(hp, n_ctx, kv_name),
        "recurrent states": recurrent_state_bytes(hp),
        f"verify stores ({n_slots} slots, {state_type})": n_rec * store_bytes,
        "prefix snapshots": prefix_snapshots * recurrent_state_bytes(hp),
        "captured features": (hp.n_embd * draft.n_feat * n_ubatch * 4) if draft else 0,
        "draft weights": draft.weight_bytes if draft else 0,
        "draft context ring": (draft.n_layer * 2 * draft.kv_row * 2 * kv_cells(draft.block_size + draft.window)
                               if draft else 0),
        "compute (estimate)": compute_estimate(hp, n_ctx, kv_name, n_ubatch, n_slots, draft)
        # replay: one layer's node states live in the verify graph instead of a store
        + (n_slots * hp.ssm_d_v ** 2 * hp.ssm_n_v_heads * 4 if state_type == "replay" and n_rec else 0),
        "reserve": int(reserve),
    }
    return MemoryPlan(n_ctx, kv_name, parts, n_ubatch, prefix_snapshots)


def _kv_name(kv_type) -> str:
    t = kv_type_of(kv_type)
    return next(name for name, v in KV_TYPES.items() if v == t)


def _kv_candidates(hp, kv_type) -> list[str]:
    if kv_type != "auto":
        return [_kv_name(kv_type)]
    # TQ3_0 rotates 128-value groups: a head size that is not a multiple of 128 cannot use it
    return [k for k in AUTO_KV_ORDER if k != "tq3_0" or hp.head_dim % 128 == 0]


def fit(hp, weight_bytes: int, vram: int, *, max_ctx="auto", kv_type="auto", min_ctx: int = 0,
        **plan_args) -> MemoryPlan:
    """The plan that fits `vram` bytes.

    max_ctx="auto": the longest context up to the model's training context (a multiple of the 256 bucket);
    with kv_type="auto" the first of f16, q8_0, q4_0, tq3_0 that holds the whole training context, else the
    most compact type at the longest context it holds. A number: exactly that context, with the first type
    (auto) that fits it. Raises PlanError, naming the numbers, when nothing fits (or less than min_ctx)."""
    n_train = hp.n_ctx_train if hp.n_ctx_train > 0 else None
    candidates = _kv_candidates(hp, kv_type)

    def plan(n, k):
        p = memory_plan(hp, weight_bytes, n, k, **plan_args)
        p.vram = vram
        return p

    if max_ctx != "auto":
        n_ctx = int(max_ctx)
        if n_ctx < 1:
            raise ValueError(f"max_ctx {max_ctx}: must be a positive number or 'auto'")
        for k in candidates:
            p = plan(n_ctx, k)
            if p.total <= vram:
                return p
        raise PlanError(f"max_ctx {n_ctx} does not fit in {fmt_bytes(vram)}: with kv_type {p.kv_type} it needs "
                        f"{fmt_bytes(p.total)} ({_largest(p)}); "
                        + _suggestion(hp, weight_bytes, vram, candidates, plan_args, n_train))
    target_ctx = n_train or 8192
    for k in candidates:
        p = plan(target_ctx, k)
        if p.total <= vram:
            return p
    k = candidates[-1]
    n_ctx = _longest(hp, weight_bytes, vram, k, plan_args, target_ctx)
    if n_ctx < max(1, min_ctx):
        p = plan(max(min_ctx, KV_BUCKET), k)
        raise PlanError(f"nothing fits in {fmt_bytes(vram)}: {max(min_ctx, KV_BUCKET)} positions with kv_type {k} "
                        f"need {fmt_bytes(p.total)} ({_largest(p)})")
    return plan(n_ctx, k)


def _longest(hp, weight_bytes, vram, kv_type, plan_args, cap) -> int:
    """The longest context (a multiple of the bucket, at most cap) whose plan fits; 0 if none does."""
    lo, hi = 0, cap // KV_BUCKET            # in buckets; the plan grows with the context
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if memory_plan(hp, weight_bytes, mid * KV_BUCKET, kv_type, **plan_args).total <= vram:
            lo = mid
        else:
            hi = mid - 1
    return lo * KV_BUCKET


def _largest(p: MemoryPlan) -> str:
    big = sorted(p.parts.items(), key=lambda kv: -kv[1])[:3]
    return ", ".join(f"{name} {fmt_bytes(n)}" for name, n in big)


def _suggestion(hp, weight_bytes, vram, candidates, plan_args, n_train) -> str:
    k = candidates[-1]
    n = _longest(hp, weight_bytes, vram, k, plan_args, n_train or (1 << 22))
    if n == 0:
        return f"not even {KV_BUCKET} positions fit with kv_type {k}"
    return f"at most {n} positions fit with kv_type {k}"


# --- from files ---------------------------------------------------------------------------------------------------

def target_shape(path):
    """(hyperparameters, weight bytes) of a target GGUF (a file name or a parsed GGUFFile), from its header
    only, for any architecture pydflash loads."""
    from .gguf_io import GGUFError, GGUFFile
    from .models import target_classes
    gf = path if isinstance(path, GGUFFile) else GGUFFile(os.fspath(path))
    targets = target_classes()
    if gf.architecture not in targets:
        raise GGUFError(f"{gf.path}: architecture {gf.architecture!r} is not supported (supported: {sorted(targets)})")
    hp = targets[gf.architecture].HParams.from_gguf(gf)
    names = hp.tensors()
    return hp, sum(info.nbytes for name, info in gf.tensors.items() if name in names)


def plan_for_files(target, draft=None, *, vram=None, max_ctx="auto", kv_type="auto", budget: int = 22,
                   n_ubatch: int = 512, state_type: str = "f32", mode: str | None = None,
                   draft_window: int = DRAFT_WINDOW, prefix_snapshots: int = 0,
                   prefix_bytes: int | None = None, draft_type: str | None = None) -> MemoryPlan:
    """The plan for a target GGUF (a file name or a parsed GGUFFile) and an optional draft (folder or GGUF),
    fitted to `vram` bytes when given (then max_ctx / kv_type may be 'auto'); without vram, max_ctx and kv_type
    must be concrete. prefix_snapshots / prefix_bytes: the prefix cache's bound (load's arguments); draft_type:
    None (the draft's matrices as stored) or a key of DRAFT_MATRIX_TYPES ('q8_0', 'q4_k') they are quantized to at
    load."""
    hp, weight_bytes = target_shape(target)
    mode = mode or ("ddtree" if draft is not None else "ar")
    shape = DraftShape.from_path(draft, draft_window, draft_type) if (draft is not None and mode != "ar") else None
    n_slots = 0 if shape is None else (min(budget, shape.block_size - 1) if mode == "chain" else budget) + 1
    args = dict(draft=shape, n_ubatch=n_ubatch, n_slots=n_slots, state_type=state_type,
                prefix_snapshots=prefix_snapshot_count(hp, prefix_snapshots, prefix_bytes))
    if vram is None:
        if max_ctx == "auto" or kv_type == "auto":
            raise ValueError("max_ctx and kv_type 'auto' need the device memory (vram)")
        result = memory_plan(hp, weight_bytes, int(max_ctx), kv_type, **args)
    else:
        result = fit(hp, weight_bytes, parse_size(vram), max_ctx=max_ctx, kv_type=kv_type, **args)
    result.draft_type = draft_type if shape is not None else None
    result.state_type = state_type
    return result


def plan_for_load(target, draft=None, *, vram, n_ubatch="auto", budget: int = 22, prefix_snapshots: int = 0,
                  prefix_bytes: int | None = PREFIX_BYTES, draft_type: str | None = "auto", state_type: str = "f32",
                  **args) -> MemoryPlan:
    """What `pydflash.load` allocates (plan_for_files' arguments). The context and KV type come first: fitted
    with the smallest buffers (no prefix snapshots, DEFAULT_UBATCH-token micro-batches, or n_ubatch when it is a
    number) and, for the options given as "auto", the first of AUTO_OPTIONS that fits the longest context (or the
    same one with the finest KV type): f32 node states and the draft's matrices as stored, else replayed states
    (state_type 'replay'), else the draft's matrices quantized to q8_0 at load, else both. None of these changes
    the output (q8_0 changes the draft's proposals; f16 states, which would, are never picked). Then the prefix
    snapshots (as many as requested, else fewer) and, with n_ubatch="auto",
    LONG_PROMPT_UBATCH micro-batches are taken where they leave that context and KV type unchanged; snapshots
    before bigger micro-batches. A verify must fit in one micro-batch (at least budget + 1 tokens)."""
    from .gguf_io import GGUFFile
    if not isinstance(target, GGUFFile):      # parsed once for the several fits below (a vocabulary is big)
        target = GGUFFile(os.fspath(target))
    ubatches = [LONG_PROMPT_UBATCH, DEFAULT_UBATCH] if n_ubatch == "auto" else [int(n_ubatch)]
    if "auto" in (draft_type, state_type):
        draft_type, state_type = _best_options(target, draft, vram, max(ubatches[-1], budget + 1), budget, draft_type,
                                               state_type, args)

    def fit_with(ubatch, snapshots):
        return plan_for_files(target, draft, vram=vram, budget=budget, n_ubatch=max(ubatch, budget + 1),
                              prefix_snapshots=snapshots, prefix_bytes=prefix_bytes, draft_type=draft_type,
                              state_type=state_type, **args)

    fitted = fit_with(ubatches[-1], 0)
    for snapshots in range(prefix_snapshots, -1, -1):
        for ubatch in ubatches:
            try:
                candidate = fit_with(ubatch, snapshots)
            except PlanError:
                continue
            if (candidate.n_ctx, candidate.kv_type) == (fitted.n_ctx, fitted.kv_type):
                return candidate
    return fitted


# state_type "auto" takes these. Never f16 (it may change the output). Replayed states alone: the smallest store (f32
# never fits more), and on the H100 the fastest step, whose verify computes each recurrent layer's tree at once
# (docs/gdn-tree-chunk.md; docs/benchmarks.md, nineteenth session: the 27B's budget-22 step 1.2 ms shorter than with
# f32 states).
AUTO_STATE_TYPES = ("replay",)
# draft_type "auto" tries the draft as stored, then these. Not q4_k: it changes the proposals more than q8_0 and is
# taken only when asked for (draft_type='q4_k').
AUTO_DRAFT_TYPES = ("q8_0",)


def _best_options(target, draft, vram, n_ubatch, budget, draft_type, state_type, args) -> tuple:
    """(draft_type, state_type) for plan_for_load: each "auto" one chosen among its candidates, in the order of
    preference the draft as stored, then the q8_0 draft (with replayed states, or the state type asked for); the
    first of the best fits is taken. When nothing fits, the PlanError of the most compact choice (the closest to
    fitting)."""
    speculative = draft is not None and args.get("mode") != "ar"
    if not speculative:
        return None, "f32" if state_type == "auto" else state_type
    drafts = [None, *AUTO_DRAFT_TYPES] if draft_type == "auto" else [draft_type]
    states = list(AUTO_STATE_TYPES) if state_type == "auto" else [state_type]
    options = [(d, st) for d in drafts for st in states]
    best, best_key, error = None, None, None
    for d, st in options:
        try:
            p = plan_for_files(target, draft, vram=vram, budget=budget, n_ubatch=n_ubatch, draft_type=d,
                               state_type=st, **args)
        except PlanError as e:
            error = e
            continue
        key = (p.n_ctx, -AUTO_KV_ORDER.index(p.kv_type))
        if best_key is None or key > best_key:
            best, best_key = (d, st), key
    if best_key is not None:
        return best
    d, st = options[-1]
    shrink = ("a smaller budget shrinks" if st != "f32" else
              "a smaller budget and replayed states (state_type='replay') shrink")
    raise PlanError(f"{error} (with the draft's matrices {d or 'as stored'} and {st} verify states; {shrink} "
                    f"the verify stores)") from None
