"""ggml_gated_delta_net_tree(_persist, _steps) and ggml_gated_delta_net_path: against the float64 reference on random
trees, against upstream ggml_gated_delta_net on chains, rollback from persisted node states, f16 intermediates, node
states rebuilt from the deltas, the replay steps (and their chunk form on CUDA), and the wrappers' checks. Runs on
the CPU in CI and on CUDA with `-m cuda`."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_err, run_graph
from pydflash import ggml
from tree_ref import TREE_KINDS, chain, gated_delta_net_tree_ref, gdn_inputs, make_tree, path_to

TOL = 5e-6  # f32 kernels against float64 over a few dozen recurrent steps (CPU: about 1e-7)
NAMES = ("q", "k", "v", "g", "beta", "state", "parent")


def split_tree_output(out: np.ndarray, n_s: int, n_t: int, H: int, S_v: int):
    """The tree op's output [S_v*H, n_t*n_s*(2+S_v)] (numpy: [rows, S_v*H]) -> o, node states."""
    assert out.shape == (n_t * n_s * (2 + S_v), S_v * H)
    o = out[: n_t * n_s].reshape(n_s, n_t, H, S_v)
    states = out[n_t * n_s: n_t * n_s * (1 + S_v)].reshape(n_s, n_t, H, S_v, S_v)
    return o, states


def tree_deltas(out: np.ndarray, n_s: int, n_t: int, H: int, S_v: int) -> np.ndarray:
    """The last part of the tree op's output: every node's delta, [n_s, n_t, H, S_v]."""
    return out[n_t * n_s * (1 + S_v):].reshape(n_s, n_t, H, S_v)


def shape_of(inputs):
    n_s, n_t, H, S_v = inputs["v"].shape
    return n_s, n_t, H, S_v


def skip_unless_supported(backend, out):
    if not backend.supports(out):
        pytest.skip(f"{backend.name} refuses this shape (checked in test_supports)")


def run_tree(backend, inputs):
    def build(ctx, t):
        out = ggml.gated_delta_net_tree(ctx, *(t[n] for n in NAMES))
        skip_unless_supported(backend, out)
        return out
    n_s, n_t, H, S_v = shape_of(inputs)
    return split_tree_output(run_graph(backend, build, inputs), n_s, n_t, H, S_v)


def new_inter(backend, dtype, S_v, H, n_t_max, n_s, fill=np.nan):
    """A persistent inter tensor in a buffer of its own, pre-filled so that unwritten slots show.
    Returns (tensor, buffer): the buffer must outlive the tensor's use."""
    ctx = ggml.Context(n_tensors=1)
    inter = ctx.new_tensor(dtype, (S_v * S_v, H, n_t_max, n_s), name="inter")
    buf = backend.alloc_tensors(ctx)
    inter.set(np.full((n_s, n_t_max, H, S_v * S_v), fill, dtype=dtype))
    return inter, buf


def run_persist(backend, inputs, inter):
    def build(ctx, t):
        out = ggml.gated_delta_net_tree_persist(ctx, *(t[n] for n in NAMES), inter)
        skip_unless_supported(backend, out)
        return out
    return run_graph(backend, build, inputs).reshape(inputs["v"].shape)  # o [n_s, n_t, H, S_v]


def inter_array(inter):
    """inter [S_v*S_v, H, n_t_max, n_s] as numpy [n_s, n_t_max, H, S_v*S_v] (trailing ones kept)."""
    return inter.numpy().reshape(inter.ne[::-1])


def inter_states(inter, n_t):
    """The first n_t node states of inter as [n_s, n_t, H, S_v, S_v]."""
    n_s, _, H, SS = inter_array(inter).shape
    S_v = int(round(SS ** 0.5))
    return inter_array(inter)[:, :n_t].reshape(n_s, n_t, H, S_v, S_v)


def with_parents(inputs, parents):
    return dict(inputs, parent=np.asarray(parents, dtype=np.int32).reshape(inputs["v"].shape[0], -1))


# --- the tree op against the reference ------------------------------------------------------------------------------

@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
@pytest.mark.parametrize("S_v", [32, 64, 128])
@pytest.mark.parametrize("kind", TREE_KINDS)
def test_random_trees(backend, rng, kind, S_v, kda):
    n_t, H, H_k = 12, 4, 2
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, 1, H_k=H_k, kda=kda), make_tree(kind, n_t, rng))
    o, states = run_tree(backend, inputs)
    o_ref, states_ref = gated_delta_net_tree_ref(**inputs)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(states, states_ref) < TOL


