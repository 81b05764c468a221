"""The `qwen35` target (Qwen3.5 / Qwen3.6 dense): hyperparameters, weights and the hybrid forward graphs.

Layers are either full attention (gated Q, per-head Q/K RMS norm, IMROPE, flash attention over the KV cache)
or Gated DeltaNet (causal depthwise conv + the fused delta-rule op); every layer ends with a SwiGLU FFN.
Formulas, keys and tensor names follow llama.cpp's implementation, which is the oracle in the tests.

A forward over n tokens at position n_past builds (or reuses) a graph keyed by (n, KV-length bucket), writes
K/V rows and recurrent state into the cache, and leaves on the device: the last token's logits and their
argmax, and the outputs of the captured layers for all n tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import ggml
from ..gguf_io import GGUFError, GGUFFile, upload
from ..kv import HybridCache
from ..validate import (check_finite, check_memory, check_tensors, meta_float, meta_int, meta_ints, role_of,
                        tensor_bytes)

ARCH = "qwen35"
ROPE_TYPE_IMROPE = 40
KV_BUCKET = 256            # the attended KV length is padded to this, so one graph serves 256 positions
GRAPH_TENSORS_PER_LAYER = 64   # ~45 used (GDN or attention + FFN, views included), ~55 with rotated KV
MAX_GRAPHS = 32            # built graphs kept for reuse (LRU): decode buckets plus recent prefill shapes
# bounds on header sizes: far above any real model, low enough that nothing sized from them hangs or overflows
MAX_LAYERS = 1024
MAX_SIZE = 1 << 20
MAX_STATE = 1024           # GDN head size (Qwen3.5: 128); the state is state_size^2 per head
MAX_CONV = 64

# the role of each tensor (name without `blk.N.`), which fixes the types it may have (pydflash/validate.py)
TENSOR_ROLES = {
    "token_embd.weight": "embedding", "output_norm.weight": "norm", "output.weight": "matrix",
    "attn_norm.weight": "norm", "post_attention_norm.weight": "norm",
    "attn_qkv.weight": "matrix", "attn_gate.weight": "matrix", "ssm_conv1d.weight": "ssm_conv",
    "ssm_dt.bias": "vector", "ssm_a": "vector", "ssm_beta.weight": "matrix", "ssm_alpha.weight": "matrix",
    "ssm_norm.weight": "norm", "ssm_out.weight": "matrix",
    "attn_q.weight": "matrix", "attn_k.weight": "matrix", "attn_v.weight": "matrix",
    "attn_output.weight": "matrix", "attn_q_norm.weight": "norm", "attn_k_norm.weight": "norm",
    "ffn_gate.weight": "matrix", "ffn_up.weight": "matrix", "ffn_down.weight": "matrix",
}


@dataclass(frozen=True)
class Qwen35HParams:
    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_sections: tuple
    rope_base: float
    rms_eps: float
    ssm_d_conv: int
    ssm_d_k: int          # GDN key head size (ssm.state_size)
    ssm_n_k_heads: int    # ssm.group_count
    ssm_n_v_heads: int    # ssm.time_step_rank
    ssm_d_v: int          # ssm.inner_size / n_v_heads
    recurrent: tuple      # per layer: True = Gated DeltaNet, False = full attention
    n_ctx_train: int

    @property
    def key_dim(self) -> int:
        return self.ssm_d_k * self.ssm_n_k_heads

    @property
    def value_dim(self) -> int:
        return self.ssm_d_v * self.ssm_n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "Qwen35HParams":
        """Read and check the hyperparameters: every number typed, finite and in range before it sizes
        anything (a damaged block_count or head_count must fail here, not hang or divide by zero later)."""
        gf.expect_architecture(ARCH)
        size = lambda name, hi=MAX_SIZE, **kw: meta_int(gf, f"{ARCH}.{name}", 1, hi, **kw)  # noqa: E731
        n_layer, n_embd, n_head = size("block_count", MAX_LAYERS), size("embedding_length"), \
            size("attention.head_count")
        n_head_kv = size("attention.head_count_kv")
        head_dim = size("attention.key_length", default=n_embd // n_head)
        size("attention.value_length", default=head_dim)
        if gf.get(f"{ARCH}.attention.value_length", head_dim) != head_dim:
            raise GGUFError(f"{gf.path}: qwen35 needs attention.key_length == attention.value_length")
        recurrent = gf.get(f"{ARCH}.attention.recurrent_layers")
        if recurrent is not None:
            recurrent = meta_ints(gf, f"{ARCH}.attention.recurrent_layers", 0, 1, max_len=MAX_LAYERS)
            if len(recurrent) < n_layer:
                raise GGUFError(f"{gf.path}: attention.recurrent_layers has {len(recurrent)} entries, "
                                f"expected {n_layer}")
            recurrent = tuple(bool(x) for x in recurrent[:n_layer])
        else:
            interval = size("full_attention_interval", MAX_LAYERS, default=4)
            recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
        n_rot = size("rope.dimension_count", default=head_dim)
        sections = meta_ints(gf, f"{ARCH}.rope.dimension_sections", 0, MAX_SIZE, max_len=4)
        sections = tuple((sections + [0, 0, 0, 0])[:4])
        emb = gf.tensors.get("token_embd.weight")
        if emb is None:
            raise GGUFError(f"{gf.path}: missing tensor 'token_embd.weight'")
        if len(emb.ne) != 2:
            raise GGUFError(f"{gf.path}: tensor 'token_embd.weight' has shape {emb.ne}, expected 2 dimensions")
        n_v_heads = size("ssm.time_step_rank")
        ssm_inner = size("ssm.inner_size")
        hp = cls(
            n_layer=n_layer, n_embd=n_embd, n_ff=size("feed_forward_length"), n_vocab=int(emb.ne[1]),
            n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot, rope_sections=sections,
            rope_base=meta_float(gf, f"{ARCH}.rope.freq_base", 0.0, math.inf, default=10000.0),
            rms_eps=meta_float(gf, f"{ARCH}.attention.layer_norm_rms_epsilon", 0.0, 1.0),
            ssm_d_conv=size("ssm.conv_kernel", MAX_CONV), ssm_d_k=size("ssm.state_size", MAX_STATE),
            ssm_n_k_heads=size("ssm.group_count"), ssm_n_v_heads=n_v_heads,
            ssm_d_v=ssm_inner // n_v_heads, recurrent=recurrent,
            n_ctx_train=meta_int(gf, f"{ARCH}.context_length", 0, 1 << 40, default=0))
        hp._validate(gf.path, ssm_inner)
        return hp

    def _validate(self, path: str, ssm_inner: int) -> None:
        """The numbers must also agree with each other: reject combinations the graph cannot be built from."""
        problems = []
        if self.n_head % self.n_head_kv:
            problems.append(f"head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if ssm_inner != self.ssm_d_v * self.ssm_n_v_heads or self.ssm_d_v != self.ssm_d_k:
            problems.append(f"ssm.inner_size {ssm_inner} is not state_size x time_step_rank")
        if self.ssm_n_v_heads % self.ssm_n_k_heads:
            problems.append("ssm.time_step_rank is not a multiple of ssm.group_count")
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            problems.append(f"rope.dimension_count {self.n_rot} does not fit head size {self.head_dim}")
        if 2 * sum(self.rope_sections) != self.n_rot:
            problems.append(f"rope.dimension_sections {list(self.rope_sections)} do not sum to "
                            f"rope.dimension_count / 2 = {self.n_rot // 2}")
        if problems:
            raise GGUFError(f"{path}: " + "; ".join(problems))

    def tensor_shapes(self) -> dict[str, tuple]:
        """Every tensor the model reads, name -> ne (ggml order), as llama.cpp's loader expects them."""
        E, hd = self.n_embd, self.head_dim
        shapes = {"token_embd.weight": (E, self.n_vocab), "output_norm.weight": (E,),
                  "output.weight": (E, self.n_vocab)}
        for il in range(self.n_layer):
            p = f"blk.{il}."
            shapes[p + "attn_norm.weight"] = (E,)
            shapes[p + "post_attention_norm.weight"] = (E,)
            if self.recurrent[il]:
                shapes.update({p + "attn_qkv.weight": (E, self.conv_dim), p + "attn_gate.weight": (E, self.value_dim),
                               p + "ssm_conv1d.weight": (self.ssm_d_conv, self.conv_dim),
                               p + "ssm_dt.bias": (self.ssm_n_v_heads,), p + "ssm_a": (self.ssm_n_v_heads,),
                               p + "ssm_beta.weight": (E, self.ssm_n_v_heads),
                               p + "ssm_alpha.weight": (E, self.ssm_n_v_heads),
                               p + "ssm_norm.weight": (self.ssm_d_v,), p + "ssm_out.weight": (self.value_dim, E)})
            else:
                shapes.update({p + "attn_q.weight": (E, 2 * hd * self.n_head),
                               p + "attn_k.weight": (E, hd * self.n_head_kv),
                               p + "attn_v.weight": (E, hd * self.n_head_kv),
                               p + "attn_output.weight": (hd * self.n_head, E),
                               p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
            shapes.update({p + "ffn_gate.weight": (E, self.n_ff), p + "ffn_up.weight": (E, self.n_ff),
                           p + "ffn_down.weight": (self.n_ff, E)})
        return shapes


class Qwen35Weights:
    """All weights of a qwen35 GGUF in one device buffer, by GGUF tensor name."""

    def __init__(self, gf: GGUFFile, hp: Qwen35HParams, backend: ggml.Backend, progress: bool | None = None):
        shapes = hp.tensor_shapes()
        tied = {}
        if "output.weight" not in gf.tensors:   # tied embeddings: the LM head is the embedding matrix
            shapes.pop("output.weight")
            tied = {"token_embd.weight": ("matrix",)}
        infos = check_tensors(gf, shapes, TENSOR_ROLES, backend=backend, tied=tied)
        check_finite(gf, [i for i in infos if role_of(i.name, TENSOR_ROLES) in ("norm", "vector")])
        self._ctx = ggml.Context(n_tensors=len(infos))
        self.t = {info.name: self._ctx.new_tensor(info.type, info.ne, name=info.name[:63]) for info in infos}
        self.buffer = backend.alloc_tensors(self._ctx)
        upload(gf, [(info, self.t[info.name]) for info in infos], progress=progress)
        if "output.weight" not in self.t:
            self.t["output.weight"] = self.t["token_embd.weight"]

    def __getitem__(self, name: str) -> ggml.Tensor:
        return self.t[name]


class _ForwardGraph:
    """One built graph and its input/output tensors, reused for every forward of the same shape."""

    def __init__(self, n_tokens: int, n_kv: int, size: int):
        self.n_tokens, self.n_kv = n_tokens, n_kv
        self.ctx = ggml.Context(n_tensors=size, graph_size=size)
        self.graph = None
        self.tokens = self.pos = self.mask = self.rows = None
        self.parent = None            # tree verify only: i32 [n_tokens, 1] parent slot per slot (-1: committed)
        self.mask_host = None         # tree verify only: the host copy of the mask, reused
        self.logits = self.argmax = None
        self.per_slot = False         # tree verify: logits for every slot, not only the last token


class _CommitGraph:
    """The on-device commit after a verify: recurrent state, conv window and (optionally) KV rows from the
    accepted path. Its inputs are the small index vectors below; built once per slot count."""

    def __init__(self, size: int):
        self.ctx = ggml.Context(n_tensors=size, graph_size=size)
        self.graph = None
        self.state_slot = None        # i32 [1]: the accepted node's slot in the verify's state store
        self.conv_cols = None         # i32 [d_conv-1]: columns of (conv state ‖ verify inputs) that become the state
        self.kv_src = self.kv_dst = None   # i32 / i64 [n_slots]: KV cells to move, and where to


class Qwen35Target:
    """A loaded qwen35 model with its cache: `prefill`, `decode`, `reset`, captured hidden states.

    n_ctx: positions of the KV cache. kv_type: 'f16', 'q8_0', 'q4_0' or 'tq3_0' (AR only). n_ubatch: tokens per prefill
    micro-batch. capture_layers: 0-based layer ids whose outputs (the residual stream after the layer) are kept
    on the device for every token of the last forward, in `captured` ([n_embd * n_capture, n_ubatch]).
    """

    def __init__(self, path, backend: ggml.Backend | str = "cpu", *, n_ctx: int = 4096, kv_type="f16",
                 n_ubatch: int = 512, capture_layers=(), progress: bool | None = None):
        self.backend = backend if isinstance(backend, ggml.Backend) else ggml.Backend(backend)
        self.gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
        self.hp = hp = Qwen35HParams.from_gguf(self.gguf)
        if n_ctx < 1 or n_ubatch < 1:
            raise ValueError("n_ctx and n_ubatch must be positive")
        self.n_ctx, self.n_ubatch = n_ctx, n_ubatch
        self.capture_layers = tuple(int(i) for i in capture_layers)
        for il in self.capture_layers:
            if not 0 <= il < hp.n_layer:
                raise ValueError(f"capture layer {il} outside 0..{hp.n_layer - 1}")
        # cells rounded up to the bucket, so every attended window is a multiple of 256 (what the GPU flash
        # attention kernels want); positions past n_ctx are never written
        n_cells = -(-n_ctx // KV_BUCKET) * KV_BUCKET
        check_memory(self.backend, {"weights": sum(t.nbytes for t in self.gguf.tensors.values()),
                                    "KV cache and state": HybridCache.plan_bytes(hp, n_cells, kv_type),
                                    "compute (estimate)": 4 * n_ubatch * (hp.n_vocab + 8 * max(hp.n_ff, hp.conv_dim))},
                     f"{self.gguf.path} with n_ctx {n_ctx}")
        self.weights = Qwen35Weights(self.gguf, hp, self.backend, progress)
        self.cache = HybridCache(self.backend, hp, n_cells, kv_type)
        self._capture_ctx = ggml.Context(n_tensors=1)
        self.captured = None
        if self.capture_layers:
            self.captured = self._capture_ctx.new_tensor(
                ggml.Type.F32, (hp.n_embd * len(self.capture_layers), n_ubatch), name="captured")
            self._capture_buffer = self.backend.alloc_tensors(self._capture_ctx)
        self._graphs: dict[tuple, _ForwardGraph] = {}
        self._allocator = ggml.Allocator(self.backend)
        self.n_slots = 0                  # verify slots; set by enable_verify
        self._tree_op = None
        self._commit_graphs: dict[bool, _CommitGraph] = {}
        self._commit_allocator = ggml.Allocator(self.backend)
        self._last: _ForwardGraph | None = None
        self._last_n_captured = 0

    # --- public API ---

    @property
    def n_past(self) -> int:
        return self.cache.n_past

    def reset(self) -> None:
        self.cache.reset()
        self._last = None

    def prefill(self, tokens, return_logits: bool = True, on_ubatch=None) -> np.ndarray | None:
        """Run the prompt in micro-batches of n_ubatch; returns the logits of its last token (f32 [n_vocab]).

        on_ubatch(first_position, n_tokens), if given, runs after each micro-batch, while `captured` holds that
        micro-batch's layer outputs (a consumer such as the draft's context cache copies them from there)."""
        tokens = self._tokens(tokens)
        if tokens.size == 0:
            raise ValueError("prefill needs at least one token")
        self._check_room(tokens.size)
        for start in range(0, tokens.size, self.n_ubatch):
            first = self.cache.n_past
            self._forward(tokens[start: start + self.n_ubatch])
            if on_ubatch is not None:
                on_ubatch(first, self._last_n_captured)
        return self.logits() if return_logits else None

    def decode(self, token: int) -> np.ndarray:
        """Run one token; returns its logits (f32 [n_vocab])."""
        self._check_room(1)
        self._forward(self._tokens([token]))
        return self.logits()

    def step(self, token: int) -> int:
        """Run one token and return the greedy next token; only 4 bytes come back to the host."""
        self._check_room(1)
        self._forward(self._tokens([token]))
        return self.argmax()

    def forward(self, tokens) -> None:
        """Run up to n_ubatch tokens at the current position (results stay on the device)."""
        tokens = self._tokens(tokens)
        if not 1 <= tokens.size <= self.n_ubatch:
            raise ValueError(f"forward takes 1..{self.n_ubatch} tokens, got {tokens.size}")
        self._check_room(tokens.size)
        self._forward(tokens)

    def logits(self) -> np.ndarray:
        """The last forward's logits for its last token."""
        if self._last is None:
            raise RuntimeError("no forward has run yet")
        return self._last.logits.numpy().reshape(-1)

    def logits_of_slots(self) -> np.ndarray:
        """The last verify's logits for every slot: f32 [n_slots, n_vocab] (a diagnostic: the decode loop reads
        only the argmaxes)."""
        if self._last is None or not self._last.per_slot:
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
        n = self._last_n_captured
        full = self.captured.numpy()   # [n_ubatch, n_capture * n_embd]
        return full[:n].reshape(n, len(self.capture_layers), self.hp.n_embd)

    # --- speculative verify ---

    def enable_verify(self, n_slots: int, *, tree: bool = True, state_type: str = "f32") -> None:
        """Allocate what `verify`/`commit` need for trees of up to n_slots slots (root + nodes): per GDN layer
        the state after every slot (f32 [S_v*S_v, H_v, n_slots]) and the slots' conv inputs ([conv_dim, n_slots]).

        tree=False allows chains only, through upstream gated_delta_net's state snapshots; tree=True needs the
        tree ops (`ggml.gated_delta_net_tree_persist`). state_type 'f16' halves the state store (tree ops only),
        at the price of rounding every node's state (DESIGN §6: measure it against f32)."""
        hp = self.hp
        if not 1 <= n_slots <= self.n_ubatch:
            raise ValueError(f"n_slots must be 1..n_ubatch ({self.n_ubatch}), got {n_slots}")
        if self.cache.kv_type == ggml.Type.TQ3_0:
            # commit moves KV rows through f32, and TQ3_0 would rotate the already-rotated rows again
            raise ValueError("speculative decoding with a tq3_0 KV cache is not supported yet: use mode 'ar' or "
                             "another kv type")
        persist = getattr(ggml, "gated_delta_net_tree_persist", None)
        if tree and persist is None:
            raise RuntimeError("tree verify needs ggml.gated_delta_net_tree_persist (the tree ops are not in this "
                               "build); use chains (tree=False)")
        if state_type not in ("f32", "f16") or (state_type == "f16" and not tree):
            raise ValueError(f"state_type {state_type!r}: 'f32', or 'f16' with tree=True")
        self._tree_op = persist if tree else None
        self.n_slots = n_slots
        n_rec = sum(hp.recurrent)
        self._verify_ctx = ggml.Context(n_tensors=2 * n_rec + 1)
        S, H = hp.ssm_d_v, hp.ssm_n_v_heads
        store_type = ggml.Type.F16 if state_type == "f16" else ggml.Type.F32
        check_memory(self.backend, {"verify state store": n_rec * n_slots * (
            tensor_bytes(store_type, (S * S, H)) + 4 * hp.conv_dim)}, f"{self.gguf.path} with {n_slots} verify slots")
        self.slot_states = {il: self._verify_ctx.new_tensor(store_type, (S * S, H, n_slots, 1),
                                                            name=f"verify.l{il}.states")
                            for il in range(hp.n_layer) if hp.recurrent[il]}
        self.slot_inputs = {il: self._verify_ctx.new_tensor(ggml.Type.F32, (hp.conv_dim, n_slots),
                                                            name=f"verify.l{il}.conv_inputs")
                            for il in range(hp.n_layer) if hp.recurrent[il]}
        self._verify_buffer = self.backend.alloc_tensors(self._verify_ctx) if n_rec else None
        self._graphs = {k: v for k, v in self._graphs.items() if k[0] != "verify"}
        self._commit_graphs = {}

    def verify(self, tokens, parents, depths) -> np.ndarray:
        """One forward over n_slots tree slots at the current position; returns the argmax token of every slot.

        tokens/parents/depths: [n_slots] (ddtree.padded): slot 0 is the root at position n_past, slot s sits at
        position n_past + depths[s] and attends to the committed cells and its ancestors; its KV row is written
        at cell n_past + s. Nothing is committed: n_past is unchanged until `commit`."""
        if self.n_slots == 0:
            raise RuntimeError("call enable_verify(n_slots) first")
        tokens = self._tokens(tokens)
        parents = np.asarray(parents, np.int32)
        depths = np.asarray(depths, np.int32)
        n, n_past = self.n_slots, self.cache.n_past
        if tokens.size != n or parents.size != n or depths.size != n:
            raise ValueError(f"verify takes exactly n_slots={n} slots")
        if self._tree_op is None and not _chain_then_padding(parents):
            raise ValueError("this verify runs chains only (enable_verify(tree=False)); got a branching tree")
        if n_past + n > self.cache.n_ctx or n_past + int(depths.max()) >= self.n_ctx:
            raise ValueError(f"context overflow: verify of {n} slots at position {n_past} exceeds n_ctx {self.n_ctx}")
        n_kv = -(-(n_past + n) // KV_BUCKET) * KV_BUCKET
        key = ("verify", n, n_kv)
        fg = self._graphs.pop(key, None)
        if fg is None:
            fg = self._build(n, n_kv, tree=True)
            while len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = fg
        if self._allocator.current is not fg.graph:
            self._allocator.allocate(fg.graph)
        fg.tokens.set(tokens)
        if fg.parent is not None:
            fg.parent.set(parents.reshape(1, n))
        if fg.pos is not None:
            pos = (n_past + depths).astype(np.int32)
            fg.pos.set(np.concatenate([pos, pos, pos, np.zeros(n, np.int32)]))
            fg.rows.set(np.arange(n_past, n_past + n, dtype=np.int64))
            # filled in place in a host array kept with the graph (a few fills, no per-step allocation)
            if fg.mask_host is None:
                fg.mask_host = np.empty((n, n_kv), dtype=np.float16)
            mask = fg.mask_host
            mask[:, :n_past] = 0.0
            mask[:, n_past:] = -np.inf
            mask[:, n_past:n_past + n][_ancestors(parents)] = 0.0
            fg.mask.set(mask)
        self.backend.compute(fg.graph)
        self._last = fg
        self._last_n_captured = n
        return fg.argmax.numpy().reshape(-1)[:n].astype(np.int64)

    def commit(self, path) -> None:
        """Make the accepted slots `path` (root first, each the parent of the next) the committed tokens: state
        of the last one, conv window along the path, KV rows of the path moved to consecutive cells."""
        path = [int(s) for s in path]
        n, n_past = self.n_slots, self.cache.n_past
        if not path or path[0] != 0 or len(path) > n:
            raise ValueError(f"path must start at the root slot 0 and hold at most {n} slots")
        compact = path != list(range(len(path)))          # a chain prefix is already in place
        cg = self._commit_graphs.get(compact)
        if cg is None:
            cg = self._commit_graphs[compact] = self._build_commit(compact)
        if self._commit_allocator.current is not cg.graph:
            self._commit_allocator.allocate(cg.graph)
        if cg.state_slot is not None:
            d = self.hp.ssm_d_conv - 1
            column = path[-1] if self._tree_op is not None else n - 1 - path[-1]   # snapshots are newest first
            cg.state_slot.set(np.array([column], np.int32))
            cols = (list(range(d)) + [d + s for s in path])[-d:]
            cg.conv_cols.set(np.array(cols, np.int32))
        if cg.kv_src is not None:
            src = np.full(n, n_past + n - 1, np.int32)        # padding: the last verify cell onto itself
            dst = np.full(n, n_past + n - 1, np.int64)
            src[:len(path)] = n_past + np.asarray(path)
            dst[:len(path)] = n_past + np.arange(len(path))
            cg.kv_src.set(src)
            cg.kv_dst.set(dst)
        if cg.graph is not None:
            self.backend.compute(cg.graph)
        self.cache.n_past = n_past + len(path)

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    # --- forward ---

    def _tokens(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.hp.n_vocab):
            bad = tokens[(tokens < 0) | (tokens >= self.hp.n_vocab)][0]
            raise ValueError(f"token id {bad} outside the vocabulary (0..{self.hp.n_vocab - 1})")
        return tokens.astype(np.int32)

    def _check_room(self, n: int) -> None:
        if self.cache.n_past + n > self.n_ctx:
            raise ValueError(f"context overflow: {self.cache.n_past} positions used + {n} new > n_ctx {self.n_ctx}")

    def _forward(self, tokens: np.ndarray) -> None:
        n, n_past = tokens.size, self.cache.n_past
        n_kv = -(-(n_past + n) // KV_BUCKET) * KV_BUCKET          # attended cells: a multiple of the bucket
        fg = self._graphs.pop((n, n_kv), None)
        if fg is None:
            fg = self._build(n, n_kv)
            while len(self._graphs) >= MAX_GRAPHS:        # drop the least recently used
                self._graphs.pop(next(iter(self._graphs)))
        self._graphs[(n, n_kv)] = fg                      # (re)insert as the most recently used
        if self._allocator.current is not fg.graph:
            self._allocator.allocate(fg.graph)
        pos = np.arange(n_past, n_past + n, dtype=np.int32)
        fg.tokens.set(tokens)
        if fg.pos is not None:
            fg.pos.set(np.concatenate([pos, pos, pos, np.zeros(n, np.int32)]))  # IMROPE: axis-major (p,p,p,0)
            fg.rows.set(pos.astype(np.int64))
            # causal mask over the KV window: token i (position n_past+i) sees cells 0..n_past+i
            cells = np.arange(n_kv)[None, :]
            mask = np.where(cells <= pos[:, None], 0.0, -np.inf).astype(np.float16)
            fg.mask.set(mask)
        self.backend.compute(fg.graph)
        self.cache.n_past = n_past + n
        self._last = fg
        self._last_n_captured = n

    # --- graph construction ---

    def _build(self, n: int, n_kv: int, tree: bool = False) -> _ForwardGraph:
        hp, w, cache = self.hp, self.weights, self.cache
        fg = _ForwardGraph(n, n_kv, GRAPH_TENSORS_PER_LAYER * hp.n_layer + 256)
        ctx = fg.ctx
        fg.tokens = ctx.new_tensor(ggml.Type.I32, (n,), name="inp.tokens").mark_input()
        if cache.k:   # positions, rows and mask only matter to attention layers
            fg.pos = ctx.new_tensor(ggml.Type.I32, (4 * n,), name="inp.pos").mark_input()
            fg.rows = ctx.new_tensor(ggml.Type.I64, (n,), name="inp.kv_rows").mark_input()
            fg.mask = ctx.new_tensor(ggml.Type.F16, (n_kv, n), name="inp.kq_mask").mark_input()
        if tree and any(hp.recurrent):
            fg.parent = ctx.new_tensor(ggml.Type.I32, (n, 1), name="inp.parent").mark_input()
        side_effects = []   # cache writes: graph outputs so they are computed

        h = ctx.get_rows(w["token_embd.weight"], fg.tokens).named("inp.embd")   # [n_embd, n]
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            x = self._norm(ctx, h, w[p + "attn_norm.weight"], f"l{il}.attn_norm")
            if hp.recurrent[il]:
                mix = self._gdn(ctx, x, il, n, side_effects, fg.parent if tree else None)
            else:
                mix = self._attention(ctx, x, il, fg, side_effects)
            h = ctx.add(mix, h).named(f"l{il}.attn_res")
            x = self._norm(ctx, h, w[p + "post_attention_norm.weight"], f"l{il}.ffn_norm")
            gate = ctx.mul_mat(w[p + "ffn_gate.weight"], x)
            up = ctx.mul_mat(w[p + "ffn_up.weight"], x)
            ffn = ctx.mul_mat(w[p + "ffn_down.weight"], ctx.swiglu_split(gate, up)).named(f"l{il}.ffn_out")
            h = ctx.add(ffn, h).named(f"l{il}.out")
            if il in self.capture_layers:
                j = self.capture_layers.index(il)
                cap = self.captured
                dst = ctx.view_2d(cap, hp.n_embd, n, cap.nb[1], j * hp.n_embd * 4)
                side_effects.append(ctx.cpy(h, dst).named(f"l{il}.capture"))

        fg.per_slot = tree
        if not tree:   # only the last token's logits
            h = ctx.view_2d(h, hp.n_embd, 1, h.nb[1], (n - 1) * h.nb[1])
        out = self._norm(ctx, h, w["output_norm.weight"], "out.norm")
        fg.logits = ctx.mul_mat(w["output.weight"], out).named("out.logits")  # [n_vocab, 1 or n (tree)]
        fg.argmax = ctx.argmax(fg.logits).named("out.argmax")
        fg.graph = ctx.graph(side_effects + [fg.logits, fg.argmax])   # Allocator.allocate checks every node
        return fg

    def _build_commit(self, compact_kv: bool) -> _CommitGraph:
        hp, cache, n = self.hp, self.cache, self.n_slots
        cg = _CommitGraph(16 * hp.n_layer + 16)
        ctx, outs = cg.ctx, []
        d = hp.ssm_d_conv - 1
        if self.slot_states:
            cg.state_slot = ctx.new_tensor(ggml.Type.I32, (1,), name="commit.state_slot").mark_input()
            cg.conv_cols = ctx.new_tensor(ggml.Type.I32, (d,), name="commit.conv_cols").mark_input()
        for il, store in self.slot_states.items():
            size = store.ne[0] * store.ne[1]
            row = store.nb[2]                                            # bytes of one slot's state
            states = ctx.view_2d(store, size, n, row, 0)                  # [S*S*H, n_slots]
            state = ctx.get_rows(states, cg.state_slot)                   # f32 [S*S*H, 1]
            outs.append(ctx.cpy(state, ctx.reshape_2d(cache.ssm[il], size, 1)).named(f"l{il}.commit.state"))
            # conv window: columns of (old state ‖ slot inputs), channel-major rows for get_rows
            old = ctx.cont(ctx.transpose(ctx.reshape_2d(cache.conv[il], d, hp.conv_dim)))   # [conv_dim, d]
            seq = ctx.concat(old, self.slot_inputs[il], 1)                # [conv_dim, d + n_slots]
            window = ctx.get_rows(seq, cg.conv_cols)                      # [conv_dim, d]
            outs.append(ctx.cpy(ctx.transpose(window), ctx.reshape_2d(cache.conv[il], d, hp.conv_dim))
                        .named(f"l{il}.commit.conv"))
        if compact_kv and cache.k:
            cg.kv_src = ctx.new_tensor(ggml.Type.I32, (n,), name="commit.kv_src").mark_input()
            cg.kv_dst = ctx.new_tensor(ggml.Type.I64, (n,), name="commit.kv_dst").mark_input()
            for il in cache.k:
                for name, t in (("k", cache.k[il]), ("v", cache.v[il])):
                    rows = ctx.get_rows(t, cg.kv_src)                     # f32 [kv_row, n_slots]
                    outs.append(ctx.set_rows(t, rows, cg.kv_dst).named(f"l{il}.commit.{name}"))
        cg.graph = ctx.graph(outs) if outs else None
        return cg

    def _norm(self, ctx, x, weight, name):
        return ctx.mul(ctx.rms_norm(x, self.hp.rms_eps), weight).named(name)

    def _attention(self, ctx, x, il, fg: _ForwardGraph, side_effects):
        hp, w, cache = self.hp, self.weights, self.cache
        p, hd, n, n_kv = f"blk.{il}.", hp.head_dim, fg.n_tokens, fg.n_kv
        q_full = ctx.mul_mat(w[p + "attn_q.weight"], x)              # [2 hd n_head, n], per head [Q | gate]
        q = ctx.view_3d(q_full, hd, hp.n_head, n, 2 * hd * 4, 2 * hd * hp.n_head * 4, 0)
        q = self._norm(ctx, q, w[p + "attn_q_norm.weight"], f"l{il}.q_norm")      # [hd, n_head, n]
        gate = ctx.view_3d(q_full, hd, hp.n_head, n, 2 * hd * 4, 2 * hd * hp.n_head * 4, hd * 4)
        gate = ctx.cont_2d(gate, hd * hp.n_head, n)
        k = ctx.reshape_3d(ctx.mul_mat(w[p + "attn_k.weight"], x), hd, hp.n_head_kv, n)
        k = self._norm(ctx, k, w[p + "attn_k_norm.weight"], f"l{il}.k_norm")
        v = ctx.reshape_3d(ctx.mul_mat(w[p + "attn_v.weight"], x), hd, hp.n_head_kv, n)
        rope = (hp.n_rot, list(hp.rope_sections), ROPE_TYPE_IMROPE, hp.n_ctx_train, hp.rope_base, 1.0, 0.0, 1.0,
                32.0, 1.0)
        q = ctx.rope_multi(q, fg.pos, None, *rope).named(f"l{il}.q")
        k = ctx.rope_multi(k, fg.pos, None, *rope).named(f"l{il}.k")
        if cache.k_rot is not None:   # quantised KV: rotate Q, K and V like llama.cpp before quantising
            q = self._rotate(ctx, q, cache.k_rot)
            k = self._rotate(ctx, k, cache.k_rot)
            v = self._rotate(ctx, v, cache.v_rot)
        elif cache.tq3_rotation is not None:   # TQ3_0 rotates K and V as it quantises them: Q follows
            q = cache.tq3_rotation.rotate(ctx, q)
        kv_row = hd * hp.n_head_kv
        k_cache, v_cache = cache.k[il], cache.v[il]
        # write this batch's rows, then read the first n_kv cells through views of the writes (so the reads
        # depend on them)
        k_written = ctx.set_rows(k_cache, ctx.view_2d(k, kv_row, n, k.nb[2], 0), fg.rows)
        v_written = ctx.set_rows(v_cache, ctx.view_2d(v, kv_row, n, v.nb[2], 0), fg.rows)
        kt = ctx.view_3d(k_written, hd, hp.n_head_kv, n_kv, ggml.row_size(cache.kv_type, hd), k_cache.nb[1], 0)
        vt = ctx.view_3d(v_written, hd, hp.n_head_kv, n_kv, ggml.row_size(cache.kv_type, hd), v_cache.nb[1], 0)
        out = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), ctx.permute(kt, 0, 2, 1, 3),
                                 ctx.permute(vt, 0, 2, 1, 3), fg.mask, 1.0 / math.sqrt(hd), 0.0, 0.0)
        out.accumulate_f32()
        out = ctx.reshape_2d(out, hd * hp.n_head, n)                 # [hd n_head, n]
        if cache.v_rot is not None:
            out = self._rotate(ctx, out, cache.v_rot)
        elif cache.tq3_rotation is not None:   # attention over rotated V gives the rotated output
            out = cache.tq3_rotation.unrotate(ctx, out)
        out = ctx.mul(out, ctx.sigmoid(gate)).named(f"l{il}.attn_gated")
        return ctx.mul_mat(w[p + "attn_output.weight"], out).named(f"l{il}.attn_out")

    @staticmethod
    def _rotate(ctx, x, rot):
        """x @ H per group of H's size along ne[0] (H symmetric and orthonormal)."""
        m = rot.ne[0]
        n_elem = int(np.prod(x.ne))
        flat = ctx.reshape_2d(x if _is_contiguous(x) else ctx.cont(x), m, n_elem // m)
        y = ctx.mul_mat(rot, flat).hint_src0_hadamard()
        return ctx.reshape_4d(y, *x.ne)

    def _gdn(self, ctx, x, il, n, side_effects, parent=None):
        """parent (tree verify): the conv and delta rule follow parent pointers, the conv state is left as it is
        (commit sets it), and every slot's state and conv input go to the verify stores."""
        hp, w, cache = self.hp, self.weights, self.cache
        p = f"blk.{il}."
        d_k, h_k, d_v, h_v = hp.ssm_d_k, hp.ssm_n_k_heads, hp.ssm_d_v, hp.ssm_n_v_heads
        qkv = ctx.mul_mat(w[p + "attn_qkv.weight"], x)               # [conv_dim, n]
        z = ctx.mul_mat(w[p + "attn_gate.weight"], x)                # [value_dim, n]
        beta = ctx.sigmoid(ctx.reshape_4d(ctx.mul_mat(w[p + "ssm_beta.weight"], x), 1, h_v, n, 1))
        alpha = ctx.reshape_3d(ctx.mul_mat(w[p + "ssm_alpha.weight"], x), h_v, n, 1)
        g = ctx.mul(ctx.softplus(ctx.add(alpha, w[p + "ssm_dt.bias"])), w[p + "ssm_a"])  # log-decay, <= 0
        g = ctx.reshape_4d(g, 1, h_v, n, 1).named(f"l{il}.gdn.g")

        # causal depthwise conv over (last d_conv-1 inputs ‖ this batch), then keep the newest d_conv-1 inputs
        conv_state = cache.conv[il]
        state_3d = ctx.reshape_3d(conv_state, hp.ssm_d_conv - 1, hp.conv_dim, 1)
        conv_in = ctx.concat(state_3d, ctx.transpose(ctx.reshape_3d(qkv, hp.conv_dim, n, 1)), 0)
        if parent is None:
            tail = ctx.view_3d(conv_in, hp.ssm_d_conv - 1, hp.conv_dim, 1, conv_in.nb[1], conv_in.nb[2], n * 4)
            side_effects.append(ctx.cpy(tail, state_3d).named(f"l{il}.gdn.conv_state_out"))
            conv = ctx.ssm_conv(conv_in, w[p + "ssm_conv1d.weight"])
        else:
            inputs = self.slot_inputs[il]
            side_effects.append(ctx.cpy(qkv, ctx.view_2d(inputs, hp.conv_dim, n, inputs.nb[1], 0))
                                .named(f"l{il}.gdn.slot_inputs"))
            conv = ggml.ssm_conv_tree(ctx, conv_in, w[p + "ssm_conv1d.weight"], parent)
        conv = ctx.silu(conv).named(f"l{il}.gdn.conv")              # [conv_dim, n, 1]

        row = hp.conv_dim * 4
        q = ctx.view_4d(conv, d_k, h_k, n, 1, d_k * 4, row, row * n, 0)
        k = ctx.view_4d(conv, d_k, h_k, n, 1, d_k * 4, row, row * n, hp.key_dim * 4)
        v = ctx.view_4d(conv, d_v, h_v, n, 1, d_v * 4, row, row * n, 2 * hp.key_dim * 4)
        q, k = self._l2_norm(ctx, q), self._l2_norm(ctx, k)

        ssm = cache.ssm[il]
        state = ctx.reshape_4d(ssm, d_v, d_v, h_v, 1)
        if parent is None:
            res = ctx.gated_delta_net(q, k, v, g, beta, state, 1)    # [d_v h_v, n + d_v]: o for n tokens, then S
            o = ctx.view_4d(res, d_v, h_v, n, 1, d_v * 4, d_v * h_v * 4, d_v * h_v * n * 4, 0)
            new_state = ctx.view_1d(res, d_v * d_v * h_v, d_v * h_v * n * 4)
            side_effects.append(ctx.cpy(new_state, ssm).named(f"l{il}.gdn.state_out"))
        elif self._tree_op is not None:                               # node states go straight to the store
            o = self._tree_op(ctx, q, k, v, g, beta, state, parent, self.slot_states[il])
        else:
            # chains: upstream's K = n snapshots, slot s = the state s tokens back; stored reversed, so the
            # store's column t is the state after slot n-1-t (commit reads it that way)
            res = ctx.gated_delta_net(q, k, v, g, beta, state, n)
            o = ctx.view_4d(res, d_v, h_v, n, 1, d_v * 4, d_v * h_v * 4, d_v * h_v * n * 4, 0)
            size = d_v * d_v * h_v
            snaps = ctx.view_2d(res, size, n, size * 4, d_v * h_v * n * 4)
            store = self.slot_states[il]
            side_effects.append(ctx.cpy(snaps, ctx.view_2d(store, size, n, size * 4, 0))
                                .named(f"l{il}.gdn.slot_states"))

        zg = ctx.reshape_4d(z, d_v, h_v, n, 1)
        o = ctx.mul(self._norm(ctx, o, w[p + "ssm_norm.weight"], f"l{il}.gdn.norm"), ctx.silu(zg))
        o = ctx.reshape_2d(o, hp.value_dim, n)
        return ctx.mul_mat(w[p + "ssm_out.weight"], o).named(f"l{il}.gdn.out")

    def _l2_norm(self, ctx, x):
        # llama.cpp's form: rms_norm with eps/d, scaled by 1/sqrt(d)  ==  x / sqrt(sum x^2 + eps)
        d = x.ne[0]
        return ctx.scale(ctx.rms_norm(x, self.hp.rms_eps / d), 1.0 / math.sqrt(d))


def _chain_then_padding(parents: np.ndarray) -> bool:
    """Slots 1..L form a chain under the root and every later slot is padding (parent -1)."""
    n_chain = 1
    while n_chain < parents.size and parents[n_chain] == n_chain - 1:
        n_chain += 1
    return bool(parents[0] == -1 and (parents[n_chain:] == -1).all())


def _ancestors(parents: np.ndarray) -> np.ndarray:
    """bool [n, n]: slot i sees itself and its ancestors."""
    n = parents.size
    seen = np.zeros((n, n), dtype=bool)
    for i in range(n):
        if parents[i] >= 0:
            seen[i] = seen[parents[i]]
        seen[i, i] = True
    return seen


def _is_contiguous(t: ggml.Tensor) -> bool:
    expected = ggml.row_size(t.type, t.ne[0])
    if t.nb[1] != expected:
        return False
    for i in range(2, 4):
        if t.ne[i - 1] > 1 and t.nb[i] != t.nb[i - 1] * t.ne[i - 1]:
            return False
    return True
