"""Fused projection weights (TargetRuntime.fused_weights / project): the matrices of one layer that read the same
input and share a type are loaded as the rows of one tensor, and one matmul computes them all: Q/K/V of the llama
family and of qwen35's attention layers, qwen35's recurrent qkv with its output gate, beta and alpha. Each
output row is the same dot product as with separate matrices, so on the CPU the logits must be bit-identical to
the unfused model's, through prefill, decode and a tree verify. Likewise a layer's input norms computed inside
the products that read them (layers.Normed)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_engine import CUDA_SHAPE   # a qwen35 shape CUDA's tree ops take
from test_qwen35 import CUDA_LOGIT_ATOL

from pydflash import ggml
from pydflash.ggml._ffi import ffi
from pydflash.gguf_io import GGUFFile
from pydflash.models import layers, load_target
from pydflash.models.runtime import fusable_runs
from pydflash.testing import write_llama_gguf, write_qwen35_gguf

# Q4_K_M: Q and K in Q4_K, V in Q6_K (fused: Q+K); Q8_0: all three fused. n_embd 256 fills whole K-quant blocks;
# heads of 64 (CUDA's flash attention has no kernel for smaller ones).
CASES = {"qwen2-q4_k_m": dict(arch="qwen2", n_embd=256, n_ff=512, weight_type="Q4_K_M", seed=4),
         "llama-q8_0": dict(arch="llama", n_embd=128, n_head=2, n_head_kv=1, n_ff=256, weight_type="Q8_0", seed=5),
         "qwen3-q8_0": dict(arch="qwen3", n_embd=128, n_ff=256, head_dim=64, weight_type="Q8_0", seed=6),
         "gemma3-q8_0": dict(arch="gemma3", n_layer=6, n_embd=128, n_head=2, n_head_kv=1, n_ff=256,
                             weight_type="Q8_0", seed=7),
         "qwen35-q8_0": dict(arch="qwen35", **dict(CUDA_SHAPE, weight_type="Q8_0", seed=8))}
# the fused weights of layer 0 (and, for qwen35, of its attention layer 1)
EXPECTED = {"qwen2-q4_k_m": {0: ["attn_q+attn_k", "ffn_gate+ffn_up"]},
            "llama-q8_0": {0: ["attn_q+attn_k+attn_v", "ffn_gate+ffn_up"]},
            "qwen3-q8_0": {0: ["attn_q+attn_k+attn_v", "ffn_gate+ffn_up"]},
            "gemma3-q8_0": {0: ["attn_q+attn_k+attn_v", "ffn_gate+ffn_up"]},
            "qwen35-q8_0": {0: ["attn_qkv+attn_gate+ssm_beta+ssm_alpha", "ffn_gate+ffn_up"],
                            1: ["attn_q+attn_k+attn_v", "ffn_gate+ffn_up"]}}


def _write(path, case):
    cfg = dict(CASES[case])
    if cfg.pop("arch") == "qwen35":
        write_qwen35_gguf(path, **cfg)
    else:
        write_llama_gguf(path, arch=CASES[case]["arch"], **cfg)


def _run(path, device, prompt, steps):
    """Prefill, then greedy decode; then a 4-slot tree verify (root, two children, a grandchild): every logit."""
    target = load_target(path, device, n_ctx=256, n_ubatch=16)
    out = [target.prefill(prompt)]
    token = int(out[0].argmax())
    for _ in range(steps):
        out.append(target.decode(token))
        token = int(out[-1].argmax())
    target.enable_verify(4, tree=True)
    target.verify([token, 5, 9, 11], [-1, 0, 0, 1], [0, 1, 1, 2])
    return target, np.concatenate([np.stack(out), target.logits_of_slots()])


def _mul_mats(target) -> int:
    """Weight matmuls of the last graph (on CUDA a 4-slot verify of K-quants takes ggml_qmatmul)."""
    return sum(node.op in (ggml.Op.MUL_MAT, ggml.Op.QMATMUL) for node in target._last.graph.nodes())


def _glu_behind_products(target) -> int:
    """GLU nodes of the last graph whose two preceding nodes are weight matmuls."""
    nodes = target._last.graph.nodes()
    products = (ggml.Op.MUL_MAT, ggml.Op.QMATMUL)
    return sum(n.op == ggml.Op.GLU and nodes[i - 1].op in products and nodes[i - 2].op in products
               for i, n in enumerate(nodes))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_weights_give_the_unfused_logits(tmp_path, monkeypatch, case, device):
    """On CUDA the one-token steps use the same per-row kernel either way, but ggml's batched MMQ splits K over
    blocks by the matrix's row count (stream-k): there the CUDA Q8_0-class bound of test_qwen35 applies."""
    path = str(tmp_path / f"{case}.gguf")
    _write(path, case)
    prompt = [int(t) for t in np.random.default_rng(1).integers(0, 400, 40)]   # three micro-batches
    fused, got = _run(path, device, prompt, 8)
    monkeypatch.setenv("PYDFLASH_FUSED_WEIGHTS", "0")
    plain, ref = _run(path, device, prompt, 8)

    for il, names in EXPECTED[case].items():
        assert sorted(k for k in fused.weights.fused if k.startswith(f"blk.{il}.") and k.endswith(".weight")) == \
            sorted(f"blk.{il}.{name}.weight" for name in names)
    assert plain.weights.fused == {}
    # each fused weight is a view of its rows, holding the file's bytes (in the target's row order, if it has one)
    gf, row_orders = GGUFFile(path), fused.row_orders()
    for merged, members in fused.weights.fused.items():
        for name in members:
            on_device = np.ascontiguousarray(fused.weights[name].numpy()).reshape(-1).view(np.uint8)
            info = gf.tensors[name]
            expected = gf.data(info).reshape(int(np.prod(info.ne[1:])), -1)
            expected = expected[row_orders[name]] if name in row_orders else expected
            assert np.array_equal(on_device, expected.reshape(-1)), name
    # a group of k matrices is one matmul instead of k (the verify graph), except FFN gate+up for one token, which
    # stay two products (ggml-cuda fuses them with the GLU; the decode graph)
    saved = sum(len(members) - 1 for merged, members in fused.weights.fused.items() if merged.endswith(".weight"))
    assert saved >= 2 * fused.hp.n_layer and _mul_mats(plain) - _mul_mats(fused) == saved
    fused.decode(5)
    plain.decode(5)
    assert _mul_mats(plain) - _mul_mats(fused) == saved - fused.hp.n_layer
    # ... and, as in the unfused graph, each GLU right behind its two products: the consecutive nodes ggml-cuda
    # fuses into one kernel at one token (a VIEW node of a weight in between would stop that)
    assert _glu_behind_products(fused) == _glu_behind_products(plain) == fused.hp.n_layer
    if device == "cpu":
        assert np.array_equal(got, ref)
    else:
        assert np.abs(got - ref).max() <= CUDA_LOGIT_ATOL["Q8_0"]
        assert np.array_equal(got.argmax(axis=1), ref.argmax(axis=1))


