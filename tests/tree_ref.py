"""float64 numpy references of the tree ops (docs/targets.md) and the random trees the tests run them on.

Arrays are in numpy (C) order, the reverse of ggml's ne: a ggml tensor [S_v, H, n_t, n_s] is an array
[n_s, n_t, H, S_v]. The conv reference builds each node's input stream from its root path, independently of the kernels' walks.
"""
from __future__ import annotations

import numpy as np


# --- trees -------------------------------------------------------------------------------------------------------

def path_to(parent: np.ndarray, t: int) -> list[int]:
    """The nodes from the first one after the committed state down to t (inclusive), in order."""
    path = []
    while t >= 0:
        path.append(t)
        t = int(parent[t])
    return path[::-1]


def chain(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int32) - 1


def star(n: int) -> np.ndarray:
    """Node 0 follows the committed state, every other node is a child of node 0."""
    p = np.zeros(n, dtype=np.int32)
    p[0] = -1
    return p


def forest(n: int) -> np.ndarray:
    """Every node follows the committed state directly."""
    return np.full(n, -1, dtype=np.int32)


def deep(n: int, rng: np.random.Generator) -> np.ndarray:
    """Long branches: each node's parent is one of the three nodes before it, mostly the last one."""
    p = np.empty(n, dtype=np.int32)
    for t in range(n):
        p[t] = t - 1 - min(int(rng.geometric(0.7)) - 1, 2, t)
    return np.maximum(p, -1)


def bushy(n: int, rng: np.random.Generator) -> np.ndarray:
    """Any earlier node (or the committed state) is equally likely as the parent: wide, shallow trees."""
    return np.array([rng.integers(-1, t) if t else -1 for t in range(n)], dtype=np.int32)


def ddtree(n: int, rng: np.random.Generator) -> np.ndarray:
    """Shaped like a DDTree verify: slot 0 is the root (the last committed token), then a best-first tree under it
    whose nodes hang mostly off the recent top-1 chain."""
    p = np.empty(n, dtype=np.int32)
    p[0] = -1
    spine = [0]
    for t in range(1, n):
        if rng.random() < 0.6:
            p[t] = spine[-1]
            spine.append(t)
        else:
            p[t] = spine[int(rng.integers(max(0, len(spine) - 4), len(spine)))]
    return p


def padded(n: int, used: int, rng: np.random.Generator) -> np.ndarray:
    """A bushy tree in the first `used` slots, then unused slots (parent -1) up to n."""
    return np.concatenate([bushy(used, rng), np.full(n - used, -1, dtype=np.int32)])


