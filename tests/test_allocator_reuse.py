"""Switching one Allocator between cached graphs: a graph allocated again after a larger one grew the compute
buffer must get fresh addresses (gallocr keeps the old, dangling ones of tensors that already have data)."""
from __future__ import annotations

import numpy as np

from pydflash import ggml, testing
from pydflash.models.qwen35 import Qwen35Target


def _graph(n):
    ctx = ggml.Context(n_tensors=8, graph_size=8)
    x = ctx.new_tensor(ggml.Type.F32, (n,), name="x").mark_input()
    y = ctx.scale(ctx.add(x, x), 3.0)
    return ctx, x, ctx.graph(y)


def test_reallocated_graph_gets_fresh_addresses():
    backend = ggml.Backend("cpu")
    alloc = ggml.Allocator(backend)
    small, big = _graph(16), _graph(1 << 20)
    for graph_of in (small, big, small, big, small):
        ctx, x, graph = graph_of
        alloc.allocate(graph)
        values = np.arange(x.ne[0], dtype=np.float32)
        x.set(values)
        backend.compute(graph)
        np.testing.assert_array_equal(graph.outputs[0].numpy(), 6 * values)


def test_target_graph_reused_after_a_larger_prefill(tmp_path):
    path = tmp_path / "t.gguf"
    testing.write_qwen35_gguf(path)
    rng = np.random.default_rng(0)
    short, long_ = rng.integers(0, 400, 5), rng.integers(0, 400, 300)
    a = Qwen35Target(path, "cpu", n_ctx=512)
    a.prefill(short)
    a.decode(7)
    a.reset()
    a.prefill(long_)                   # a bigger graph grows the shared compute buffer
    a.reset()
    a.prefill(short)                   # the cached short-prefill and decode graphs are allocated again
    reused = a.decode(7)
    b = Qwen35Target(path, "cpu", n_ctx=512)
    b.prefill(short)
    np.testing.assert_array_equal(reused, b.decode(7))


def test_every_allocation_renews_the_graph_uid():
    """The CUDA backend replays its captured graph without re-checking nodes while the uid stays the same, so
    any allocation (which may move tensors) must give the graph a new one; computing alone must not."""
    backend = ggml.Backend("cpu")
    alloc = ggml.Allocator(backend)
    (_, xs, small), (_, xb, big) = _graph(16), _graph(1 << 20)
    assert small.uid == 0                          # ggml's default: never seen
    alloc.allocate(small)
    first = small.uid
    xs.set(np.zeros(16, np.float32))
    backend.compute(small)
    backend.compute(small)
    assert small.uid == first != 0
    alloc.allocate(big)
    alloc.allocate(small)
    assert small.uid not in (0, first, big.uid)


def test_a_constant_input_keeps_its_values_between_computes():
    """An input's memory may serve later nodes of the graph once its readers ran (here the chain of adds after the
    first one fits in x's bytes); mark_constant keeps it: set once, read by every compute."""
    backend = ggml.Backend("cpu")
    ctx = ggml.Context(n_tensors=16, graph_size=16)
    x = ctx.new_tensor(ggml.Type.F32, (64,), name="x").mark_constant()
    y = ctx.scale(x, 2.0)
    for _ in range(6):
        y = ctx.add(y, y)
    graph = ctx.graph(y)
    ggml.Allocator(backend).allocate(graph)
    values = np.arange(64, dtype=np.float32)
    x.set(values)
    for _ in range(3):
        backend.compute(graph)
        np.testing.assert_array_equal(graph.outputs[0].numpy(), 128 * values)
        np.testing.assert_array_equal(x.numpy(), values)