@pytest.mark.parametrize("n_s_qk", [1, 3])
@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
def test_several_sequences(backend, rng, kda, n_s_qk):
    """Each sequence has its own tree and state; q/k may be shared by all sequences (n_s_qk = 1)."""
    n_t, H, S_v, n_s = 10, 4, 64, 3
    parents = np.stack([make_tree(kind, n_t, rng) for kind in ("bushy", "deep", "padded")])
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, n_s, H_k=1, n_s_qk=n_s_qk, kda=kda), parents)
    o, states = run_tree(backend, inputs)
    o_ref, states_ref = gated_delta_net_tree_ref(**inputs)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(states, states_ref) < TOL


@pytest.mark.parametrize("kind", ["ddtree", "chain", "bushy"])
def test_27b_layer_shape(backend, rng, kind):
    """The Qwen3.5-27B GDN layer: H_v 48 heads of 128 (q/k 16 heads), a 23-node verify tree."""
    n_t, H, H_k, S_v = 23, 48, 16, 128
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, 1, H_k=H_k), make_tree(kind, n_t, rng))
    o, states = run_tree(backend, inputs)
    o_ref, states_ref = gated_delta_net_tree_ref(**inputs)
    assert rel_err(o, o_ref) < TOL
    assert rel_err(states, states_ref) < TOL


@pytest.mark.parametrize("offset", [4, 8])
def test_unaligned_state(backend, rng, offset):
    """A committed state viewed at an offset that is not a multiple of 16 bytes (CUDA then moves 4 bytes at a
    time instead of 16)."""
    n_t, H, S_v = 9, 4, 64
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, 1), make_tree("bushy", n_t, rng))
    state = inputs.pop("state")
    pad = offset // 4
    inputs["state_buf"] = np.concatenate([np.full(pad, np.nan, np.float32), state.ravel()])

    def build(ctx, t):
        st = ctx.view_4d(t["state_buf"], S_v, S_v, H, 1, 4 * S_v, 4 * S_v * S_v, 4 * S_v * S_v * H, offset)
        out = ggml.gated_delta_net_tree(ctx, *(t[n] for n in NAMES[:5]), st, t["parent"])
        skip_unless_supported(backend, out)
        return out

    o, states = split_tree_output(run_graph(backend, build, inputs), 1, n_t, H, S_v)
    o_ref, states_ref = gated_delta_net_tree_ref(**{n: inputs[n] for n in NAMES[:5]}, state=state,
                                                 parent=inputs["parent"])
    assert rel_err(o, o_ref) < TOL
    assert rel_err(states, states_ref) < TOL


def test_supports(backend):
    """CUDA takes head sizes 64 and 128 and refuses others through supports_op; the CPU takes any."""
    ctx = ggml.Context(n_tensors=64)
    for S_v in (16, 32, 64, 96, 128, 256):
        t = {n: ctx.new_tensor(np.float32, ne) for n, ne in
             dict(q=(S_v, 2, 3, 1), k=(S_v, 2, 3, 1), v=(S_v, 4, 3, 1), g=(1, 4, 3, 1), beta=(1, 4, 3, 1),
                  state=(S_v, S_v, 4, 1)).items()}
        t["parent"] = ctx.new_tensor(np.int32, (3, 1))
        out = ggml.gated_delta_net_tree(ctx, *(t[n] for n in NAMES))
        assert backend.supports(out) == (backend.is_cpu or S_v in (64, 128)), S_v
        for dtype in (np.float32, np.float16):
            inter, _buf = new_inter(backend, dtype, S_v, 4, 3, 1, fill=0)
            out = ggml.gated_delta_net_tree_persist(ctx, *(t[n] for n in NAMES), inter)
            assert backend.supports(out) == (backend.is_cpu or S_v in (64, 128)), (S_v, dtype)


# --- chains against upstream ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
@pytest.mark.parametrize("n_t, n_s, S_v", [(1, 1, 128), (23, 1, 128), (7, 2, 64), (5, 3, 64)])
def test_chain_equals_gated_delta_net(backend, rng, n_t, n_s, S_v, kda):
    """parent[t] = t-1 gives upstream ggml_gated_delta_net's o and final state (K = 1); the persist op's o and
    last node state too."""
    H, H_k = 6, 3
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, n_s, H_k=H_k, kda=kda), np.tile(chain(n_t), (n_s, 1)))
    inter, _buf = new_inter(backend, np.float32, S_v, H, n_t, n_s)

    def build(ctx, t):
        args = [t[n] for n in NAMES]
        return [ggml.gated_delta_net_tree(ctx, *args), ctx.gated_delta_net(*args[:6], 1),
                ggml.gated_delta_net_tree_persist(ctx, *args, inter)]

    tree, upstream, persist_o = run_graph(backend, build, inputs)
    o, states = split_tree_output(tree, n_s, n_t, H, S_v)
    o_up = upstream[: n_t * n_s].reshape(n_s, n_t, H, S_v)
    final_up = upstream[n_t * n_s:].reshape(n_s, H, S_v, S_v)
    assert rel_err(o, o_up) < 1e-6
    assert rel_err(states[:, -1], final_up) < 1e-6
    assert rel_err(persist_o.reshape(o_up.shape), o_up) < 1e-6
    assert rel_err(inter_states(inter, n_t)[:, -1], final_up) < 1e-6


