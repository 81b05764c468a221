"""ggml_ssm_conv_tree against its float64 reference, against upstream ggml_ssm_conv on chains, and its wrapper's
checks. Runs on the CPU in CI and on CUDA with `-m cuda`."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import rel_err, run_graph
from pydflash import ggml
from tree_ref import TREE_KINDS, chain, make_tree, ssm_conv_tree_ref

TOL = 1e-6  # f32 sums of d_conv products against float64


def conv_inputs(rng, d_conv, d_inner, n_t, n_s, parents):
    return {
        "sx": rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(np.float32),
        "c": rng.standard_normal((d_inner, d_conv)).astype(np.float32),
        "parent": np.asarray(parents, dtype=np.int32).reshape(n_s, n_t),
    }


def run_tree(backend, inputs):
    """Compute the op; on a backend that refuses the shape, check that it says so and skip."""
    def build(ctx, t):
        out = ggml.ssm_conv_tree(ctx, t["sx"], t["c"], t["parent"])
        if not backend.supports(out):
            pytest.skip(f"{backend.name} refuses d_conv={inputs['c'].shape[1]} (checked in test_supports)")
        return out
    n_s, d_inner, cols = inputs["sx"].shape
    return run_graph(backend, build, inputs).reshape(n_s, cols - inputs["c"].shape[1] + 1, d_inner)


@pytest.mark.parametrize("kind", TREE_KINDS)
def test_random_trees(backend, rng, kind):
    n_t, d_inner, d_conv = 17, 200, 4
    inputs = conv_inputs(rng, d_conv, d_inner, n_t, 1, make_tree(kind, n_t, rng))
    got = run_tree(backend, inputs)
    assert rel_err(got, ssm_conv_tree_ref(**inputs)) < TOL


@pytest.mark.parametrize("d_conv", [2, 3, 4, 5, 8])
def test_kernel_sizes(backend, rng, d_conv):
    n_t, d_inner = 11, 64
    inputs = conv_inputs(rng, d_conv, d_inner, n_t, 1, make_tree("deep", n_t, rng))
    got = run_tree(backend, inputs)
    assert rel_err(got, ssm_conv_tree_ref(**inputs)) < TOL


def test_supports(backend):
    """CUDA takes kernel size 4 and refuses others through supports_op; the CPU takes any size up to 16."""
    ctx = ggml.Context(n_tensors=16)
    for d_conv in (2, 3, 4, 5):
        sx = ctx.new_tensor(np.float32, (d_conv - 1 + 5, 32, 1))
        c = ctx.new_tensor(np.float32, (d_conv, 32))
        parent = ctx.new_tensor(np.int32, (5, 1))
        out = ggml.ssm_conv_tree(ctx, sx, c, parent)
        assert backend.supports(out) == (backend.is_cpu or d_conv == 4), d_conv


def test_several_sequences(backend, rng):
    """Each sequence has its own tree and its own state columns."""
    n_t, d_inner, d_conv, n_s = 9, 130, 4, 4
    parents = np.stack([make_tree(kind, n_t, rng) for kind in ("bushy", "chain", "star", "padded")])
    inputs = conv_inputs(rng, d_conv, d_inner, n_t, n_s, parents)
    got = run_tree(backend, inputs)
    assert rel_err(got, ssm_conv_tree_ref(**inputs)) < TOL


@pytest.mark.parametrize("kind", ["ddtree", "chain"])
def test_27b_layer_shape(backend, rng, kind):
    """The Qwen3.5-27B conv: d_inner 10240, kernel 4, a 23-node verify tree."""
    n_t, d_inner, d_conv = 23, 10240, 4
    inputs = conv_inputs(rng, d_conv, d_inner, n_t, 1, make_tree(kind, n_t, rng))
    got = run_tree(backend, inputs)
    assert rel_err(got, ssm_conv_tree_ref(**inputs)) < TOL


@pytest.mark.parametrize("n_s", [1, 3])
@pytest.mark.parametrize("n_t", [1, 2, 23])
def test_chain_equals_ssm_conv(backend, rng, n_t, n_s):
    """parent[t] = t-1 gives upstream ggml_ssm_conv's numbers."""
    d_inner, d_conv = 256, 4
    inputs = conv_inputs(rng, d_conv, d_inner, n_t, n_s, np.tile(chain(n_t), (n_s, 1)))
    tree, upstream = run_graph(
        backend, lambda ctx, t: [ggml.ssm_conv_tree(ctx, t["sx"], t["c"], t["parent"]), ctx.ssm_conv(t["sx"], t["c"])],
        inputs)
    assert tree.shape == upstream.shape
    tree, upstream = tree.reshape(n_s, n_t, d_inner), upstream.reshape(n_s, n_t, d_inner)
    assert rel_err(tree, upstream) < 1e-7
    assert rel_err(tree, ssm_conv_tree_ref(**inputs)) < TOL


