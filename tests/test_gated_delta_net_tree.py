"""ggml_gated_delta_net_tree and ggml_gated_delta_net_tree_persist: against the float64 reference on random trees,
against upstream ggml_gated_delta_net on chains, rollback from persisted node states, f16 intermediates, and the
wrappers' checks. Runs on the CPU in CI and on CUDA with `-m cuda`."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_err, run_graph
from pydflash import ggml
from tree_ref import TREE_KINDS, chain, gated_delta_net_tree_ref, gdn_inputs, make_tree, path_to

TOL = 5e-6  # f32 kernels against float64 over a few dozen recurrent steps (CPU: about 1e-7)
NAMES = ("q", "k", "v", "g", "beta", "state", "parent")


def split_tree_output(out: np.ndarray, n_s: int, n_t: int, H: int, S_v: int):
    """The tree op's output [S_v*H, n_t*n_s*(1+S_v)] (numpy: [rows, S_v*H]) -> o, node states."""
    o = out[: n_t * n_s].reshape(n_s, n_t, H, S_v)
    states = out[n_t * n_s:].reshape(n_s, n_t, H, S_v, S_v)
    return o, states


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