def reloaded_nodes(parents: np.ndarray) -> list[int]:
    """Nodes whose state a later node starts from without directly following them (the tree walk reloads it)."""
    return sorted({int(p) for t, p in enumerate(parents) if p >= 0 and p != t - 1})


@pytest.mark.parametrize("kind", ["ddtree", "bushy", "padded", "chain"])
def test_o_only_gives_the_same_o(backend, rng, kind):
    """ggml_gated_delta_net_tree_o (the caller reads only o): o bit for bit as the full op gives it, and as the
    reference; of the node states, those a later node reloads are written (the walk needs them) and right."""
    n_t, H, H_k, S_v = 23, 4, 2, 128
    parents = make_tree(kind, n_t, rng)
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, 1, H_k=H_k), parents)
    o_full, _ = run_tree(backend, inputs)

    def build(ctx, t):
        out = ggml.gated_delta_net_tree(ctx, *(t[n] for n in NAMES), o_only=True)
        skip_unless_supported(backend, out)
        return out
    o, states = split_tree_output(run_graph(backend, build, inputs), 1, n_t, H, S_v)
    np.testing.assert_array_equal(o, o_full)
    o_ref, states_ref = gated_delta_net_tree_ref(**inputs)
    assert rel_err(o, o_ref) < TOL
    reloaded = reloaded_nodes(parents)
    assert (kind == "chain") == (reloaded == [])
    if reloaded:
        assert rel_err(states[:, reloaded], states_ref[:, reloaded]) < TOL


# --- the deltas, and node states rebuilt from them (ggml_gated_delta_net_path) ----------------------------------------

def deltas_ref(inputs, states_ref) -> np.ndarray:
    """Every node's delta beta (v - (exp(g) S)^T k), S its parent's float64 reference state: [n_s, n_t, H, S_v]."""
    k, v, g, beta, state, parent = (inputs[n] for n in ("k", "v", "g", "beta", "state", "parent"))
    n_s, n_t, H, S_v = v.shape
    heads_k, rk = np.arange(H) % k.shape[2], n_s // k.shape[0]
    out = np.empty((n_s, n_t, H, S_v))
    for s in range(n_s):
        for t in range(n_t):
            p = int(parent[s, t])
            S = np.asarray(state[s] if p < 0 else states_ref[s, p], np.float64).transpose(0, 2, 1)   # [H, key, value]
            S = np.exp(g[s, t].astype(np.float64))[:, :, None] * S
            kt = k[s // rk, t, heads_k].astype(np.float64)
            out[s, t] = beta[s, t, :, :1] * (v[s, t] - np.einsum("hij,hi->hj", S, kt))
    return out


@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
@pytest.mark.parametrize("kind", ["ddtree", "bushy"])
def test_deltas(backend, rng, kind, kda):
    """The tree op's last part is every node's delta (against float64), the same bits with o_only."""
    n_t, H, H_k, S_v, n_s = 23, 4, 2, 128, 2
    parents = np.stack([make_tree(kind, n_t, rng) for _ in range(n_s)])
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, n_s, H_k=H_k, kda=kda), parents)

    def build(ctx, t):
        args = [t[n] for n in NAMES]
        outs = [ggml.gated_delta_net_tree(ctx, *args), ggml.gated_delta_net_tree(ctx, *args, o_only=True)]
        skip_unless_supported(backend, outs[0])
        return outs
    full, o_only = run_graph(backend, build, inputs)
    _, states_ref = gated_delta_net_tree_ref(**inputs)
    deltas = tree_deltas(full, n_s, n_t, H, S_v)
    assert rel_err(deltas, deltas_ref(inputs, states_ref)) < TOL
    np.testing.assert_array_equal(tree_deltas(o_only, n_s, n_t, H, S_v), deltas)