def test_padding_slots_do_not_touch_real_nodes(backend, rng):
    """Unused slots after a tree (whatever their inputs) leave the real nodes' outputs as without them."""
    used, n_t, d_inner, d_conv = 6, 23, 64, 4
    parents = make_tree("bushy", used, rng)
    full = conv_inputs(rng, d_conv, d_inner, n_t, 1, np.concatenate([parents, np.full(n_t - used, -1, np.int32)]))
    small = {"sx": full["sx"][:, :, : d_conv - 1 + used].copy(), "c": full["c"], "parent": parents[None]}
    got_full = run_tree(backend, full)
    got_small = run_tree(backend, small)
    np.testing.assert_array_equal(got_full[:, :used], got_small)


@pytest.mark.parametrize("kind, n_t, n_s", [("ddtree", 23, 1), ("bushy", 9, 3), ("chain", 1, 1)])
def test_split_form_equals_the_concatenated_one(backend, rng, kind, n_t, n_s):
    """ggml_ssm_conv_tree_split over the state and the new inputs where they are (x a row range of a wider
    projection output, as a fused qkv's) gives the concatenated form's numbers bit for bit."""
    d_conv, d_inner, width = 4, 640, 1000
    parents = np.stack([make_tree(kind, n_t, rng) for _ in range(n_s)])
    inputs = {"state": rng.standard_normal((n_s, d_inner, d_conv - 1)).astype(np.float32),
              "proj": rng.standard_normal((n_s, n_t, width)).astype(np.float32),
              "c": rng.standard_normal((d_inner, d_conv)).astype(np.float32),
              "parent": parents.astype(np.int32)}

    def both(ctx, t):
        proj = t["proj"]
        x = ctx.view_3d(proj, d_inner, n_t, n_s, proj.nb[1], proj.nb[2], 7 * 4)   # rows 7 .. 7 + d_inner
        sx = ctx.concat(t["state"], ctx.transpose(ctx.cont(x)), 0)
        return [ggml.ssm_conv_tree_split(ctx, t["state"], x, t["c"], t["parent"]),
                ggml.ssm_conv_tree(ctx, sx, t["c"], t["parent"])]
    split, concatenated = run_graph(backend, both, inputs)
    np.testing.assert_array_equal(split, concatenated)
    sx = np.concatenate([inputs["state"], inputs["proj"][:, :, 7:7 + d_inner].transpose(0, 2, 1)], axis=2)
    ref = ssm_conv_tree_ref(sx=sx, c=inputs["c"], parent=inputs["parent"])
    assert rel_err(split.reshape(n_s, n_t, d_inner), ref) < TOL