def test_fusable_runs_cut_a_group_where_type_row_length_or_bias_change():
    """Each run of neighbours sharing type, row length and bias presence becomes one matrix, wherever it sits."""
    def info(**weights):
        out = {}
        for name, (wtype, n_in, bias) in weights.items():
            out[name + ".weight"] = SimpleNamespace(type=wtype, ne=(n_in, 64))
            if bias:
                out[name + ".bias"] = SimpleNamespace(type=ggml.Type.F32, ne=(64,))
        return out
    Q4, Q6 = ggml.Type.Q4_K, ggml.Type.Q6_K
    assert fusable_runs(info(q=(Q4, 256, 0), k=(Q4, 256, 0), v=(Q6, 256, 0)), ("q", "k", "v")) == [("q", "k"), ("v",)]
    assert fusable_runs(info(q=(Q6, 256, 0), k=(Q4, 256, 0), v=(Q4, 256, 0)), ("q", "k", "v")) == [("q",), ("k", "v")]
    assert fusable_runs(info(a=(Q4, 256, 0), b=(Q4, 512, 0), c=(Q4, 512, 0), d=(Q4, 512, 1)),
                        ("a", "b", "c", "d")) == [("a",), ("b", "c"), ("d",)]
    assert fusable_runs(info(a=(Q4, 256, 1), b=(Q4, 256, 1)), ("a", "b")) == [("a", "b")]


