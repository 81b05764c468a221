"""DDTree building and walking against brute force on tiny vocabularies."""
import itertools

import numpy as np
import pytest

from pydflash import ddtree


def _topk(rng, n_depth, vocab, k):
    logits = rng.standard_normal((n_depth, vocab)) * 2.0
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    ids = np.argsort(-logp, axis=1)[:, :k]
    return np.take_along_axis(logp, ids, 1), ids


def _all_prefixes(logp):
    n_depth, k = logp.shape
    out = {}
    for d in range(1, n_depth + 1):
        for ranks in itertools.product(range(k), repeat=d):
            out[ranks] = sum(logp[i, r] for i, r in enumerate(ranks))
    return out


def _tree_prefixes(tree, ids):
    """The rank tuple of every node, recovered from tokens and parents."""
    out = []
    for slot in range(1, tree.n_nodes + 1):
        ranks, s = [], slot
        while s > 0:
            d = tree.depths[s]
            ranks.append(int(np.flatnonzero(ids[d - 1] == tree.tokens[s - 1])[0]))
            s = tree.parents[s]
        out.append(tuple(reversed(ranks)))
    return out


@pytest.mark.parametrize("n_depth,vocab,k,budget", [(3, 5, 3, 7), (4, 6, 4, 22), (5, 4, 2, 15), (6, 8, 5, 40),
                                                    (2, 3, 3, 12), (4, 5, 1, 8)])
def test_best_first_equals_brute_force(n_depth, vocab, k, budget):
    rng = np.random.default_rng(n_depth * 100 + budget)
    for _ in range(5):
        logp, ids = _topk(rng, n_depth, vocab, k)
        tree = ddtree.build_tree(logp, ids, budget)
        every = _all_prefixes(logp)
        want = sorted(every, key=lambda r: -every[r])[:budget]
        got = _tree_prefixes(tree, ids)
        assert sorted(got) == sorted(want)
        # parents before children, depths consistent, scores are the prefix sums
        assert all(tree.parents[s] < s for s in range(1, tree.n_nodes + 1))
        assert all(tree.depths[s] == tree.depths[tree.parents[s]] + 1 for s in range(1, tree.n_nodes + 1))
        np.testing.assert_allclose(tree.scores, [every[r] for r in got], rtol=1e-5)


@pytest.mark.parametrize("n_depth,vocab,k,budget", [(3, 5, 3, 7), (4, 6, 4, 22), (6, 8, 5, 40), (5, 4, 3, 3)])
def test_seeded_chain_then_best_first(n_depth, vocab, k, budget):
    rng = np.random.default_rng(budget)
    for _ in range(5):
        logp, ids = _topk(rng, n_depth, vocab, k)
        tree = ddtree.build_tree(logp, ids, budget, seed_chain=True)
        every = _all_prefixes(logp)
        chain = [(0,) * d for d in range(1, min(n_depth, budget) + 1)]
        rest = sorted((r for r in every if r not in chain), key=lambda r: -every[r])[:budget - len(chain)]
        got = _tree_prefixes(tree, ids)
        assert got[:len(chain)] == chain          # the chain comes first, in slots 1..L
        assert sorted(got) == sorted(chain + rest)
        assert all(tree.parents[s] < s for s in range(1, tree.n_nodes + 1))


def test_budget_larger_than_all_prefixes():
    rng = np.random.default_rng(1)
    logp, ids = _topk(rng, 2, 4, 2)
    tree = ddtree.build_tree(logp, ids, 40)
    assert tree.n_nodes == 2 + 4


def test_chain_mode_is_k1_tree():
    rng = np.random.default_rng(2)
    logp, ids = _topk(rng, 6, 9, 1)
    a = ddtree.build_tree(logp, ids, 4)
    b = ddtree.chain_tree(ids[:, 0], 4)
    assert a.tokens.tolist() == b.tokens.tolist() and a.parents.tolist() == b.parents.tolist()
    assert b.parents.tolist() == [-1, 0, 1, 2, 3] and b.depths.tolist() == [0, 1, 2, 3, 4]


def test_ancestor_mask_and_padding():
    tree = ddtree.Tree(np.array([5, 6, 7, 8], np.int32), np.array([-1, 0, 0, 1, 3], np.int32),
                       np.array([0, 1, 1, 2, 3], np.int32), np.zeros(4, np.float32))
    tokens, parents, depths = ddtree.padded(tree, 7)
    assert tokens.tolist() == [0, 5, 6, 7, 8, 0, 0]
    assert parents.tolist() == [-1, 0, 0, 1, 3, -1, -1] and depths.tolist() == [0, 1, 1, 2, 3, 1, 1]
    m = ddtree.ancestor_mask(parents)
    assert np.flatnonzero(m[4]).tolist() == [0, 1, 3, 4]
    assert np.flatnonzero(m[2]).tolist() == [0, 2]
    assert np.flatnonzero(m[5]).tolist() == [5] and np.flatnonzero(m[6]).tolist() == [6]
    with pytest.raises(ValueError):
        ddtree.padded(tree, 4)


def test_accept_walk():
    # root -> a(5) -> c(7) -> d(8); root -> b(6)
    tree = ddtree.Tree(np.array([5, 6, 7, 8], np.int32), np.array([-1, 0, 0, 1, 3], np.int32),
                       np.array([0, 1, 1, 2, 3], np.int32), np.zeros(4, np.float32))
    # target says 6 after root, then 9 after b: accept b, bonus 9
    assert ddtree.accept(tree, np.array([6, 0, 9, 0, 0])) == ([0, 2], [6, 9])
    # full path a, c, d then bonus 3
    assert ddtree.accept(tree, np.array([5, 7, 0, 8, 3])) == ([0, 1, 3, 4], [5, 7, 8, 3])
    # nothing accepted: still one token
    assert ddtree.accept(tree, np.array([2, 0, 0, 0, 0])) == ([0], [2])
