"""Many DFlash draft blocks of one sequence in one PyTorch forward: the training-time form of z-lab's draft.

At inference the draft sees, for an anchor position a (the last committed token), the target's captured features
of positions 0..a-1 and a block of B tokens at positions a..a+B-1: the anchor's token, then B-1 mask tokens. Its
attention runs the block's queries over [context K/V, block K/V] with no causal mask (z-lab's
`DFlashDraftModel.forward` with full-attention layers).

Training on one anchor per sequence wastes the context: its K/V projections are the same for every anchor. Here
the queries of m blocks (anchors a_1..a_m of one sequence) attend over the context K/V of positions 0..L-1 plus
all m blocks' K/V, under a mask that lets block j see context positions < a_j and its own block only: each block
gets exactly the attention it would get alone, so one forward trains m blocks. The weights are those of a z-lab
`DFlashDraftModel` (its submodules are called directly), so the trained model saves in z-lab's format unchanged.
Torch is imported inside the functions: every pydflash module imports without the `train` extra.
"""
from __future__ import annotations


def block_visibility(anchors, n_ctx: int, block: int):
    """Boolean attention mask [batch, 1, m*block, n_ctx + m*block] (True: may attend) for anchors [batch, m]:
    query block j sees context positions < anchors[:, j] and the keys of block j."""
    import torch

    batch, m = anchors.shape
    block_of = torch.arange(m, device=anchors.device).repeat_interleave(block)            # [m*block]
    anchor_of = anchors[:, block_of]                                                       # [batch, m*block]
    ctx = torch.arange(n_ctx, device=anchors.device)[None, None, :] < anchor_of[:, :, None]
    own = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    return torch.cat([ctx, own], dim=-1)[:, None]


def block_positions(anchors, block: int):
    """Positions [batch, m*block] of the blocks' tokens: a_j, a_j + 1, ..., a_j + block - 1 for each anchor."""
    import torch

    offsets = torch.arange(block, device=anchors.device)
    return (anchors[:, :, None] + offsets).reshape(anchors.shape[0], -1)


def _rotate_half(x):
    import torch

    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x, cos, sin):
    """x [batch, heads, n, head_dim]; cos/sin [batch, n, head_dim] (Qwen3's rotate-half RoPE)."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def blocks_hidden(model, features, anchors, noise):
    """The draft's final hidden states of every block: [batch, m*block, hidden].

    model: a z-lab `DFlashDraftModel` (full-attention layers). features: the target's captured features
    [batch, n_ctx, n_target_layers * hidden] of positions 0..n_ctx-1 (rows padded past their length are never
    seen if every anchor of the row is at most its length). anchors: [batch, m], each in 1..n_ctx.
    noise: the blocks' input embeddings [batch, m*block, hidden] (anchor token, then mask tokens)."""
    import torch
    import torch.nn.functional as F

    batch, n_ctx = features.shape[:2]
    block = model.block_size
    n_q = noise.shape[1]
    if n_q != anchors.shape[1] * block:
        raise ValueError(f"noise has {n_q} rows, expected {anchors.shape[1]} anchors x block {block}")
    ctx = model.hidden_norm(model.fc(features))
    ctx_pos = torch.arange(n_ctx, device=features.device).expand(batch, -1)
    positions = torch.cat([ctx_pos, block_positions(anchors, block)], dim=1)
    cos, sin = model.rotary_emb(noise, positions)
    mask = block_visibility(anchors, n_ctx, block)
    hidden = noise
    for layer in model.layers:
        attn = layer.self_attn
        if attn.is_causal or attn.sliding_window is not None:
            raise ValueError("blocks_hidden supports full-attention draft layers only (no causal/sliding config)")
        d = attn.head_dim
        x = layer.input_layernorm(hidden)
        q = attn.q_norm(attn.q_proj(x).view(batch, n_q, -1, d)).transpose(1, 2)
        k = torch.cat([attn.k_proj(ctx), attn.k_proj(x)], dim=1).view(batch, n_ctx + n_q, -1, d)
        k = attn.k_norm(k).transpose(1, 2)
        v = torch.cat([attn.v_proj(ctx), attn.v_proj(x)], dim=1).view(batch, n_ctx + n_q, -1, d).transpose(1, 2)
        q = _rope(q, cos[:, n_ctx:], sin[:, n_ctx:])
        k = _rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        hidden = hidden + attn.o_proj(out.transpose(1, 2).reshape(batch, n_q, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.norm(hidden)