def path_inputs(inputs, deltas, paths, n_steps):
    """ggml_gated_delta_net_path's inputs for one path per sequence (numpy order), each padded to n_steps with
    steps of zero keys, log-decays and deltas."""
    k, g = inputs["k"], inputs["g"]
    n_s, _, H, S_v = inputs["v"].shape
    rk = n_s // k.shape[0]
    out = {"state": inputs["state"],
           "k": np.zeros((n_s, n_steps, k.shape[2], S_v), np.float32),
           "g": np.zeros((n_s, n_steps, H, g.shape[3]), np.float32),
           "delta": np.zeros((n_s, n_steps, H, S_v), np.float32)}
    for s, path in enumerate(paths):
        out["k"][s, :len(path)] = k[s // rk, path]
        out["g"][s, :len(path)] = g[s, path]
        out["delta"][s, :len(path)] = deltas[s, path]
    return out


def run_path(backend, inputs):
    def build(ctx, t):
        out = ggml.gated_delta_net_path(ctx, t["state"], t["k"], t["g"], t["delta"])
        skip_unless_supported(backend, out)
        return out
    n_s, H, S_v, _ = inputs["state"].shape
    return run_graph(backend, build, inputs).reshape(n_s, H, S_v, S_v)


@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
@pytest.mark.parametrize("S_v", [64, 128])
@pytest.mark.parametrize("kind", ["ddtree", "bushy", "chain"])
def test_path_rebuilds_node_states_bit_for_bit(backend, rng, kind, S_v, kda):
    """The state after any node, rebuilt by ggml_gated_delta_net_path from the committed state and its root path's
    keys, log-decays and deltas (padded with zero steps to the longest path), is the tree op's stored state bit for
    bit: what a speculative commit relies on to skip storing the node states."""
    n_t, H, H_k, n_s = 23, 6, 3, 2
    parents = np.stack([make_tree(kind, n_t, rng) for _ in range(n_s)])
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, n_s, H_k=H_k, n_s_qk=1, kda=kda), parents)

    def build(ctx, t):
        out = ggml.gated_delta_net_tree(ctx, *(t[n] for n in NAMES), o_only=True)
        skip_unless_supported(backend, out)
        return out
    deltas = tree_deltas(run_graph(backend, build, inputs), n_s, n_t, H, S_v)   # as a replay verify has them
    _, states = run_tree(backend, inputs)                                            # every node's, stored
    for nodes in ([n_t - 1, n_t // 2], [0, 3], [7, n_t - 2]):
        paths = [path_to(parents[s], r) for s, r in enumerate(nodes)]
        n_steps = max(len(p) for p in paths) + 1   # at least one padding step for every sequence
        got = run_path(backend, path_inputs(inputs, deltas, paths, n_steps))
        for s, r in enumerate(nodes):
            np.testing.assert_array_equal(got[s], states[s, r])


@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
def test_path_against_float64(backend, rng, kda):
    """Each step S <- exp(g) S; S += k delta^T, against float64; a step of zero log-decay and delta changes no bit."""
    S_v, H, H_k, L, n_s = 64, 4, 2, 6, 2
    inputs = {"state": (0.3 * rng.standard_normal((n_s, H, S_v, S_v))).astype(np.float32),
              "k": rng.standard_normal((1, L, H_k, S_v)).astype(np.float32),
              "g": (-np.abs(rng.standard_normal((n_s, L, H, S_v if kda else 1))) * 0.1).astype(np.float32),
              "delta": rng.standard_normal((n_s, L, H, S_v)).astype(np.float32)}
    got = run_path(backend, inputs)
    ref = inputs["state"].astype(np.float64).transpose(0, 1, 3, 2)          # [n_s, H, key, value]
    for l in range(L):
        k = inputs["k"][0, l, np.arange(H) % H_k].astype(np.float64)           # [H, key]
        ref = np.exp(inputs["g"][:, l].astype(np.float64))[..., None] * ref
        ref = ref + k[None, :, :, None] * inputs["delta"][:, l, :, None, :]
    assert rel_err(got, ref.transpose(0, 1, 3, 2)) < 1e-6
    padded = {n: np.concatenate([a[:, :3], np.zeros_like(a[:, :1]), a[:, 3:]], axis=1) if n != "state" else a
              for n, a in inputs.items()}
    np.testing.assert_array_equal(run_path(backend, padded), got)


@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
def test_path_picks_its_steps(backend, rng, kda):
    """ggml_gated_delta_net_path_steps: step l is candidate steps[l] of k, g and delta (views with a row stride, as
    in a replay store); indices outside the candidates are steps that change nothing. Bit for bit the plain path
    op over the picked steps, each sequence its own picks."""
    S_v, H, H_k, n_cand, n_s = 64, 4, 2, 7, 2
    cand = {"state": (0.3 * rng.standard_normal((n_s, H, S_v, S_v))).astype(np.float32),
            "k": rng.standard_normal((1, n_cand, H_k, S_v)).astype(np.float32),
            "g": (-np.abs(rng.standard_normal((n_s, n_cand, H, S_v if kda else 1))) * 0.1).astype(np.float32),
            "delta": rng.standard_normal((n_s, n_cand, H, S_v)).astype(np.float32)}
    picks = np.array([[5, 0, 3, -1, 6], [2, n_cand, 2, 4, 1]], np.int32)   # [n_s, L]

    def build(ctx, t):
        out = ggml.gated_delta_net_path(ctx, t["state"], t["k"], t["g"], t["delta"], steps=t["picks"])
        skip_unless_supported(backend, out)
        return out
    got = run_graph(backend, build, dict(cand, picks=picks)).reshape(n_s, H, S_v, S_v)
    for s in range(n_s):
        kept = [int(i) for i in picks[s] if 0 <= i < n_cand]
        one = {"state": cand["state"][s:s + 1], "k": cand["k"][:, kept], "g": cand["g"][s:s + 1, kept],
               "delta": cand["delta"][s:s + 1, kept]}
        np.testing.assert_array_equal(got[s], run_path(backend, one)[0])


# --- the replay-steps op (ggml_gated_delta_net_tree_steps) ------------------------------------------------------------

def new_steps(backend, width, n_cols):
    """A persistent steps tensor [width, n_cols] pre-filled with NaN (unwritten columns show). Returns (tensor,
    buffer): the buffer must outlive the tensor's use."""
    ctx = ggml.Context(n_tensors=1)
    steps = ctx.new_tensor(np.float32, (width, n_cols), name="steps")
    buf = backend.alloc_tensors(ctx)
    steps.set(np.full((n_cols, width), np.nan, np.float32))
    return steps, buf


def run_steps(backend, inputs, exact):
    """The steps op over `inputs` (one sequence) into a fresh steps tensor with one spare column: (o [n_t, H, S_v],
    steps [n_t + 1, width] as numpy)."""
    _, n_t, H, S_v = shape_of(inputs)
    width = S_v * inputs["k"].shape[2] + S_v * H + inputs["g"].shape[3] * H
    steps, buf = new_steps(backend, width, n_t + 1)

    def build(ctx, t):
        out = ggml.gated_delta_net_tree_steps(ctx, *(t[n] for n in NAMES), steps, exact=exact)
        skip_unless_supported(backend, out)
        return out
    out = run_graph(backend, build, inputs)
    assert out.shape == (n_t * (1 + S_v), S_v * H)
    got = steps.numpy().reshape(n_t + 1, width)
    del buf
    return out[:n_t].reshape(n_t, H, S_v), got


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "any_order"])
@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
@pytest.mark.parametrize("S_v, n_t", [(128, 23), (64, 32), (128, 40)])
@pytest.mark.parametrize("kind", ["ddtree", "bushy", "padded", "chain"])
def test_steps_op(backend, rng, kind, S_v, n_t, kda, exact):
    """ggml_gated_delta_net_tree_steps writes each node's key, delta and log-decay into its column of `steps` (the
    spare column untouched) and returns o. Exact, and always on the CPU, o and the deltas are the tree walk's bits.
    Otherwise, on CUDA with a scalar decay and at most 32 nodes, they come from the chunk form: not the walk's
    bits, but the float64 reference's within the kernels' tolerance, and a state rebuilt from those steps by
    ggml_gated_delta_net_path is the reference's state after that node."""
    H, H_k = 4, 2
    parents = make_tree(kind, n_t, rng)
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, 1, H_k=H_k, kda=kda), parents)
    o, steps = run_steps(backend, inputs, exact)
    key_dim, value_dim = S_v * H_k, S_v * H

    assert np.isnan(steps[n_t]).all()
    np.testing.assert_array_equal(steps[:n_t, :key_dim].reshape(n_t, H_k, S_v), inputs["k"][0])
    np.testing.assert_array_equal(steps[:n_t, key_dim + value_dim:].reshape(inputs["g"][0].shape), inputs["g"][0])
    deltas = steps[:n_t, key_dim:key_dim + value_dim].reshape(n_t, H, S_v)

    def build(ctx, t):
        return ggml.gated_delta_net_tree(ctx, *(t[n] for n in NAMES), o_only=True)
    walked = run_graph(backend, build, inputs)
    chunk_form = backend.name.lower().startswith("cuda") and not exact and not kda and n_t <= 32
    if not chunk_form:
        np.testing.assert_array_equal(o, walked[:n_t].reshape(n_t, H, S_v))
        np.testing.assert_array_equal(deltas, tree_deltas(walked, 1, n_t, H, S_v)[0])
        return
    assert not np.array_equal(o, walked[:n_t].reshape(n_t, H, S_v))   # (the chunk form ran, not the walk)
    o_ref, states_ref = gated_delta_net_tree_ref(**inputs)
    assert rel_err(o, o_ref[0]) < TOL
    assert rel_err(deltas, deltas_ref(inputs, states_ref)[0]) < TOL
    for r in (n_t - 1, n_t // 2, 3):
        path = path_to(parents, r)
        rebuilt = run_path(backend, path_inputs(inputs, deltas[None], [path], len(path)))
        assert rel_err(rebuilt[0], states_ref[0, r]) < TOL


# --- the persist op ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kda", [False, True], ids=["scalar_g", "kda"])
@pytest.mark.parametrize("S_v", [64, 128])
def test_persist_f32_equals_tree(backend, rng, S_v, kda):
    """With f32 intermediates the persist op computes exactly what the tree op does; slots past n_t are left
    alone."""
    n_t, n_t_max, H, n_s = 9, 12, 4, 2
    parents = np.stack([make_tree("bushy", n_t, rng), make_tree("ddtree", n_t, rng)])
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, n_s, kda=kda), parents)
    o_tree, states_tree = run_tree(backend, inputs)
    inter, _buf = new_inter(backend, np.float32, S_v, H, n_t_max, n_s)
    o = run_persist(backend, inputs, inter)
    assert o.shape == (n_s, n_t, H, S_v)
    np.testing.assert_array_equal(o, o_tree)
    np.testing.assert_array_equal(inter_states(inter, n_t), states_tree)
    assert np.isnan(inter_array(inter)[:, n_t:]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_persist_into_view_of_cache(backend, rng, dtype):
    """inter may be a view of a larger persistent tensor (here: one layer of a three-layer cache); the other
    layers are left alone."""
    n_t, H, S_v, n_layers = 7, 4, 64, 3
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, 1), make_tree("ddtree", n_t, rng))
    cache, _buf = new_inter(backend, dtype, S_v, H, n_t, n_layers)  # [S_v*S_v, H, n_t, layer]

    def build(ctx, t):
        inter = ctx.view_4d(cache, S_v * S_v, H, n_t, 1, cache.nb[1], cache.nb[2], cache.nb[3], cache.nb[3])
        out = ggml.gated_delta_net_tree_persist(ctx, *(t[n] for n in NAMES), inter)
        skip_unless_supported(backend, out)
        return out

    o = run_graph(backend, build, inputs).reshape(inputs["v"].shape)
    o_tree, states_tree = run_tree(backend, inputs)
    layers = inter_array(cache)
    if dtype == np.float32:
        np.testing.assert_array_equal(o, o_tree)
        np.testing.assert_array_equal(layers[1].reshape(states_tree.shape), states_tree)
    else:
        assert rel_err(o, o_tree) < 1e-3
        assert rel_err(layers[1].reshape(states_tree.shape), states_tree) < 1e-3
    assert np.isnan(layers[[0, 2]]).all()


