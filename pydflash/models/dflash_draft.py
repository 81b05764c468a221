"""The DFlash block-diffusion draft (z-lab format, or llama.cpp's `dflash` GGUF) and its context cache.

One draft step turns the target's captured hidden states (the context) and the block
[last token, MASK x (B-1)] into logits for the B-1 masked positions, in one forward:

    c = rmsnorm(fc . concat(features of target_layer_ids)) * hidden_norm          per committed position
    h = target_embedding(block)                                                    [H, B] at positions n..n+B-1
    per layer: x = rmsnorm(h) * input_layernorm
               Q = rope(q_norm(q_proj x));  K = rope(k_norm(k_proj [c; x]));  V = v_proj [c; x]
               h += o_proj attention(Q, K, V)        (non-causal unless the layer type says otherwise)
               h += down(silu(gate x') * up x'),  x' = rmsnorm(h) * post_attention_layernorm
    logits = target_lm_head(rmsnorm(h) * norm) on block positions 1..B-1

The draft has no embedding and no LM head of its own: it reads the target's tensors on the device.

Context cache: the K/V of the context rows depend only on their own position, so each draft layer keeps them,
projected (after k_norm and RoPE), in a ring of W slots; a commit appends only the new positions, and a draft
step attends over the ring plus the block. Attention is a weighted sum over keys, so the slot order inside the
ring does not matter; only which positions it holds does (tracked on the host, for the masks).

Staged appends: a verify's slots can have their K/V computed into staging rows before it is known which slots are
accepted (`stage_from_target`, queued while the host waits for the verify's tokens); the append of the accepted
path then only notes which staged rows go where, and the next draft forward copies them into the ring before its
attention (or `settle`, for anything else that needs the ring first): the device does not wait for the host's
append between the verify and the draft's next forward.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from .. import ggml
from ..gguf_io import GGUFError, GGUFFile, regular_file_size
from ..validate import check_float
from .layers import Gated, Normed, heads, linear, row_ranges
from .runtime import fusing_enabled

KV_BUCKET = 256             # attended rows are padded to this (what the GPU flash attention kernels want)
GRAPH_TENSORS_PER_LAYER = 48
MAX_GRAPHS = 32
DEFAULT_WINDOW = 2048
MAX_LAYERS = 1024          # bound on layer counts read from a file, checked before anything is sized by them


class DraftLoadError(ValueError):
    """A draft checkpoint is missing, damaged, unsupported, or does not fit its target."""


# config.json fields that must be JSON integers (a float such as 4.5 would be truncated silently)
_INT_FIELDS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
               "num_key_value_heads", "head_dim", "vocab_size", "sliding_window", "num_target_layers", "block_size",
               "mask_token_id")
_FLOAT_FIELDS = ("rms_norm_eps", "rope_theta", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping", "partial_rotary_factor")


# --- hyperparameters ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DFlashHParams:
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple       # 0-based target layers whose outputs form the context features
    causal: tuple                 # per layer: block queries attend causally (z-lab: sliding layers are causal)
    window: tuple                 # per layer: sliding window length, or 0 for full attention
    vocab_size: int = 0           # from config.json, 0 when unknown (GGUF drafts)
    embedding_scale: float = 1.0  # input_embedding_scale
    logit_scale: float = 1.0      # output_multiplier
    logit_softcap: float = 0.0    # final_logit_softcapping, 0 = off

    @property
    def n_feat(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_config(cls, cfg: dict, path: str) -> "DFlashHParams":
        """From a z-lab `config.json` (already parsed); unsupported variants are refused, not ignored."""
        try:
            return cls._from_config(cfg, path)
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as e:
            if isinstance(e, DraftLoadError):
                raise
            # a field of the wrong JSON type (a string where a number belongs, a list for an object)
            raise DraftLoadError(f"{path}: a field has the wrong type or value ({type(e).__name__}: {e})") from None

    @classmethod
    def _from_config(cls, cfg: dict, path: str) -> "DFlashHParams":
        for key, value in cfg.items():
            if isinstance(value, float) and not math.isfinite(value):
                raise DraftLoadError(f"{path}: {key} = {value}: expected a finite number")
            if isinstance(value, bool) and key in _INT_FIELDS:
                raise DraftLoadError(f"{path}: {key} = {value}: expected an integer")
        for holder, prefix in ((cfg, ""), (cfg.get("dflash_config"), "dflash_config."),
                               (cfg.get("rope_parameters"), "rope_parameters.")):
            if not isinstance(holder, dict):
                continue
            for key in _INT_FIELDS:
                value = holder.get(key)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                    raise DraftLoadError(f"{path}: {prefix}{key} = {value!r}: expected an integer")
            for key in _FLOAT_FIELDS:
                value = holder.get(key)
                if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                    raise DraftLoadError(f"{path}: {prefix}{key} = {value!r}: expected a number")
        dcfg = cfg.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise DraftLoadError(f"{path}: dflash_config is not an object")

        def draft_value(name, default=None):     # z-lab's lookup order: dflash_config first, then top level
            return dcfg.get(name, cfg.get(name, default))

        def need(name):
            if name not in cfg:
                raise DraftLoadError(f"{path}: missing field {name!r}")
            return cfg[name]

        for name in ("conv_kernel_size", "selector_rank"):
            if draft_value(name) is not None:
                raise DraftLoadError(f"{path}: DFlash2 drafts ({name}) are not supported")
        if cfg.get("attention_bias"):
            raise DraftLoadError(f"{path}: attention_bias = true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise DraftLoadError(f"{path}: hidden_act {cfg.get('hidden_act')!r} is not supported (silu only)")
        if draft_value("attention_value_scale") is not None:
            raise DraftLoadError(f"{path}: attention_value_scale is not supported")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise DraftLoadError(f"{path}: rope type {rope_type!r} is not supported")
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise DraftLoadError(f"{path}: partial_rotary_factor is not supported")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta"))
        if rope_theta is None:   # a port that defaulted this produced garbage: insist on it
            raise DraftLoadError(f"{path}: missing field 'rope_theta'")

        n_layer, n_embd, n_head = int(need("num_hidden_layers")), int(need("hidden_size")), \
            int(need("num_attention_heads"))
        if not 1 <= n_layer <= MAX_LAYERS:    # before per-layer lists are built from it
            raise DraftLoadError(f"{path}: num_hidden_layers = {n_layer} is out of range: expected 1..{MAX_LAYERS}")
        head_dim = int(cfg.get("head_dim") or n_embd // max(n_head, 1))
        layer_ids = draft_value("target_layer_ids")
        if layer_ids is None:    # z-lab's default spread over the target's depth
            n_target = int(need("num_target_layers"))
            if n_layer == 1:
                layer_ids = [n_target // 2]
            else:
                span = n_target - 4
                layer_ids = [round(1 + i * span / (n_layer - 1)) for i in range(n_layer)]
        mask_token_id = draft_value("mask_token_id")
        if mask_token_id is None:
            raise DraftLoadError(f"{path}: missing field 'dflash_config.mask_token_id'")

        layer_types = cfg.get("layer_types") or ["full_attention"] * n_layer
        if len(layer_types) < n_layer:
            raise DraftLoadError(f"{path}: layer_types has {len(layer_types)} entries for {n_layer} layers")
        sliding = [t == "sliding_attention" for t in layer_types[:n_layer]]
        for t in layer_types[:n_layer]:
            if t not in ("full_attention", "sliding_attention"):
                raise DraftLoadError(f"{path}: layer type {t!r} is not supported")
        if any(sliding) and not cfg.get("sliding_window"):
            raise DraftLoadError(f"{path}: sliding_attention layers need 'sliding_window'")
        is_causal = cfg.get("is_causal")
        causal = tuple(s if is_causal is None else bool(is_causal) for s in sliding)
        window = tuple(int(cfg["sliding_window"]) if s else 0 for s in sliding)
        softcap = draft_value("final_logit_softcapping")
        hp = cls(n_layer=n_layer, n_embd=n_embd, n_ff=int(need("intermediate_size")), n_head=n_head,
                 n_head_kv=int(need("num_key_value_heads")), head_dim=head_dim,
                 rms_eps=float(need("rms_norm_eps")), rope_theta=float(rope_theta),
                 block_size=int(draft_value("block_size", 16)), mask_token_id=int(mask_token_id),
                 target_layer_ids=tuple(int(i) for i in layer_ids), causal=causal, window=window,
                 vocab_size=int(cfg.get("vocab_size") or 0),
                 embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
                 logit_scale=float(draft_value("output_multiplier", 1.0)),
                 logit_softcap=float(softcap) if softcap else 0.0)
        hp.validate(path)
        return hp

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "DFlashHParams":
        """From llama.cpp's `dflash` GGUF (keys as in its src/models/dflash.cpp and conversion/qwen.py)."""
        try:
            return cls._from_gguf(gf)
        except (TypeError, ValueError, OverflowError) as e:
            if isinstance(e, (DraftLoadError, GGUFError)):   # already a refusal naming the file
                raise
            raise DraftLoadError(f"{gf.path}: a metadata value has the wrong type ({type(e).__name__}: {e})") \
                from None

    @classmethod
    def _from_gguf(cls, gf: GGUFFile) -> "DFlashHParams":
        for key, value in gf.metadata.items():
            if key.startswith("dflash.") and isinstance(value, float) and not math.isfinite(value):
                raise DraftLoadError(f"{gf.path}: {key} = {value}: expected a finite number")
        gf.expect_architecture("dflash")
        k = lambda name, default=None: gf.get(f"dflash.{name}", default)  # noqa: E731

        def need(name):
            value = k(name)
            if value is None:
                raise DraftLoadError(f"{gf.path}: missing metadata key 'dflash.{name}'")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return value
            if isinstance(value, list) and all(type(v) is int for v in value):
                return value
            raise DraftLoadError(f"{gf.path}: dflash.{name} = {value!r:.60}: expected a number")

        def need_int(name, default=None, hi=1 << 20):
            if default is not None and k(name) is None:
                return default
            value = need(name)
            if not isinstance(value, int):
                raise DraftLoadError(f"{gf.path}: dflash.{name} = {value!r}: expected an integer")
            if not 1 <= value <= hi:     # before anything is sized by it (a per-layer table, a pattern list)
                raise DraftLoadError(f"{gf.path}: dflash.{name} = {value} is out of range: expected 1..{hi}")
            return value

        for key in ("dflash.selector_rank", "dflash.hyper_connection.count", "dflash.attention.value_scale"):
            if key in gf.metadata:
                raise DraftLoadError(f"{gf.path}: {key} (a DFlash2 / DSpark variant) is not supported")
        if k("hidden_activation", "silu") != "silu":
            raise DraftLoadError(f"{gf.path}: hidden activation {k('hidden_activation')!r} is not supported")
        for name in ("d2t", "output.weight", "token_embd.weight", "markov_w1.weight"):
            if name in gf.tensors:
                raise DraftLoadError(f"{gf.path}: drafts with their own vocabulary tensors ({name}) are not "
                                     f"supported; this loader uses the target's embedding and LM head")
        sections = k("rope.dimension_sections")
        if sections is not None and any(int(s) for s in list(sections)[1:]):
            raise DraftLoadError(f"{gf.path}: multi-axis rope sections {list(sections)} are not supported")
        n_layer, n_embd, n_head = need_int("block_count", hi=MAX_LAYERS), need_int("embedding_length"), \
            need_int("attention.head_count")
        head_dim = need_int("attention.key_length", n_embd // max(n_head, 1))
        scale = float(k("attention.scale", 0.0) or 0.0)
        if scale and abs(scale - head_dim ** -0.5) > 1e-6 * head_dim ** -0.5:
            raise DraftLoadError(f"{gf.path}: attention.scale {scale} other than 1/sqrt(head_dim) is not supported")
        if int(k("attention.value_length", head_dim)) != head_dim:
            raise DraftLoadError(f"{gf.path}: key_length != value_length is not supported")
        if int(k("rope.dimension_count", head_dim)) != head_dim:
            raise DraftLoadError(f"{gf.path}: partial rotary embeddings are not supported")
        mask = gf.get("tokenizer.ggml.mask_token_id")
        if mask is None:
            raise DraftLoadError(f"{gf.path}: missing metadata key 'tokenizer.ggml.mask_token_id'")
        # llama.cpp stores the extraction index lid+1 (Hugging Face hidden_states numbering); ours is lid
        layers = tuple(int(i) - 1 for i in need("target_layers"))
        n_swa = int(k("attention.sliding_window", 0) or 0)
        if n_swa > 0:
            pattern = list(k("attention.sliding_window_pattern") or [True] * n_layer)
            sliding = [bool(x) for x in (pattern + [False] * n_layer)[:n_layer]]
        else:
            sliding = [False] * n_layer
        causal_key = k("attention.causal")
        causal = tuple(s if causal_key is None else bool(causal_key) for s in sliding)
        hp = cls(n_layer=n_layer, n_embd=n_embd, n_ff=need_int("feed_forward_length"), n_head=n_head,
                 n_head_kv=need_int("attention.head_count_kv"), head_dim=head_dim,
                 rms_eps=float(need("attention.layer_norm_rms_epsilon")),
                 rope_theta=float(need("rope.freq_base")), block_size=need_int("block_size", 16),
                 mask_token_id=int(mask), target_layer_ids=layers, causal=causal,
                 window=tuple(n_swa if s else 0 for s in sliding),
                 embedding_scale=float(k("embedding_scale", 0.0) or 1.0),
                 logit_scale=float(k("logit_scale", 0.0) or 1.0),
                 logit_softcap=float(k("final_logit_softcapping", 0.0) or 0.0))
        hp.validate(gf.path)
        return hp

    def validate(self, path: str) -> None:
        """Header numbers are untrusted: reject the ones the graph cannot be built from."""
        sizes = {"num_hidden_layers": self.n_layer, "hidden_size": self.n_embd, "intermediate_size": self.n_ff,
                 "num_attention_heads": self.n_head, "num_key_value_heads": self.n_head_kv,
                 "head_dim": self.head_dim, "block_size": self.block_size}
        for key, value in sizes.items():
            if not 1 <= value <= 1 << 20:
                raise DraftLoadError(f"{path}: {key} = {value} is out of range")
        if self.block_size > 1024:
            raise DraftLoadError(f"{path}: block_size {self.block_size} is out of range: expected 2..1024")
        if self.block_size < 2:
            raise DraftLoadError(f"{path}: block_size {self.block_size} leaves nothing to draft")
        if self.n_head % self.n_head_kv:
            raise DraftLoadError(f"{path}: num_attention_heads {self.n_head} is not a multiple of "
                                 f"num_key_value_heads {self.n_head_kv}")
        if self.head_dim % 2:
            raise DraftLoadError(f"{path}: head_dim {self.head_dim} is odd (RoPE rotates pairs)")
        if not self.target_layer_ids:
            raise DraftLoadError(f"{path}: target_layer_ids is empty")
        numbers = {"rope_theta": (self.rope_theta, 0.0, math.inf), "rms_norm_eps": (self.rms_eps, 0.0, 1.0),
                   "input_embedding_scale": (self.embedding_scale, 0.0, math.inf),
                   "output_multiplier": (self.logit_scale, 0.0, math.inf)}
        for key, (value, lo, hi) in numbers.items():
            check_float(f"{path}: {key}", value, lo, hi, DraftLoadError)
        if not (math.isfinite(self.logit_softcap) and self.logit_softcap >= 0):
            raise DraftLoadError(f"{path}: final_logit_softcapping = {self.logit_softcap}: expected a finite "
                                 f"number >= 0 (0: off)")
        if self.n_layer > MAX_LAYERS or len(self.target_layer_ids) > MAX_LAYERS:
            raise DraftLoadError(f"{path}: {self.n_layer} layers / {len(self.target_layer_ids)} target layers: "
                                 f"at most {MAX_LAYERS} expected")
        if any(i < 0 for i in self.target_layer_ids):
            raise DraftLoadError(f"{path}: target_layer_ids {list(self.target_layer_ids)} has a negative layer")
        if any(not 0 <= w <= 1 << 24 for w in self.window):
            raise DraftLoadError(f"{path}: sliding_window {max(self.window, key=abs)} is out of range: "
                                 f"expected 1..{1 << 24}")
        if self.mask_token_id < 0 or self.vocab_size < 0:
            raise DraftLoadError(f"{path}: mask_token_id {self.mask_token_id} and vocab_size {self.vocab_size} "
                                 f"must not be negative")

    def tensor_shapes(self) -> dict[str, tuple]:
        """Every draft tensor by z-lab name -> ne (ggml order: ne[0] = input features)."""
        E, hd = self.n_embd, self.head_dim
        shapes = {"fc.weight": (E * self.n_feat, E), "hidden_norm.weight": (E,), "norm.weight": (E,)}
        for il in range(self.n_layer):
            p = f"layers.{il}."
            shapes.update({p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                           p + "self_attn.q_proj.weight": (E, hd * self.n_head),
                           p + "self_attn.k_proj.weight": (E, hd * self.n_head_kv),
                           p + "self_attn.v_proj.weight": (E, hd * self.n_head_kv),
                           p + "self_attn.o_proj.weight": (hd * self.n_head, E),
                           p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                           p + "mlp.gate_proj.weight": (E, self.n_ff), p + "mlp.up_proj.weight": (E, self.n_ff),
                           p + "mlp.down_proj.weight": (self.n_ff, E)})
        return shapes


# llama.cpp GGUF tensor name -> z-lab name
def _gguf_names(n_layer: int) -> dict[str, str]:
    names = {"fc.weight": "fc.weight", "enc.output_norm.weight": "hidden_norm.weight",
             "output_norm.weight": "norm.weight"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
    for il in range(n_layer):
        for g, z in per_layer.items():
            names[f"blk.{il}.{g}.weight"] = f"layers.{il}.{z}.weight"
    return names


MAX_CONFIG_BYTES = 16 << 20


def read_config(path) -> dict:
    """A draft's config.json as a dict: a regular file of bounded size (a FIFO would block open(), /dev/zero
    never ends), valid UTF-8 JSON, an object without duplicate keys."""
    path = os.fspath(path)
    try:
        size = regular_file_size(path)
        if size > MAX_CONFIG_BYTES:
            raise DraftLoadError(f"{path}: {size} bytes; a config.json has at most {MAX_CONFIG_BYTES}")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise DraftLoadError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        cfg = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique_keys)
    except UnicodeDecodeError as e:
        raise DraftLoadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise DraftLoadError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise DraftLoadError(f"{path}: not a JSON object")
    return cfg


def _unique_keys(pairs) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


# --- safetensors ------------------------------------------------------------------------------------------------

_ST_TYPES = {"BF16": (ggml.Type.BF16, 2), "F16": (ggml.Type.F16, 2), "F32": (ggml.Type.F32, 4)}
_ST_MAX_HEADER = 100 << 20


@dataclass(frozen=True)
class _STTensor:
    name: str
    type: ggml.Type
    ne: tuple          # ggml order
    offset: int        # absolute byte offset in the file
    nbytes: int


def read_safetensors_header(path) -> tuple[dict[str, _STTensor], np.ndarray]:
    """The tensor table of a .safetensors file (bounds checked against the file) and a memory map of it."""
    path = os.fspath(path)
    try:
        size = regular_file_size(path)
        mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except OSError as e:
        raise DraftLoadError(f"{path}: cannot open ({e.strerror or e})") from None
    if size < 8:
        raise DraftLoadError(f"{path}: not a safetensors file (shorter than its header length)")
    n_header = int(np.frombuffer(bytes(mm[:8]), "<u8")[0])
    if n_header > min(size - 8, _ST_MAX_HEADER):
        raise DraftLoadError(f"{path}: damaged safetensors header (length {n_header}, file size {size})")
    try:
        header = json.loads(bytes(mm[8: 8 + n_header]).decode("utf-8"), object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise DraftLoadError(f"{path}: damaged safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise DraftLoadError(f"{path}: damaged safetensors header (not an object)")
    data_start = 8 + n_header
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], list(entry["shape"]), entry["data_offsets"]
            if not all(type(n) is int for n in (*shape, begin, end)) or not isinstance(dtype, str):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise DraftLoadError(f"{path}: tensor {name!r}: damaged header entry (expected dtype, an integer "
                                 f"shape and data_offsets)") from None
        if dtype not in _ST_TYPES:
            raise DraftLoadError(f"{path}: tensor {name!r} has dtype {dtype}; expected BF16 (or F16/F32)")
        type_, itemsize = _ST_TYPES[dtype]
        if not 1 <= len(shape) <= 4 or any(n < 1 for n in shape):
            raise DraftLoadError(f"{path}: tensor {name!r} has an unsupported shape {shape}")
        nbytes = itemsize * int(np.prod(shape, dtype=object))
        if not 0 <= begin <= end or end - begin != nbytes or data_start + end > size:
            raise DraftLoadError(f"{path}: tensor {name!r}: data [{begin}, {end}) does not match its shape "
                                 f"{shape} {dtype} or lies outside the file ({size} bytes)")
        tensors[name] = _STTensor(name, type_, tuple(shape[::-1]), data_start + begin, nbytes)
    # two tensors must not share bytes (safetensors files hold each tensor once, in disjoint ranges)
    spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end_a, a), (begin_b, _, b) in zip(spans, spans[1:]):
        if begin_b < end_a:
            raise DraftLoadError(f"{path}: tensors {a!r} and {b!r} overlap in the file")
    return tensors, mm


# --- weights ----------------------------------------------------------------------------------------------------

def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (np.frombuffer(raw.tobytes(), np.uint16).astype(np.uint32) << 16).view(np.float32)


def _to_f32(raw: np.ndarray, src_type: ggml.Type) -> np.ndarray:
    if src_type == ggml.Type.BF16:
        return _bf16_to_f32(raw)
    return np.frombuffer(raw.tobytes(), np.float16 if src_type == ggml.Type.F16 else np.float32).astype(np.float32)


# draft_type -> the type the draft's matrices are quantized to at load (None: as stored)
DRAFT_MATRIX_TYPES = {"q8_0": ggml.Type.Q8_0, "q4_k": ggml.Type.Q4_K}
# A matrix whose rows do not fill its draft_type's blocks takes this type instead (Q4_K's blocks hold 256 values;
# a draft 64 or 128 wide still gets Q4_K where its rows allow and Q8_0, 32-value blocks, elsewhere).
DRAFT_FALLBACK_TYPES = {ggml.Type.Q4_K: ggml.Type.Q8_0}


def draft_matrix_type(matrix_type: str, name: str, n_per_row: int, path: str) -> ggml.Type:
    """The type a draft matrix with rows of n_per_row values is quantized to at load for draft_type matrix_type
    (one of DRAFT_MATRIX_TYPES): that type where the rows are whole blocks of it, else its fallback type where they
    are whole blocks of that; a DraftLoadError naming the tensor otherwise. Load and memory plan both use it."""
    wanted = DRAFT_MATRIX_TYPES[matrix_type]
    fallback = DRAFT_FALLBACK_TYPES.get(wanted)
    for type_ in (wanted, fallback):
        if type_ is not None and n_per_row % ggml.block_size(type_) == 0:
            return type_
    need = f"a multiple of {ggml.block_size(wanted)}"
    if fallback is not None:
        need += f" (or of {ggml.block_size(fallback)}, for {fallback.name.lower()})"
    raise DraftLoadError(f"{path}: tensor {name!r} has rows of {n_per_row} values; {matrix_type} needs {need}")


class DFlashWeights:
    """The draft's tensors in one device buffer, by z-lab name.

    Matrices keep their stored type (bf16 for z-lab drafts; f16 on a backend without bf16 matrix products),
    or with matrix_type 'q8_0' or 'q4_k' are quantized on the host as they are uploaded (q8_0: 53% of bf16's bytes,
    q4_k: 28%, its matrices with rows that are not whole 256-value blocks in q8_0: draft_matrix_type; the draft's
    proposals change slightly, the verified output does not); the 1-D norm weights are widened to f32 on the host
    because ggml's elementwise ops want f32 operands. A layer's Q, K and V are also one matrix, qkv_proj (K and V:
    kv_proj), and its FFN gate and up one, gateup_proj, unless PYDFLASH_FUSED_WEIGHTS=0 or their types differ.
    """

    def __init__(self, hp: DFlashHParams, backend: ggml.Backend, sources: dict, read, path: str,
                 matrix_type: str | None = None):
        """sources: z-lab name -> (type, ne, nbytes); read(name) -> the raw bytes (uint8 array); matrix_type:
        None (as stored) or one of DRAFT_MATRIX_TYPES."""
        if matrix_type is not None and matrix_type not in DRAFT_MATRIX_TYPES:
            raise ValueError(f"draft weight type {matrix_type!r}: expected one of {sorted(DRAFT_MATRIX_TYPES)} "
                             f"or None (as stored)")
        shapes = hp.tensor_shapes()
        extra = sorted(set(sources) - set(shapes))
        if extra:
            raise DraftLoadError(f"{path}: {len(extra)} tensors the draft does not use ({', '.join(extra[:5])}); "
                                 f"is num_hidden_layers ({hp.n_layer}) right?")
        for name, ne in shapes.items():
            if name not in sources:
                raise DraftLoadError(f"{path}: missing tensor {name!r}")
            if tuple(sources[name][1]) != tuple(ne):
                raise DraftLoadError(f"{path}: tensor {name!r} has shape {tuple(sources[name][1])[::-1]}, "
                                     f"expected {tuple(ne)[::-1]} (from the config)")
            if sources[name][0] not in (ggml.Type.BF16, ggml.Type.F16, ggml.Type.F32):
                raise DraftLoadError(f"{path}: tensor {name!r} is {ggml.Type(sources[name][0]).name}; expected "
                                     f"BF16 (or F16/F32)")
        bf16_ok = _supports_bf16_matmul(backend)
        plan = []
        for name, ne in shapes.items():
            src_type = ggml.Type(sources[name][0])
            if len(ne) == 1:
                dst_type = ggml.Type.F32
            elif matrix_type is not None:
                dst_type = draft_matrix_type(matrix_type, name, ne[0], path)
            elif src_type == ggml.Type.BF16 and not bf16_ok:
                dst_type = ggml.Type.F16
            else:
                dst_type = src_type
            plan.append((name, src_type, dst_type))
        types = {name: dst_type for name, _, dst_type in plan}
        # per layer, Q, K and V back to back as the rows of one matrix (one product, one read of the activations:
        # at the 27B shape its 6,144 rows take the f16 kernel, the three apart did not), K and V also seen as one;
        # the FFN's gate and up likewise (gateup_proj: one product and one activation preparation, not two).
        # Each is its own tensor placed on its rows (Buffer.alias), as TargetWeights' fused members.
        placed = {}   # name -> (fused matrix, first row)

        def fuse(fused: str, members: list[str]) -> None:
            row = 0
            for m in members:
                placed[m] = (fused, row)
                row += shapes[m][1]
            shapes[fused], types[fused] = (hp.n_embd, row), types[members[0]]

        for il in range(hp.n_layer):
            p = f"layers.{il}.self_attn."
            q, k, v = (p + f"{m}_proj.weight" for m in "qkv")
            gate, up = (f"layers.{il}.mlp.{m}_proj.weight" for m in ("gate", "up"))
            if not fusing_enabled():
                continue
            if len({types[q], types[k], types[v]}) == 1:
                fuse(p + "qkv_proj.weight", [q, k, v])
                shapes[p + "kv_proj.weight"], types[p + "kv_proj.weight"] = (hp.n_embd, 2 * shapes[k][1]), types[k]
                placed[p + "kv_proj.weight"] = (p + "qkv_proj.weight", shapes[q][1])
            if types[gate] == types[up]:
                fuse(f"layers.{il}.mlp.gateup_proj.weight", [gate, up])
        self._ctx = ggml.Context(n_tensors=len(shapes) - len(placed))
        self._member_ctx = ggml.Context(n_tensors=max(len(placed), 1))
        self.t = {}
        for name, ne in shapes.items():
            ctx = self._member_ctx if name in placed else self._ctx
            self.t[name] = ctx.new_tensor(types[name], ne, name=("draft." + name)[:63])
        self.buffer = backend.alloc_tensors(self._ctx)
        for name, (of, row) in placed.items():
            self.buffer.alias(self.t[name], self.t[of], row * self.t[of].nb[1])
        for name, src_type, dst_type in plan:
            raw = read(name)
            if src_type == dst_type:
                chunk = 64 << 20
                for start in range(0, raw.nbytes, chunk):
                    self.t[name].set_bytes(raw[start: start + chunk], start)
                continue
            if dst_type in DRAFT_MATRIX_TYPES.values():   # quantized here, by row chunks
                self._upload_quantized(self.t[name], raw, src_type)
                continue
            values = _to_f32(raw, src_type)
            self.t[name].set(values.astype(np.float32 if dst_type == ggml.Type.F32 else np.float16))

    @staticmethod
    def _upload_quantized(t: ggml.Tensor, raw: np.ndarray, src_type: ggml.Type) -> None:
        """Quantize a matrix to t's type by row chunks (a 17408 x 5120 matrix is 356 MB as f32) on several cores:
        ggml's Q4_K quantizer takes ~50 MB of f32 a second on one core (two minutes for a 27B draft's matrices),
        and cffi releases the GIL around it."""
        n_per_row = t.ne[0]
        src_row = n_per_row * (4 if src_type == ggml.Type.F32 else 2)
        dst_row = ggml.row_size(t.type, n_per_row)
        n_rows = raw.nbytes // src_row
        chunk = max(1, (8 << 20) // (4 * n_per_row))

        def quantize(r: int) -> np.ndarray:
            rows = _to_f32(raw[r * src_row: min(n_rows, r + chunk) * src_row], src_type).reshape(-1, n_per_row)
            return ggml.quantize(t.type, rows)

        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
            for r, blocks in zip(range(0, n_rows, chunk), pool.map(quantize, range(0, n_rows, chunk))):
                t.set_bytes(blocks, r * dst_row)

    def __getitem__(self, name: str) -> ggml.Tensor:
        return self.t[name]

    def __contains__(self, name: str) -> bool:
        return name in self.t


def _supports_bf16_matmul(backend: ggml.Backend) -> bool:
    ctx = ggml.Context(n_tensors=4)
    a = ctx.new_tensor(ggml.Type.BF16, (64, 4))
    b = ctx.new_tensor(ggml.Type.F32, (64, 2))
    return backend.supports(ctx.mul_mat(a, b))


# --- loading ----------------------------------------------------------------------------------------------------

def _resolve_zlab(path) -> tuple[str, str]:
    """(config.json, model.safetensors) from a folder, or from (config, safetensors) explicit paths."""
    if isinstance(path, (tuple, list)):
        config_path, weights_path = (os.fspath(p) for p in path)
    else:
        config_path = os.path.join(os.fspath(path), "config.json")
        weights_path = os.path.join(os.fspath(path), "model.safetensors")
    for p in (config_path, weights_path):
        if not os.path.isfile(p):
            raise DraftLoadError(f"{p}: no such file (a z-lab DFlash draft needs config.json and "
                                 f"model.safetensors)")
    return config_path, weights_path


def _is_gguf(path) -> bool:
    return not isinstance(path, (tuple, list)) and os.fspath(path).endswith(".gguf")


def read_draft_hparams(path) -> DFlashHParams:
    """The hyperparameters of a draft without loading its weights: a z-lab folder, its config.json, a
    (config, safetensors) pair, or a llama.cpp `dflash` GGUF. The one lookup of target_layer_ids (and its
    default) that loading and `pydflash.load` share."""
    if _is_gguf(path):
        return DFlashHParams.from_gguf(_open_gguf(path))
    if isinstance(path, (tuple, list)):
        config_path = os.fspath(path[0])
    else:
        path = os.fspath(path)
        config_path = os.path.join(path, "config.json") if os.path.isdir(path) else path
    return DFlashHParams.from_config(read_config(config_path), config_path)


def _open_gguf(path) -> GGUFFile:
    """A draft GGUF parsed; a damaged file is a DraftLoadError (a wrong architecture, found later by from_gguf,
    stays a GGUFError)."""
    try:
        return GGUFFile(path)
    except GGUFError as e:
        raise DraftLoadError(str(e)) from None


def load_draft_weights(path, backend: ggml.Backend, check=None, matrix_type: str | None = None):
    """(hparams, weights, weights path) of a z-lab draft folder / (config, safetensors) pair, or a GGUF.

    check(hp, weights_path), if given, runs before anything is uploaded (e.g. the fit to a target); matrix_type:
    see DFlashWeights."""
    check = check or (lambda hp, p: None)
    if _is_gguf(path):
        gf = _open_gguf(path)
        hp = DFlashHParams.from_gguf(gf)
        check(hp, gf.path)
        names = _gguf_names(hp.n_layer)
        by_zlab = {names.get(g, g): info for g, info in gf.tensors.items()}
        sources = {z: (info.type, info.ne, info.nbytes) for z, info in by_zlab.items()}
        return hp, DFlashWeights(hp, backend, sources, lambda n: gf.data(by_zlab[n]), gf.path, matrix_type), gf.path
    config_path, weights_path = _resolve_zlab(path)
    hp = DFlashHParams.from_config(read_config(config_path), config_path)
    check(hp, weights_path)
    tensors, mm = read_safetensors_header(weights_path)
    # some exports prefix the names with "model."
    strip = {n[len("model."):] if n.startswith("model.") else n: t for n, t in tensors.items()}
    sources = {n: (t.type, t.ne, t.nbytes) for n, t in strip.items()}
    weights = DFlashWeights(hp, backend, sources, lambda n: mm[strip[n].offset: strip[n].offset + strip[n].nbytes],
                            weights_path, matrix_type)
    return hp, weights, weights_path


def check_fits(hp: DFlashHParams, target_hp, draft_path: str, target_path: str) -> None:
    """Raise DraftLoadError naming both files and the field when the draft cannot run on this target."""
    def fail(field, detail):
        raise DraftLoadError(f"draft {draft_path} does not fit target {target_path}: {field}: {detail}")

    if hp.n_embd != target_hp.n_embd:
        fail("hidden_size", f"draft {hp.n_embd} != target embedding_length {target_hp.n_embd}")
    if hp.vocab_size and hp.vocab_size != target_hp.n_vocab:
        fail("vocab_size", f"draft {hp.vocab_size} != target vocabulary {target_hp.n_vocab}")
    bad = [i for i in hp.target_layer_ids if not 0 <= i < target_hp.n_layer]
    if bad:
        fail("target_layer_ids", f"{bad} outside the target's layers 0..{target_hp.n_layer - 1}")
    if not 0 <= hp.mask_token_id < target_hp.n_vocab:
        fail("mask_token_id", f"{hp.mask_token_id} outside the target vocabulary (0..{target_hp.n_vocab - 1})")


# --- the context cache ------------------------------------------------------------------------------------------

def _layer_rows(backend: ggml.Backend, hp: DFlashHParams, n_rows: int, what: str):
    """Per draft layer, K and V f16 [head_dim * n_head_kv, n_rows] on the backend: (context, k list, v list, buffer)."""
    row = hp.head_dim * hp.n_head_kv
    ctx = ggml.Context(n_tensors=2 * hp.n_layer)
    k = [ctx.new_tensor(ggml.Type.F16, (row, n_rows), name=f"draft.{what}_k_l{il}") for il in range(hp.n_layer)]
    v = [ctx.new_tensor(ggml.Type.F16, (row, n_rows), name=f"draft.{what}_v_l{il}") for il in range(hp.n_layer)]
    return ctx, k, v, backend.alloc_tensors(ctx)


class DraftContextCache:
    """Per draft layer, the projected context K/V (after k_norm and RoPE) of the last `window` positions.

    Rows of each [head_dim * n_head_kv, n_rows] f16 tensor: 0..B-1 are scratch for the current block's own K/V,
    B..B+window-1 the ring (position p lives in row B + p % window). n_rows is padded to the attention bucket.
    The host keeps which position each ring slot holds, to mask empty slots and sliding-window layers.
    """

    def __init__(self, backend: ggml.Backend, hp: DFlashHParams, window: int = DEFAULT_WINDOW):
        if window < 1:
            raise ValueError("the draft context window must be at least 1 position")
        self.hp, self.window, self.block = hp, int(window), hp.block_size
        self.n_rows = -(-(self.block + self.window) // KV_BUCKET) * KV_BUCKET
        self._ctx, self.k, self.v, self.buffer = _layer_rows(backend, hp, self.n_rows, "cache")
        self.reset()

    def reset(self) -> None:
        self.buffer.clear(0)   # zeros, not NaN garbage: masked rows still meet the attention kernel
        self.n_ctx = 0         # positions appended so far (0..n_ctx-1)
        self.slot_pos = np.full(self.window, -1, dtype=np.int64)
        self._slot_open = np.full(self.window, -np.inf, dtype=np.float16)   # mask value of each slot: 0 where held

    @property
    def n_filled(self) -> int:
        return min(self.n_ctx, self.window)

    def truncate(self, n: int) -> bool:
        """Forget positions n.. so that the next append continues at position n (prefix reuse).

        A context of n positions keeps max(0, n - window)..n-1 in the ring; once later positions have overwritten
        any of them this is impossible: returns False and changes nothing (rebuild the context from scratch)."""
        if not 0 <= n <= self.n_ctx:
            raise ValueError(f"truncate to {n} positions: the context holds 0..{self.n_ctx}")
        kept = np.arange(max(0, n - self.window), n)
        if not np.array_equal(self.slot_pos[kept % self.window], kept):
            return False
        gone = self.slot_pos >= n
        self.slot_pos[gone] = -1                   # masked from now on; the next appends overwrite them
        self._slot_open[gone] = -np.inf
        self.n_ctx = n
        return True

    def rows_for(self, first: int, m: int) -> np.ndarray:
        """i64 [m]: the ring rows of positions first..first+m-1."""
        return self.block + np.arange(first, first + m) % self.window

    def commit(self, first: int, m: int) -> None:
        """Positions first..first+m-1 (m <= window) now fill their slots (in at most two runs of the ring)."""
        s0 = first % self.window
        for s, p, k in ((s0, first, min(m, self.window - s0)), (0, first + self.window - s0, m - self.window + s0)):
            if k > 0:
                self.slot_pos[s:s + k] = np.arange(p, p + k)
                self._slot_open[s:s + k] = 0
        self.n_ctx = first + m

    def n_attended(self) -> int:
        """Rows a draft step attends: block + filled ring, padded to the bucket (a graph per bucket)."""
        return min(self.n_rows, -(-(self.block + self.n_filled) // KV_BUCKET) * KV_BUCKET)

    def mask(self, n_attn: int, causal: bool, window: int, out: np.ndarray | None = None) -> np.ndarray:
        """f16 [B, n_attn] additive mask for the block queries at positions n_ctx..n_ctx+B-1 (written into `out`
        where given, and returned).

        z-lab's rule (index distance = position distance, keys contiguous): causal layers see keys at or before
        the query; sliding layers see keys within `window` before (and, if non-causal, after) the query."""
        B = self.block
        out = np.empty((B, n_attn), np.float16) if out is None else out
        n_ring = min(n_attn - B, self.window)
        if not causal and not window:   # every query sees the block and every held key: one row, repeated
            row = out[0]
            row[:B] = 0
            row[B: B + n_ring] = self._slot_open[:n_ring]
            row[B + n_ring:] = -np.inf
            out[1:] = row
            return out
        kpos = np.full(n_attn, -1, dtype=np.int64)
        kpos[:B] = self.n_ctx + np.arange(B)
        kpos[B: B + n_ring] = self.slot_pos[:n_ring]
        q = self.n_ctx + np.arange(B)[:, None]
        visible = np.broadcast_to(kpos >= 0, (B, n_attn)).copy()
        k = kpos[None, :]
        if causal:
            visible &= k <= q
        if window:
            visible &= q - k < window
            if not causal:
                visible &= k - q < window
        out[:] = np.where(visible, 0.0, -np.inf)
        return out


class _Staging:
    """Per draft layer, K and V rows [head_dim * n_head_kv, capacity] f16 computed ahead of an append
    (DFlashDraft.stage_from_target): the tokens of one target forward, at the positions they would be appended at."""

    def __init__(self, backend: ggml.Backend, hp: DFlashHParams, capacity: int):
        self.capacity = int(capacity)
        self._ctx, self.k, self.v, self.buffer = _layer_rows(backend, hp, self.capacity, "stage")


@dataclass(frozen=True, eq=False)
class _Staged:
    """What the staging rows hold: the tokens of the target forward numbered `serial` (its capture_serial), token
    i computed at position first + depths[i]."""
    serial: int
    first: int
    depths: list[int]

    @property
    def n(self) -> int:
        return len(self.depths)

    def holds(self, serial: int, first: int, rows: list[int]) -> bool:
        """Whether appending `rows` of forward `serial` at positions first, first + 1, .. is a copy of staged rows."""
        return serial == self.serial and first == self.first and all(self.depths[r] == i for i, r in enumerate(rows))


# --- the draft --------------------------------------------------------------------------------------------------

def _mask_input(kind: tuple[bool, int]) -> str:
    """The step graph's input name of the mask of layers (causal, window)."""
    return f"mask_c{int(kind[0])}_w{kind[1]}"


class _Graph:
    """A built graph with its own allocator (compute buffer), reused for every run of the same shape.

    One allocator per graph, not one shared: a step alternates the append and the draft graphs, and with
    private compute buffers that switch costs nothing (no re-allocation); the buffers are small next to the
    weights (the largest holds the [n_vocab, B-1] logits)."""

    def __init__(self, size: int):
        self.ctx = ggml.Context(n_tensors=size, graph_size=size)
        self.graph = None
        self.allocator = None
        self.inputs: dict[str, ggml.Tensor] = {}
        self.constants: dict[str, np.ndarray] = {}     # inputs (mark_constant) set once, when the graph is allocated
        self.masks: dict[tuple, ggml.Tensor] = {}
        self.outputs: dict[str, ggml.Tensor] = {}
        self.io: ggml.InputBlock | None = None          # the step graph's inputs, uploaded in one copy


class DFlashDraft:
    """A DFlash draft bound to a loaded target: its context cache, `append_*` and `propose`.

    path: a z-lab folder, a (config.json, model.safetensors) pair, or a llama.cpp `dflash` GGUF.
    target: a loaded Qwen35Target (its token embedding and LM head are used in place, and its backend).
    window: context positions kept (the ring); top_k: candidates per block position returned by `propose`.
    weight_type: None (matrices as stored), 'q8_0' or 'q4_k' (quantized at load: DFlashWeights).
    """

    def __init__(self, path, target, *, window: int = DEFAULT_WINDOW, top_k: int = 8, weight_type: str | None = None):
        self.target = target
        self.backend = target.backend
        self.hp, self.weights, self.path = load_draft_weights(
            path, self.backend, lambda hp, p: check_fits(hp, target.hp, p, target.gguf.path), weight_type)
        max_k = min(target.hp.n_vocab, ggml.TOP_K_LOGP_MAX_K)    # the device top-k op's limit
        if not 1 <= top_k <= max_k:
            raise ValueError(f"top_k {top_k} outside 1..{max_k}")
        self.top_k = int(top_k)
        self.cache = DraftContextCache(self.backend, self.hp, window)
        self.token_embd = target.weights["token_embd.weight"]
        self.lm_head = target.weights["output.weight"]
        self._graphs: dict[tuple, _Graph] = {}
        self._top = ggml.Readback(self.backend)   # the proposals, copied into page-locked memory (queue_propose)
        self._stage: _Staging | None = None     # staging rows (stage_from_target), sized on first use
        self._staged: _Staged | None = None     # what they hold, until an append takes them or they go stale
        self._pending: np.ndarray | None = None  # an append's cache rows for the staged rows: the next step copies them
        self._block_offsets = np.arange(self.hp.block_size, dtype=np.int32)

    @property
    def block_size(self) -> int:
        return self.hp.block_size

    @property
    def n_ctx(self) -> int:
        return self.cache.n_ctx

    def reset(self) -> None:
        self.cache.reset()
        self._staged = self._pending = None

    def truncate(self, n: int) -> bool:
        """Keep context positions 0..n-1 only; False (nothing changed) when the ring no longer holds them."""
        self._copy_pending()
        self._staged = None
        return self.cache.truncate(n)

    def settle(self) -> None:
        """Copy staged rows an append left for the next draft forward into the ring, and wait for the device: the
        cache tensors then hold every appended position (for host reads of them)."""
        self._copy_pending()
        self.backend.synchronize()

    # --- context appends ---

    def append_features(self, features: np.ndarray) -> None:
        """Append context positions n_ctx.. from host features f32 [m, n_feat, n_embd] (or [m, n_feat*n_embd])."""
        self._copy_pending()
        self._staged = None
        feats = np.ascontiguousarray(features, dtype=np.float32).reshape(len(features), -1)
        if feats.shape[1] != self.hp.n_feat * self.hp.n_embd:
            raise ValueError(f"features have {feats.shape[1]} values per position, expected "
                             f"{self.hp.n_feat} x {self.hp.n_embd}")
        first = self.cache.n_ctx
        if len(feats) > self.cache.window:     # only the last `window` positions survive in the ring
            feats, first = feats[-self.cache.window:], first + len(feats) - self.cache.window
        for start in range(0, len(feats), 512):
            chunk = feats[start: start + 512]
            g = self._graph(("append_host", len(chunk)), lambda: self._build_append(len(chunk), None))
            self._activate(g)
            g.inputs["feat"].set(chunk)
            self._run_append(g, first + start, len(chunk))

    def append_from_target(self, rows=None, wait: bool = True) -> None:
        """Append context positions from the target's captured features on the device (no host copy).

        rows: indices into the target's last forward (default: all of its tokens), e.g. the accepted path of a
        verify step. The target must capture exactly this draft's target_layer_ids, in that order: the output
        of decoder layer lid, which is z-lab's `hidden_states[lid + 1]`. (Hugging Face applies the
        final norm to the last entry, so a draft reading the target's last layer would need it; none do.)
        wait=False queues the append on the backend's stream and returns: the draft's next forward is ordered after
        it (the decoding engine's step), nothing else waits for it. Where stage_from_target staged this forward at
        this position and rows sit at depths 0, 1, 2, .., the staged rows are copied instead of computed, by the
        next draft forward (or `settle`)."""
        self._check_capture()
        n_last = self.target.n_captured
        rows = np.arange(n_last) if rows is None else np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size == 0:
            return
        listed = rows.tolist()    # (checked in Python: numpy's per-call costs dominate on a path of a few rows)
        if not 0 <= min(listed) <= max(listed) < n_last:
            raise ValueError(f"rows must lie in the target's last forward (0..{n_last - 1})")
        first = self.cache.n_ctx
        if rows.size > self.cache.window:
            rows, first = rows[-self.cache.window:], first + rows.size - self.cache.window
        staged, self._staged = self._staged, None
        listed = listed[-rows.size:]
        if staged is not None and staged.holds(self.target.capture_serial, first, listed):
            self._pending = np.zeros(staged.n, dtype=np.int64)   # the rows not taken: to the block's scratch row 0,
            self._pending[listed] = self.cache.rows_for(first, len(listed))   # which every draft step writes first
            self.cache.commit(first, len(listed))
            return
        self._copy_pending()
        src = self.target.captured
        g = self._graph(("append_dev", rows.size), lambda: self._build_append(rows.size, src))
        self._activate(g)
        g.inputs["src_rows"].set(rows.astype(np.int32), self.backend)
        self._run_append(g, first, rows.size, wait)

    def stage_from_target(self, first_position: int, depths, wait: bool = True) -> None:
        """Compute the context rows of every token of the target's last forward, token i at position
        first_position + depths[i], into staging rows (not the context yet). The next append_from_target(rows) of
        that same forward at first_position whose rows lie at depths 0, 1, 2, .. (a verify's accepted path) takes
        its rows from there: the next draft forward copies them into the ring (no products of its own). The engine
        stages a verify's slots while the host waits for its tokens. wait=False queues it (as append_from_target)."""
        self._check_capture()
        n = self.target.n_captured
        depths = np.asarray(depths, dtype=np.int64).reshape(-1)
        if depths.size != n:
            raise ValueError(f"depths for {depths.size} tokens; the target's last forward has {n}")
        if n == 0:
            return
        if first_position != self.cache.n_ctx:
            raise ValueError(f"staging at position {first_position}: the draft context holds {self.cache.n_ctx}")
        self._copy_pending()      # (it reads the staging rows this overwrites)
        if self._stage is None or self._stage.capacity < n:
            if self._stage is not None:
                self.backend.synchronize()     # queued work may still read or write the rows being replaced
            self._stage = _Staging(self.backend, self.hp, n)
            self._graphs = {k: g for k, g in self._graphs.items()
                            if k[0] not in ("stage", "gather") and not (k[0] == "step" and len(k) > 3)}
        g = self._graph(("stage", n), lambda: self._build_stage(n))
        self._activate(g)
        g.inputs["pos"].set((first_position + depths).astype(np.int32), self.backend)
        (self.backend.compute if wait else self.backend.compute_async)(g.graph)
        self._staged = _Staged(self.target.capture_serial, int(first_position), depths.tolist())

    def _check_capture(self) -> None:
        if tuple(self.target.capture_layers) != self.hp.target_layer_ids:
            raise ValueError(f"the target captures layers {self.target.capture_layers}, the draft needs "
                             f"{self.hp.target_layer_ids}")

    def _run_append(self, g: _Graph, first: int, m: int, wait: bool = True) -> None:
        self._activate(g)
        g.inputs["pos"].set(np.arange(first, first + m, dtype=np.int32), self.backend)
        g.inputs["rows"].set(self.cache.rows_for(first, m), self.backend)
        (self.backend.compute if wait else self.backend.compute_async)(g.graph)
        self.cache.commit(first, m)

    def _copy_pending(self) -> None:
        """The staged rows an append left for the next draft forward, copied into the ring now (queued)."""
        if self._pending is None:
            return
        dest, self._pending = self._pending, None
        g = self._graph(("gather", dest.size), lambda: self._build_gather(dest.size))
        self._activate(g)
        g.inputs["dest"].set(dest, self.backend)
        self.backend.compute_async(g.graph)

    def _step(self, last_token: int) -> _Graph:
        if not 0 <= int(last_token) < self.target.hp.n_vocab:
            raise ValueError(f"token id {last_token} outside the vocabulary")
        n_attn = self.cache.n_attended()
        dest, self._pending = self._pending, None   # the last append's staged rows: copied first, in this forward
        n_staged = 0 if dest is None else dest.size
        key = ("step", n_attn, self.top_k) + ((n_staged,) if n_staged else ())
        g = self._graph(key, lambda: self._build_step(n_attn, n_staged))
        self._activate(g)
        io = g.io
        io["tokens"][0] = last_token
        np.add(self._block_offsets, self.cache.n_ctx, out=io["pos"])
        if n_staged:
            io["dest"][:] = dest
        for causal, window in g.masks:
            self.cache.mask(n_attn, causal, window, out=io[_mask_input((causal, window))])
        io.upload()
        self.backend.compute_async(g.graph)
        return g

    def propose(self, last_token: int, then=None) -> tuple[np.ndarray, np.ndarray]:
        """One draft forward for the block after `last_token` (at position n_ctx).

        Returns (ids, log-probs), each [B-1, top_k], best first; only these cross to the host. then: as in
        queue_propose."""
        return self.queue_propose(last_token, then)()

    def queue_propose(self, last_token: int, then=None) -> Callable[[], tuple[np.ndarray, np.ndarray]]:
        """Queue propose's forward and the copy of its proposals into page-locked memory; returns the call that
        waits for them and returns them (as propose). One at a time: a later call's copy takes the same memory.
        then: a callable that queues more work on the backend once the forward and the copy are queued (the
        engine's deferred target commit): it runs on the device while the host takes the proposals, and is not
        waited for."""
        self._top.queue(self._step(last_token).outputs["top"])
        if then is not None:
            then()
        return self._proposals

    def _proposals(self) -> tuple[np.ndarray, np.ndarray]:
        top = self._top.wait().view(np.float32).reshape(self.hp.block_size - 1, 2, self.top_k)
        return top[:, 1].astype(np.int64), top[:, 0].copy()                   # log-probs, ids; best first

    def logits(self, last_token: int) -> np.ndarray:
        """The full draft logits f32 [B-1, n_vocab] of one step (tests and diagnostics: a large copy)."""
        g = self._step(last_token)
        self.backend.synchronize()
        return g.outputs["logits"].numpy()

    # --- graphs ---

    def _graph(self, key, build) -> _Graph:
        g = self._graphs.pop(key, None)
        if g is None:
            g = build()
            while len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
        self._graphs[key] = g
        return g

    def _activate(self, g: _Graph) -> None:
        if g.allocator is None:
            g.allocator = ggml.Allocator(self.backend)
            g.allocator.allocate(g.graph)
            for name, values in g.constants.items():
                g.inputs[name].set(values)

    @property
    def n_graphs(self) -> int:
        return len(self._graphs)

    def _norm(self, ctx, x, weight, name):
        return ctx.mul(ctx.rms_norm(x, self.hp.rms_eps), weight).named(name)

    def _normed(self, ctx, x, weight, name) -> Normed:
        """_norm(x) as the input of products: normed where a product that ggml_qmatmul takes prepares its activations
        (layers.Normed: one kernel fewer), else built once as _norm."""
        return Normed(ctx, x, weight, self.hp.rms_eps, name)

    def _rope(self, ctx, x, pos):
        hp = self.hp
        # NEOX (rotate_half) pairing over the whole head, as Qwen3's rotary embedding
        return ctx.rope_ext(x, pos, None, hp.head_dim, 2, 0, hp.rope_theta, 1.0, 0.0, 1.0, 0.0, 0.0)

    def _project(self, ctx: ggml.Context, x: ggml.Tensor | Normed, prefix: str, parts: tuple[str, ...]
                 ) -> list[ggml.Tensor]:
        """x through the projections `parts` ('q', 'k', 'v' with prefix 'layers.N.self_attn.'; 'gate', 'up' with
        'layers.N.mlp.'): one product of the fused matrix that holds them where the weights have one (qkv_proj,
        kv_proj, gateup_proj), each result a row range of its output (a view, contiguous for one column only); else
        a product each."""
        w = self.weights
        fused = prefix + "".join(parts) + "_proj.weight"
        if fused not in w:
            return [linear(ctx, w[prefix + f"{part}_proj.weight"], x) for part in parts]
        return row_ranges(ctx, linear(ctx, w[fused], x), [w[prefix + f"{part}_proj.weight"].ne[1] for part in parts])

    def _build_append(self, m: int, src, into=None) -> _Graph:
        """Context rows: c = rmsnorm(fc . features) * hidden_norm; per layer K, V of c into the ring (or into
        `into`: per-layer K and V tensor lists, the staging rows), at the rows the `rows` input names."""
        # the weight products go through `linear` (ggml_qmatmul for quantized CUDA weights where it is faster,
        # mul_mat elsewhere): the draft's weights are allocated before any graph is built, as linear needs
        hp, w, cache = self.hp, self.weights, self.cache
        dest_k, dest_v = into if into is not None else (cache.k, cache.v)
        g = _Graph(16 * hp.n_layer + 32)
        ctx = g.ctx
        if src is None:
            feat = g.inputs["feat"] = ctx.new_tensor(ggml.Type.F32, (hp.n_feat * hp.n_embd, m),
                                                     name="draft.inp.feat").mark_input()
        else:   # gather the rows straight out of the target's capture buffer
            idx = g.inputs["src_rows"] = ctx.new_tensor(ggml.Type.I32, (m,), name="draft.inp.src_rows").mark_input()
            feat = ctx.get_rows(src, idx).named("draft.ctx.feat")                  # [n_feat E, m]
        pos = g.inputs["pos"] = ctx.new_tensor(ggml.Type.I32, (m,), name="draft.inp.ctx_pos").mark_input()
        rows = g.inputs["rows"] = ctx.new_tensor(ggml.Type.I64, (m,), name="draft.inp.ctx_rows").mark_input()
        c = self._normed(ctx, linear(ctx, w["fc.weight"], feat), w["hidden_norm.weight"], "draft.ctx.c")  # [E, m]
        writes = []
        for il in range(hp.n_layer):
            p = f"layers.{il}.self_attn."
            k, v = self._project(ctx, c, p, ("k", "v"))
            k = self._rope(ctx, self._norm(ctx, heads(ctx, k, hp.head_dim, hp.n_head_kv, m), w[p + "k_norm.weight"],
                                           f"draft.l{il}.ctx_k_norm"), pos)
            writes.append(ctx.set_rows(dest_k[il], ctx.reshape_2d(k, hp.head_dim * hp.n_head_kv, m), rows)
                          .named(f"draft.l{il}.ctx_k_write"))
            writes.append(ctx.set_rows(dest_v[il], v, rows).named(f"draft.l{il}.ctx_v_write"))
        g.graph = ctx.graph(writes)
        return g

    def _build_stage(self, n: int) -> _Graph:
        """The append's graph over all n tokens of the target's last forward, into staging rows 0..n-1."""
        g = self._build_append(n, self.target.captured, (self._stage.k, self._stage.v))
        g.constants.update(src_rows=np.arange(n, dtype=np.int32), rows=np.arange(n, dtype=np.int64))
        for name in g.constants:
            g.inputs[name].mark_constant()     # (before the graph is allocated)
        return g

    def _gathered(self, ctx: ggml.Context, il: int, n: int, dest: ggml.Tensor) -> tuple[ggml.Tensor, ggml.Tensor]:
        """Layer il's cache K and V with the first n staging rows written to the rows `dest` names."""
        pairs = ((self._stage.k[il], self.cache.k[il]), (self._stage.v[il], self.cache.v[il]))
        return tuple(ctx.set_rows(cached, ctx.view_2d(staged, staged.ne[0], n, staged.nb[1], 0), dest)
                     for staged, cached in pairs)

    def _build_gather(self, n: int) -> _Graph:
        """The first n staging rows of every layer's K and V written to the cache rows the `dest` input names."""
        hp = self.hp
        g = _Graph(4 * hp.n_layer + 8)
        ctx = g.ctx
        dest = g.inputs["dest"] = ctx.new_tensor(ggml.Type.I64, (n,), name="draft.inp.gather_rows").mark_input()
        writes = []
        for il in range(hp.n_layer):
            for part, written in zip("kv", self._gathered(ctx, il, n, dest)):
                writes.append(written.named(f"draft.l{il}.ctx_{part}_gather"))
        g.graph = ctx.graph(writes)
        return g

    def _build_step(self, n_attn: int, n_staged: int = 0) -> _Graph:
        """The draft forward; with n_staged, the first n_staged staging rows go to the cache rows the `dest` input
        names first (an append's, DFlashDraft.append_from_target)."""
        hp, w, cache = self.hp, self.weights, self.cache
        B, hd, E = hp.block_size, hp.head_dim, hp.n_embd
        g = _Graph(GRAPH_TENSORS_PER_LAYER * hp.n_layer + 64)
        ctx = g.ctx
        # the step's inputs in one block (one upload a step), placed before the graph is allocated
        tokens = g.inputs["tokens"] = ctx.new_tensor(ggml.Type.I32, (B,), name="draft.inp.tokens")
        pos = g.inputs["pos"] = ctx.new_tensor(ggml.Type.I32, (B,), name="draft.inp.pos")
        if n_staged:
            dest = g.inputs["dest"] = ctx.new_tensor(ggml.Type.I64, (n_staged,), name="draft.inp.gather_rows")
        for kind in sorted(set(zip(hp.causal, hp.window))):
            g.masks[kind] = g.inputs[_mask_input(kind)] = ctx.new_tensor(
                ggml.Type.F16, (n_attn, B), name=f"draft.inp.{_mask_input(kind)}")
        block_rows = g.inputs["block_rows"] = ctx.new_tensor(ggml.Type.I64, (B,), name="draft.inp.block_rows")
        g.io = ggml.InputBlock(self.backend, dict(g.inputs))
        g.io["tokens"][1:] = hp.mask_token_id                  # (what does not change from step to step: set once)
        g.io["block_rows"][:] = np.arange(B)

        h = ctx.get_rows(self.token_embd, tokens).named("draft.inp.embd")           # [E, B]
        if hp.embedding_scale != 1.0:
            h = ctx.scale(h, hp.embedding_scale)
        row = hd * hp.n_head_kv
        for il in range(hp.n_layer):
            p = f"layers.{il}."
            x = self._normed(ctx, h, w[p + "input_layernorm.weight"], f"draft.l{il}.attn_norm")
            q, k, v = self._project(ctx, x, p + "self_attn.", ("q", "k", "v"))
            q = self._rope(ctx, self._norm(ctx, heads(ctx, q, hd, hp.n_head, B), w[p + "self_attn.q_norm.weight"],
                                           f"draft.l{il}.q_norm"), pos)
            k = self._rope(ctx, self._norm(ctx, heads(ctx, k, hd, hp.n_head_kv, B), w[p + "self_attn.k_norm.weight"],
                                           f"draft.l{il}.k_norm"), pos)
            # the block's K/V go to the scratch rows 0..B-1; read the first n_attn rows through the writes
            ring_k, ring_v = cache.k[il], cache.v[il]
            if n_staged:   # (set_rows reads its destination: the block's writes below come after these)
                ring_k, ring_v = self._gathered(ctx, il, n_staged, dest)
            k_all = ctx.set_rows(ring_k, ctx.reshape_2d(k, row, B), block_rows)
            v_all = ctx.set_rows(ring_v, v, block_rows)
            kt = ctx.view_3d(k_all, hd, hp.n_head_kv, n_attn, hd * 2, cache.k[il].nb[1], 0)
            vt = ctx.view_3d(v_all, hd, hp.n_head_kv, n_attn, hd * 2, cache.v[il].nb[1], 0)
            mask = g.masks[(hp.causal[il], hp.window[il])]
            att = ctx.flash_attn_ext(ctx.permute(q, 0, 2, 1, 3), ctx.permute(kt, 0, 2, 1, 3),
                                     ctx.permute(vt, 0, 2, 1, 3), mask, 1.0 / math.sqrt(hd), 0.0, 0.0)
            att.accumulate_f32()
            att = ctx.reshape_2d(att, hd * hp.n_head, B).named(f"draft.l{il}.attn")
            h = linear(ctx, w[p + "self_attn.o_proj.weight"], att, add=h).named(f"draft.l{il}.attn_res")
            x = self._normed(ctx, h, w[p + "post_attention_layernorm.weight"], f"draft.l{il}.ffn_norm")
            gate, up = self._project(ctx, x, p + "mlp.", ("gate", "up"))
            h = linear(ctx, w[p + "mlp.down_proj.weight"], Gated(ctx, gate, up), add=h).named(f"draft.l{il}.out")

        tail = ctx.view_2d(h, E, B - 1, h.nb[1], h.nb[1])                           # block positions 1..B-1
        hn = self._normed(ctx, tail, w["norm.weight"], "draft.out.norm")
        logits = linear(ctx, self.lm_head, hn)                                      # [V, B-1]
        if hp.logit_scale != 1.0:
            logits = ctx.scale(logits, hp.logit_scale)
        if hp.logit_softcap > 0:
            logits = ctx.scale(ctx.tanh(ctx.scale(logits, 1.0 / hp.logit_softcap)), hp.logit_softcap)
        logits = logits.named("draft.out.logits")
        # top-K on the device in one pass: log-probs and ids, best first (no full sort, no full softmax)
        top = ggml.top_k_logp(ctx, logits, self.top_k).named("draft.out.top")       # [K, 2, B-1]
        g.outputs.update(logits=logits, top=top)
        g.graph = ctx.graph([logits, top])   # Allocator.allocate checks every node
        return g
