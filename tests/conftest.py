"""Shared fixtures: every op test runs on the CPU backend in CI and, with `-m cuda`, on CUDA."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

from pydflash import ggml

# Subprocesses (`python -m pydflash.cli serve`, the examples) must import the installed package, as the tests do:
# a plain `python -m` from the repository root would put the source checkout, which has no compiled ggml, first.
os.environ["PYTHONSAFEPATH"] = "1"


@pytest.fixture(scope="session", params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request) -> ggml.Backend:
    return ggml.Backend(request.param)


@pytest.fixture
def rng(request) -> np.random.Generator:
    """Fresh random inputs per test, reproducible from the test's name."""
    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


def run_graph(backend: ggml.Backend, build, inputs: dict[str, np.ndarray], n_nodes: int = 64):
    """Build a graph with `build(ctx, tensors) -> output tensor(s)` over input tensors made from `inputs`
    (numpy arrays in C order; ggml shape = reversed), compute it on `backend`, return the outputs as numpy."""
    ctx = ggml.Context(n_tensors=len(inputs) + n_nodes, graph_size=n_nodes)
    tensors = {name: ctx.new_tensor(arr.dtype, arr.shape[::-1], name=name) for name, arr in inputs.items()}
    for t in tensors.values():
        t.mark_input()
    outputs = build(ctx, tensors)
    single = isinstance(outputs, ggml.Tensor)
    graph = ctx.graph(outputs)
    alloc = ggml.Allocator(backend)
    alloc.allocate(graph)
    for name, arr in inputs.items():
        tensors[name].set(arr)
    backend.compute(graph)
    results = [o.numpy() for o in graph.outputs]
    return results[0] if single else results


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    """||got - ref|| / ||ref|| in float64; NaN/inf anywhere counts as total failure."""
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, f"shape {got.shape} != reference {ref.shape}"
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300))


def attention_f64(q, k, v, mask, scale, softcap=0.0, weights=False):
    """Float64 attention, the flash-attention tests' oracle: q [n_seq, H, n_q, D], k/v [n_seq, Hkv, n_kv, D] (each
    KV head serving H / Hkv query heads), mask [n_q, n_kv] additive -> [n_seq, n_q, H, Dv]; with weights, also the
    softmax weights [n_seq, H, n_q, n_kv]."""
    h, hkv = q.shape[1], k.shape[1]
    k = np.repeat(k, h // hkv, axis=1).astype(np.float64)
    v = np.repeat(v, h // hkv, axis=1).astype(np.float64)
    s = np.einsum("shqd,shkd->shqk", q.astype(np.float64), k) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = s + mask
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    out = np.einsum("shqk,shkd->sqhd", p, v)
    return (out, p) if weights else out


def llama_cpp_plain(path, **kwargs):
    """llama_cpp.Llama(path, **kwargs) with the weights in the plain CPU buffer: no repacking into interleaved
    layouts, whose kernels round differently (and whose AMX variant crashes on the CI host)."""
    import llama_cpp
    low = llama_cpp.llama_cpp
    default_params = low.llama_model_default_params

    def plain_params():
        params = default_params()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = plain_params
    try:
        return llama_cpp.Llama(str(path), **kwargs)
    finally:
        low.llama_model_default_params = default_params
