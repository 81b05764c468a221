"""pydflash.draft_blocks (many draft blocks in one forward) against z-lab's own single-anchor forward."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="draft training needs the `train` extra (torch)")


def zlab_draft(seed: int, *, hidden=96, n_layer=2, n_head=4, n_head_kv=2, head_dim=32, n_ff=160, block=6,
               n_target_layers=3):
    from dflash import model as zlab
    from transformers import Qwen3Config

    config = Qwen3Config(hidden_size=hidden, num_hidden_layers=n_layer, num_attention_heads=n_head,
                         num_key_value_heads=n_head_kv, head_dim=head_dim, intermediate_size=n_ff,
                         rms_norm_eps=1e-6, rope_theta=1e4, vocab_size=300, block_size=block,
                         num_target_layers=8, max_position_embeddings=4096,
                         dflash_config={"mask_token_id": 299, "target_layer_ids": list(range(n_target_layers))})
    torch.manual_seed(seed)
    model = zlab.DFlashDraftModel(config).float().eval()
    with torch.no_grad():          # weights of a trained model's scale, not post_init's near-zero ones
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    return model


def test_every_block_equals_zlab_single_anchor_forward():
    """Two sequences of different lengths in one padded batch, four anchors each (one at the first position
    that has context, one whose block ends at the last position): every block's logits equal z-lab's forward of
    that anchor alone, with the context features of positions < anchor only. The padding rows hold huge values,
    so a block that saw one would be far off."""
    from pydflash.draft_blocks import blocks_hidden

    model = zlab_draft(3)
    block, hidden = model.block_size, model.config.hidden_size
    rng = np.random.default_rng(0)
    lengths, n_feat = [40, 27], 3 * hidden
    feats = torch.full((2, 40, n_feat), 1e4)
    for r, n in enumerate(lengths):
        feats[r, :n] = torch.from_numpy(rng.standard_normal((n, n_feat)).astype(np.float32))
    tokens = torch.from_numpy(rng.integers(0, 299, (2, 40)))
    anchors = torch.tensor([[1, 17, 30, 40 - block], [27 - block, 5, 12, 3]])
    embed = torch.randn(300, hidden)
    head = torch.randn(300, hidden)

    ids = torch.full((2, 4, block), 299)
    ids[:, :, 0] = tokens.gather(1, anchors)
    noise = torch.nn.functional.embedding(ids.reshape(2, -1), embed)
    with torch.no_grad():
        mine = blocks_hidden(model, feats, anchors, noise).reshape(2, 4, block, hidden) @ head.T
        for r in range(2):
            for j in range(4):
                a = int(anchors[r, j])
                pos = torch.arange(a + block)[None]
                ref = model(position_ids=pos, noise_embedding=noise[r: r + 1, j * block: (j + 1) * block],
                            target_hidden=feats[r: r + 1, :a]) @ head.T
                # float32 rounding only: the two forwards sum the same terms in other orders (a longer, masked
                # key axis; batched matmuls). f32 eps is 1.2e-7 and the sums run over <= 200 terms through two
                # layers: 1e-5 of the largest logit leaves room (measured: about 5e-7), while a real mismatch
                # (a visible padding row, a wrong position) is O(1) (a mask off by one position: 0.3).
                scale = float(ref.abs().max())
                assert scale > 1
                err = float((mine[r, j] - ref[0]).abs().max())
                assert err <= 1e-5 * scale, (r, j, a, err, scale)


def test_visibility_mask():
    from pydflash.draft_blocks import block_visibility

    mask = block_visibility(torch.tensor([[2, 4]]), 5, 3)[0, 0]
    assert mask.shape == (6, 5 + 6)
    want = np.zeros((6, 11), bool)
    want[:3, :2] = True            # block 0 (anchor 2): context 0, 1
    want[3:, :4] = True            # block 1 (anchor 4): context 0..3
    want[:3, 5:8] = True           # each block sees its own block
    want[3:, 8:11] = True
    assert (mask.numpy() == want).all()
