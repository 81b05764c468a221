"""The `llama` target and the attention-only layer stack it shares with qwen2 and qwen3.

Every layer: RMS norm, Q/K/V projections (biases where the file has them), rotary embedding, attention over
the KV cache, output projection, residual; RMS norm, SwiGLU FFN, residual. Rollback is KV compaction only.
Keys, tensor names and formulas follow llama.cpp (src/models/llama.cpp), the oracle in the tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from ..gguf_io import GGUFError, GGUFFile
from ..validate import MAX_CTX_TRAIN, MAX_LAYERS, MAX_SIZE, meta_float, meta_int, meta_str, vocab_rows
from . import layers
from .layers import linear, rms_norm
from .runtime import GraphInputs, TargetRuntime, TensorSpec


@dataclass(frozen=True)
class LlamaHParams:
    ARCH: ClassVar[str] = "llama"
    ROPE_TYPE: ClassVar[int] = layers.ROPE_TYPE_NORMAL
    QKV_BIAS: ClassVar[str] = "optional"      # "optional", "required" or "none"
    QK_NORM: ClassVar[bool] = False           # per-head RMS norm of Q and K before the rope (qwen3)

    n_layer: int
    n_embd: int
    n_ff: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_base: float
    rope_freq_scale: float
    rms_eps: float
    n_ctx_train: int
    attn_scale: float
    recurrent: tuple          # all False: every layer keeps a KV cache

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "LlamaHParams":
        """Read and check the hyperparameters: every number typed, finite and in range before it sizes
        anything, and the features this runtime does not implement refused by name."""
        arch = cls.ARCH
        gf.expect_architecture(arch)
        size = lambda name, hi=MAX_SIZE, **kw: meta_int(gf, f"{arch}.{name}", 1, hi, **kw)  # noqa: E731
        n_layer, n_embd, n_head = size("block_count", MAX_LAYERS), size("embedding_length"), \
            size("attention.head_count")
        head_dim = size("attention.key_length", default=n_embd // n_head)
        if size("attention.value_length", default=head_dim) != head_dim:
            raise GGUFError(f"{gf.path}: {arch} needs attention.key_length == attention.value_length")
        if meta_int(gf, f"{arch}.expert_count", 0, MAX_SIZE, default=0) > 0:
            raise GGUFError(f"{gf.path}: {arch}.expert_count: mixture-of-experts models are not supported")
        scaling = meta_str(gf, f"{arch}.rope.scaling.type", default="none", max_len=64)
        factor = 0.0
        if scaling == "linear":
            factor = meta_float(gf, f"{arch}.rope.scaling.factor", 0.0, math.inf)
        elif scaling != "none":
            raise GGUFError(f"{gf.path}: {arch}.rope.scaling.type {scaling!r} is not supported (none or linear)")
        if "rope_freqs.weight" in gf.tensors:
            raise GGUFError(f"{gf.path}: per-frequency rope factors (rope_freqs.weight) are not supported")
        if isinstance(gf.get(f"{arch}.attention.head_count_kv"), list):
            raise GGUFError(f"{gf.path}: {arch}.attention.head_count_kv per layer is not supported")
        scale = None
        if gf.get(f"{arch}.attention.scale") not in (None, 0):     # 0: the default, 1/sqrt(head_dim)
            scale = meta_float(gf, f"{arch}.attention.scale", 0.0, math.inf)
        hp = cls(n_layer=n_layer, n_embd=n_embd, n_ff=size("feed_forward_length"), n_vocab=vocab_rows(gf),
                 n_head=n_head, n_head_kv=size("attention.head_count_kv", default=n_head), head_dim=head_dim,
                 n_rot=size("rope.dimension_count", default=head_dim),
                 rope_base=meta_float(gf, f"{arch}.rope.freq_base", 0.0, math.inf, default=10000.0),
                 rope_freq_scale=1.0 / factor if scaling == "linear" else 1.0,
                 rms_eps=meta_float(gf, f"{arch}.attention.layer_norm_rms_epsilon", 0.0, 1.0),
                 n_ctx_train=meta_int(gf, f"{arch}.context_length", 0, MAX_CTX_TRAIN, default=0),
                 attn_scale=scale or 1.0 / math.sqrt(head_dim), recurrent=(False,) * n_layer)
        hp._validate(gf.path)
        return hp

    def _validate(self, path: str) -> None:
        """The numbers must also agree with each other: reject combinations the graph cannot be built from."""
        if self.n_head % self.n_head_kv:
            raise GGUFError(f"{path}: head_count {self.n_head} is not a multiple of head_count_kv {self.n_head_kv}")
        if not 0 < self.n_rot <= self.head_dim or self.n_rot % 2:
            raise GGUFError(f"{path}: rope.dimension_count {self.n_rot} does not fit head size {self.head_dim}")

    def tensors(self) -> dict[str, TensorSpec]:
        """Every tensor the model reads, name -> (ne in ggml order, role), as llama.cpp's loader expects them."""
        E, hd, q_dim, kv_dim = self.n_embd, self.head_dim, self.head_dim * self.n_head, self.head_dim * self.n_head_kv
        mat = lambda n_in, n_out: TensorSpec((n_in, n_out), "matrix")  # noqa: E731
        specs = {"token_embd.weight": TensorSpec((E, self.n_vocab), "embedding"),
                 "output_norm.weight": TensorSpec((E,), "norm"),
                 "output.weight": TensorSpec((E, self.n_vocab), "output", optional=True)}
        for il in range(self.n_layer):
            p = f"blk.{il}."
            specs.update({p + "attn_norm.weight": TensorSpec((E,), "norm"), p + "attn_q.weight": mat(E, q_dim),
                          p + "attn_k.weight": mat(E, kv_dim), p + "attn_v.weight": mat(E, kv_dim),
                          p + "attn_output.weight": mat(q_dim, E)})
            if self.QKV_BIAS != "none":
                optional = self.QKV_BIAS == "optional"
                for name, n in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
                    specs[p + name + ".bias"] = TensorSpec((n,), "bias", optional)
                if optional:
                    specs[p + "attn_output.bias"] = TensorSpec((E,), "bias", True)
            if self.QK_NORM:
                specs[p + "attn_q_norm.weight"] = TensorSpec((hd,), "norm")
                specs[p + "attn_k_norm.weight"] = TensorSpec((hd,), "norm")
            specs.update({p + "ffn_norm.weight": TensorSpec((E,), "norm"), p + "ffn_gate.weight": mat(E, self.n_ff),
                          p + "ffn_up.weight": mat(E, self.n_ff), p + "ffn_down.weight": mat(self.n_ff, E)})
        return specs


