"""The `gemma3` target (Gemma 3 text models, e.g. Gemma-3-270M): llama's attention layers with Gemma's extras.

Differences from llama (facts as llama.cpp reads and builds them: src/llama-model.cpp's gemma3 hyperparameters,
src/models/gemma3.cpp):
- the token embeddings are scaled by sqrt(n_embd);
- per-head RMS norms of Q and K before the NEOX rope; Q is scaled by `attn_scale` before attention (1/sqrt
  (head_dim), or 1/sqrt(n_embd / n_head) for the 62-layer 27B model), and the attention itself by 1;
- RMS norms after the attention output and after the FFN (`post_attention_norm`, `post_ffw_norm`), before each
  residual add;
- a GELU(tanh)-gated FFN: down(gelu(gate x) * up x);
- sliding-window attention on five layers of every six (layer il is local when il % 6 < 5): a token at position
  p sees positions p - n_swa < p' <= p (`attention.sliding_window`); local layers rope with base 10000 and no
  scaling, global ones with `rope.freq_base` and the file's rope scaling;
- the LM head is tied to the token embedding unless the file has `output.weight`.
The KV cache keeps every position for every layer (local layers only read their window through the mask).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..gguf_io import GGUFError, GGUFFile
from ..validate import meta_int
from . import layers
from .layers import linear, rms_norm
from .llama import LlamaHParams, LlamaTarget
from .runtime import GraphInputs, TensorSpec

SWA_PATTERN = 6             # llama.cpp's set_swa_pattern(6): layers 0..4 of every 6 are local, the 6th global
ROPE_BASE_LOCAL = 10000.0   # llama.cpp's rope_freq_base_train_swa for gemma3 (not in the file)
N_LAYER_27B = 62            # the one size whose query scale is 1/sqrt(n_embd / n_head)


@dataclass(frozen=True)
class Gemma3HParams(LlamaHParams):
    ARCH = "gemma3"
    ROPE_TYPE = layers.ROPE_TYPE_NEOX
    QKV_BIAS = "none"
    QK_NORM = True

    n_swa: int = 0              # sliding window (positions) of the local layers
    swa_layers: tuple = ()      # per layer: True for a sliding-window (local) layer

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "Gemma3HParams":
        hp = super().from_gguf(gf)
        n_swa = meta_int(gf, f"{cls.ARCH}.attention.sliding_window", 1, 1 << 24)
        if hp.n_layer < SWA_PATTERN:   # every layer local: the graph would never read the global mask
            raise GGUFError(f"{gf.path}: {cls.ARCH}.block_count {hp.n_layer}: gemma3 needs at least {SWA_PATTERN} "
                            f"layers (one global layer per {SWA_PATTERN})")
        # the 27B scales Q by 1/sqrt(n_embd / n_head) (its head size differs); every other size by 1/sqrt(head_dim)
        scale = 1.0 / math.sqrt(hp.n_embd // hp.n_head if hp.n_layer == N_LAYER_27B else hp.head_dim)
        swa = tuple(il % SWA_PATTERN < SWA_PATTERN - 1 for il in range(hp.n_layer))
        return replace(hp, n_swa=n_swa, swa_layers=swa, attn_scale=scale)

    def tensors(self) -> dict[str, TensorSpec]:
        specs = super().tensors()
        for il in range(self.n_layer):
            p = f"blk.{il}."
            specs[p + "post_attention_norm.weight"] = TensorSpec((self.n_embd,), "norm")
            specs[p + "post_ffw_norm.weight"] = TensorSpec((self.n_embd,), "norm")
        return specs


class Gemma3Target(LlamaTarget):
    """A loaded Gemma 3 model with its cache (public surface: docs/targets.md)."""

    ARCH = Gemma3HParams.ARCH
    HParams = Gemma3HParams
    GRAPH_TENSORS_PER_LAYER = 64   # llama's ~40 plus the post norms, the Q scale and the gated GELU

    def embed(self, ctx, g: GraphInputs):
        rows = ctx.get_rows(self.weights["token_embd.weight"], g.tokens)
        return ctx.scale(rows, math.sqrt(self.hp.n_embd)).named("inp.embd")

    def build_layer(self, ctx, il: int, h, g: GraphInputs):
        hp, w, p = self.hp, self.weights, f"blk.{il}."
        x = rms_norm(ctx, h, w[p + "attn_norm.weight"], hp.rms_eps, f"l{il}.attn_norm")
        attn = rms_norm(ctx, self._attention(ctx, x, il, g), w[p + "post_attention_norm.weight"], hp.rms_eps,
                        f"l{il}.attn_post_norm")
        h = ctx.add(attn, h).named(f"l{il}.attn_res")
        x = rms_norm(ctx, h, w[p + "ffn_norm.weight"], hp.rms_eps, f"l{il}.ffn_norm")
        ffn = rms_norm(ctx, self.gated_ffn(ctx, x, p, "geglu", f"l{il}.ffn_out"),
                       w[p + "post_ffw_norm.weight"], hp.rms_eps, f"l{il}.ffn_post_norm")
        return ctx.add(ffn, h).named(f"l{il}.out")

    def _attention(self, ctx, x, il: int, g: GraphInputs):
        hp, w, p, n = self.hp, self.weights, f"blk.{il}.", g.n_tokens
        local = hp.swa_layers[il]
        q, k, v = self._qkv(ctx, x, il, n)
        q = rms_norm(ctx, q, w[p + "attn_q_norm.weight"], hp.rms_eps, f"l{il}.q_norm")
        k = rms_norm(ctx, k, w[p + "attn_k_norm.weight"], hp.rms_eps, f"l{il}.k_norm")
        rope = dict(n_rot=hp.n_rot, mode=hp.ROPE_TYPE, n_ctx_train=hp.n_ctx_train,
                    base=ROPE_BASE_LOCAL if local else hp.rope_base, freq_scale=1.0 if local else hp.rope_freq_scale)
        q = layers.rope(ctx, q, g.pos, **rope)
        k = layers.rope(ctx, k, g.pos, **rope).named(f"l{il}.k")
        q = ctx.scale(q, hp.attn_scale).named(f"l{il}.q")         # llama.cpp scales Q, then attends with scale 1
        out = layers.attention(ctx, self.cache, il, q, k, v, g, 1.0, mask=g.kq_mask_swa if local else None)
        return linear(ctx, w[p + "attn_output.weight"], out).named(f"l{il}.attn_out")