def test_one_token_gate_and_up_stay_one_product_where_qmatmul_takes_them(tmp_path, monkeypatch):
    """At one token the FFN's gate and up are two products only for ggml's mul_mat (which ggml-cuda fuses with the
    GLU); where ggml_qmatmul takes the fused matrix (here forced: PYDFLASH_QMATMUL=1 and the weights counted as a
    GPU's, its CPU reference computing) they stay one product, with the unfused model's logits."""
    path = str(tmp_path / "llama.gguf")
    _write(path, "llama-q8_0")
    monkeypatch.setenv("PYDFLASH_QMATMUL", "1")
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, 400, 20)]
    fused, got = _run(path, "cpu", prompt, 3)
    fused.decode(5)
    monkeypatch.setenv("PYDFLASH_FUSED_WEIGHTS", "0")
    plain, ref = _run(path, "cpu", prompt, 3)
    plain.decode(5)
    qmatmuls = sum(node.op == ggml.Op.QMATMUL for node in fused._last.graph.nodes())
    assert qmatmuls == _mul_mats(fused) and qmatmuls > 0
    saved = sum(len(members) - 1 for merged, members in fused.weights.fused.items() if merged.endswith(".weight"))
    assert _mul_mats(plain) - _mul_mats(fused) == saved == 3 * fused.hp.n_layer   # QKV: 2, gate+up: 1
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("case", ["llama-q8_0", "qwen35-q8_0"])
def test_norms_computed_inside_qmatmul_give_the_same_logits(tmp_path, monkeypatch, case):
    """With the norms inside the products (the default) a layer's input norms (layers.Normed) go into the products
    ggml_qmatmul takes (ggml_qmatmul_rms_norm, here forced: PYDFLASH_QMATMUL=1 and the weights counted as a GPU's,
    its CPU reference computing): no RMS_NORM node is left for them, and the logits are those of the graph with the
    norms as their own ops (PYDFLASH_NORM_IN_QMATMUL=0), bit for bit (the CPU reference norms the columns as
    ggml's rms_norm and mul)."""
    path = str(tmp_path / f"{case}.gguf")
    _write(path, case)
    monkeypatch.setenv("PYDFLASH_QMATMUL", "1")
    monkeypatch.setenv("PYDFLASH_NORM_IN_QMATMUL", "1")
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 400, 20)]
    fused, got = _run(path, "cpu", prompt, 3)
    monkeypatch.setenv("PYDFLASH_NORM_IN_QMATMUL", "0")
    plain, ref = _run(path, "cpu", prompt, 3)

    def count(target):
        nodes = target._last.graph.nodes()   # the 4-slot verify
        normed = sum(n.op == ggml.Op.QMATMUL and len(n.src) == 3 for n in nodes)   # w, x and the norm
        return normed, sum(n.op == ggml.Op.RMS_NORM for n in nodes)
    n_layer = fused.hp.n_layer
    normed, norms = count(fused)
    assert count(plain)[0] == 0 and normed == 2 * n_layer
    assert count(plain)[1] - norms == 2 * n_layer   # both input norms of every layer
    assert np.array_equal(got, ref)


