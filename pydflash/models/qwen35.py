"""The `qwen35` target (Qwen3.5 / Qwen3.6 dense): hyperparameters, tensors and the hybrid layer graphs.

Layers are either full attention (gated Q, per-head Q/K RMS norm, IMROPE, flash attention over the KV cache)
or Gated DeltaNet (causal depthwise conv + the fused delta-rule op); every layer ends with a SwiGLU FFN.
Formulas, keys and tensor names follow llama.cpp's implementation, which is the oracle in the tests.
The runtime (cache, graphs, prefill/decode, verify/commit, capture) is pydflash/models/runtime.py.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from .. import ggml
from ..gguf_io import GGUFError, GGUFFile
from ..validate import MAX_CTX_TRAIN, MAX_LAYERS, MAX_SIZE, meta_float, meta_int, meta_ints, vocab_rows
from . import layers
from .layers import linear, rms_norm
from .runtime import GraphInputs, TargetRuntime, TensorSpec

ARCH = "qwen35"
MAX_STATE = 1024           # GDN head size (Qwen3.5: 128); the state is state_size^2 per head
MAX_CONV = 64              # ssm.conv_kernel (Qwen3.5: 4)


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
        if size("attention.value_length", default=head_dim) != head_dim:
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
        n_v_heads = size("ssm.time_step_rank")
        ssm_inner = size("ssm.inner_size")
        hp = cls(
            n_layer=n_layer, n_embd=n_embd, n_ff=size("feed_forward_length"), n_vocab=vocab_rows(gf),
            n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n_rot=n_rot, rope_sections=sections,
            rope_base=meta_float(gf, f"{ARCH}.rope.freq_base", 0.0, math.inf, default=10000.0),
            rms_eps=meta_float(gf, f"{ARCH}.attention.layer_norm_rms_epsilon", 0.0, 1.0),
            ssm_d_conv=size("ssm.conv_kernel", MAX_CONV), ssm_d_k=size("ssm.state_size", MAX_STATE),
            ssm_n_k_heads=size("ssm.group_count"), ssm_n_v_heads=n_v_heads,
            ssm_d_v=ssm_inner // n_v_heads, recurrent=recurrent,
            n_ctx_train=meta_int(gf, f"{ARCH}.context_length", 0, MAX_CTX_TRAIN, default=0))
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

    @functools.cached_property
    def text_rope_is_neox(self) -> bool:
        """Whether IMROPE at a text token's positions (p, p, p, 0) is NEOX rope at p: ggml's rope_multi gives the
        rotated pair i the angle of position axis a = s % 3 (s = i % sum(sections)) where s < 3 sections[a], else of
        axis 3, which holds 0. When every pair takes one of the three axes that hold p, the angles, and so the
        values, are NEOX's (ggml's CPU and CUDA rope compute them by the same expressions), and ggml-cuda fuses a
        NEOX rope with the norm before it and the KV-cache write after it (IMROPE it does not)."""
        pairs = range(self.n_rot // 2)
        return all((s := i % sum(self.rope_sections)) < 3 * self.rope_sections[s % 3] for i in pairs)

    def tensors(self) -> dict[str, TensorSpec]:
        """Every tensor the model reads, name -> (ne in ggml order, role), as llama.cpp's loader expects them."""
        E, hd = self.n_embd, self.head_dim
        mat = lambda n_in, n_out: TensorSpec((n_in, n_out), "matrix")  # noqa: E731
        vec = lambda n, role="norm": TensorSpec((n,), role)            # noqa: E731
        specs = {"token_embd.weight": TensorSpec((E, self.n_vocab), "embedding"), "output_norm.weight": vec(E),
                 "output.weight": TensorSpec((E, self.n_vocab), "output", optional=True)}
        for il in range(self.n_layer):
            p = f"blk.{il}."
            specs[p + "attn_norm.weight"] = vec(E)
            specs[p + "post_attention_norm.weight"] = vec(E)
            if self.recurrent[il]:
                specs.update({p + "attn_qkv.weight": mat(E, self.conv_dim), p + "attn_gate.weight": mat(E, self.value_dim),
                              p + "ssm_conv1d.weight": TensorSpec((self.ssm_d_conv, self.conv_dim), "conv"),
                              p + "ssm_dt.bias": vec(self.ssm_n_v_heads, "bias"),
                              p + "ssm_a": vec(self.ssm_n_v_heads, "vector"),
                              p + "ssm_beta.weight": mat(E, self.ssm_n_v_heads),
                              p + "ssm_alpha.weight": mat(E, self.ssm_n_v_heads),
                              p + "ssm_norm.weight": vec(self.ssm_d_v), p + "ssm_out.weight": mat(self.value_dim, E)})
            else:
                specs.update({p + "attn_q.weight": mat(E, 2 * hd * self.n_head),
                              p + "attn_k.weight": mat(E, hd * self.n_head_kv),
                              p + "attn_v.weight": mat(E, hd * self.n_head_kv),
                              p + "attn_output.weight": mat(hd * self.n_head, E),
                              p + "attn_q_norm.weight": vec(hd), p + "attn_k_norm.weight": vec(hd)})
            specs.update({p + "ffn_gate.weight": mat(E, self.n_ff), p + "ffn_up.weight": mat(E, self.n_ff),
                          p + "ffn_down.weight": mat(self.n_ff, E)})
        return specs

    def tensor_shapes(self) -> dict[str, tuple]:
        """name -> ne of every tensor the model reads."""
        return {name: spec.ne for name, spec in self.tensors().items()}


