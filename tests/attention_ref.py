"""A float64 numpy forward of the attention-only architectures (llama, qwen2, qwen3, gemma3) from an F32 GGUF:
the independent oracle next to llama.cpp (formulas as in llama.cpp's src/models/{llama,qwen2,qwen3,gemma3}.cpp;
gemma3: five sliding-window layers of every six, rope base 10000 on those)."""
from __future__ import annotations

import numpy as np

from pydflash.gguf_io import GGUFFile


def last_logits(path, tokens) -> np.ndarray:
    """float64 logits of the last of `tokens` (positions 0..n-1)."""
    gf = GGUFFile(path)
    arch = gf.architecture

    def w(name):
        info = gf.tensors[name]
        return np.frombuffer(gf.data(info), np.float32).reshape(info.ne[::-1]).astype(np.float64)

    def key(name, default=None):
        return gf.get(f"{arch}.{name}", default)

    n_layer, n_embd, n_head = key("block_count"), key("embedding_length"), key("attention.head_count")
    n_head_kv, eps = key("attention.head_count_kv"), key("attention.layer_norm_rms_epsilon")
    hd = key("attention.key_length", n_embd // n_head)
    n = len(tokens)
    pos = np.arange(n)
    gemma = arch == "gemma3"

    def rotation(base):
        angle = pos[:, None, None] * base ** (-np.arange(0, hd, 2) / hd)  # [n, 1, hd/2]
        return np.cos(angle), np.sin(angle)

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rope(x, cos, sin):             # x [n, heads, hd]
        if arch == "llama":            # adjacent pairs
            a, b = x[..., 0::2], x[..., 1::2]
            return np.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape)
        a, b = x[..., :hd // 2], x[..., hd // 2:]   # NEOX: halves
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    def proj(x, name, heads):
        y = x @ w(name + ".weight").T
        if name + ".bias" in gf.tensors:
            y = y + w(name + ".bias")
        return y.reshape(n, heads, hd)

    h = w("token_embd.weight")[tokens] * (np.sqrt(n_embd) if gemma else 1.0)
    causal = np.where(pos[None, :] <= pos[:, None], 0.0, -np.inf)
    window = np.where(pos[:, None] - pos[None, :] < key("attention.sliding_window", n), causal, -np.inf)
    for il in range(n_layer):
        p = f"blk.{il}."
        local = gemma and il % 6 < 5
        cos, sin = rotation(10000.0 if local else key("rope.freq_base", 10000.0))
        x = norm(h, w(p + "attn_norm.weight"))
        q, k, v = proj(x, p + "attn_q", n_head), proj(x, p + "attn_k", n_head_kv), proj(x, p + "attn_v", n_head_kv)
        if arch in ("qwen3", "gemma3"):
            q, k = norm(q, w(p + "attn_q_norm.weight")), norm(k, w(p + "attn_k_norm.weight"))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        k, v = np.repeat(k, n_head // n_head_kv, 1), np.repeat(v, n_head // n_head_kv, 1)
        s = np.einsum("ihd,jhd->hij", q, k) / np.sqrt(hd) + (window if local else causal)
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        attn = np.einsum("hij,jhd->ihd", s, v).reshape(n, n_head * hd) @ w(p + "attn_output.weight").T
        h = h + (norm(attn, w(p + "post_attention_norm.weight")) if gemma else attn)
        x = norm(h, w(p + "ffn_norm.weight"))
        gate = x @ w(p + "ffn_gate.weight").T
        if gemma:   # GELU, tanh form
            act = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate ** 3)))
        else:       # SiLU
            act = gate / (1 + np.exp(-gate))
        ffn = (act * (x @ w(p + "ffn_up.weight").T)) @ w(p + "ffn_down.weight").T
        h = h + (norm(ffn, w(p + "post_ffw_norm.weight")) if gemma else ffn)
    head = w("output.weight") if "output.weight" in gf.tensors else w("token_embd.weight")
    return head @ norm(h[-1], w("output_norm.weight"))