def _fused_and_separate(tmp_path, monkeypatch, case, separate):
    """A model whose products ggml_qmatmul takes (forced as above), run twice: as built, and with ggml.qmatmul
    replaced by separate(product, ...) (the same product with a fusion done by ggml's own op instead):
    (fused target, its logits, separate target, its logits)."""
    path = str(tmp_path / f"{case}.gguf")
    _write(path, case)
    monkeypatch.setenv("PYDFLASH_QMATMUL", "1")
    monkeypatch.setattr(layers, "_on_device", lambda w: True)
    prompt = [int(t) for t in np.random.default_rng(5).integers(0, 400, 20)]
    fused, got = _run(path, "cpu", prompt, 3)
    product = ggml.qmatmul
    monkeypatch.setattr(ggml, "qmatmul", lambda *args, **kw: separate(product, *args, **kw))
    plain, ref = _run(path, "cpu", prompt, 3)
    return fused, got, plain, ref


def _count(target, op, src):
    """In the last graph (the 4-slot verify): QMATMUL nodes with src[src] set, and nodes of op."""
    nodes = target._last.graph.nodes()
    return (sum(n.op == ggml.Op.QMATMUL and n._ptr.src[src] != ffi.NULL for n in nodes),
            sum(n.op == op for n in nodes))


@pytest.mark.parametrize("case", ["llama-q8_0", "qwen35-q8_0"])
def test_residuals_added_inside_qmatmul_give_the_same_logits(tmp_path, monkeypatch, case):
    """Where ggml_qmatmul takes a layer's output projections it adds the residual as it stores each output
    (ggml_qmatmul_fused's add): both output projections of every layer carry the residual, no ADD node is left
    for it, and the logits are those of the same products followed by ggml's add, bit for bit."""
    def then_add(product, ctx, w, x, row_tiles=0, add=None, **fusions):
        out = product(ctx, w, x, row_tiles, **fusions)
        return out if add is None else ctx.add(out, add)
    fused, got, plain, ref = _fused_and_separate(tmp_path, monkeypatch, case, then_add)
    n_layer = fused.hp.n_layer
    (adding, adds), (adding_plain, adds_plain) = _count(fused, ggml.Op.ADD, 3), _count(plain, ggml.Op.ADD, 3)
    assert adding == 2 * n_layer and adding_plain == 0 and adds_plain - adds == 2 * n_layer
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("case", ["llama-q8_0", "qwen35-q8_0"])
def test_swiglu_inside_qmatmul_gives_the_same_logits(tmp_path, monkeypatch, case):
    """Where ggml_qmatmul takes a layer's FFN down product (and a qwen35 GDN layer's output projection, whose input
    is silu(z) * the normed output) it gates the columns as it quantises them (layers.Gated, ggml_qmatmul_fused's
    up): no GLU node is left, and the logits are those of ggml's swiglu followed by the same product, bit for
    bit. A qwen35 attention layer's output projection likewise takes sigmoid(gate) * its input
    (ggml_qmatmul_sigmoid_gated): no SIGMOID node left, the bits of ggml's sigmoid and mul."""
    def gate_first(product, ctx, w, x, row_tiles=0, up=None, gate="silu", **fusions):
        if up is not None:
            x = ctx.mul(up, ctx.sigmoid(x)) if gate == "sigmoid" else ctx.swiglu_split(x, up)
        return product(ctx, w, x, row_tiles, **fusions)
    monkeypatch.setenv("PYDFLASH_HEAD_NORM_IN_QMATMUL", "0")   # (the GDN head norm as ggml's ops in both runs)
    fused, got, plain, ref = _fused_and_separate(tmp_path, monkeypatch, case, gate_first)
    recurrent = getattr(fused.hp, "recurrent", ())
    swiglu = fused.hp.n_layer + sum(recurrent)
    sigmoid = sum(not r for r in recurrent) if case.startswith("qwen35") else 0   # (gated attention)
    assert _count(fused, ggml.Op.GLU, 4) == (swiglu + sigmoid, 0) and _count(plain, ggml.Op.GLU, 4) == (0, swiglu)
    unary = [sum(n.op == ggml.Op.UNARY for n in t._last.graph.nodes()) for t in (fused, plain)]
    assert unary[1] - unary[0] == sigmoid
    assert np.array_equal(got, ref)