@pytest.mark.parametrize("split", [False, True], ids=["concatenated", "split"])
def test_fused_silu_is_ggml_silu_of_the_conv(backend, rng, split):
    """silu=True (the op's own silu, one kernel fewer) gives ggml_silu of the plain op's result bit for bit, in
    both forms, over several sequences, with a channel count whose rows end in a partial SIMD block and (CPU) 3
    threads, so that the rows are split unevenly across them."""
    if backend.is_cpu:
        backend.set_n_threads(3)
    d_conv, d_inner, n_t, n_s = 4, 645, 23, 2
    parents = np.stack([make_tree("ddtree", n_t, rng) for _ in range(n_s)]).astype(np.int32)
    inputs = {"state": rng.standard_normal((n_s, d_inner, d_conv - 1)).astype(np.float32),
              "x": (rng.standard_normal((n_s, n_t, d_inner)) * 3.0).astype(np.float32),
              "c": rng.standard_normal((d_inner, d_conv)).astype(np.float32), "parent": parents}

    def both(ctx, t):
        if split:
            conv = [ggml.ssm_conv_tree_split(ctx, t["state"], t["x"], t["c"], t["parent"], silu=silu)
                    for silu in (True, False)]
        else:
            sx = ctx.concat(t["state"], ctx.transpose(t["x"]), 0)
            conv = [ggml.ssm_conv_tree(ctx, sx, t["c"], t["parent"], silu=silu) for silu in (True, False)]
        return [conv[0], ctx.silu(conv[1])]
    fused, separate = run_graph(backend, both, inputs)
    np.testing.assert_array_equal(fused, separate)
    sx = np.concatenate([inputs["state"], inputs["x"].transpose(0, 2, 1)], axis=2).astype(np.float64)
    ref = ssm_conv_tree_ref(sx=sx, c=inputs["c"], parent=parents)
    assert rel_err(fused.reshape(n_s, n_t, d_inner), ref / (1.0 + np.exp(-ref))) < 1e-5


@pytest.mark.parametrize("head_dim, n_heads, n_t, n_s", [(128, 2, 23, 1), (64, 3, 9, 2), (16, 4, 23, 1), (4, 5, 3, 1)])
def test_gdn_conv_tree_is_the_conv_norm_copy_and_gates(backend, rng, head_dim, n_heads, n_t, n_s):
    """ggml_gdn_conv_tree gives, bit for bit, what it replaces in a verify's recurrent layer: the split conv with
    silu, q and k's heads (the first 2 n_heads head_dim channels) through layers.l2_norm (ggml's rms_norm and
    scale), the other channels as the conv left them, x copied into `inputs` and (one sequence) the gates of
    gdn_gates (beta and alpha read as row ranges of the same projection). Heads of 128 (the 27B), 64 (two warps on
    CUDA), 16 and 4 (several heads a warp); the value channels end mid-block; (CPU) 3 threads."""
    from pydflash.models.layers import l2_norm
    if backend.is_cpu:
        backend.set_n_threads(3)
    d_conv, eps = 4, 1e-6
    qk = 2 * n_heads * head_dim
    d_inner, width = qk + 200, qk + 211
    parents = np.stack([make_tree("ddtree", n_t, rng) for _ in range(n_s)]).astype(np.int32)
    H = 6   # gate heads: beta and alpha the projection's rows d_inner + 7 .. + 7 + 2 H
    inputs = {"state": rng.standard_normal((n_s, d_inner, d_conv - 1)).astype(np.float32),
              "proj": (rng.standard_normal((n_s, n_t, width + 2 * H)) * 2.0).astype(np.float32),
              "c": rng.standard_normal((d_inner, d_conv)).astype(np.float32), "parent": parents}
    if n_s == 1:   # (the gates are computed for one sequence)
        inputs.update(dt_bias=rng.standard_normal(H).astype(np.float32),
                      a=-np.exp(rng.standard_normal(H)).astype(np.float32))
    inputs["proj"][..., d_inner + 7 + H] = 30.0   # an alpha past softplus's threshold
    store_ctx = ggml.Context(n_tensors=1)
    store = store_ctx.new_tensor(np.float32, (d_inner, n_t, n_s))
    store_buf = backend.alloc_tensors(store_ctx)
    store.set(np.full((n_s, n_t, d_inner), np.nan, np.float32))

    def both(ctx, t):
        proj = t["proj"]
        x = ctx.view_3d(proj, d_inner, n_t, n_s, proj.nb[1], proj.nb[2], 7 * 4)   # rows 7 .. 7 + d_inner
        beta, alpha = (ctx.view_2d(proj, H, n_t, proj.nb[1], (d_inner + 7 + i * H) * 4) for i in (0, 1))
        gates = (beta, alpha, t["dt_bias"], t["a"]) if n_s == 1 else None
        fused, g, b = ggml.gdn_conv_tree(ctx, t["state"], x, t["c"], t["parent"], qk=qk, head_dim=head_dim, eps=eps,
                                         inputs=store, gates=gates)
        if not backend.supports(fused.src[0] if gates else fused):
            pytest.fail(f"{backend.name} refuses gdn_conv_tree with heads of {head_dim}")
        conv = ggml.ssm_conv_tree_split(ctx, t["state"], x, t["c"], t["parent"], silu=True)
        heads = ctx.view_4d(conv, head_dim, 2 * n_heads, n_t, n_s, head_dim * 4, conv.nb[1], conv.nb[2], 0)
        out = [ctx.cont(fused), conv, l2_norm(ctx, heads, eps)]
        if gates:
            out += [ctx.cont(g), ctx.cont(b), *ggml.gdn_gates(ctx, *gates)]
        return out
    fused, conv, normed, *gates = run_graph(backend, both, inputs)
    if n_s == 1:   # the gates, as gdn_gates computes them
        np.testing.assert_array_equal(gates[0], gates[2])
        np.testing.assert_array_equal(gates[1], gates[3])
        assert np.isfinite(gates[0]).all() and (gates[1] > 0).all() and (gates[1] < 1).all()
    fused, conv = fused.reshape(n_s, n_t, d_inner), conv.reshape(n_s, n_t, d_inner)
    np.testing.assert_array_equal(fused[..., :qk], normed.reshape(n_s, n_t, qk))
    np.testing.assert_array_equal(fused[..., qk:], conv[..., qk:])
    np.testing.assert_array_equal(store.numpy().reshape(n_s, n_t, d_inner), inputs["proj"][..., 7:7 + d_inner])
    # (the gates against float64: tests/test_gdn_gates.py)
    # and what that is: each head of silu(conv) over its length, the conv against float64
    sx = np.concatenate([inputs["state"], inputs["proj"][..., 7:7 + d_inner].transpose(0, 2, 1)], axis=2)
    ref = ssm_conv_tree_ref(sx=sx.astype(np.float64), c=inputs["c"], parent=parents)
    ref = ref / (1.0 + np.exp(-ref))
    heads = ref[..., :qk].reshape(n_s, n_t, 2 * n_heads, head_dim)
    heads = heads / np.sqrt((heads ** 2).sum(-1, keepdims=True) + eps)
    assert rel_err(fused[..., :qk], heads.reshape(n_s, n_t, qk)) < 1e-5
    del store_buf


