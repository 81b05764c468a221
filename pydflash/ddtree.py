"""DDTree: the draft tree of one speculative step, built from the draft's per-position top-K, and its walk.

The draft proposes, for each depth d = 1..D (D = block size - 1), its K best tokens with their log-probs; the
positions are independent, so a prefix (r_1, .., r_d) of ranks scores sum_i logp[i, r_i]. The tree holds the
N most probable prefixes (best first). Everything here is host-side numpy over at most a few dozen
nodes: the verify and commit run on the device from the arrays this module produces.

Slot layout of a verify: slot 0 is the root (the last committed token, not yet run through the target), slots
1..N are the tree nodes in the order they were added (a parent always before its children); `parents[s]` is
the parent slot of slot s (-1 for the root).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Tree:
    tokens: np.ndarray    # i32 [N]: the node tokens, slot s+1 holds tokens[s]
    parents: np.ndarray   # i32 [N+1]: parent slot of each slot; parents[0] = -1 (the root's predecessor is committed)
    depths: np.ndarray    # i32 [N+1]: 0 for the root, 1.. for nodes (position = root position + depth)
    scores: np.ndarray    # f32 [N]: the summed log-prob of each node's prefix
    _kids: list[dict[int, int]] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def n_nodes(self) -> int:
        return int(self.tokens.size)

    def children(self) -> list[dict[int, int]]:
        """Per slot, token -> child slot (tokens of siblings are distinct: they are different ranks). Built on the
        first call (the engine makes it while the verify runs, so the walk after it only looks up)."""
        if self._kids is None:
            kids: list[dict[int, int]] = [{} for _ in range(self.n_nodes + 1)]
            for slot, (parent, token) in enumerate(zip(self.parents[1:].tolist(), self.tokens.tolist()), start=1):
                kids[parent].setdefault(token, slot)
            self._kids = kids
        return self._kids


def build_tree(logp: np.ndarray, ids: np.ndarray, budget: int, *, seed_chain: bool = False) -> Tree:
    """The `budget` most probable prefixes of the per-depth top-K proposals, as a tree.

    logp, ids: [D, K] per depth, ranks sorted by descending log-prob. seed_chain: first take the whole top-1
    chain (up to the budget), then continue best first (a published port found seeding better under Q4
    targets; docs/benchmarks.md measures both).
    Best first: a max-heap of candidate prefixes; popping one makes it a node and pushes its next sibling
    (same depth, rank + 1) and its first child (depth + 1, rank 0). Ties break towards shallower depth, then
    lower rank, then earlier parent, so the result is deterministic.
    """
    logp = np.asarray(logp, dtype=np.float64)
    ids = np.asarray(ids)
    if logp.ndim != 2 or logp.shape != ids.shape:
        raise ValueError(f"logp and ids must both be [depth, K], got {logp.shape} and {ids.shape}")
    n_depth, k = logp.shape
    if budget < 1:
        raise ValueError("budget must be at least 1")
    budget = min(budget, _count_prefixes(n_depth, k, budget))
    # (Python lists and floats from here, the heap operations written out: the tree is built on the host while the
    # device waits for the verify, and numpy scalars or helper calls per candidate double the time; the same float64
    # sums, so the same tree)
    lp, tok = logp.tolist(), ids.tolist()
    tokens, parents, depths = [], [-1], [0]
    score = [0.0]      # per slot, the root's 0 first
    heap: list = []    # (-score, depth, rank, parent slot): a candidate prefix
    push, pop = heapq.heappush, heapq.heappop

    def add(depth, rank, parent_slot, s):
        tokens.append(tok[depth - 1][rank])
        parents.append(parent_slot)
        depths.append(depth)
        score.append(s)
        return len(tokens)

    if seed_chain:
        slot = 0
        for depth in range(1, min(n_depth, budget) + 1):
            if k > 1:                          # the chain node's next sibling stays a candidate
                push(heap, (-(score[slot] + lp[depth - 1][1]), depth, 1, slot))
            slot = add(depth, 0, slot, score[slot] + lp[depth - 1][0])
        if depths[slot] < n_depth:             # and the chain's own continuation past the budget's reach
            push(heap, (-(score[slot] + lp[depths[slot]][0]), depths[slot] + 1, 0, slot))
    else:
        push(heap, (-(0.0 + lp[0][0]), 1, 0, 0))
    while len(tokens) < budget and heap:
        neg, depth, rank, parent = pop(heap)
        slot = add(depth, rank, parent, -neg)
        if depth < n_depth:                    # its first child
            push(heap, (neg - lp[depth][0], depth + 1, 0, slot))
        if rank + 1 < k:                       # its next sibling
            push(heap, (-(score[parent] + lp[depth - 1][rank + 1]), depth, rank + 1, parent))
    return Tree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.asarray(depths, np.int32),
                np.asarray(score[1:], np.float32))


def _count_prefixes(n_depth: int, k: int, cap: int) -> int:
    """How many prefixes exist (K + K^2 + .. + K^D), capped at `cap`."""
    total, level = 0, 1
    for _ in range(n_depth):
        level *= k
        total += level
        if total >= cap:
            return cap
    return total


def chain_tree(ids_top1: np.ndarray, length: int) -> Tree:
    """A plain chain of the top-1 tokens (chain mode): the tree of budget `length` with K = 1."""
    ids_top1 = np.asarray(ids_top1).reshape(-1)[:length]
    n = ids_top1.size
    return Tree(ids_top1.astype(np.int32), np.arange(-1, n, dtype=np.int32), np.arange(n + 1, dtype=np.int32),
                np.zeros(n, np.float32))


def padded(tree: Tree, n_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(slot tokens [n_slots], parents [n_slots], depths [n_slots]) for a verify of n_slots fixed slots.

    Slot 0's token is filled by the caller (the root). Padding slots hang off the committed state (parent -1,
    depth 1): they see the committed tokens and themselves, no slot sees them, and their outputs are ignored."""
    n = tree.n_nodes + 1
    if n > n_slots:
        raise ValueError(f"tree of {tree.n_nodes} nodes does not fit {n_slots} slots")
    tokens = np.zeros(n_slots, np.int32)
    tokens[1:n] = tree.tokens
    parents = np.full(n_slots, -1, np.int32)
    parents[:n] = tree.parents
    depths = np.ones(n_slots, np.int32)
    depths[:n] = tree.depths
    return tokens, parents, depths


def ancestor_mask(parents: np.ndarray) -> np.ndarray:
    """bool [n, n]: row i is True at i and at every ancestor of i (what slot i may attend to in the tree)."""
    n = parents.size
    mask = np.zeros((n, n), dtype=bool)
    for i in range(n):
        p = int(parents[i])
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    return mask


def accept(tree: Tree, argmax: np.ndarray) -> tuple[list[int], list[int]]:
    """The acceptance walk. argmax: the target's token at each slot (at least N+1 of them): its argmax when
    greedy, or when sampling the token drawn from the slot's own filtered distribution (sample-and-match,
    docs/sampling.md: the walk visits each slot at most once, so every committed token is a fresh draw).

    Returns (accepted slots, starting with the root; new tokens): the new tokens are the accepted nodes' tokens
    followed by the target's own token after the last accepted node (the bonus token, always one), so every step
    commits at least one token."""
    kids = tree.children()
    drawn = np.asarray(argmax).tolist()
    slot, path, new = 0, [0], []
    while True:
        nxt = int(drawn[slot])
        new.append(nxt)
        child = kids[slot].get(nxt)
        if child is None:
            return path, new
        path.append(child)
        slot = child