def test_persist_f16_reads_rounded_parents(backend, rng):
    """With f16 intermediates each node stores its state rounded to f16 and children start from that."""
    n_t, H, S_v, n_s = 11, 4, 128, 2
    parents = np.stack([make_tree("deep", n_t, rng), make_tree("bushy", n_t, rng)])
    inputs = with_parents(gdn_inputs(rng, S_v, H, n_t, n_s), parents)
    inter, _buf = new_inter(backend, np.float16, S_v, H, n_t, n_s)
    o = run_persist(backend, inputs, inter)
    o_ref, states_ref = gated_delta_net_tree_ref(**inputs, round_states=np.float16)
    # where the f32 and float64 states straddle an f16 rounding boundary the stored values differ by one f16 step,
    # and the children inherit it
    assert rel_err(o, o_ref) < 1e-4
    assert rel_err(inter_states(inter, n_t), states_ref) < 1e-4


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("kind", ["ddtree", "bushy", "chain"])
def test_rollback_to_any_node(backend, rng, kind, dtype):
    """After a tree step with persist, making node r's state current (a device copy out of inter) and running
    more tokens gives what running r's root path plus those tokens as a chain from the start gives."""
    n_t, n_more, H, S_v = 10, 4, 4, 128
    parents = make_tree(kind, n_t, rng)
    step = with_parents(gdn_inputs(rng, S_v, H, n_t, 1, H_k=2), parents)
    more = gdn_inputs(rng, S_v, H, n_more, 1, H_k=2)

    cache_ctx = ggml.Context(n_tensors=2)
    inter = cache_ctx.new_tensor(dtype, (S_v * S_v, H, n_t, 1), name="inter")
    committed = cache_ctx.new_tensor(np.float32, (S_v, S_v, H, 1), name="committed")
    cache_buf = backend.alloc_tensors(cache_ctx)
    committed.set(step["state"])

    run_persist(backend, step, inter)
    for r in range(n_t):
        # rollback: committed <- inter[:, :, r, 0], converted to f32, in a graph of its own
        def restore(ctx, _t, r=r):
            node = ctx.view_1d(inter, S_v * S_v * H, r * inter.nb[2])
            return ctx.cpy(node, ctx.reshape_1d(committed, S_v * S_v * H))
        run_graph(backend, restore, {})
        cont_in = dict(more, state=committed.numpy().reshape(1, H, S_v, S_v), parent=chain(n_more)[None])
        o_cont, states_cont = run_tree(backend, cont_in)

        path = path_to(parents, r)
        chain_in = {n: np.concatenate([step[n][:, path], more[n]], axis=1) for n in ("q", "k", "v", "g", "beta")}
        chain_in.update(state=step["state"], parent=chain(len(path) + n_more)[None])
        if dtype == np.float16:
            # the path's states were rounded to f16 where they were stored (the continuation ran in f32): the
            # reference does the same
            path_in = dict({n: a[:, : len(path)] for n, a in chain_in.items()}, state=step["state"])
            _, path_states = gated_delta_net_tree_ref(**path_in, round_states=np.float16)
            cont_ref = dict(cont_in, state=path_states[:, -1].astype(np.float32))
            o_ref, states_ref = gated_delta_net_tree_ref(**cont_ref)
            assert rel_err(o_cont, o_ref) < 1e-4
            assert rel_err(states_cont, states_ref) < 1e-4
        else:
            o_chain, states_chain = run_tree(backend, chain_in)
            assert rel_err(o_cont, o_chain[:, len(path):]) < 1e-6
            assert rel_err(states_cont, states_chain[:, len(path):]) < 1e-6
    del cache_buf