def test_gdn_conv_tree_supports(backend):
    """CUDA takes heads of 1 to 128 values, powers of two; the CPU any (up to the conv's channels)."""
    ctx = ggml.Context(n_tensors=32)
    state, c, parent = (ctx.new_tensor(np.float32, (3, 768, 1)), ctx.new_tensor(np.float32, (4, 768)),
                        ctx.new_tensor(np.int32, (5, 1)))
    x = ctx.new_tensor(np.float32, (768, 5, 1))
    for head_dim, cuda in ((1, True), (128, True), (96, False), (256, False)):
        op, _, _ = ggml.gdn_conv_tree(ctx, state, x, c, parent, qk=2 * head_dim, head_dim=head_dim, eps=1e-6)
        assert backend.supports(op) == (backend.is_cpu or cuda), head_dim


# --- the wrapper's checks (no compute) ------------------------------------------------------------------------------

def test_wrapper_rejects_bad_inputs():
    ctx = ggml.Context(n_tensors=48)
    sx = ctx.new_tensor(np.float32, (3 + 5, 16, 2))
    c = ctx.new_tensor(np.float32, (4, 16))
    parent = ctx.new_tensor(np.int32, (5, 2))
    ggml.ssm_conv_tree(ctx, sx, c, parent)  # fine
    with pytest.raises(TypeError, match="parent"):
        ggml.ssm_conv_tree(ctx, sx, c, ctx.new_tensor(np.float32, (5, 2)))
    with pytest.raises(ValueError, match="parent"):
        ggml.ssm_conv_tree(ctx, sx, c, ctx.new_tensor(np.int32, (5, 1)))
    with pytest.raises(ValueError, match="sx"):
        ggml.ssm_conv_tree(ctx, ctx.new_tensor(np.float32, (8, 17, 2)), c, parent)
    with pytest.raises(TypeError, match="sx"):
        ggml.ssm_conv_tree(ctx, ctx.new_tensor(np.float16, (8, 16, 2)), c, parent)
    with pytest.raises(ValueError, match="state columns"):
        ggml.ssm_conv_tree(ctx, ctx.new_tensor(np.float32, (3, 16, 2)), c, parent)
    with pytest.raises(ValueError, match="contiguous rows"):
        ggml.ssm_conv_tree(ctx, ctx.transpose(ctx.new_tensor(np.float32, (16, 8))), c, parent)
    with pytest.raises(ValueError, match="> 16"):
        ggml.ssm_conv_tree(ctx, ctx.new_tensor(np.float32, (16 + 5, 16, 2)), ctx.new_tensor(np.float32, (17, 16)),
                           parent)
    state, x = ctx.new_tensor(np.float32, (3, 16, 2)), ctx.new_tensor(np.float32, (16, 5, 2))
    ggml.ssm_conv_tree_split(ctx, state, x, c, parent)  # fine
    with pytest.raises(ValueError, match="state must have ne"):
        ggml.ssm_conv_tree_split(ctx, ctx.new_tensor(np.float32, (4, 16, 2)), x, c, parent)
    with pytest.raises(ValueError, match="x must have ne"):
        ggml.ssm_conv_tree_split(ctx, state, ctx.new_tensor(np.float32, (17, 5, 2)), c, parent)
    with pytest.raises(ValueError, match="parent must have ne"):
        ggml.ssm_conv_tree_split(ctx, state, ctx.new_tensor(np.float32, (16, 4, 2)), c, parent)
    ggml.gdn_conv_tree(ctx, state, x, c, parent, qk=8, head_dim=4, eps=1e-6)  # fine
    with pytest.raises(ValueError, match="multiple of head_dim"):
        ggml.gdn_conv_tree(ctx, state, x, c, parent, qk=6, head_dim=4, eps=1e-6)
    with pytest.raises(ValueError, match="at most d_inner"):
        ggml.gdn_conv_tree(ctx, state, x, c, parent, qk=20, head_dim=4, eps=1e-6)
    with pytest.raises(ValueError, match="inputs must have ne"):
        ggml.gdn_conv_tree(ctx, state, x, c, parent, qk=8, head_dim=4, eps=1e-6,
                           inputs=ctx.new_tensor(np.float32, (16, 4, 2)))
    with pytest.raises(ValueError, match="x must have ne"):
        ggml.gdn_conv_tree(ctx, state, ctx.new_tensor(np.float32, (17, 5, 2)), c, parent, qk=8, head_dim=4, eps=1e-6)
    gates = (ctx.new_tensor(np.float32, (3, 5)), ctx.new_tensor(np.float32, (3, 5)), ctx.new_tensor(np.float32, (3,)),
             ctx.new_tensor(np.float32, (3,)))
    with pytest.raises(ValueError, match="one sequence, got n_s=2"):
        ggml.gdn_conv_tree(ctx, state, x, c, parent, qk=8, head_dim=4, eps=1e-6, gates=gates)
    one = (ctx.new_tensor(np.float32, (3, 16, 1)), ctx.new_tensor(np.float32, (16, 5, 1)),
           ctx.new_tensor(np.int32, (5, 1)))
    ggml.gdn_conv_tree(ctx, one[0], one[1], c, one[2], qk=8, head_dim=4, eps=1e-6, gates=gates)  # fine
    with pytest.raises(ValueError, match="gdn_gates alpha must have ne"):
        ggml.gdn_conv_tree(ctx, one[0], one[1], c, one[2], qk=8, head_dim=4, eps=1e-6,
                           gates=(gates[0], ctx.new_tensor(np.float32, (3, 4)), *gates[2:]))