class Qwen35Target(TargetRuntime):
    """A loaded qwen35 model with its cache (the public surface is TargetRuntime's; docs/targets.md)."""

    ARCH = ARCH
    HParams = Qwen35HParams
    GRAPH_TENSORS_PER_LAYER = 64   # ~45 used (GDN or attention + FFN, views included), ~55 with rotated KV

    @property
    def POS_PER_TOKEN(self) -> int:
        """IMROPE's four position axes per token, or one where its text positions make it NEOX rope
        (Qwen35HParams.text_rope_is_neox)."""
        return 1 if self.hp.text_rope_is_neox else 4

    def rope_positions(self, pos: np.ndarray) -> np.ndarray:
        if self.hp.text_rope_is_neox:
            return pos
        return np.concatenate([pos, pos, pos, np.zeros(pos.size, np.int32)])   # axis-major (p, p, p, 0)

    def build_layer(self, ctx, il: int, h, g: GraphInputs):
        hp, w, p = self.hp, self.weights, f"blk.{il}."
        # the norms' outputs only feed projections, which may compute them (layers.Normed)
        x = layers.Normed(ctx, h, w[p + "attn_norm.weight"], hp.rms_eps, f"l{il}.attn_norm")
        # the residual is added by the output projections (layers.linear: inside ggml_qmatmul where it takes them)
        mix = self._gdn if hp.recurrent[il] else self._attention
        h = mix(ctx, x, il, g, add=h).named(f"l{il}.attn_res")
        x = layers.Normed(ctx, h, w[p + "post_attention_norm.weight"], hp.rms_eps, f"l{il}.ffn_norm")
        return self.gated_ffn(ctx, x, p, "swiglu", f"l{il}.ffn_out", add=h).named(f"l{il}.out")

    def fusion_candidates(self, il: int) -> list[tuple[str, ...]]:
        """Per layer, the projections of the same input: attention Q(+gate), K, V (as the llama family's);
        recurrent qkv, the output gate z, beta and alpha (all four where their types agree: on an H100 beta and
        alpha's 96 rows alone took 16 us at 23 tokens, and a quantisation of the input of their own);
        the FFN's gate and up (gated_ffn). One matmul instead of two to four, the same dot products
        (TargetRuntime.project)."""
        p = f"blk.{il}."
        runs = [(p + "attn_qkv", p + "attn_gate", p + "ssm_beta", p + "ssm_alpha")] if self.hp.recurrent[il] \
            else [(p + "attn_q", p + "attn_k", p + "attn_v")]
        return runs + [(p + "ffn_gate", p + "ffn_up")]

    def row_orders(self) -> dict[str, np.ndarray]:
        """attn_q's rows interleave each head's Q and output gate; loaded as every head's Q, then every gate, the
        gate is a column slice of the product, which the output projection (ggml_qmatmul_sigmoid_gated) or
        ggml-cuda's sigmoid-and-multiply kernel reads where it is (no copy)."""
        hd, n_head = self.hp.head_dim, self.hp.n_head
        head_rows = np.arange(n_head)[:, None] * 2 * hd + np.arange(hd)[None, :]   # each head's Q rows in the file
        order = np.concatenate([head_rows.ravel(), (head_rows + hd).ravel()])
        return {f"blk.{il}.attn_q.weight": order for il in range(self.hp.n_layer) if not self.hp.recurrent[il]}

    def _attention(self, ctx, x, il: int, g: GraphInputs, add=None):
        hp, w = self.hp, self.weights
        p, hd, n = f"blk.{il}.", hp.head_dim, g.n_tokens
        q_full, k, v = self.project(ctx, x, [p + "attn_q", p + "attn_k", p + "attn_v"])   # q_full: [Q | gate]
        q = ctx.view_3d(q_full, hd, hp.n_head, n, hd * 4, q_full.nb[1], 0)                # (row_orders)
        q = rms_norm(ctx, q, w[p + "attn_q_norm.weight"], hp.rms_eps, f"l{il}.q_norm")     # [hd, n_head, n]
        gate = ctx.view_2d(q_full, hd * hp.n_head, n, q_full.nb[1], hd * hp.n_head * 4)
        k = layers.heads(ctx, k, hd, hp.n_head_kv, n)
        k = rms_norm(ctx, k, w[p + "attn_k_norm.weight"], hp.rms_eps, f"l{il}.k_norm")
        v = layers.heads(ctx, v, hd, hp.n_head_kv, n)
        if hp.text_rope_is_neox:
            def rope(t):
                return layers.rope(ctx, t, g.pos, n_rot=hp.n_rot, mode=layers.ROPE_TYPE_NEOX, base=hp.rope_base,
                                   n_ctx_train=hp.n_ctx_train)
        else:
            def rope(t):
                return ctx.rope_multi(t, g.pos, None, hp.n_rot, list(hp.rope_sections), layers.ROPE_TYPE_IMROPE,
                                      hp.n_ctx_train, hp.rope_base, 1.0, 0.0, 1.0, 32.0, 1.0)
        q, k = rope(q).named(f"l{il}.q"), rope(k).named(f"l{il}.k")
        out = layers.attention(ctx, self.cache, il, q, k, v, g)     # [hd n_head, n]
        out = layers.Gated(ctx, gate, out, act="sigmoid", name=f"l{il}.attn_gated")   # sigmoid(gate) * out
        return linear(ctx, w[p + "attn_output.weight"], out, add=add, name=f"l{il}.attn_out")

    def _conv_norms_qk(self) -> bool:
        """Whether a tree verify's conv op also norms q and k, stores the conv inputs and computes the gates
        (ggml.gdn_conv_tree, layers.gdn_conv_fused_enabled; CUDA takes heads of a power of two up to 128 values: the
        27B's 128)."""
        d_k = self.hp.ssm_d_k
        return layers.gdn_conv_fused_enabled() and d_k <= 128 and d_k & (d_k - 1) == 0

    def _gdn(self, ctx, x, il: int, g: GraphInputs, add=None):
        """In a tree verify (g.parent set) the conv and delta rule follow parent pointers, the conv state is left
        as it is (commit sets it), and every slot's state and conv input go to the verify stores."""
        hp, w, cache = self.hp, self.weights, self.cache
        p, n, parent, side_effects = f"blk.{il}.", g.n_tokens, g.parent, g.side_effects
        d_k, h_k, d_v, h_v = hp.ssm_d_k, hp.ssm_n_k_heads, hp.ssm_d_v, hp.ssm_n_v_heads
        # qkv [conv_dim, n], z [value_dim, n], beta and alpha [h_v, n]: row ranges of a fused product (views; one
        # column is contiguous), copied where the ops below need whole tensors
        qkv, z, beta, alpha = self.project(ctx, x, [p + "attn_qkv", p + "attn_gate", p + "ssm_beta", p + "ssm_alpha"])
        # log-decay g = softplus(alpha + dt_bias) * a (<= 0) and sigmoid(beta), from the row ranges as they are
        gate_inputs = (beta, alpha, w[p + "ssm_dt.bias"], w[p + "ssm_a"])
        gates = None        # (g, sigmoid(beta)) where ggml.gdn_conv_tree computes them; else gdn_gates' (below)
        qk_normed = False   # (ggml.gdn_conv_tree norms q and k itself)

        # causal depthwise conv over (last d_conv-1 inputs ‖ this batch), then keep the newest d_conv-1 inputs
        conv_state = cache.conv[il]
        conv_w = w[p + "ssm_conv1d.weight"]
        state_3d = ctx.reshape_3d(conv_state, hp.ssm_d_conv - 1, hp.conv_dim, 1)

        def conv_input():   # state ‖ qkv along time, channel by channel
            rows = qkv if qkv.is_contiguous else ctx.cont(qkv)
            return ctx.concat(state_3d, ctx.transpose(ctx.reshape_3d(rows, hp.conv_dim, n, 1)), 0)
        if parent is None:
            conv_in = conv_input()
            tail = ctx.view_3d(conv_in, hp.ssm_d_conv - 1, hp.conv_dim, 1, conv_in.nb[1], conv_in.nb[2], n * 4)
            side_effects.append(ctx.cpy(tail, state_3d).named(f"l{il}.gdn.conv_state_out"))
            if g.decode_parent is not None:   # bit-exact decode: the verify's conv op, over a one-node tree
                conv = ggml.ssm_conv_tree(ctx, conv_in, conv_w, g.decode_parent, silu=True)
            else:
                conv = ctx.silu(ctx.ssm_conv(conv_in, conv_w))   # (ggml-cuda runs the two as one kernel)
        else:
            inputs = ctx.view_3d(self.slot_inputs[il], hp.conv_dim, n, 1, self.slot_inputs[il].nb[1],
                                 self.slot_inputs[il].nb[1] * n, 0)
            rows = ctx.view_3d(qkv, hp.conv_dim, n, 1, qkv.nb[1], qkv.nb[1] * n, 0)
            if layers.conv_split_enabled() and self._conv_norms_qk():
                # conv, silu, q and k's L2 norm, the slots' inputs stored and the gates, in one op (the bits of the
                # four ops it replaces)
                conv, *gates = ggml.gdn_conv_tree(ctx, state_3d, rows, conv_w, parent, qk=2 * hp.key_dim,
                                                  head_dim=d_k, eps=hp.rms_eps, inputs=inputs, gates=gate_inputs)
                qk_normed = True
            else:
                side_effects.append(ctx.cpy(rows, inputs).named(f"l{il}.gdn.slot_inputs"))
                if layers.conv_split_enabled():   # the state and qkv's rows where they are: no concatenated copy
                    conv = ggml.ssm_conv_tree_split(ctx, state_3d, rows, conv_w, parent, silu=True)
                else:
                    conv = ggml.ssm_conv_tree(ctx, conv_input(), conv_w, parent, silu=True)
        # silu(conv) [conv_dim, n, 1] (its q and k heads normed: another name, so that pydflash.probe compares it
        # with nothing of a decode)
        conv = conv.named(f"l{il}.gdn.conv" + ("_qk_normed" if qk_normed else ""))

        gk, beta = gates if gates is not None else ggml.gdn_gates(ctx, *gate_inputs)
        gk = ctx.reshape_4d(gk, 1, h_v, n, 1).named(f"l{il}.gdn.g")
        beta = ctx.reshape_4d(beta, 1, h_v, n, 1)

        row = hp.conv_dim * 4
        # q's heads then k's, l2-normed as one tensor (one norm kernel instead of two; each head on its own)
        qk = ctx.view_4d(conv, d_k, 2 * h_k, n, 1, d_k * 4, row, row * n, 0)
        if not qk_normed:
            qk = layers.l2_norm(ctx, qk, hp.rms_eps)
        q = ctx.view_4d(qk, d_k, h_k, n, 1, qk.nb[1], qk.nb[2], qk.nb[3], 0)
        k = ctx.view_4d(qk, d_k, h_k, n, 1, qk.nb[1], qk.nb[2], qk.nb[3], hp.key_dim * 4)
        v = ctx.view_4d(conv, d_v, h_v, n, 1, d_v * 4, row, row * n, 2 * hp.key_dim * 4)

        ssm = cache.ssm[il]
        state = ctx.reshape_4d(ssm, d_v, d_v, h_v, 1)
        if parent is None:
            if g.decode_parent is not None:   # bit-exact decode: the verify's delta-rule kernel, one-node tree
                res = ggml.gated_delta_net_tree(ctx, q, k, v, gk, beta, state, g.decode_parent)
            else:
                res = ctx.gated_delta_net(q, k, v, gk, beta, state, 1)   # [d_v h_v, n + d_v]: o for n tokens, then S
            o = ctx.view_4d(res, d_v, h_v, n, 1, d_v * 4, d_v * h_v * 4, d_v * h_v * n * 4, 0)
            new_state = ctx.view_1d(res, d_v * d_v * h_v, d_v * h_v * n * 4)
            side_effects.append(ctx.cpy(new_state, ssm).named(f"l{il}.gdn.state_out"))
        elif self.replay:   # no node state kept: the op writes each slot's key, delta and decay, which commit replays
            res = ggml.gated_delta_net_tree_steps(ctx, q, k, v, gk, beta, state, parent, self.slot_states[il],
                                                  exact=not layers.gdn_chunk_enabled())
            o = ctx.view_4d(res, d_v, h_v, n, 1, d_v * 4, d_v * h_v * 4, d_v * h_v * n * 4, 0)
        elif self.tree_state_op is not None:                          # node states go straight to the store
            o = self.tree_state_op(ctx, q, k, v, gk, beta, state, parent, self.slot_states[il])
        else:
            # chains: upstream's K = n snapshots, slot s = the state s tokens back; stored reversed, so the
            # store's column t is the state after slot n-1-t (commit reads it that way)
            res = ctx.gated_delta_net(q, k, v, gk, beta, state, n)
            o = ctx.view_4d(res, d_v, h_v, n, 1, d_v * 4, d_v * h_v * 4, d_v * h_v * n * 4, 0)
            size = d_v * d_v * h_v
            snaps = ctx.view_2d(res, size, n, size * 4, d_v * h_v * n * 4)
            store = self.slot_states[il]
            side_effects.append(ctx.cpy(snaps, ctx.view_2d(store, size, n, size * 4, 0))
                                .named(f"l{il}.gdn.slot_states"))

        # the gated norm silu(z) * rms_norm(o): a SwiGLU of z's rows (read where they are) and o normed per head,
        # which ggml_qmatmul computes as it quantises the output projection's input (layers.Gated; the per-head
        # norm too with PYDFLASH_HEAD_NORM_IN_QMATMUL=1)
        gated = layers.Gated(ctx, z, ctx.reshape_2d(o, hp.value_dim, n),
                             head_norm=(w[p + "ssm_norm.weight"], hp.rms_eps, f"l{il}.gdn.norm"))
        return linear(ctx, w[p + "ssm_out.weight"], gated, add=add, name=f"l{il}.gdn.out")