def f16_drift(backend, rng, checkpoints=(1, 8, 64), S_v=128, H=4, H_k=2, n_t=12) -> dict[int, tuple[float, float]]:
    """Run consecutive verify steps (a tree step with persist, then commit the deepest node's state) with f32 and
    with f16 intermediates on the same inputs. After each number of rollbacks in `checkpoints`, the relative error
    against f32 of the f16 committed state and of that step's o. Also used by bench/tree_ops.py --drift."""
    cache_ctx = ggml.Context(n_tensors=2)
    inters = {dt: cache_ctx.new_tensor(dt, (S_v * S_v, H, n_t, 1)) for dt in (np.float32, np.float16)}
    cache_buf = backend.alloc_tensors(cache_ctx)
    start = gdn_inputs(rng, S_v, H, 1, 1)["state"]
    committed = {dt: start for dt in inters}
    errs = {}
    for n in range(1, max(checkpoints) + 1):
        parents = make_tree("ddtree", n_t, rng)
        step = with_parents(gdn_inputs(rng, S_v, H, n_t, 1, H_k=H_k), parents)
        r = max(range(n_t), key=lambda t: len(path_to(parents, t)))  # the deepest node is accepted
        o = {}
        for dt, inter in inters.items():
            o[dt] = run_persist(backend, dict(step, state=committed[dt]), inter)
            committed[dt] = inter_array(inter)[:, r].reshape(1, H, S_v, S_v).astype(np.float32)
        if n in checkpoints:
            errs[n] = (rel_err(committed[np.float16], committed[np.float32]), rel_err(o[np.float16], o[np.float32]))
    del cache_buf
    return errs