@pytest.mark.parametrize("bad, where", [([0, 0, 1], "parent\\[0, 0\\] = 0"), ([-1, 1, 0], "parent\\[0, 1\\] = 1"),
                                        ([-1, 0, -2], "parent\\[0, 2\\] = -2"), ([-1, 0, 5], "parent\\[0, 2\\] = 5")])
def test_parent_values_are_checked(bad, where):
    with pytest.raises(ValueError, match=where):
        ggml.check_parents(np.array(bad))
    ctx = ggml.Context(n_tensors=1)
    parent = ctx.new_tensor(np.int32, (3, 1))
    with pytest.raises(ValueError, match=where):
        ggml.set_parents(parent, bad)  # rejected before the tensor (unallocated here) is touched


def test_set_parents(backend):
    ctx = ggml.Context(n_tensors=1)
    parent = ctx.new_tensor(np.int32, (4, 2))
    buf = backend.alloc_tensors(ctx)
    with pytest.raises(ValueError, match="n_s=2, n_t=4"):
        ggml.set_parents(parent, [-1, 0, 1, 2])
    with pytest.raises(ValueError, match="integer"):
        ggml.set_parents(parent, np.zeros((2, 4)))
    ggml.set_parents(parent, [[-1, 0, 0, 1], [-1, -1, 1, 2]])
    np.testing.assert_array_equal(parent.numpy(), [[-1, 0, 0, 1], [-1, -1, 1, 2]])
    del buf


