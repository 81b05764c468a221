"""Long-context mechanics of the target: attention reads only the filled KV bucket (prefill, decode and verify),
whatever n_ctx was allocated, and the prefill micro-batch chosen by prompt length gives the logits of a fixed
one."""
from __future__ import annotations

import numpy as np
import pytest

from pydflash import ggml
from pydflash.models import load_target, runtime
from pydflash.models.qwen35 import Qwen35Target
from pydflash.models.runtime import KV_BUCKET, prefill_ubatch
from pydflash.testing import write_llama_gguf, write_qwen35_gguf

LOGIT_ATOL_F32 = 1e-3      # tests/test_qwen35.py's f32 bound between micro-batch splits


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("longctx") / "t.gguf"
    write_qwen35_gguf(path, seed=21, recurrent_layers=(True, False, True, False))
    return path


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("longctx") / "llama.gguf"
    write_llama_gguf(path, seed=22)
    return path


def attended_lengths(target) -> set[int]:
    """The KV length every flash-attention node of the last forward reads (its K operand's ne[1])."""
    nodes = [n for n in target._last.graph.nodes() if n.op == ggml.Op.FLASH_ATTN_EXT]
    assert len(nodes) == len(target.cache.k)
    return {n.src[1].ne[1] for n in nodes}


def bucket(n: int) -> int:
    return -(-n // KV_BUCKET) * KV_BUCKET


@pytest.mark.parametrize("arch", ["qwen35", "llama"])
def test_attention_reads_only_the_filled_bucket(arch, request):
    """With 8192 cells allocated, prefill micro-batches, decode steps and verifies attend to the bucket of the
    positions filled so far (n_past + the new tokens), never the allocation, and compute exactly what a
    target allocated just large enough computes (the shared runtime: a hybrid and an attention-only model)."""
    path = request.getfixturevalue("model" if arch == "qwen35" else "llama_model")
    prompt = [int(t) for t in np.random.default_rng(1).integers(3, 400, 300)]
    big = load_target(path, "cpu", n_ctx=8192, n_ubatch=128)
    small = load_target(path, "cpu", n_ctx=512, n_ubatch=128)
    seen = []
    big.prefill(prompt, ubatch=128, on_ubatch=lambda first, n: seen.append((first + n, attended_lengths(big))))
    assert seen == [(128, {256}), (256, {256}), (300, {512})]
    assert np.array_equal(big.logits(), small.prefill(prompt, ubatch=128))
    token = big.argmax()
    for _ in range(3):
        assert np.array_equal(big.decode(token), small.decode(token))
        assert attended_lengths(big) == {bucket(big.n_past)}
        token = big.argmax()
    for t in (big, small):
        t.enable_verify(6)
    parents, depths = np.array([-1, 0, 1, 1, 3, 4]), np.array([0, 1, 2, 2, 3, 4])
    tokens = [token, 5, 6, 7, 8, 9]
    assert np.array_equal(big.verify(tokens, parents, depths), small.verify(tokens, parents, depths))
    assert attended_lengths(big) == {bucket(big.n_past + 6)} == {512}


def test_prefill_ubatch_grows_with_the_prompt():
    assert [prefill_ubatch(n, 2048) for n in (1, 300, 8192, 8193, 16384, 16385, 32768, 200_000)] == \
        [512, 512, 512, 1024, 1024, 2048, 2048, 2048]
    assert prefill_ubatch(200_000, 512) == 512          # never past the target's n_ubatch
    assert prefill_ubatch(100, 64) == 64


def test_auto_micro_batch_gives_the_logits_of_a_fixed_one(model, monkeypatch):
    """The same split rule at a tiny scale (start at 8 tokens, at most 16 batches): a 200-token prompt runs in
    batches of 16, and its logits match a fixed 64-token split within the f32 bound of test_qwen35."""
    monkeypatch.setattr(runtime, "PREFILL_MIN_UBATCH", 8)
    prompt = [int(t) for t in np.random.default_rng(2).integers(3, 400, 200)]
    target = Qwen35Target(model, "cpu", n_ctx=256, n_ubatch=64)
    sizes = []
    auto = target.prefill(prompt, on_ubatch=lambda first, n: sizes.append(n))
    assert sizes == [16] * 12 + [8]
    target.reset()
    fixed = target.prefill(prompt, ubatch=64)
    assert np.abs(auto - fixed).max() <= LOGIT_ATOL_F32
    target.reset()
    with pytest.raises(ValueError, match="ubatch 65 outside 1..n_ubatch"):
        target.prefill(prompt, ubatch=65)


def test_masks_updated_in_place_equal_fresh_ones():
    """The host masks kept with a graph, updated only where they change, equal masks built from scratch for any
    sequence of positions (forward and back, as after a reset)."""
    rng = np.random.default_rng(3)
    n, n_kv = 5, 512
    causal, tree = runtime.GraphInputs(n, n_kv, 8, tree=False), runtime.GraphInputs(n, n_kv, 8, tree=True)
    for n_past in (0, 3, 4, 100, 101, 507, 250, 2, 300):
        want = np.where(np.arange(n_kv)[None, :] <= n_past + np.arange(n)[:, None], 0.0, -np.inf)
        assert np.array_equal(causal.causal_mask(n_past), want.astype(np.float16))
        parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, n)])
        seen = runtime._ancestors(parents)
        want = np.full((n, n_kv), -np.inf)
        want[:, :n_past] = 0.0
        want[:, n_past:n_past + n][seen] = 0.0
        assert np.array_equal(tree.tree_mask(n_past, seen), want.astype(np.float16))


def test_verify_masks_shared_by_the_buckets_graphs(model):
    """Verify graphs of different KV buckets keep their host masks in one page-locked buffer: a graph that comes
    back after another one used it rewrites its masks whole, and every verify computes what a fresh target
    computes at the same position (the graphs' order: bucket 256, then 512, then 256 again)."""
    rng = np.random.default_rng(4)
    parents, depths = np.array([-1, 0, 1, 1, 3, 4]), np.array([0, 1, 2, 2, 3, 4])
    target = load_target(model, "cpu", n_ctx=1024, n_ubatch=128)
    target.enable_verify(6)
    for n_prompt, n_kv in ((20, 256), (300, 512), (30, 256)):
        prompt = [int(t) for t in rng.integers(3, 400, n_prompt)]
        tokens = [int(t) for t in rng.integers(3, 400, 6)]
        fresh = load_target(model, "cpu", n_ctx=1024, n_ubatch=128)
        fresh.enable_verify(6)
        got = []
        for t in (target, fresh):
            t.reset()
            t.prefill(prompt, return_logits=False)
            t.verify(tokens, parents, depths)
            got.append(t.logits_of_slots())
        assert attended_lengths(target) == {n_kv}
        np.testing.assert_array_equal(got[0], got[1])