def test_f16_drift_stays_bounded(backend, rng):
    """f16 intermediates: error against f32 after 1, 8 and 64 rollbacks (bench/tree_ops.py --drift measures the
    27B shape for docs/benchmarks.md). It stays near f16's resolution (2^-11) instead of compounding."""
    errs = f16_drift(backend, rng, H=8)
    for n, (state_err, o_err) in errs.items():
        print(f"f16 drift after {n} rollbacks: state {state_err:.2e}, o {o_err:.2e}")
        assert 0 < state_err < 2e-3 and o_err < 2e-3, (n, state_err, o_err)


# --- the wrappers' checks (no compute) --------------------------------------------------------------------------------

def test_wrappers_reject_bad_inputs(backend):
    ctx = ggml.Context(n_tensors=64)
    S_v, H, n_t, n_s = 64, 4, 5, 2
    shapes = dict(q=(S_v, 2, n_t, n_s), k=(S_v, 2, n_t, n_s), v=(S_v, H, n_t, n_s), g=(1, H, n_t, n_s),
                  beta=(1, H, n_t, n_s), state=(S_v, S_v, H, n_s))
    good = {n: ctx.new_tensor(np.float32, ne) for n, ne in shapes.items()}
    good["parent"] = ctx.new_tensor(np.int32, (n_t, n_s))
    ggml.gated_delta_net_tree(ctx, *(good[n] for n in NAMES))

    def bad(name, tensor, exc, match):
        args = dict(good, **{name: tensor})
        with pytest.raises(exc, match=match):
            ggml.gated_delta_net_tree(ctx, *(args[n] for n in NAMES))

    bad("q", ctx.new_tensor(np.float32, (S_v, 3, n_t, n_s)), ValueError, "H_k dividing")
    bad("k", ctx.new_tensor(np.float32, (S_v + 1, 2, n_t, n_s)), ValueError, "k must be")
    bad("q", ctx.new_tensor(np.float16, (S_v, 2, n_t, n_s)), TypeError, "q must be F32")
    bad("v", ctx.new_tensor(np.float32, (S_v, H, n_t + 1, n_s)), ValueError, "must be")
    bad("g", ctx.new_tensor(np.float32, (2, H, n_t, n_s)), ValueError, "g must be")
    bad("g", ctx.new_tensor(np.float32, (S_v, H, n_t, 1)), ValueError, "g must have")
    bad("beta", ctx.new_tensor(np.float32, (S_v, H, n_t, n_s)), ValueError, "beta")
    bad("state", ctx.new_tensor(np.float32, (S_v, S_v, H, 1)), ValueError, "state")
    bad("state", ctx.new_tensor(np.float16, (S_v, S_v, H, n_s)), TypeError, "state")
    bad("parent", ctx.new_tensor(np.int32, (n_t, 1)), ValueError, "parent")
    bad("parent", ctx.new_tensor(np.float32, (n_t, n_s)), TypeError, "parent")
    bad("v", ctx.permute(ctx.new_tensor(np.float32, (H, S_v, n_t, n_s)), 1, 0, 2, 3), ValueError, "contiguous rows")

    args = [good[n] for n in NAMES]
    with pytest.raises(ValueError, match="allocated in a persistent buffer"):
        ggml.gated_delta_net_tree_persist(ctx, *args, ctx.new_tensor(np.float32, (S_v * S_v, H, n_t, n_s)))
    for ne, dtype, exc, match in [((S_v * S_v, H, n_t - 1, n_s), np.float32, ValueError, "n_t=5"),
                                  ((S_v * S_v, H, n_t, 1), np.float32, ValueError, "inter must have"),
                                  ((S_v, S_v * H, n_t, n_s), np.float32, ValueError, "inter must have"),
                                  ((S_v * S_v, H, n_t, n_s), np.int32, TypeError, "F32 or F16")]:
        cache = ggml.Context(n_tensors=1)
        inter = cache.new_tensor(dtype, ne)
        buf = backend.alloc_tensors(cache)
        with pytest.raises(exc, match=match):
            ggml.gated_delta_net_tree_persist(ctx, *args, inter)
        del buf

    one = dict(good, **{n: ctx.new_tensor(np.float32, ne[:3] + (1,)) for n, ne in shapes.items()})
    one["parent"] = ctx.new_tensor(np.int32, (n_t, 1))
    width = S_v * 2 + S_v * H + H
    with pytest.raises(ValueError, match="allocated in a persistent buffer"):
        ggml.gated_delta_net_tree_steps(ctx, *(one[n] for n in NAMES), ctx.new_tensor(np.float32, (width, n_t)),
                                        exact=True)
    for args, ne, match in [(good, (width, n_t), "one sequence, got n_s=2"),
                            (one, (width + 1, n_t), "steps must have ne"),
                            (one, (width, n_t - 1), "steps holds 4 columns, the tree has n_t=5")]:
        cache = ggml.Context(n_tensors=1)
        steps = cache.new_tensor(np.float32, ne)
        buf = backend.alloc_tensors(cache)
        with pytest.raises(ValueError, match=match):
            ggml.gated_delta_net_tree_steps(ctx, *(args[n] for n in NAMES), steps, exact=False)
        del buf

    L = 3
    path = dict(state=good["state"], k=ctx.new_tensor(np.float32, (S_v, 2, L, 1)),
                g=ctx.new_tensor(np.float32, (1, H, L, n_s)), delta=ctx.new_tensor(np.float32, (S_v, H, L, n_s)))
    ggml.gated_delta_net_path(ctx, **path)
    for name, ne, dtype, exc, match in [("k", (S_v, 3, L, 1), np.float32, ValueError, "H_k dividing"),
                                        ("k", (S_v, 2, L + 1, 1), np.float32, ValueError, "path k"),
                                        ("g", (2, H, L, n_s), np.float32, ValueError, "path g"),
                                        ("delta", (S_v, H, L, 1), np.float32, ValueError, "path delta"),
                                        ("delta", (S_v, H, L, n_s), np.float16, TypeError, "path delta"),
                                        ("state", (S_v, S_v, H + 1, n_s), np.float32, ValueError, "path delta")]:
        with pytest.raises(exc, match=match):
            ggml.gated_delta_net_path(ctx, **dict(path, **{name: ctx.new_tensor(dtype, ne)}))
    ggml.gated_delta_net_path(ctx, **path, steps=ctx.new_tensor(np.int32, (4, n_s)))
    for ne, dtype, exc, match in [((4, 1), np.int32, ValueError, "path steps must have"),
                                  ((4, n_s), np.float32, TypeError, "path steps must be I32")]:
        with pytest.raises(exc, match=match):
            ggml.gated_delta_net_path(ctx, **path, steps=ctx.new_tensor(dtype, ne))