# --- in the model ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_verify_with_the_split_conv_gives_the_same_logits(tmp_path, monkeypatch, device):
    """The split conv (a tree verify's conv reading the state and the projection's rows where they are, the
    default), alone and fused with the q/k norm and the inputs' copy: prefill, decode and a tree verify give the
    very logits of the concatenated form (PYDFLASH_CONV_SPLIT=0)."""
    from test_engine import CUDA_SHAPE
    from test_fused_weights import _run

    from pydflash.testing import write_qwen35_gguf
    path = str(tmp_path / "q35.gguf")
    write_qwen35_gguf(path, **dict(CUDA_SHAPE, weight_type="Q8_0"))
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 400, 20)]
    monkeypatch.setenv("PYDFLASH_CONV_SPLIT", "0")
    concatenated, ref = _run(path, device, prompt, 3)
    assert ggml.Op.CONCAT in [n.op for n in concatenated._last.graph.nodes()]
    monkeypatch.delenv("PYDFLASH_CONV_SPLIT")
    monkeypatch.setenv("PYDFLASH_GDN_CONV_FUSED", "0")
    split, got = _run(path, device, prompt, 3)
    ops = [n.op for n in split._last.graph.nodes()]
    assert ggml.Op.CONCAT not in ops and ggml.Op.SSM_CONV_TREE in ops
    np.testing.assert_array_equal(got, ref)
    # the default: the conv op also norms q and k, stores the slots' inputs and computes the gates
    # (ggml.gdn_conv_tree): the same logits, three ops fewer per recurrent layer
    monkeypatch.delenv("PYDFLASH_GDN_CONV_FUSED")
    fused, got = _run(path, device, prompt, 3)
    np.testing.assert_array_equal(got, ref)
    n_rec = sum(fused.hp.recurrent)
    names = [n.name for n in fused._last.graph.nodes()]
    assert sum(name.endswith(".gdn.conv_qk_normed") for name in names) == n_rec
    assert not any(name.endswith(".gdn.slot_inputs") for name in names)
    count = lambda target, op: sum(n.op == op for n in target._last.graph.nodes())   # noqa: E731
    assert count(split, ggml.Op.RMS_NORM) - count(fused, ggml.Op.RMS_NORM) == n_rec
    assert count(split, ggml.Op.CPY) - count(fused, ggml.Op.CPY) == n_rec
    assert count(split, ggml.Op.GDN_GATES) == n_rec and count(fused, ggml.Op.GDN_GATES) == 0
