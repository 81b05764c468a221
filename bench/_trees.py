"""The random tree the bench scripts verify: a best-first DDTree over random draft log-probs, as ddtree.padded
lays it out."""
from __future__ import annotations

import numpy as np


def random_tree(n: int, rng: np.random.Generator, root: int, top_k: int = 8):
    """(tokens, parents, depths) of an n-node tree plus the root (token `root`), built by ddtree.build_tree from
    15 positions of random log-probs over 64 ids (their top_k each; ids offset by 100). One rng draw."""
    from pydflash import ddtree
    logits = rng.standard_normal((15, 64)) * 3
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ids = np.argsort(-logp, 1)[:, :top_k]
    tree = ddtree.build_tree(np.take_along_axis(logp, ids, 1), ids + 100, n)
    tokens, parents, depths = ddtree.padded(tree, n + 1)
    tokens[0] = root
    return tokens, parents, depths