class LlamaTarget(TargetRuntime):
    """A loaded llama-family (attention-only) model with its cache (public surface: docs/targets.md)."""

    ARCH = LlamaHParams.ARCH
    HParams = LlamaHParams
    GRAPH_TENSORS_PER_LAYER = 48   # ~30 used (attention + FFN, views included), ~40 with rotated KV

    def build_layer(self, ctx, il: int, h, g: GraphInputs):
        hp, w, p = self.hp, self.weights, f"blk.{il}."
        # the norms' outputs only feed projections, which may compute them (layers.Normed)
        x = layers.Normed(ctx, h, w[p + "attn_norm.weight"], hp.rms_eps, f"l{il}.attn_norm")
        # the residual is added by the output projections (layers.linear: inside ggml_qmatmul where it takes them)
        h = self._attention(ctx, x, il, g, add=h).named(f"l{il}.attn_res")
        x = layers.Normed(ctx, h, w[p + "ffn_norm.weight"], hp.rms_eps, f"l{il}.ffn_norm")
        return self.gated_ffn(ctx, x, p, "swiglu", f"l{il}.ffn_out", add=h).named(f"l{il}.out")

    def fusion_candidates(self, il: int) -> list[tuple[str, ...]]:
        """Q, K and V of a layer as one matrix where their types agree (else the two neighbours whose do), their
        biases likewise: one matmul (and one quantisation of the activations) instead of three, which is most
        of a small model's decode time in kernel launches; the FFN's gate and up likewise (gated_ffn). Each output
        row is the same dot product as before, so the logits do not change."""
        p = f"blk.{il}."
        return [(p + "attn_q", p + "attn_k", p + "attn_v"), (p + "ffn_gate", p + "ffn_up")]

    def _qkv(self, ctx, x, il: int, n: int):
        """Q [head_dim, n_head, n], K and V [head_dim, n_head_kv, n], biases added (TargetRuntime.project)."""
        hp, p = self.hp, f"blk.{il}."
        q, k, v = self.project(ctx, x, [p + "attn_q", p + "attn_k", p + "attn_v"])
        return (layers.heads(ctx, q, hp.head_dim, hp.n_head, n), layers.heads(ctx, k, hp.head_dim, hp.n_head_kv, n),
                layers.heads(ctx, v, hp.head_dim, hp.n_head_kv, n))

    def _attention(self, ctx, x, il: int, g: GraphInputs, add=None):
        hp, w, p, n = self.hp, self.weights, f"blk.{il}.", g.n_tokens
        q, k, v = self._qkv(ctx, x, il, n)
        if hp.QK_NORM:
            q = rms_norm(ctx, q, w[p + "attn_q_norm.weight"], hp.rms_eps, f"l{il}.q_norm")
            k = rms_norm(ctx, k, w[p + "attn_k_norm.weight"], hp.rms_eps, f"l{il}.k_norm")
        rope = dict(n_rot=hp.n_rot, mode=hp.ROPE_TYPE, base=hp.rope_base, n_ctx_train=hp.n_ctx_train,
                    freq_scale=hp.rope_freq_scale)
        q = layers.rope(ctx, q, g.pos, **rope).named(f"l{il}.q")
        k = layers.rope(ctx, k, g.pos, **rope).named(f"l{il}.k")
        out = layers.attention(ctx, self.cache, il, q, k, v, g, hp.attn_scale)   # [hd n_head, n]
        if p + "attn_output.bias" not in w:
            return linear(ctx, w[p + "attn_output.weight"], out, add=add, name=f"l{il}.attn_out")
        out = ctx.add(linear(ctx, w[p + "attn_output.weight"], out), w[p + "attn_output.bias"]).named(f"l{il}.attn_out")
        return out if add is None else ctx.add(out, add)   # (the bias first, as before)
