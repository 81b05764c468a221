"""The thin binding layer: devices, ownership checks, errors raised before ggml could abort, and the ggml_ext
op hook end to end (patched enum + constructor in ggml-base + kernels in the backends)."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import run_graph
from pydflash import ggml
from pydflash.ggml import _ffi


def test_library_is_our_build():
    assert _ffi.lib.ggml_ext_abi_version() == _ffi.EXT_ABI_VERSION
    assert any(d["kind"] == "cpu" for d in ggml.devices())


def test_unknown_or_missing_devices_are_explained():
    with pytest.raises(ValueError, match="unknown device"):
        ggml.Backend("tpu")
    with pytest.raises(ValueError, match="cuda:N"):
        ggml.Backend("cuda:x")
    if not any(d["name"].startswith("CUDA") for d in ggml.devices()):
        with pytest.raises(ValueError, match="built without CUDA"):
            ggml.Backend("cuda")


def test_tensor_io_checks():
    be = ggml.Backend("cpu", n_threads=1)
    ctx = ggml.Context(n_tensors=4)
    t = ctx.new_tensor(np.float32, (8, 2), name="t")
    with pytest.raises(ggml.GGMLError, match="no device memory"):
        t.set(np.zeros((2, 8), np.float32))
    buf = be.alloc_tensors(ctx)
    assert buf.nbytes >= 64
    with pytest.raises(TypeError, match="F32"):
        t.set(np.zeros((2, 8), np.float64))
    with pytest.raises(ValueError, match="64 bytes"):
        t.set(np.zeros((3, 8), np.float32))
    data = np.arange(16, dtype=np.float32).reshape(2, 8)
    t.set(data)
    np.testing.assert_array_equal(t.numpy(), data)
    with pytest.raises(ValueError, match="multiple of 32"):
        ctx.new_tensor(ggml.Type.Q8_0, (40, 2))


def test_graph_must_be_allocated_before_compute():
    be = ggml.Backend("cpu", n_threads=1)
    ctx = ggml.Context(n_tensors=4, graph_size=4)
    a = ctx.new_tensor(np.float32, (4,)).mark_input()
    g1 = ctx.graph(ctx.scale(a, 2.0))
    with pytest.raises(ggml.GGMLError, match="not allocated"):
        be.compute(g1)
    alloc = ggml.Allocator(be)
    alloc.allocate(g1)
    a.set(np.ones(4, np.float32))
    be.compute(g1)
    np.testing.assert_array_equal(g1.outputs[0].numpy(), np.full(4, 2.0, np.float32))
    # allocating another graph on the same allocator invalidates the first
    ctx2 = ggml.Context(n_tensors=4, graph_size=4)
    g2 = ctx2.graph(ctx2.scale(ctx2.new_tensor(np.float32, (4,)).mark_input(), 3.0))
    alloc.allocate(g2)
    with pytest.raises(ggml.GGMLError, match="another graph"):
        be.compute(g1)


def test_unsupported_node_is_refused_before_compute():
    # the CPU backend multiplies Q8_0 weights only by f32 (or Q8_0) activations, not f16
    ctx = ggml.Context(n_tensors=4, graph_size=4)
    w = ctx.new_tensor(ggml.Type.Q8_0, (32, 2))
    x = ctx.new_tensor(np.float16, (32, 1))
    graph = ctx.graph(ctx.mul_mat(w, x).named("y"))
    with pytest.raises(ggml.GGMLError, match="cannot compute node y .MUL_MAT"):
        ggml.Allocator(ggml.Backend("cpu", n_threads=1)).allocate(graph)


def test_generic_op_dispatch_checks_arity_and_types():
    ctx = ggml.Context(n_tensors=4, graph_size=4)
    a = ctx.new_tensor(np.float32, (4, 4))
    with pytest.raises(TypeError, match="takes 2 arguments"):
        ctx.mul_mat(a)
    with pytest.raises(TypeError, match="expected a Tensor"):
        ctx.mul_mat(a, np.zeros(4))
    with pytest.raises(AttributeError, match="not a graph op"):
        ctx.set_input
    with pytest.raises(AttributeError, match="no op"):
        ctx.definitely_not_an_op


def test_ext_op_is_registered_after_upstream_ops():
    assert ggml.Op.SSM_CONV_TREE > ggml.Op.GLU
    ctx = ggml.Context(n_tensors=8)
    sx = ctx.new_tensor(np.float32, (3 + 5, 16, 1))
    c = ctx.new_tensor(np.float32, (4, 16))
    parent = ctx.new_tensor(np.int32, (5, 1))
    assert ggml.ssm_conv_tree(ctx, sx, c, parent).op == ggml.Op.SSM_CONV_TREE


def test_ext_op_chain_equals_upstream_op(backend, rng):
    """ssm_conv_tree with parent[t] = t-1 runs through the patched dispatch and equals ggml_ssm_conv."""
    d_conv, d_inner, n_t, n_s = 4, 256, 6, 2
    sx = rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(np.float32)
    c = rng.standard_normal((d_inner, d_conv)).astype(np.float32)
    parent = np.tile(np.arange(n_t, dtype=np.int32) - 1, (n_s, 1))
    tree = run_graph(backend, lambda ctx, t: ggml.ssm_conv_tree(ctx, t["sx"], t["c"], t["p"]),
                     {"sx": sx, "c": c, "p": parent})
    chain = run_graph(backend, lambda ctx, t: ctx.ssm_conv(t["sx"], t["c"]), {"sx": sx, "c": c})
    np.testing.assert_array_equal(tree, chain)


def test_ext_wrapper_rejects_bad_input_before_ggml():
    ctx = ggml.Context(n_tensors=8)
    sx = ctx.new_tensor(np.float32, (3 + 5, 16, 1))
    c = ctx.new_tensor(np.float32, (4, 16))
    with pytest.raises(ValueError, match="parent"):
        ggml.ssm_conv_tree(ctx, sx, c, ctx.new_tensor(np.int32, (4, 1)))
    with pytest.raises(TypeError, match="I32"):
        ggml.ssm_conv_tree(ctx, sx, c, ctx.new_tensor(np.float32, (5, 1)))
    with pytest.raises(ValueError, match="earlier node"):
        ggml.ext.check_parents(np.array([-1, 0, 2]))
    np.testing.assert_array_equal(ggml.ext.check_parents([-1, 0, 0, 1]), [[-1, 0, 0, 1]])


def test_set_queued_on_the_backend_stream_lands_before_its_next_compute(backend, rng):
    """The decode loop queues its inputs on the computing backend's stream (no synchronisation per input);
    a graph computed right after must see them, also when the host array is overwritten at once."""
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    a = ctx.new_tensor(np.float32, (64,), name="a").mark_input()
    out = ctx.scale(a, 2.0).named("out")
    graph = ctx.graph([out])
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    host = np.empty(64, np.float32)
    for _ in range(3):
        values = rng.standard_normal(64).astype(np.float32)
        host[:] = values
        a.set(host, backend)
        host[:] = np.nan                 # the copy was staged before set returned
        backend.compute(graph)
        np.testing.assert_array_equal(out.numpy(), 2.0 * values)
    with pytest.raises(ValueError, match="256 bytes"):
        a.set(np.zeros(65, np.float32), backend)


def test_readback_returns_the_result_of_the_queued_graph(backend, rng):
    """Readback queues a result's copy behind a queued compute and waits for it once: the bytes are that compute's,
    for results of any size (its page-locked memory grows)."""
    readback = ggml.Readback(backend)
    for n in (16, 600, 64):
        ctx = ggml.Context(n_tensors=8, graph_size=8)
        a = ctx.new_tensor(np.float32, (n,), name="a").mark_input()
        out = ctx.scale(a, 3.0).named("out")
        graph = ctx.graph([out])
        ggml.Allocator(backend).allocate(graph)
        values = rng.standard_normal(n).astype(np.float32)
        a.set(values, backend)
        backend.compute_async(graph)
        readback.queue(out)
        np.testing.assert_array_equal(readback.wait().view(np.float32), 3.0 * values)


def test_input_block_uploads_every_input_at_once_and_keeps_them(backend, rng):
    """Inputs of three types placed in one InputBlock: the graph reads what the mirror held at upload; an input
    not written again keeps its value in later computes (the allocator reuses no block memory for its nodes);
    the graph's own compute buffer does not hold them."""
    n = 40
    ctx = ggml.Context(n_tensors=16, graph_size=16)
    table = ctx.new_tensor(np.float32, (3, n), name="table")
    idx = ctx.new_tensor(np.int32, (5,), name="idx")
    x = ctx.new_tensor(np.float32, (3, 5), name="x")
    h = ctx.new_tensor(np.float16, (3, 5), name="h")
    block = ggml.InputBlock(backend, {"table": table, "idx": idx, "x": x, "h": h})
    assert block["table"].shape == (n, 3) and block["idx"].dtype == np.int32 and block["h"].dtype == np.float16
    # get_rows, then two adds and a scale: intermediate nodes that would reuse freed input memory if they could
    out = ctx.scale(ctx.add(ctx.add(ctx.get_rows(table, idx), x), ctx.cast(h, ggml.Type.F32)), 2.0).named("out")
    graph = ctx.graph([out])
    allocator = ggml.Allocator(backend)
    allocator.allocate(graph)
    assert allocator.nbytes < table.nbytes + x.nbytes     # (the block's inputs are not in it)
    values = {"table": rng.standard_normal((n, 3)).astype(np.float32), "idx": np.array([4, 0, 39, 4, 17], np.int32),
              "x": rng.standard_normal((5, 3)).astype(np.float32),
              "h": rng.standard_normal((5, 3)).astype(np.float16)}

    def expect():
        v = values
        return 2.0 * ((v["table"][v["idx"]] + v["x"]) + v["h"].astype(np.float32))

    for name, v in values.items():
        block[name][...] = v
    for step in range(3):
        if step:                                     # only idx and h change; table and x stay from before
            values["idx"] = rng.integers(0, n, 5).astype(np.int32)
            values["h"] = rng.standard_normal((5, 3)).astype(np.float16)
            block["idx"][:] = values["idx"]
            block["h"][:] = values["h"]
        block.upload()
        backend.compute_async(graph)
        backend.synchronize()
        np.testing.assert_allclose(out.numpy(), expect(), rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="numpy-typed"):
        ggml.InputBlock(backend, {"q": ctx.new_tensor(ggml.Type.Q8_0, (32, 2))})


_LOG_PROBE = """
from pydflash.ggml._ffi import ffi, lib
cb = ffi.new("ggml_log_callback *"); ud = ffi.new("void **")
lib.ggml_log_get(cb, ud)
print("filter" if cb[0] == lib.ggml_ext_log_no_debug else "other", flush=True)
for level, text in ((1, b"debug line\\n"), (5, b"its continuation\\n"), (3, b"warning line\\n"), (5, b"its cont\\n"),
                    (2, b"info line\\n"), (1, b"debug again\\n")):
    lib.ggml_ext_log_no_debug(level, text, ffi.NULL)
"""


@pytest.mark.parametrize("debug", [False, True])
def test_ggml_debug_lines_are_dropped_unless_asked_for(debug):
    """pydflash installs a ggml logger that drops DEBUG lines (ggml-cuda logs one per decode step) and their
    continuations and passes the other levels to stderr; PYDFLASH_GGML_DEBUG=1 keeps ggml's default logger."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYDFLASH_GGML_DEBUG"}
    if debug:
        env["PYDFLASH_GGML_DEBUG"] = "1"
    out = subprocess.run([sys.executable, "-c", _LOG_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("other" if debug else "filter")
    assert out.stderr.splitlines() == ["warning line", "its cont", "info line"]