def make_tree(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "chain":
        return chain(n)
    if kind == "star":
        return star(n)
    if kind == "forest":
        return forest(n)
    if kind == "deep":
        return deep(n, rng)
    if kind == "bushy":
        return bushy(n, rng)
    if kind == "ddtree":
        return ddtree(n, rng)
    if kind == "padded":
        return padded(n, max(1, n // 2), rng)
    raise ValueError(kind)


TREE_KINDS = ["chain", "star", "forest", "deep", "bushy", "ddtree", "padded"]


# --- references ----------------------------------------------------------------------------------------------------

def ssm_conv_tree_ref(sx: np.ndarray, c: np.ndarray, parent: np.ndarray) -> np.ndarray:
    """sx [n_s, d_inner, d_conv-1+n_t], c [d_inner, d_conv], parent [n_s, n_t] -> [n_s, n_t, d_inner].

    Token t sees the stream (state columns, then the inputs of its root path) and convolves its last d_conv."""
    sx = np.asarray(sx, np.float64)
    c = np.asarray(c, np.float64)
    n_s, d_inner, cols = sx.shape
    d_conv = c.shape[1]
    n_t = cols - (d_conv - 1)
    out = np.empty((n_s, n_t, d_inner))
    for s in range(n_s):
        for t in range(n_t):
            stream = list(range(d_conv - 1)) + [d_conv - 1 + u for u in path_to(parent[s], t)]
            window = sx[s][:, stream[-d_conv:]]  # [d_inner, d_conv], oldest first
            out[s, t] = np.sum(window * c, axis=1)
    return out


def gdn_step(S: np.ndarray, q, k, v, g, beta) -> tuple[np.ndarray, np.ndarray]:
    """One gated delta rule step for every head at once, float64. S [H, key, value], q/k/v [H, S_v],
    g [H, 1 or S_v] (log-decay per head or per key dim), beta [H] -> (new S, o [H, S_v])."""
    S = np.exp(g)[:, :, None] * S
    delta = beta[:, None] * (v - np.einsum("hij,hi->hj", S, k))
    S = S + k[:, :, None] * delta[:, None, :]
    return S, np.einsum("hij,hi->hj", S, q) / np.sqrt(q.shape[-1])


def gated_delta_net_tree_ref(q, k, v, g, beta, state, parent, round_states=None) -> tuple[np.ndarray, np.ndarray]:
    """q, k [n_s_qk, n_t, H_k, S], v [n_s, n_t, H, S], g [n_s, n_t, H, 1 or S], beta [n_s, n_t, H, 1],
    state [n_s, H, S(value), S(key)] (ggml [S_v, S_v, H, n_s]), parent [n_s, n_t]
    -> o [n_s, n_t, H, S], node states [n_s, n_t, H, S(value), S(key)] (ggml [S_v*S_v, H, n_t, n_s]).
    Node t steps from the committed state (parent -1) or from its parent's float64 state; q/k head h is h % H_k
    and q/k sequence s is s // (n_s / n_s_qk), as in upstream ggml_gated_delta_net. With `round_states` (a numpy
    dtype, e.g. float16) each node's state is stored rounded to it, as persisted intermediates are, and children
    start from the rounded state."""
    q, k, v, g, beta, state = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, state))
    n_s, n_t, H, S_v = v.shape
    heads_q, heads_k = np.arange(H) % q.shape[2], np.arange(H) % k.shape[2]
    rq, rk = n_s // q.shape[0], n_s // k.shape[0]
    o = np.empty((n_s, n_t, H, S_v))
    states = np.empty((n_s, n_t, H, S_v, S_v))
    for s in range(n_s):
        for t in range(n_t):
            p = int(parent[s, t])
            assert -1 <= p < t, "parents precede their children"
            S = (state[s] if p < 0 else states[s, p]).transpose(0, 2, 1)  # [H, key, value]
            S, o[s, t] = gdn_step(S, q[s // rq, t, heads_q], k[s // rk, t, heads_k], v[s, t], g[s, t],
                                  beta[s, t, :, 0])
            states[s, t] = S.transpose(0, 2, 1)
            if round_states is not None:
                states[s, t] = states[s, t].astype(round_states)
    return o, states


def gdn_inputs(rng: np.random.Generator, S_v: int, H: int, n_t: int, n_s: int, H_k: int | None = None,
               n_s_qk: int | None = None, kda: bool = False) -> dict[str, np.ndarray]:
    """Inputs shaped and scaled like a Qwen3.5 GDN layer: L2-normalised q and k; g = -A_h softplus(x) with a
    per-head rate A_h from 1e-3 to 1, so some heads forget within a few tokens and some keep their state for
    hundreds; beta in (0, 1); a state of order one. float32, numpy order."""
    H_k = H_k or H
    n_s_qk = n_s_qk or n_s
    decay_rate = 10.0 ** rng.uniform(-3, 0, size=(1, 1, H, 1))

    def unit(shape):
        x = rng.standard_normal(shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    return {
        "q": unit((n_s_qk, n_t, H_k, S_v)).astype(np.float32),
        "k": unit((n_s_qk, n_t, H_k, S_v)).astype(np.float32),
        "v": rng.standard_normal((n_s, n_t, H, S_v)).astype(np.float32),
        "g": (-decay_rate * np.log1p(np.exp(rng.standard_normal((n_s, n_t, H, S_v if kda else 1))))).astype(np.float32),
        "beta": (1.0 / (1.0 + np.exp(-rng.standard_normal((n_s, n_t, H, 1))))).astype(np.float32),
        "state": (0.3 * rng.standard_normal((n_s, H, S_v, S_v))).astype(np.float32),
    }
