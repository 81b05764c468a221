"""The target runtime shared by every architecture: weights, cache, graphs, prefill/decode, tree verify, commit.

An architecture subclasses `TargetRuntime` and provides only what is its own (docs/targets.md is the contract):
`ARCH` (its `general.architecture`), `HParams` (parsed from the GGUF, with `tensors()`: name -> TensorSpec,
and `recurrent`: per layer, True for a recurrent-state layer, False for a KV-cache attention layer) and
`build_layer`, which adds one layer to a graph given the runtime's inputs (`GraphInputs`).

A forward over n tokens at position n_past builds (or reuses) a graph keyed by (n, KV-length bucket), writes
K/V rows and recurrent state into the cache, and leaves on the device: the last token's logits and their
argmax, and the outputs of the captured layers for all n tokens. A verify runs a tree of n_slots slots in one
graph and commits nothing; `commit` then keeps the accepted path (KV rows moved to consecutive cells, the
recurrent state and conv window taken from the accepted slot).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from .. import ggml, sampling
from ..gguf_io import GGUFFile, upload
from ..kv import HybridCache
from ..validate import SMALL_F32_ROLES, check_finite, check_memory, check_tensors, tensor_bytes
from . import layers

KV_BUCKET = 256            # the attended KV length is padded to this, so one graph serves 256 positions
MAX_GRAPHS = 32            # built graphs kept for reuse (LRU): decode buckets plus recent prefill shapes
PREFILL_MIN_UBATCH = 512   # prefill micro-batches start at this size ...
PREFILL_TARGET_BATCHES = 16  # ... and double while a prompt would need more than this many of them

ROLES = ("embedding", "output", "matrix", "norm", "bias", "vector", "conv")


def kv_cells(n: int) -> int:
    """n positions rounded up to whole KV buckets: the cells a cache allocates, the cells a forward attends."""
    return -(-n // KV_BUCKET) * KV_BUCKET


@dataclass(frozen=True)
class TensorSpec:
    """A tensor an architecture reads: its shape (ggml order) and its role.

    role: 'embedding' (token embedding), 'output' (LM head), 'matrix' (a weight matmul), 'norm' (a norm's
    weight), 'bias', 'vector' (other per-channel parameters), 'conv' (a convolution kernel); each role allows
    the tensor types in pydflash/validate.py's ROLE_TYPES. optional: may be absent from the file (e.g. a tied
    LM head)."""
    ne: tuple
    role: str
    optional: bool = False

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"tensor role {self.role!r}: expected one of {ROLES}")


class TargetWeights:
    """All weights an architecture reads from a GGUF, in one device buffer, by GGUF tensor name.

    Without `output.weight` the LM head is the token embedding (tied embeddings). fused: merged name -> member
    names (same type, same row length): the members are laid out back to back as the rows of one tensor under
    the merged name, so one matmul computes all of them (e.g. Q, K and V of a layer from one read of the
    activations: fewer, larger kernels for small batches). Each member is its own tensor placed on its rows
    (Buffer.alias), not a view: a graph reading it alone sees a leaf, so backend fusions that match consecutive
    nodes (ggml-cuda's gate/up/GLU at one token) still apply."""

    def __init__(self, gf: GGUFFile, specs: dict[str, TensorSpec], backend: ggml.Backend,
                 progress: bool | None = None, infos: list | None = None, fused: dict | None = None,
                 row_orders: dict | None = None):
        """infos: what `check(gf, specs, backend)` returned, when the caller already ran it; row_orders: tensors
        loaded with their rows reordered (gguf_io.upload)."""
        if infos is None:
            infos = self.check(gf, specs, backend)
        fused = fused or {}
        self.specs = {info.name: specs[info.name] for info in infos}
        self.fused = {merged: tuple(members) for merged, members in fused.items()}
        self.member_of = {m: merged for merged, members in self.fused.items() for m in members}
        self._ctx = ggml.Context(n_tensors=max(len(infos) - len(self.member_of) + len(fused), 1))
        self._member_ctx = ggml.Context(n_tensors=max(len(self.member_of), 1))   # placed in the fused tensors
        by_name = {info.name: info for info in infos}
        self.t = {}
        for merged, members in self.fused.items():
            self.t[merged] = self._merged_tensor(merged, [by_name[m] for m in members])
        for info in infos:
            ctx = self._member_ctx if info.name in self.member_of else self._ctx
            self.t[info.name] = ctx.new_tensor(info.type, info.ne, name=info.name[:63])
        self.buffer = backend.alloc_tensors(self._ctx)
        for merged, members in self.fused.items():   # each member: a leaf on its rows of the fused tensor
            offset = 0
            for m in members:
                self.buffer.alias(self.t[m], self.t[merged], offset)
                offset += by_name[m].nbytes
        upload(gf, [(info, self.t[info.name]) for info in infos], progress=progress, row_orders=row_orders)
        if "output.weight" not in self.t:
            self.t["output.weight"] = self.t["token_embd.weight"]

    def _merged_tensor(self, merged: str, members: list) -> ggml.Tensor:
        """One tensor with room for the members' rows in order (vectors: their values)."""
        first = members[0]
        vector = len(first.ne) == 1
        if any(m.type != first.type or len(m.ne) != len(first.ne) or (not vector and m.ne[0] != first.ne[0])
               for m in members):
            raise ValueError(f"{merged}: fused tensors need one type and row length: "
                             f"{[(m.name, m.type.name, m.ne) for m in members]}")
        ne = (sum(m.ne[0] for m in members),) if vector else (first.ne[0], sum(m.ne[1] for m in members))
        return self._ctx.new_tensor(first.type, ne, name=merged[:63])

    @staticmethod
    def check(gf: GGUFFile, specs: dict[str, TensorSpec], backend: ggml.Backend) -> list:
        """The file's tensor table held to the specs (names, shapes, a type each role allows and the backend
        computes, no unused tensor) and the small f32 tensors finite; the TensorInfos to load, nothing
        allocated. A NaN norm weight would make every logit NaN."""
        infos = check_tensors(gf, specs, backend=backend)
        check_finite(gf, [info for info in infos if specs[info.name].role in SMALL_F32_ROLES])
        return infos

    def __getitem__(self, name: str) -> ggml.Tensor:
        return self.t[name]

    def __contains__(self, name: str) -> bool:
        return name in self.t


def fusable_runs(info: dict, bases: tuple[str, ...]) -> list[tuple[str, ...]]:
    """`bases` (names without '.weight') cut into runs of neighbours that can share one matrix: the same type and
    row length, and a bias on all of them or on none. info: tensor name -> TensorInfo."""
    def key(base):
        w = info[base + ".weight"]
        return w.type, w.ne[0], base + ".bias" in info
    runs = [[bases[0]]]
    for base in bases[1:]:
        if key(base) == key(runs[-1][0]):
            runs[-1].append(base)
        else:
            runs.append([base])
    return [tuple(run) for run in runs]


def fused_entries(info: dict, bases: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """TargetWeights' `fused` entries for weights `bases` (and their biases, if any): 'blk.N.a+b.weight' ->
    ('blk.N.a.weight', 'blk.N.b.weight'); nothing for fewer than two."""
    if len(bases) < 2:
        return {}
    prefix = bases[0].rsplit(".", 1)[0] + "."
    merged = prefix + "+".join(b[len(prefix):] for b in bases)
    parts = (".weight", ".bias") if bases[0] + ".bias" in info else (".weight",)
    return {merged + part: tuple(b + part for b in bases) for part in parts}


def fusing_enabled() -> bool:
    """PYDFLASH_FUSED_WEIGHTS=0 loads every weight as its own tensor (TargetRuntime.fused_weights returns {})."""
    return layers.env_switch("PYDFLASH_FUSED_WEIGHTS", default="1")


class GraphInputs:
    """One built forward graph and its inputs/outputs, reused for every forward of the same shape.

    What a layer builder reads: n_tokens, n_kv (attended KV cells), tokens (i32 [n]), pos (i32
    [n * POS_PER_TOKEN]: rope positions), kv_rows (i64 [n]: the KV cells this forward writes), kq_mask (f16
    [n_kv, n]: 0 where a token may attend a cell, -inf elsewhere), kq_mask_swa (models with sliding-window
    layers, `hp.swa_layers` true for some: kq_mask further limited to the cells of the last `hp.n_swa`
    positions), parent (tree verify of a model with recurrent layers: i32 [n, 1], each slot's parent slot, -1 for
    the root), decode_parent (a one-token decode of such a model in bit-exact mode: i32 [1, 1] = -1, the one-node
    tree its recurrent layers run the verify's tree ops over), tree (a verify graph), side_effects (cache writes a
    layer adds; they become graph outputs so they are computed). pos, kv_rows and kq_mask exist only when the
    model has attention layers."""

    def __init__(self, n_tokens: int, n_kv: int, size: int, tree: bool):
        self.n_tokens, self.n_kv, self.tree = n_tokens, n_kv, tree
        self.ctx = ggml.Context(n_tensors=size, graph_size=size)
        self.graph = None
        self.tokens = self.pos = self.kq_mask = self.kq_mask_swa = self.kv_rows = self.parent = None
        self.decode_parent = None
        self.side_effects: list[ggml.Tensor] = []
        self.mask_host = None         # the host copy of the mask, kept and updated where it changes
        self.mask_past = None         # the n_past mask_host was last written for (None: write it whole)
        self.swa_host = None          # the same for kq_mask_swa
        self.swa_past = None
        self.logits = self.argmax = None
        self.sampler = None           # sampling.SamplerNodes when the target samples (enable_sampling)
        self.io = None                # a verify's tokens, parents, positions and KV rows: one upload (InputBlock)

    def causal_mask(self, n_past: int) -> np.ndarray:
        """f16 [n_tokens, n_kv]: token i (position n_past + i) sees cells 0..n_past + i. Only the columns between
        the last call's n_past and this one's change, so a deep context is not refilled every step."""
        n, n_kv = self.n_tokens, self.n_kv
        lo, hi = (0, n_kv) if self.mask_past is None else (min(self.mask_past, n_past),
                                                           min(n_kv, max(self.mask_past, n_past) + n))
        if self.mask_host is None:
            self.mask_host = np.empty((n, n_kv), dtype=np.float16)
        cols = np.arange(lo, hi)[None, :]
        self.mask_host[:, lo:hi] = np.where(cols <= n_past + np.arange(n)[:, None], 0.0, -np.inf)
        self.mask_past = n_past
        return self.mask_host

    def tree_mask(self, n_past: int, seen: np.ndarray) -> np.ndarray:
        """f16 [n_tokens, n_kv] for a tree verify: every slot sees the committed cells 0..n_past-1, and the cells
        n_past + j of the slots j that seen[i, j] marks (itself and its ancestors). Updated in place like
        causal_mask: the previous tree's columns and the newly committed ones."""
        n, n_kv = self.n_tokens, self.n_kv
        lo, hi = (0, n_kv) if self.mask_past is None else (min(self.mask_past, n_past),
                                                           min(n_kv, max(self.mask_past, n_past) + n))
        if self.mask_host is None:
            self.mask_host = np.empty((n, n_kv), dtype=np.float16)
        mask = self.mask_host
        mask[:, lo:max(lo, n_past)] = 0.0
        mask[:, max(lo, n_past):hi] = -np.inf
        mask[:, n_past:n_past + n][seen] = 0.0
        self.mask_past = n_past
        return mask


    def window_mask(self, n_past: int, pos: np.ndarray, n_swa: int) -> np.ndarray:
        """f16 [n_tokens, n_kv]: the mask causal_mask or tree_mask just wrote, and further -inf where a token at
        position p meets a cell of position p' <= p - n_swa (llama.cpp's standard sliding window). pos: the
        tokens' (slots') positions; cell c < n_past holds position c, cell n_past + i the row of token i.

        Only columns that can differ from the last call are rewritten: every cell below (the smaller n_past)
        - n_swa is outside the window of every token of both calls, and every cell from (the larger n_past) + n
        on is masked in both."""
        n, n_kv = self.n_tokens, self.n_kv
        lo, hi = (0, n_kv) if self.swa_past is None else (max(0, min(self.swa_past, n_past) - n_swa),
                                                          min(n_kv, max(self.swa_past, n_past) + n))
        if self.swa_host is None:
            self.swa_host = np.empty((n, n_kv), dtype=np.float16)
        cell_pos = np.arange(lo, hi)
        new = slice(max(lo, n_past), min(hi, n_past + n))      # columns holding this forward's rows
        cell_pos[new.start - lo:new.stop - lo] = pos[new.start - n_past:new.stop - n_past]
        inside = pos[:, None].astype(np.int64) - cell_pos[None, :] < n_swa
        self.swa_host[:, lo:hi] = np.where(inside, self.mask_host[:, lo:hi], np.float16(-np.inf))
        self.swa_past = n_past
        return self.swa_host

    def place_masks(self, memory: list[np.ndarray]) -> None:
        """Keep the host masks in `memory` (f16 [n_tokens, n_kv] each: the mask's, then kq_mask_swa's), written
        whole on their next call: what they held belongs to whichever graph used that memory last."""
        self.mask_host = memory[0]
        self.swa_host = memory[1] if len(memory) > 1 else None
        self.mask_past = self.swa_past = None


class _CommitGraph:
    """The on-device commit after a verify: recurrent state, conv window and (optionally) KV rows from the
    accepted path. Its inputs are the small index vectors below; built once per slot count."""

    def __init__(self, size: int):
        self.ctx = ggml.Context(n_tensors=size, graph_size=size)
        self.graph = None
        self.state_slot = None        # i32 [1]: the accepted node's slot in the verify's state store
        self.replay_slots = None      # i32 [steps]: state_type 'replay': the path's slots, then the zero column
        self.conv_cols = None         # i32 [d_conv-1]: columns of (conv state ‖ verify inputs) that become the state
                                      # (of the verify inputs alone where the path is at least that long)
        self.kv_src = self.kv_dst = None   # i32 / i64 [n_slots]: KV cells to move, and where to


class _AheadIO:
    """decode_ahead's host side: step inputs staged in page-locked memory (two halves: a step's half is rewritten
    two steps later, after the step before it was waited for), and each step's token copied back into one of two
    slots, with an event behind it."""

    def __init__(self, backend: ggml.Backend, fed_token: ggml.Tensor, stage_bytes: int):
        self.half = -(-stage_bytes // 64) * 64
        self.host = ggml.HostBuffer(backend, 2 * self.half + 64)
        self.fed_token = fed_token
        self.events = [backend.event(), backend.event()]
        self.cursor = 0

    def stage_token(self, token: int) -> None:
        """The first step's input token (staged after the step halves, so it never overlaps them)."""
        at = 2 * self.half
        self.host.array[at:at + 4] = np.frombuffer(np.int32(token).tobytes(), np.uint8)
        self.host.upload(self.fed_token, at, 4)

    def begin(self, step: int) -> None:
        self.cursor = (step % 2) * self.half + 8     # the slot's first 8 bytes: its argmax

    def stage(self, tensor: ggml.Tensor, values: np.ndarray) -> None:
        raw = np.ascontiguousarray(values).view(np.uint8).reshape(-1)
        at = self.cursor
        self.host.array[at:at + raw.size] = raw
        self.host.upload(tensor, at, raw.size)
        self.cursor = -(-(at + raw.size) // 16) * 16

    def fetch(self, argmax: ggml.Tensor, step: int) -> None:
        self.host.download(argmax, (step % 2) * self.half)
        event = self.events[step % 2]
        if event is not None:
            event.record()

    def wait(self, step: int) -> int:
        event = self.events[step % 2]
        if event is not None:
            event.synchronize()
        at = (step % 2) * self.half
        return int(self.host.array[at:at + 4].view(np.int32)[0])


class TargetRuntime:
    """A loaded target model with its cache: `prefill`, `decode`, `step`, `verify`/`commit`, captured features.

    path: a GGUF file name, or an already parsed `GGUFFile` (the file is parsed once per load). n_ctx:
    positions of the KV cache. kv_type: 'f16', 'q8_0', 'q4_0' or 'tq3_0'. n_ubatch: tokens per prefill
    micro-batch. capture_layers: 0-based layer ids whose outputs (the residual stream after the layer) are kept
    on the device for every token of the last forward, in `captured` ([n_embd * n_capture, n_ubatch]).
    """

    ARCH = ""                     # general.architecture of the files this class loads
    HParams = None                # the architecture's hyperparameter class (from_gguf, tensors, recurrent)
    POS_PER_TOKEN = 1             # rope position values per token (multi-axis rope: more)
    GRAPH_TENSORS_PER_LAYER = 64  # graph tensor budget per layer (views included)

    def __init__(self, path, backend: ggml.Backend | str = "cpu", *, n_ctx: int = 4096, kv_type="f16",
                 n_ubatch: int = 512, capture_layers=(), progress: bool | None = None):
        self.backend = backend if isinstance(backend, ggml.Backend) else ggml.Backend(backend)
        self.gguf = path if isinstance(path, GGUFFile) else GGUFFile(os.fspath(path))
        self.hp = hp = self.HParams.from_gguf(self.gguf)
        if n_ctx < 1 or n_ubatch < 1:
            raise ValueError("n_ctx and n_ubatch must be positive")
        self.n_ctx, self.n_ubatch = n_ctx, n_ubatch
        self.capture_layers = tuple(int(i) for i in capture_layers)
        for il in self.capture_layers:
            if not 0 <= il < hp.n_layer:
                raise ValueError(f"capture layer {il} outside 0..{hp.n_layer - 1}")
        specs = hp.tensors()
        infos = TargetWeights.check(self.gguf, specs, self.backend)
        # cells rounded up to the bucket, so every attended window is a multiple of 256 (what the GPU flash
        # attention kernels want); positions past n_ctx are never written
        n_cells = kv_cells(n_ctx)
        # the whole plan against the device before anything is allocated: a damaged header or a huge n_ctx
        # fails here with the numbers, not in the allocator (or by exhausting the host)
        check_memory(self.backend, self.memory_plan(infos, n_cells, kv_type, n_ubatch),
                     f"{self.gguf.path} with n_ctx {n_ctx}")
        self.weights = TargetWeights(self.gguf, specs, self.backend, progress, infos, self.fused_weights(infos),
                                     self.row_orders())
        self.cache = HybridCache(self.backend, hp, n_cells, kv_type)
        self._capture_ctx = ggml.Context(n_tensors=1)
        self.captured = None
        if self.capture_layers:
            self.captured = self._capture_ctx.new_tensor(
                ggml.Type.F32, (hp.n_embd * len(self.capture_layers), n_ubatch), name="captured")
            self._capture_buffer = self.backend.alloc_tensors(self._capture_ctx)
        self.capture_serial = 0          # counts the forwards that wrote `captured` (n_captured's setter)
        self.n_captured = 0              # tokens of the last forward whose features are in `captured`
        self._graphs: dict[tuple, GraphInputs] = {}
        self._allocator = ggml.Allocator(self.backend)
        self.n_slots = 0                  # verify slots; set by enable_verify
        # recurrent layers' verify stores (enable_verify): the state after every slot and every slot's conv input
        self.slot_states: dict[int, ggml.Tensor] = {}
        self.slot_inputs: dict[int, ggml.Tensor] = {}
        self.tree_state_op = None         # the tree delta-rule op writing slot_states (None: chains only)
        self.replay = False               # state_type 'replay': slot_states hold each slot's key, delta and decay
        self._trees = False               # verify accepts branching trees (else chains only)
        # (KV compacted, replay steps, conv window from the verify inputs alone) -> its commit graph
        self._commit_graphs: dict[tuple[bool, int | None, bool], _CommitGraph] = {}
        self._commit_allocator = ggml.Allocator(self.backend)
        self._last: GraphInputs | None = None
        self.sampling_enabled = False     # graphs end in the on-device sampler (enable_sampling)
        self.sample_inputs = None         # sampling.StepInputs of the next prefill/step/verify (then cleared)
        self._last_sampled = False        # the last forward's sampler drew from given inputs
        self._ahead = None                # decode_ahead's staging buffers (_AheadIO), made on first use
        self._readback = ggml.Readback(self.backend)   # a verify's tokens, copied into page-locked memory
        self._verify_masks: ggml.HostBuffer | None = None   # a verify's masks, page-locked (enable_verify)
        self._masks_of: GraphInputs | None = None           # the verify graph whose masks it holds
        self._fed_token = None            # i32 [1] on the device: the token of decode_ahead's next step

    def memory_plan(self, infos, n_cells: int, kv_type, n_ubatch: int) -> dict[str, int]:
        """Bytes a load would allocate, by part (the compute buffer estimated: the logits and a few activations
        of the widest layer for a micro-batch)."""
        hp = self.hp
        width = max(hp.n_embd, getattr(hp, "n_ff", 0), getattr(hp, "conv_dim", 0) if any(hp.recurrent) else 0)
        return {"weights": sum(info.nbytes for info in infos),
                "KV cache and state": HybridCache.plan_bytes(hp, n_cells, kv_type),
                "compute (estimate)": 4 * n_ubatch * (hp.n_vocab + 8 * width)}

    # --- what an architecture provides ---

    def fusion_candidates(self, il: int) -> list[tuple[str, ...]]:
        """Groups of layer il's weights (names without '.weight') that read the same input, in row order: each run
        of neighbours of one type and row length is loaded as one matrix (fused_weights); none by default."""
        return []

    def row_orders(self) -> dict[str, np.ndarray]:
        """Weights whose rows the graphs want in another order than the file's: name -> the file's row for each
        loaded row (TargetWeights); none by default."""
        return {}

    def fused_weights(self, infos) -> dict[str, tuple[str, ...]]:
        """TargetWeights' `fused` from the file's TensorInfos: every layer's fusion_candidates, each cut into the
        runs fusable_runs allows; nothing with PYDFLASH_FUSED_WEIGHTS=0."""
        if not fusing_enabled():
            return {}
        info, fused = {i.name: i for i in infos}, {}
        for il in range(self.hp.n_layer):
            for bases in self.fusion_candidates(il):
                for run in fusable_runs(info, bases):
                    fused.update(fused_entries(info, run))
        return fused

    def project(self, ctx: ggml.Context, x: ggml.Tensor, bases: list[str], fuse_one_token: bool = True
                ) -> list[ggml.Tensor]:
        """x [n_in, n] through each weight of `bases` (names without '.weight'), its bias added where the file has
        one: [n_out, n] each. Weights that fused_weights fused take one matmul and one bias add together, and each
        one's result is a row range (a view) of that output; a view is contiguous only for n = 1.
        fuse_one_token=False: for one token, one matmul per weight all the same where the products would be
        ggml's mul_mat (ggml-cuda fuses separate products with what follows, as an FFN's gate and up with the GLU);
        a fused matrix that ggml_qmatmul takes stays one product (one read of the activations, one launch). A
        normed input that several products read is prepared once for all of them where they can share it
        (layers.prepared_for: an attention's Q/K matrix and its V of another type)."""
        w, out, products = self.weights, {}, []   # products: (matrix name without '.weight', its members)
        for base in bases:
            if any(base + ".weight" in members for _, members in products):
                continue
            merged = w.member_of.get(base + ".weight")
            if merged and not fuse_one_token and x.ne[1] == 1 and not layers.uses_qmatmul(w[merged], x):
                merged = None
            products.append(((merged or base + ".weight")[:-len(".weight")], w.fused[merged] if merged else
                             (base + ".weight",)))
        # several products of one normed input: prepared once for all where they can share it
        prepared = layers.prepared_for(ctx, x, [w[m + ".weight"] for m, _ in products]) \
            if isinstance(x, layers.Normed) else None
        for mbase, members in products:
            if prepared is not None:
                y = ggml.qmatmul_prepared(ctx, w[mbase + ".weight"], prepared, x.ne[1])
            else:
                y = layers.linear(ctx, w[mbase + ".weight"], x)
            if mbase + ".bias" in w:
                y = ctx.add(y, w[mbase + ".bias"])
            for member, part in zip(members, layers.row_ranges(ctx, y, [w[m].ne[1] for m in members])):
                out[member[:-len(".weight")]] = part
        return [out[b] for b in bases]

    def gated_ffn(self, ctx: ggml.Context, x: ggml.Tensor, prefix: str, glu: str, name: str,
                  add: ggml.Tensor | None = None) -> ggml.Tensor:
        """down(glu(gate x, up x)) with the layer's ffn_gate / ffn_up / ffn_down weights (prefix 'blk.N.'), named
        `name`, plus `add` (the residual) where given (layers.linear); glu: 'swiglu' or 'geglu' (ggml's
        swiglu_split / geglu_split; SwiGLU is computed inside the down product where ggml_qmatmul takes it:
        layers.Gated). Gate and up go through `project`: one matmul where fused, except for one token through
        ggml's mul_mat, where ggml-cuda already runs both products and the GLU as one kernel. Where both products
        take the f16 kernel, a fused gate/up writes the down product's input itself (layers.swiglu_down)."""
        w = self.weights
        gate_up = w.member_of.get(prefix + "ffn_gate.weight")
        if (glu == "swiglu" and gate_up is not None and gate_up[:-len(".weight")] + ".bias" not in w
                and w.fused[gate_up] == (prefix + "ffn_gate.weight", prefix + "ffn_up.weight")):
            out = layers.swiglu_down(ctx, w[gate_up], x, w[prefix + "ffn_down.weight"], add)
            if out is not None:
                return out if add is not None else out.named(name)
        gate, up = self.project(ctx, x, [prefix + "ffn_gate", prefix + "ffn_up"], fuse_one_token=False)
        if glu == "swiglu":
            gated = layers.Gated(ctx, gate, up)
        elif glu == "geglu":
            gated = ctx.geglu_split(gate, up)
        else:
            raise ValueError(f"glu must be 'swiglu' or 'geglu', got {glu!r}")
        return layers.linear(ctx, self.weights[prefix + "ffn_down.weight"], gated, add=add, name=name)

    def build_layer(self, ctx: ggml.Context, il: int, h: ggml.Tensor, g: GraphInputs) -> ggml.Tensor:
        """Add layer il to the graph: the residual stream h [n_embd, n] in, the layer's output out."""
        raise NotImplementedError

    def embed(self, ctx: ggml.Context, g: GraphInputs) -> ggml.Tensor:
        """The input embeddings [n_embd, n] of g.tokens."""
        return ctx.get_rows(self.weights["token_embd.weight"], g.tokens).named("inp.embd")

    def output_norm(self, ctx: ggml.Context, h: ggml.Tensor) -> ggml.Tensor:
        """The final norm before the LM head."""
        return layers.rms_norm(ctx, h, self.weights["output_norm.weight"], self.hp.rms_eps, "out.norm")

    def rope_positions(self, pos: np.ndarray) -> np.ndarray:
        """The values of the `pos` input for tokens at positions pos (POS_PER_TOKEN per token)."""
        return pos

    # --- public API ---

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    @property
    def n_captured(self) -> int:
        return self._n_captured

    @n_captured.setter
    def n_captured(self, n: int) -> None:
        # every forward sets it: capture_serial tells a holder of work derived from `captured` (the draft's staged
        # context rows, DFlashDraft.stage_from_target) whether it still describes the last forward
        self._n_captured = int(n)
        self.capture_serial += 1

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def reset(self) -> None:
        self.cache.reset()
        self._last = None

    def prefill(self, tokens, return_logits: bool = True, on_ubatch=None, ubatch: int | None = None
                ) -> np.ndarray | None:
        """Run the prompt in micro-batches; returns the logits of its last token (f32 [n_vocab]).

        ubatch: tokens per micro-batch (at most n_ubatch); None chooses by prompt length (`prefill_ubatch`).
        on_ubatch(first_position, n_tokens), if given, runs after each micro-batch, while `captured` holds that
        micro-batch's layer outputs (a consumer such as the draft's context cache copies them from there)."""
        tokens = self._tokens(tokens)
        if tokens.size == 0:
            raise ValueError("prefill needs at least one token")
        self._check_room(tokens.size)
        if ubatch is None:
            ubatch = prefill_ubatch(tokens.size, self.n_ubatch)
        if not 1 <= ubatch <= self.n_ubatch:
            raise ValueError(f"ubatch {ubatch} outside 1..n_ubatch ({self.n_ubatch})")
        for start in range(0, tokens.size, ubatch):
            first = self.cache.n_past
            self._forward(tokens[start: start + ubatch])
            if on_ubatch is not None:
                on_ubatch(first, self.n_captured)
        self.sample_inputs = None
        return self.logits() if return_logits else None

    def decode(self, token: int) -> np.ndarray:
        """Run one token; returns its logits (f32 [n_vocab])."""
        self._check_room(1)
        self._forward(self._tokens([token]))
        self.sample_inputs = None
        return self.logits()

    def step(self, token: int) -> int:
        """Run one token and return the next token (greedy, or drawn by the sampler when sampling is enabled
        and `sample_inputs` are set); only 4 bytes come back to the host."""
        self._check_room(1)
        self._forward(self._tokens([token]))
        self.sample_inputs = None
        return int(self.sampled()[0]) if self._last_sampled else self.argmax()

    @property
    def decodes_ahead(self) -> bool:
        """Whether decode_ahead applies: a model without recurrent layers, whose queued step can be taken back by
        moving n_past (its KV row past n_past is never read, and is overwritten later)."""
        return not any(self.hp.recurrent)

    def decode_ahead(self, token: int, max_steps: int, sampler=None):
        """Decoding after `token` (run first): yields the next token of each of up to max_steps steps while the
        step after it already runs on the device. The tokens stay on the device (each step's argmax, or its drawn
        token, is the next step's input), so the host's work for a step, including this generator's consumer,
        overlaps the device's; only the 4-byte token comes back, into page-locked memory. Closing the generator
        early (break, close()) takes the queued step back: the cache then holds `token` and every yielded token
        but the last, as after the same calls of `step`.

        sampler: None (greedy), or a sampling.Sampler without penalties (with enable_sampling(True)): its draws then
        need nothing from the host but the next uniform, taken in step order as `step` would take them (the
        queued step that is taken back has drawn one more)."""
        if not self.decodes_ahead:
            raise ValueError(f"{self.ARCH}: decode_ahead needs a model without recurrent layers (use step)")
        if (sampler is not None) != self.sampling_enabled:
            raise ValueError("decode_ahead samples with enable_sampling(True) and a sampler, decodes greedily with "
                             "enable_sampling(False) and none")
        if sampler is not None and sampler.params.penalised:
            raise ValueError("penalties read the last tokens on the host: sample with step instead")
        token = int(self._tokens([token])[0])
        if max_steps < 1:
            return
        self._check_room(max_steps)
        ahead = self._ahead_io()
        ahead.stage_token(token)
        launched = taken = 0
        try:
            self._launch_fed(ahead, 0, sampler)
            launched = 1
            while taken < max_steps:
                if launched < max_steps:
                    self._launch_fed(ahead, launched, sampler)
                    launched += 1
                next_token = ahead.wait(taken)
                taken += 1
                yield next_token
        finally:
            self.backend.synchronize()
            self.cache.n_past -= launched - taken       # the queued step (if any) is taken back
            self._last = None                           # its logits would be the dropped step's
            self.n_captured = 0

    def _ahead_io(self) -> "_AheadIO":
        if self._ahead is None:
            n_cells = self.cache.n_ctx
            self._fed_ctx = ggml.Context(n_tensors=1)
            self._fed_token = self._fed_ctx.new_tensor(ggml.Type.I32, (1,), name="fed_token")
            self._fed_buffer = self.backend.alloc_tensors(self._fed_ctx)
            self._ahead = _AheadIO(self.backend, self._fed_token, 2 * n_cells * 2 + 1024)   # masks, sampler inputs
        return self._ahead

    def _launch_fed(self, ahead: "_AheadIO", step: int, sampler) -> None:
        """Queue one fed decode step at n_past (its inputs staged in half step % 2 of the page-locked buffer)."""
        n_past = self.cache.n_past
        n_kv = kv_cells(n_past + 1)
        g = self._graph((1, n_kv, "fed"), 1, n_kv, tree=False, fed=True)
        ahead.begin(step)
        for tensor, values in self._position_inputs(g, n_past):
            ahead.stage(tensor, values)
        if sampler is not None:
            inputs = sampler.for_context(())          # no penalties: no history, the next uniform
            ahead.stage(g.sampler.hist, np.ascontiguousarray(inputs.hist, np.int32))
            ahead.stage(g.sampler.params, inputs.params)
            ahead.stage(g.sampler.rand, inputs.rand)
        self.backend.compute_async(g.graph)
        ahead.fetch(g.sampler.tokens if sampler is not None else g.argmax, step)
        self.cache.n_past = n_past + 1

    def enable_sampling(self, on: bool) -> None:
        """Make every graph end in the on-device sampler (pydflash.sampling) as well as the argmax: a prefill,
        step or verify then draws from `sample_inputs` when they are set (they are cleared after it), and
        `step`/`verify` return the drawn tokens; without inputs they stay greedy. Built graphs are dropped when
        this changes."""
        on = bool(on)
        if on != self.sampling_enabled:
            self.sampling_enabled = on
            self._graphs = {}
            self._last = None

    def sampled(self) -> np.ndarray:
        """The tokens the sampler drew in the last forward, one per logits row (i32)."""
        if self._last is None or not self._last_sampled:
            raise RuntimeError("the last forward did not sample (enable_sampling, then set sample_inputs)")
        return self._last.sampler.tokens.numpy().reshape(-1)

    def forward(self, tokens) -> None:
        """Run up to n_ubatch tokens at the current position (results stay on the device)."""
        tokens = self._tokens(tokens)
        if not 1 <= tokens.size <= self.n_ubatch:
            raise ValueError(f"forward takes 1..{self.n_ubatch} tokens, got {tokens.size}")
        self._check_room(tokens.size)
        self._forward(tokens)
        self.sample_inputs = None

    def logits(self) -> np.ndarray:
        """The last forward's logits for its last token."""
        if self._last is None:
            raise RuntimeError("no forward has run yet")
        return self._last.logits.numpy().reshape(-1)

    def logits_of_slots(self) -> np.ndarray:
        """The last verify's logits for every slot: f32 [n_slots, n_vocab] (a diagnostic: the decode loop reads
        only the argmaxes)."""
        if self._last is None or not self._last.tree:
            raise RuntimeError("the last forward was not a verify")
        return self._last.logits.numpy().reshape(self._last.n_tokens, -1)

    def argmax(self) -> int:
        if self._last is None:
            raise RuntimeError("no forward has run yet")
        return int(self._last.argmax.numpy().reshape(-1)[0])

    def captured_features(self) -> np.ndarray:
        """The captured layers' outputs for the tokens of the last forward: f32 [n_tokens, n_capture, n_embd]."""
        if self.captured is None:
            raise RuntimeError("no capture_layers were given")
        n = self.n_captured
        full = self.captured.numpy()   # [n_ubatch, n_capture * n_embd]
        return full[:n].reshape(n, len(self.capture_layers), self.hp.n_embd)

    # --- speculative verify ---

    def enable_verify(self, n_slots: int, *, tree: bool = True, state_type: str = "f32") -> None:
        """Allocate what `verify`/`commit` need for trees of up to n_slots slots (root + nodes): per recurrent
        layer the state after every slot (f32 [S_v*S_v, H_v, n_slots]) and the slots' conv inputs
        ([conv_dim, n_slots]).

        tree=False allows chains only, through upstream gated_delta_net's state snapshots; tree=True needs the
        tree ops (`ggml.gated_delta_net_tree_persist`). state_type 'f16' halves the state store (tree ops only),
        at the price of rounding every node's state (docs/benchmarks.md measures it against f32). state_type
        'replay' (tree ops only) stores no node state: per slot only its key, decay and delta (what the tree op
        adds to its parent's state), and `commit` rebuilds the accepted node's state from the committed one
        (ggml.gated_delta_net_path: the verify's node state, bit for bit, with no dot products left to redo), so
        the 27B's store shrinks from 3.3 GiB to ~80 MiB at 23 slots and the verify skips most state stores. A
        model without recurrent layers verifies trees either way."""
        hp = self.hp
        if not 1 <= n_slots <= self.n_ubatch:
            raise ValueError(f"n_slots must be 1..n_ubatch ({self.n_ubatch}), got {n_slots}")
        if self.cache.kv_type == ggml.Type.TQ3_0 and self.cache.k_words is None:
            # through f32, TQ3_0 would rotate the already-rotated rows again (its rows are whole words anyway)
            raise ValueError("speculative decoding with a tq3_0 KV cache needs rows of whole 32-bit words")
        n_rec = sum(hp.recurrent)
        persist = getattr(ggml, "gated_delta_net_tree_persist", None)
        if tree and persist is None and n_rec:
            raise RuntimeError("tree verify needs ggml.gated_delta_net_tree_persist (the tree ops are not in this "
                               "build); use chains (tree=False)")
        if state_type not in ("f32", "f16", "replay") or (state_type != "f32" and not tree):
            raise ValueError(f"state_type {state_type!r}: 'f32', or 'f16' / 'replay' with tree=True")
        replay = state_type == "replay"
        store_type = ggml.Type.F16 if state_type == "f16" else ggml.Type.F32
        if layers.bitexact_enabled() and n_slots > ggml.QMATMUL_MAX_COLS:
            raise ValueError(f"PYDFLASH_BITEXACT=1 verifies at most {ggml.QMATMUL_MAX_COLS} slots, got {n_slots}")
        bitexact = layers.bitexact_enabled() and n_rec > 0
        if bitexact and (persist is None or state_type not in ("f32", "replay")):
            # a decode keeps its state in f32 and runs the tree kernel: a verify must do the same, chains included
            # (a replayed state is the tree kernel's f32 state, rebuilt bit for bit)
            raise ValueError("PYDFLASH_BITEXACT=1 verifies through the tree ops with f32 or replayed states, got "
                             f"state_type {state_type!r}" + ("" if persist else " and a build without the tree ops"))
        S, H = (hp.ssm_d_v, hp.ssm_n_v_heads) if n_rec else (0, 0)   # attention-only models have no GDN layer
        if n_rec:
            per_slot = (4 * replay_width(hp) if replay else tensor_bytes(store_type, (S * S, H))) + 4 * hp.conv_dim
            check_memory(self.backend, {"verify state store": n_rec * n_slots * per_slot},
                         f"{self.gguf.path} with {n_slots} verify slots")
        self.tree_state_op = persist if tree or bitexact else None
        self.replay = replay
        self._trees = tree or not n_rec
        self.n_slots = n_slots
        # every recurrent layer's store as one tensor (the commit updates all layers in one op), each layer's part
        # placed on its last-axis slice
        self.slot_states, self.slot_inputs = {}, {}
        self.states_all = self.inputs_all = None
        self._verify_buffer = None
        if n_rec:
            if replay:   # one more column, kept zero: the commit's padding steps (decay 1, delta 0) change nothing
                shape, name = (replay_width(hp), n_slots + 1), "steps"
            else:
                shape, name = (S * S, H, n_slots), "states"
            self._verify_ctx = ggml.Context(n_tensors=2)
            self.states_all = self._verify_ctx.new_tensor(store_type, shape + (n_rec,), name=f"verify.{name}")
            self.inputs_all = self._verify_ctx.new_tensor(ggml.Type.F32, (hp.conv_dim, n_slots, n_rec),
                                                          name="verify.conv_inputs")
            self._verify_buffer = self.backend.alloc_tensors(self._verify_ctx)
            self._verify_layers = ggml.Context(n_tensors=2 * n_rec)
            rec = self.cache.rec_layers
            for per_layer, whole, layer_shape, part in (
                    (self.slot_states, self.states_all, shape, name),
                    (self.slot_inputs, self.inputs_all, (hp.conv_dim, n_slots), "conv_inputs")):
                parts = self._verify_buffer.alias_slices(self._verify_layers, whole, layer_shape,
                                                         [f"verify.l{il}.{part}" for il in rec])
                per_layer.update(zip(rec, parts))
            if replay:
                self.states_all.set(np.zeros(self.states_all.ne[::-1], np.float32))
        self._graphs = {k: v for k, v in self._graphs.items() if k[0] != "verify"}
        # the masks of every verify in one page-locked buffer, sized for the whole context: uploaded from pageable
        # memory, a mask of 23 slots took the host ~0.1 ms at 8K positions, and grows with the context
        self._verify_masks, self._masks_of = None, None
        if self.cache.k:
            n_masks = 2 if any(getattr(hp, "swa_layers", ())) else 1
            self._verify_masks = ggml.HostBuffer(self.backend, n_masks * n_slots * kv_cells(self.cache.n_ctx) * 2)
        self._commit_graphs = {}

    def verify(self, tokens, parents, depths, then=None) -> np.ndarray:
        """One forward over n_slots tree slots at the current position; returns the argmax token of every slot
        (with enable_sampling and `sample_inputs` set: the token the sampler drew for every slot).

        tokens/parents/depths: [n_slots] (ddtree.padded): slot 0 is the root at position n_past, slot s sits at
        position n_past + depths[s] and attends to the committed cells and its ancestors; its KV row is written
        at cell n_past + s. Nothing is committed: n_past is unchanged until `commit`. then: a callable that
        queues more work on the backend once the forward and its tokens' copy are queued (the engine's staging of
        the draft's context rows): it runs on the device while the host waits for the tokens."""
        if self.n_slots == 0:
            raise RuntimeError("call enable_verify(n_slots) first")
        tokens = self._tokens(tokens)
        parents = np.asarray(parents, np.int32)
        depths = np.asarray(depths, np.int32)
        n, n_past = self.n_slots, self.cache.n_past
        if tokens.size != n or parents.size != n or depths.size != n:
            raise ValueError(f"verify takes exactly n_slots={n} slots")
        if not self._trees and not _chain_then_padding(parents):
            raise ValueError("this verify runs chains only (enable_verify(tree=False)); got a branching tree")
        if n_past + n > self.cache.n_ctx or n_past + int(depths.max()) >= self.n_ctx:
            raise ValueError(f"context overflow: verify of {n} slots at position {n_past} exceeds n_ctx {self.n_ctx}")
        n_kv = kv_cells(n_past + n)
        g = self._graph(("verify", n, n_kv), n, n_kv, tree=True)
        io = g.io
        io["tokens"][:] = tokens
        if g.parent is not None:
            io["parent"][:] = parents
        if g.pos is not None:
            io["pos"][:] = self.rope_positions(n_past + depths)
            io["kv_rows"][:] = np.arange(n_past, n_past + n)
        io.upload()
        if g.pos is not None:
            self._upload_verify_masks(g, n_past, parents, depths)
        self._set_sampler(g)
        self.sample_inputs = None
        self.backend.compute_async(g.graph)
        self._last = g
        self.n_captured = n
        return self._read_i32(g.sampler.tokens if self._last_sampled else g.argmax, then)[:n].astype(np.int64)

    def _upload_verify_masks(self, g: GraphInputs, n_past: int, parents: np.ndarray, depths: np.ndarray) -> None:
        """A verify's masks, written where they changed in the page-locked buffer, and queued to the device. (The
        buffer is rewritten only after the last verify's tokens were read: its copies have run.)"""
        masks = [g.kq_mask] + ([g.kq_mask_swa] if g.kq_mask_swa is not None else [])
        stride = self._verify_masks.array.nbytes // 2 // len(masks)     # f16 values a mask may take
        if self._masks_of is not g:
            g.place_masks([self._verify_masks.array.view(np.float16)[i * stride: i * stride + g.n_tokens * g.n_kv]
                           .reshape(g.n_tokens, g.n_kv) for i in range(len(masks))])
            self._masks_of = g
        g.tree_mask(n_past, _ancestors(parents))
        if g.kq_mask_swa is not None:
            g.window_mask(n_past, n_past + depths, self.hp.n_swa)
        for i, t in enumerate(masks):
            self._verify_masks.upload(t, 2 * i * stride, t.nbytes)

    def _read_i32(self, t: ggml.Tensor, then=None) -> np.ndarray:
        """An i32 result of the forward just queued, copied behind it on the backend's stream into page-locked
        memory, then waited for: one wait (a synchronous compute, then Tensor.numpy's own copy and wait, took
        ~0.1 ms more a verify on the H100: docs/benchmarks.md, twenty-second session)."""
        self._readback.queue(t)
        if then is not None:
            then()
        return self._readback.wait().view(np.int32).copy()

    def commit(self, path, wait: bool = True) -> None:
        """Make the accepted slots `path` (root first, each the parent of the next) the committed tokens: state
        of the last one, conv window along the path, KV rows of the path moved to consecutive cells.

        wait=False queues the commit on the backend's stream and returns: the next forward (verify, decode) is
        ordered after it, but a host read or copy of the cache (Tensor.numpy, copy_to) is not: synchronize the
        backend first."""
        path = [int(s) for s in path]
        n, n_past = self.n_slots, self.cache.n_past
        if not path or path[0] != 0 or len(path) > n:
            raise ValueError(f"path must start at the root slot 0 and hold at most {n} slots")
        compact = path != list(range(len(path)))          # a chain prefix is already in place
        steps = replay_steps(len(path), n) if self.replay else None
        d = self.hp.ssm_d_conv - 1 if self.slot_states else 0
        inputs_only = len(path) >= d                       # the new conv window holds no column of the old one
        key = (compact, steps, inputs_only)
        cg = self._commit_graphs.get(key)
        if cg is None:
            cg = self._commit_graphs[key] = self._build_commit(compact, steps, inputs_only)
        if cg.graph is not None and self._commit_allocator.current is not cg.graph:
            self.backend.synchronize()    # a queued commit may still use the compute buffer this allocation reuses
            self._commit_allocator.allocate(cg.graph)
        if cg.conv_cols is not None:   # (the same picks for every recurrent layer)
            n_rec = cg.conv_cols.ne[1]
            if cg.replay_slots is not None:
                padded = path + [n] * (steps - len(path))          # n: the store's zero column
                cg.replay_slots.set(np.tile(np.array(padded, np.int32), (n_rec, 1)), self.backend)
            else:
                column = path[-1] if self.tree_state_op is not None else n - 1 - path[-1]   # snapshots: newest first
                cg.state_slot.set(np.full((n_rec, 1), column, np.int32), self.backend)
            cols = path[-d:] if inputs_only else (list(range(d)) + [d + s for s in path])[-d:]
            cg.conv_cols.set(np.tile(np.array(cols, np.int32), (n_rec, 1)), self.backend)
        if cg.kv_src is not None:
            src = np.full(n, n_past + n - 1, np.int32)        # padding: the last verify cell onto itself
            dst = np.full(n, n_past + n - 1, np.int64)
            src[:len(path)] = n_past + np.asarray(path)
            dst[:len(path)] = n_past + np.arange(len(path))
            cg.kv_src.set(np.tile(src, (cg.kv_src.ne[1], 1)), self.backend)   # (the same rows in every layer)
            cg.kv_dst.set(dst, self.backend)
        if cg.graph is not None:
            (self.backend.compute if wait else self.backend.compute_async)(cg.graph)
        self.cache.n_past = n_past + len(path)

    # --- forward ---

    def _tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.hp.n_vocab):
            bad = tokens[(tokens < 0) | (tokens >= self.hp.n_vocab)][0]
            raise ValueError(f"token id {bad} outside the vocabulary (0..{self.hp.n_vocab - 1})")
        return tokens.astype(np.int32)

    def _set_sampler(self, g: GraphInputs) -> None:
        """Upload the sampler's inputs of a forward (neutral ones without sample_inputs: the argmax is read)."""
        self._last_sampled = g.sampler is not None and self.sample_inputs is not None
        if g.sampler is not None:
            g.sampler.set(self.sample_inputs)

    def _check_room(self, n: int) -> None:
        if self.cache.n_past + n > self.n_ctx:
            raise ValueError(f"context overflow: {self.cache.n_past} positions used + {n} new > n_ctx {self.n_ctx}")

    def _graph(self, key: tuple, n: int, n_kv: int, tree: bool, fed: bool = False) -> GraphInputs:
        """The cached graph for `key` (built on first use; least recently used dropped), allocated."""
        g = self._graphs.pop(key, None)
        if g is None:
            g = self._build(n, n_kv, tree, fed)
            while len(self._graphs) >= MAX_GRAPHS:        # drop the least recently used
                self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = g                             # (re)insert as the most recently used
        if self._allocator.current is not g.graph:
            self._allocator.allocate(g.graph)
        return g

    def _forward(self, tokens: np.ndarray) -> None:
        n, n_past = tokens.size, self.cache.n_past
        n_kv = kv_cells(n_past + n)          # attended cells: a multiple of the bucket
        g = self._graph((n, n_kv), n, n_kv, tree=False)
        g.tokens.set(tokens, self.backend)
        if g.decode_parent is not None:
            g.decode_parent.set(_ROOT_PARENT, self.backend)
        for tensor, values in self._position_inputs(g, n_past):
            tensor.set(values, self.backend)
        self._set_sampler(g)
        self.backend.compute(g.graph)
        self.cache.n_past = n_past + n
        self._last = g
        self.n_captured = n

    def _position_inputs(self, g: GraphInputs, n_past: int) -> list[tuple[ggml.Tensor, np.ndarray]]:
        """What a forward of g's tokens at n_past uploads for its attention layers (none without): rope positions,
        the KV rows it writes, the causal mask and, with sliding-window layers, their mask."""
        if g.pos is None:
            return []
        pos = np.arange(n_past, n_past + g.n_tokens, dtype=np.int32)
        out = [(g.pos, self.rope_positions(pos)), (g.kv_rows, pos.astype(np.int64)),
               (g.kq_mask, g.causal_mask(n_past))]
        if g.kq_mask_swa is not None:
            out.append((g.kq_mask_swa, g.window_mask(n_past, pos, self.hp.n_swa)))
        return out

    # --- graph construction ---

    def _build(self, n: int, n_kv: int, tree: bool = False, fed: bool = False) -> GraphInputs:
        """fed: a one-token decode whose token is the device-resident `_fed_token`, which the graph overwrites with
        its own argmax (or drawn token) at the end (decode_ahead)."""
        hp, cache = self.hp, self.cache
        per_layer = self.GRAPH_TENSORS_PER_LAYER + (32 if layers.bitexact_enabled() else 0)   # + reshapes
        g = GraphInputs(n, n_kv, per_layer * hp.n_layer + 256, tree)
        ctx = g.ctx
        g.tokens = self._fed_token if fed else ctx.new_tensor(ggml.Type.I32, (n,), name="inp.tokens").mark_input()
        if cache.k:   # positions, rows and mask only matter to attention layers
            g.pos = ctx.new_tensor(ggml.Type.I32, (self.POS_PER_TOKEN * n,), name="inp.pos").mark_input()
            g.kv_rows = ctx.new_tensor(ggml.Type.I64, (n,), name="inp.kv_rows").mark_input()
            g.kq_mask = ctx.new_tensor(ggml.Type.F16, (n_kv, n), name="inp.kq_mask").mark_input()
            if any(getattr(hp, "swa_layers", ())):   # a model with sliding-window layers: their mask too
                g.kq_mask_swa = ctx.new_tensor(ggml.Type.F16, (n_kv, n), name="inp.kq_mask_swa").mark_input()
        if tree and any(hp.recurrent):
            g.parent = ctx.new_tensor(ggml.Type.I32, (n, 1), name="inp.parent").mark_input()
        elif n == 1 and any(hp.recurrent) and layers.bitexact_enabled():
            g.decode_parent = ctx.new_tensor(ggml.Type.I32, (1, 1), name="inp.decode_parent").mark_input()
        if tree:   # a verify's small inputs in one upload (the masks, large at long contexts, stay apart)
            g.io = ggml.InputBlock(self.backend, {name: t for name, t in (
                ("tokens", g.tokens), ("parent", g.parent), ("pos", g.pos), ("kv_rows", g.kv_rows)) if t is not None})

        h = self.embed(ctx, g)                                          # [n_embd, n]
        for il in range(hp.n_layer):
            h = self.build_layer(ctx, il, h, g)
            for j in (j for j, lid in enumerate(self.capture_layers) if lid == il):   # a layer may repeat
                cap = self.captured
                dst = ctx.view_2d(cap, hp.n_embd, n, cap.nb[1], j * hp.n_embd * 4)
                g.side_effects.append(ctx.cpy(h, dst).named(f"l{il}.capture{j}"))

        if not tree:   # only the last token's logits
            h = ctx.view_2d(h, hp.n_embd, 1, h.nb[1], (n - 1) * h.nb[1])
        out = self.output_norm(ctx, h)
        g.logits = layers.linear(ctx, self.weights["output.weight"], out).named("out.logits")  # [n_vocab, 1 or n]
        g.argmax = ggml.argmax_first(ctx, g.logits).named("out.argmax")
        if self.sampling_enabled:   # the sampling hook: filter + draw per row on the device
            g.sampler = sampling.attach(ctx, g.logits)
        if fed:   # the next step's token, without a trip through the host
            chosen = g.sampler.tokens if g.sampler is not None else g.argmax
            g.side_effects.append(ctx.cpy(chosen, self._fed_token).named("out.fed_token"))
        outputs = g.side_effects + [g.logits, g.argmax] + ([g.sampler.tokens] if g.sampler is not None else [])
        g.graph = ctx.graph(outputs)   # Allocator.allocate checks every node
        return g

    def _replay_states(self, ctx, slots):
        """Every recurrent layer's committed state after the accepted path, in one op, rebuilt in place in the cache
        from its state and the steps (k, delta, gate) that slots [steps, n_rec] pick in the store, padded with its
        zero column (ggml.gated_delta_net_path: the verify's own node state, bit for bit; the op reads each value
        before it writes it)."""
        hp, store, ssm = self.hp, self.states_all, self.cache.ssm_all    # f32 [replay_width, n_slots + 1, n_rec]
        d_k, h_k, d_v, h_v = hp.ssm_d_k, hp.ssm_n_k_heads, hp.ssm_d_v, hp.ssm_n_v_heads
        row, n, layer, n_rec = store.nb[1], store.ne[1], store.nb[2], store.ne[2]
        k = ctx.view_4d(store, d_k, h_k, n, n_rec, d_k * 4, row, layer, 0)
        delta = ctx.view_4d(store, d_v, h_v, n, n_rec, d_v * 4, row, layer, hp.key_dim * 4)
        g = ctx.view_4d(store, 1, h_v, n, n_rec, 4, row, layer, (hp.key_dim + hp.value_dim) * 4)
        state = ggml.gated_delta_net_path(ctx, ctx.reshape_4d(ssm, d_v, d_v, h_v, n_rec), k, g, delta, steps=slots)
        return self.cache.buffer.alias(state.named("commit.states"), ssm)

    def _build_commit(self, compact_kv: bool, steps: int | None, inputs_only: bool) -> _CommitGraph:
        """steps: with state_type 'replay', the delta-rule steps the commit runs (replay_steps). inputs_only: the
        path is at least d_conv-1 slots long, so the conv window comes from the verify's inputs alone (no
        transposed copy and concatenation of the old window). Every recurrent layer at once: the stores and the
        cache's states are one tensor each (HybridCache.ssm_all / conv_all, enable_verify), so the states take one
        op and the conv windows two, whatever the layer count (the 27B: 144 kernels before)."""
        hp, cache, n = self.hp, self.cache, self.n_slots
        cg = _CommitGraph(8 * hp.n_layer + 16)
        ctx, outs = cg.ctx, []
        if self.slot_states:
            d, n_rec = hp.ssm_d_conv - 1, len(cache.rec_layers)
            if self.replay:
                cg.replay_slots = ctx.new_tensor(ggml.Type.I32, (steps, n_rec), name="commit.replay_slots").mark_input()
                outs.append(self._replay_states(ctx, cg.replay_slots))
            else:
                cg.state_slot = ctx.new_tensor(ggml.Type.I32, (1, n_rec), name="commit.state_slot").mark_input()
                store = self.states_all                                     # [S*S, H, n_slots, n_rec]
                states = ctx.view_3d(store, store.ne[0] * store.ne[1], n, n_rec, store.nb[2], store.nb[3], 0)
                # f32 [S*S*H, 1, n_rec], gathered straight into the cache's states (placed on their bytes: no copy)
                state = ctx.get_rows(states, cg.state_slot).named("commit.states")
                outs.append(cache.buffer.alias(state, cache.ssm_all))
            # conv windows: columns of (old window ‖ slot inputs), channel-major rows for get_rows
            cg.conv_cols = ctx.new_tensor(ggml.Type.I32, (d, n_rec), name="commit.conv_cols").mark_input()
            conv = ctx.reshape_3d(cache.conv_all, d, hp.conv_dim, n_rec)
            if inputs_only:
                seq = self.inputs_all                                       # [conv_dim, n_slots, n_rec]
            else:
                seq = ctx.concat(ctx.cont(ctx.transpose(conv)), self.inputs_all, 1)   # [conv_dim, d + n_slots, n_rec]
            window = ctx.get_rows(seq, cg.conv_cols)                        # [conv_dim, d, n_rec]
            outs.append(ctx.cpy(ctx.transpose(window), conv).named("commit.conv"))
        if compact_kv and cache.k:   # every attention layer's rows in one gather and one scatter per K and V
            cg.kv_src = ctx.new_tensor(ggml.Type.I32, (n, len(cache.k)), name="commit.kv_src").mark_input()
            cg.kv_dst = ctx.new_tensor(ggml.Type.I64, (n,), name="commit.kv_dst").mark_input()   # (every layer)
            # raw words where the rows are whole words (bit-exact for every type), else through f32
            k, v = (cache.k_words, cache.v_words) if cache.k_words is not None else (cache.k_all, cache.v_all)
            for name, t in (("k", k), ("v", v)):
                rows = ctx.get_rows(t, cg.kv_src)                         # f32 [row words or kv_row, n, n_attn]
                outs.append(ctx.set_rows(t, rows, cg.kv_dst).named(f"commit.{name}"))
        cg.graph = ctx.graph(outs) if outs else None
        return cg


_ROOT_PARENT = np.full((1, 1), -1, np.int32)   # a one-node tree: the node follows the committed state


def replay_width(hp) -> int:
    """Values per verify slot and recurrent layer that state_type 'replay' keeps: k (key_dim), the delta-rule
    update's delta (value_dim) and the log-decay (one per value head)."""
    return hp.key_dim + hp.value_dim + hp.ssm_n_v_heads


def replay_steps(path_len: int, n_slots: int) -> int:
    """Delta-rule steps a replay commit of path_len accepted slots runs: path_len rounded up to a power of two (at
    most n_slots), the rest padding steps that change nothing. One commit graph per such size, not per length,
    and a short path does not pay for n_slots steps (27B shape, 23 slots: the padded commit took 2.3 ms a step)."""
    return min(n_slots, 1 << (path_len - 1).bit_length())


def prefill_ubatch(n_tokens: int, n_max: int) -> int:
    """Micro-batch size for a prompt of n_tokens, at most n_max: PREFILL_MIN_UBATCH, doubled while the prompt
    would take more than PREFILL_TARGET_BATCHES micro-batches. A long prompt then runs in bigger batches (each
    reads the weights once, and graph set-up is paid per batch), a short one keeps the compute buffer (the
    batch x KV-cells mask, the FFN activations) small."""
    ubatch = PREFILL_MIN_UBATCH
    while ubatch < n_max and -(-n_tokens // ubatch) > PREFILL_TARGET_BATCHES:
        ubatch *= 2
    return max(1, min(ubatch, n_max))


def _chain_then_padding(parents: np.ndarray) -> bool:
    """Slots 1..L form a chain under the root and every later slot is padding (parent -1)."""
    n_chain = 1
    while n_chain < parents.size and parents[n_chain] == n_chain - 1:
        n_chain += 1
    return bool(parents[0] == -1 and (parents[n_chain:] == -1).all())


def _ancestors(parents: np.ndarray) -> np.ndarray:
    """bool [n, n]: slot i sees itself and its ancestors."""
    seen = np.zeros((parents.size, parents.size), dtype=bool)
    for i, p in enumerate(parents.tolist()):    # (Python ints: numpy scalars would make the loop ~2x slower)
        if p >= 0:
            seen[i] = seen[p]
        seen[i, i] = True
    return seen