def test_head_norm_inside_qmatmul_gives_the_same_logits(tmp_path, monkeypatch):
    """With PYDFLASH_HEAD_NORM_IN_QMATMUL=1 a qwen35 GDN layer's output projection also RMS-norms o per head as it
    quantises its input (ggml_qmatmul_fused's up with a norm): one RMS_NORM node fewer per recurrent layer, and the
    logits are those of ggml's rms_norm and mul before the same gated product, bit for bit (CPU)."""
    monkeypatch.setenv("PYDFLASH_HEAD_NORM_IN_QMATMUL", "1")

    def norm_first(product, ctx, w, x, row_tiles=0, up=None, norm=None, eps=0.0, **fusions):
        if up is not None and norm is not None:   # the per-head norm as ggml's ops, the gating left inside
            heads = ctx.reshape_3d(up, norm.ne[0], up.ne[0] // norm.ne[0], up.ne[1])
            up, norm = ctx.reshape_2d(ctx.mul(ctx.rms_norm(heads, eps), norm), *up.ne[:2]), None
        return product(ctx, w, x, row_tiles, up=up, norm=norm, eps=eps, **fusions)
    fused, got, plain, ref = _fused_and_separate(tmp_path, monkeypatch, "qwen35-q8_0", norm_first)
    n_rec = sum(fused.hp.recurrent)
    (both, norms), (both_plain, norms_plain) = (
        [sum(n.op == ggml.Op.QMATMUL and n._ptr.src[2] != ffi.NULL and n._ptr.src[4] != ffi.NULL
             for n in t._last.graph.nodes()), sum(n.op == ggml.Op.RMS_NORM for n in t._last.graph.nodes())]
        for t in (fused, plain))
    assert both == n_rec > 0 and both_plain == 0 and norms_plain - norms == n_rec
    assert np.array_equal(got, ref)


def test_recurrent_projections_of_two_types_fuse_in_two_runs(tmp_path, monkeypatch):
    """A file whose beta and alpha are stored in another type than qkv and z (Q8_0 beside Q4_K): the four split into
    two fused matrices, qkv+z and beta+alpha, and the logits stay the unfused model's, bit for bit (CPU)."""
    import pydflash.testing as testing
    storage_type = testing._storage_type

    def mixed(spec, weight_type):
        if spec.name.endswith(("ssm_beta.weight", "ssm_alpha.weight")):
            return "Q8_0"
        return storage_type(spec, weight_type)
    monkeypatch.setattr(testing, "_storage_type", mixed)
    path = str(tmp_path / "mixed.gguf")
    write_qwen35_gguf(path, **dict(CUDA_SHAPE, n_embd=256, weight_type="Q4_K", seed=9))
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 400, 20)]
    fused, got = _run(path, "cpu", prompt, 3)
    monkeypatch.setenv("PYDFLASH_FUSED_WEIGHTS", "0")
    plain, ref = _run(path, "cpu", prompt, 3)
    assert GGUFFile(path).tensors["blk.0.ssm_beta.weight"].type != GGUFFile(path).tensors["blk.0.attn_qkv.weight"].type
    assert sorted(k for k in fused.weights.fused if k.startswith("blk.0.") and k.endswith(".weight")) == \
        ["blk.0.attn_qkv+attn_gate.weight", "blk.0.ffn_gate+ffn_up.weight", "blk.0.ssm_beta+ssm_alpha.weight"]
    assert np.array_equal(got, ref)
