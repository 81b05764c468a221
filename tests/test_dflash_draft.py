"""The DFlash draft: logits against z-lab's reference (PyPI `dflash`, PyTorch, float64), the context cache
against recomputation, device top-K, both loaders, and loading errors.

Shapes are tiny (hidden 64, 2 draft layers, block 16, a 459-token vocabulary) so the file runs in seconds.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from pydflash import testing
from pydflash.gguf_io import GGUFError, GGUFFile
from pydflash.models.dflash_draft import DFlashDraft, DraftLoadError, read_safetensors_header
from pydflash.models.qwen35 import Qwen35Target

try:    # the oracle: z-lab's own PyTorch model. Missing it is an error, not a skip.
    import torch
    import dflash.model as zlab
except ImportError as e:   # pragma: no cover
    raise ImportError(f"tests/test_dflash_draft.py needs z-lab's reference: pip install torch==2.13.0 (CPU wheel), "
                      f"then pip install transformers==5.15.0 and pip install --no-deps dflash==0.1.0 ({e})") from e

WINDOW = 64          # a small ring, so contexts of 100+ positions wrap it
CAPTURE = (1, 2)     # target layers the tiny drafts read

# Tolerance on draft logits against the float64 reference, as max |error| / max |reference logit|.
# Our path keeps the weights in bf16 (exactly the reference's values) but rounds the activations entering each
# bf16 matrix product to bf16 (ggml's CPU vec_dot type for BF16; relative step 2^-9 ~ 2e-3), stores the context
# K/V in f16 and runs flash attention with f16 K/V: each adds ~1e-3 relative error per layer, and 2 layers plus
# the LM head accumulate to ~2.5e-3 measured (CPU). 1e-2 leaves 4x margin and stays below what one real mistake
# costs: a wrong RoPE base, a block position off by one, or features from the wrong layers (checked below).
LOGIT_TOL = 1e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dflash")
    target = d / "target.gguf"
    testing.write_qwen35_gguf(target)   # tiny: 4 layers, hidden 64, F32
    full = d / "draft"
    testing.write_dflash_draft(full, target, target_layer_ids=list(CAPTURE), seed=1)
    swa = d / "draft_swa"
    testing.write_dflash_draft(swa, target, target_layer_ids=list(CAPTURE), seed=2,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    # every maths-changing size differs from the defaults; head 128 rather than 32, which CUDA's flash
    # attention has no kernel for (the H100 run refused it)
    odd = d / "draft_odd"
    testing.write_dflash_draft(odd, target, target_layer_ids=list(CAPTURE), seed=3, n_layer=3, n_head=8,
                               n_head_kv=2, head_dim=128, n_ff=96, block_size=8, rope_theta=1e6, rms_eps=1e-5,
                               mask_token_id=300)
    gguf_draft = d / "draft.gguf"
    testing.write_dflash_gguf(gguf_draft, full)
    return {"dir": d, "target": target, "full": full, "swa": swa, "odd": odd, "gguf": gguf_draft}


@pytest.fixture(scope="module")
def target_cache():
    return {}


def _target(models, backend, target_cache):
    key = backend.name
    if key not in target_cache:
        target_cache[key] = Qwen35Target(models["target"], backend, n_ctx=512, capture_layers=CAPTURE)
    return target_cache[key]


# --- the reference ------------------------------------------------------------------------------------------------

def _target_matrix(path, name) -> np.ndarray:
    gf = GGUFFile(path)
    info = gf.tensors[name]
    assert info.type.name == "F32"
    return np.frombuffer(gf.data(info).tobytes(), np.float32).reshape(info.ne[1], info.ne[0]).astype(np.float64)


class Reference:
    """z-lab's DFlashDraftModel in float64 on the draft's bf16 weights, with the target's embedding and head."""

    def __init__(self, draft_dir, target_path, **config_overrides):
        from transformers import Qwen3Config
        with open(os.path.join(draft_dir, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(config_overrides)
        self.model = zlab.DFlashDraftModel(Qwen3Config(**cfg)).to(torch.float64).eval()
        tensors, mm = read_safetensors_header(os.path.join(draft_dir, "model.safetensors"))
        state = {}
        for name, info in tensors.items():
            raw = np.asarray(mm[info.offset: info.offset + info.nbytes]).view(np.uint16)
            values = testing.bf16_to_f32(raw).reshape(info.ne[::-1])
            state[name] = torch.from_numpy(values.astype(np.float64))
        self.model.load_state_dict(state, strict=True)
        self.embed = torch.from_numpy(_target_matrix(target_path, "token_embd.weight"))
        self.head = torch.from_numpy(_target_matrix(target_path, "output.weight"))
        self.block = self.model.block_size
        self.mask = self.model.mask_token_id

    @torch.inference_mode()
    def logits(self, features: np.ndarray, first_pos: int, last_token: int, block_shift: int = 0) -> np.ndarray:
        """features [m, n_feat, E] of positions first_pos..first_pos+m-1; the block follows at first_pos+m
        (+ block_shift, to model a position off-by-one)."""
        m = len(features)
        start = first_pos + m
        block = torch.tensor([[last_token] + [self.mask] * (self.block - 1)])
        noise = torch.nn.functional.embedding(block, self.embed)
        hidden = torch.from_numpy(features.reshape(1, m, -1).astype(np.float64))
        pos = torch.cat([torch.arange(start - m, start), torch.arange(start, start + self.block) + block_shift])[None]
        out = self.model(position_ids=pos, noise_embedding=noise, target_hidden=hidden)
        return self.model.compute_logits(out[:, 1:, :], lambda h: h @ self.head.T)[0].numpy()


def _max_rel(got, ref) -> float:
    assert got.shape == ref.shape
    assert np.all(np.isfinite(got))
    return float(np.abs(got - ref).max() / np.abs(ref).max())


# --- draft logits vs the reference ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["full", "swa", "odd", "gguf"])
@pytest.mark.parametrize("n_ctx", [1, 37, 100])      # 100 > WINDOW: the reference gets the same last 64
def test_logits_match_zlab_reference(models, backend, target_cache, rng, kind, n_ctx):
    target = _target(models, backend, target_cache)
    draft = DFlashDraft(models[kind], target, window=WINDOW, top_k=4)
    ref = Reference(models["full" if kind == "gguf" else kind], models["target"])
    features = rng.standard_normal((n_ctx, len(CAPTURE), 64)).astype(np.float32)
    draft.append_features(features)
    assert draft.n_ctx == n_ctx
    got = draft.logits(last_token=123)
    assert got.shape == (ref.block - 1, 459)
    keep = min(n_ctx, WINDOW)
    want = ref.logits(features[n_ctx - keep:], n_ctx - keep, 123)
    err = _max_rel(got, want)
    print(f"{kind} n_ctx={n_ctx} {backend.name}: max |logit error| / max |logit| = {err:.2e}")
    assert err < LOGIT_TOL


def test_reference_check_is_sensitive(models, backend, target_cache, rng):
    """The tolerance separates real mistakes: a wrong RoPE base, a position off by one, features of the wrong
    layers."""
    target = _target(models, backend, target_cache)
    draft = DFlashDraft(models["full"], target, window=WINDOW)
    features = rng.standard_normal((37, len(CAPTURE), 64)).astype(np.float32)
    draft.append_features(features)
    got = draft.logits(last_token=123)
    wrong_theta = Reference(models["full"], models["target"], rope_theta=1e4,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    ref = Reference(models["full"], models["target"])
    errors = {"right": _max_rel(got, ref.logits(features, 0, 123)),
              "rope_theta 1e4": _max_rel(got, wrong_theta.logits(features, 0, 123)),
              "block one position late": _max_rel(got, ref.logits(features, 0, 123, block_shift=1)),
              "captured layers swapped": _max_rel(got, ref.logits(features[:, ::-1], 0, 123))}
    print(errors)
    assert errors["right"] < LOGIT_TOL
    assert min(v for k, v in errors.items() if k != "right") > 2 * LOGIT_TOL


# --- the context cache ---------------------------------------------------------------------------------------------

def test_cache_appends_equal_recomputation_across_wrap(models, backend, target_cache, rng):
    target = _target(models, backend, target_cache)
    incremental = DFlashDraft(models["swa"], target, window=WINDOW)
    scratch = DFlashDraft(models["swa"], target, window=WINDOW)
    features = rng.standard_normal((3 * WINDOW + 5, len(CAPTURE), 64)).astype(np.float32)
    done, checks = 0, 0
    # compare when first reaching each mark (before the ring fills, as it wraps, after, at the end) and at
    # random points; commit sizes are random, so the marks are crossed rather than hit exactly
    marks = [40, WINDOW, WINDOW + 7, len(features)]
    while done < len(features):
        m = int(rng.integers(1, 17))          # commits of 1..B positions, as after verify steps
        incremental.append_features(features[done: done + m])
        done = min(done + m, len(features))
        crossed = bool(marks) and done >= marks[0]
        while marks and done >= marks[0]:
            marks.pop(0)
        if crossed or rng.random() < 0.1:
            scratch.reset()
            scratch.append_features(features[:done])     # recompute the last WINDOW positions in one batch
            a, b = incremental.logits(7), scratch.logits(7)
            # same per-row products; only the batch size of the projections differs (GEMM blocking may
            # reorder sums), so agreement is to f32/f16 rounding, not to the bf16 tolerance above
            assert _max_rel(a, b) < 1e-3, done
            checks += 1
    # one commit can cross both WINDOW and WINDOW + 7; the other marks are more than 16 apart: >= 3 checks
    assert incremental.n_ctx == len(features) and checks >= 3


@pytest.mark.parametrize("kind", [(False, 0), (True, 0), (True, 8), (False, 8)])
def test_mask_follows_the_held_positions(models, backend, target_cache, rng, kind):
    """The step's mask, written in place, against z-lab's rule applied to the positions the test itself knows the
    ring holds (the last WINDOW appended, at slot p % WINDOW; none past a truncation): before the ring fills, as
    it wraps, after a truncation leaves holes, and after a reset."""
    causal, window = kind
    draft = DFlashDraft(models["full"], _target(models, backend, target_cache), window=WINDOW)
    cache, B = draft.cache, draft.block_size
    held: dict[int, int] = {}                 # slot -> position, kept here

    def want(n_attn):
        kpos = np.full(n_attn, -1)
        kpos[:B] = cache.n_ctx + np.arange(B)
        for slot, p in held.items():
            if B + slot < n_attn:
                kpos[B + slot] = p
        q, k = cache.n_ctx + np.arange(B)[:, None], kpos[None, :]
        visible = (k >= 0) & (q >= 0)          # (every query: [B, n_attn])
        if causal:
            visible = visible & (k <= q)
        if window:
            visible = visible & (q - k < window) & ((k - q < window) | causal)
        return np.where(visible, 0.0, -np.inf).astype(np.float16)

    def check():
        n_attn = cache.n_attended()
        out = np.full((B, n_attn), 7, np.float16)
        assert cache.mask(n_attn, causal, window, out=out) is out
        np.testing.assert_array_equal(out, want(n_attn))
        np.testing.assert_array_equal(cache.mask(n_attn, causal, window), want(n_attn))

    check()
    truncated = False
    while cache.n_ctx <= 2 * WINDOW:
        m = int(rng.integers(1, 17))
        positions = range(cache.n_ctx, cache.n_ctx + m)
        cache.commit(cache.n_ctx, m)
        held.update({p % WINDOW: p for p in positions})
        if not truncated and cache.n_ctx >= 20:   # (before the ring wraps) the last few forgotten: masked again
            n, truncated = cache.n_ctx - 3, True
            assert cache.truncate(n)
            held = {s: p for s, p in held.items() if p < n}
        check()
    cache.reset()
    held = {}
    check()


def test_append_from_target_device_path(models, backend, target_cache, rng):
    """Features gathered on the device from the target's capture buffer == the same features from the host."""
    target = _target(models, backend, target_cache)
    target.reset()
    device = DFlashDraft(models["full"], target, window=WINDOW)
    host = DFlashDraft(models["full"], target, window=WINDOW)
    tokens = rng.integers(0, 400, 30)
    target.prefill(tokens[:20], return_logits=False)
    device.append_from_target()
    host.append_features(target.captured_features())
    target.forward(tokens[20:30])
    rows = [0, 1, 2, 5]                     # e.g. an accepted tree path
    device.append_from_target(rows)
    host.append_features(target.captured_features()[rows])
    assert device.n_ctx == host.n_ctx == 24
    np.testing.assert_array_equal(device.logits(9), host.logits(9))
    target.reset()


# a forward's 8 tokens as tree slots: their depths, and paths of slots at depths 0, 1, 2, .. (the gather takes
# them) or not (the append computes them)
STAGE_DEPTHS = [0, 1, 1, 2, 2, 3, 3, 4]


def _two_drafts(models, backend, target_cache, rng):
    """The target after a forward of len(STAGE_DEPTHS) tokens, and two drafts whose contexts hold the 20 before."""
    target = _target(models, backend, target_cache)
    target.reset()
    ahead = DFlashDraft(models["full"], target, window=WINDOW)
    plain = DFlashDraft(models["full"], target, window=WINDOW)
    target.forward(rng.integers(0, 400, 20))
    for d in (ahead, plain):
        d.append_from_target()
    target.forward(rng.integers(0, 400, len(STAGE_DEPTHS)))
    return target, ahead, plain


def _assert_same_context(ahead, plain, backend, gpu_rel=LOGIT_TOL / 10, logits=None):
    """The two drafts' context rows equal (CPU), and their logits (CPU: equal; GPU: within gpu_rel)."""
    got, want = logits if logits is not None else (ahead.logits(9), plain.logits(9))
    if backend.name == "CPU":
        ahead.settle()
        n = plain.n_ctx
        for k_ahead, k_plain in zip(ahead.cache.k + ahead.cache.v, plain.cache.k + plain.cache.v):
            np.testing.assert_array_equal(k_ahead.numpy()[16:16 + n], k_plain.numpy()[16:16 + n])
        np.testing.assert_array_equal(got, want)
    else:
        rel = _max_rel(got, want)
        assert rel < gpu_rel, f"max rel {rel}"


def _copied_staged_rows(draft) -> set[str]:
    """Which graphs copied staged rows into the ring: a draft forward's ('step') or settle's ('gather')."""
    return {k[0] for k in draft._graphs if k[0] == "gather" or (k[0] == "step" and len(k) > 3)}


@pytest.mark.parametrize("rows, staged", [([0, 2, 4, 6], True), ([0, 1, 3], True), ([0], True),
                                          ([0, 2, 1], False), ([1, 3], False)])
def test_staged_append_equals_the_append(models, backend, target_cache, rng, rows, staged):
    """stage_from_target (every token of a forward computed ahead at its depth) then append_from_target(rows) fills
    the context as the plain append does; where rows sit at depths 0, 1, 2, .. the next draft forward copies the
    staged rows into the ring before its attention, elsewhere the append computes them."""
    target, ahead, plain = _two_drafts(models, backend, target_cache, rng)
    ahead.stage_from_target(20, STAGE_DEPTHS)
    ahead.append_from_target(rows)
    plain.append_from_target(rows)
    assert ahead.n_ctx == plain.n_ctx == 20 + len(rows)
    logits = ahead.logits(9), plain.logits(9)      # (the forward copies the staged rows)
    assert _copied_staged_rows(ahead) == ({"step"} if staged else set())
    # the staging's products take 8 columns, the append's len(rows): on the GPU a one-column product takes a kernel
    # that does not round its activations to bf16 (H100: 1.8e-3 apart for rows [0], under 1e-3 for the others), each
    # path within the reference's bound; a row at a wrong position or slot is O(0.1) off
    _assert_same_context(ahead, plain, backend, LOGIT_TOL / 10 if len(rows) > 1 else LOGIT_TOL / 2, logits)
    target.reset()


def test_settle_copies_staged_rows_without_a_step(models, backend, target_cache, rng):
    """An append of staged rows followed by no draft forward (the end of a run): settle copies them into the ring;
    so does a later append (ring writes stay in position order)."""
    target, ahead, plain = _two_drafts(models, backend, target_cache, rng)
    ahead.stage_from_target(20, STAGE_DEPTHS)
    for d in (ahead, plain):
        d.append_from_target([0, 2, 4])
    ahead.settle()
    assert _copied_staged_rows(ahead) == {"gather"}
    target.forward(rng.integers(0, 400, len(STAGE_DEPTHS)))
    ahead.stage_from_target(23, STAGE_DEPTHS)
    for d in (ahead, plain):
        d.append_from_target([0, 1])          # staged: left for the next forward
        d.append_from_target([5])             # not staged (taken already): computed after copying the pending rows
    assert ahead.n_ctx == plain.n_ctx == 26
    _assert_same_context(ahead, plain, backend)
    target.reset()


def test_staged_rows_go_stale(models, backend, target_cache, rng):
    """Staged rows describe one forward at one position: after another forward of the target, or a truncation
    of the draft's context, the append computes its rows (and gets those of the new forward); staging at a
    position the context does not end at, or with depths for another number of tokens, is refused."""
    target, ahead, plain = _two_drafts(models, backend, target_cache, rng)
    with pytest.raises(ValueError, match="position 19"):
        ahead.stage_from_target(19, STAGE_DEPTHS)
    with pytest.raises(ValueError, match="depths for 7 tokens"):
        ahead.stage_from_target(20, STAGE_DEPTHS[:7])
    ahead.stage_from_target(20, STAGE_DEPTHS)
    target.forward(rng.integers(0, 400, len(STAGE_DEPTHS)))      # another forward: the staging is stale
    ahead.append_from_target([0, 2])
    plain.append_from_target([0, 2])
    assert _copied_staged_rows(ahead) == set()
    ahead.stage_from_target(22, STAGE_DEPTHS)
    assert ahead.truncate(21) and plain.truncate(21)              # the context moved: stale as well
    ahead.append_from_target([0, 1])
    plain.append_from_target([0, 1])
    assert _copied_staged_rows(ahead) == set()
    _assert_same_context(ahead, plain, backend)
    target.reset()


def test_fused_projections_change_nothing(models, backend, target_cache, rng, monkeypatch):
    """Q, K and V of a layer load as the rows of one matrix (qkv_proj; K and V also as kv_proj), the FFN's gate and
    up as another (gateup_proj), each a tensor on its own rows: the rows hold the file's matrices in that order,
    and the draft's logits and proposals (step and context appends through the fused products) are the ones of
    separate matrices (PYDFLASH_FUSED_WEIGHTS=0): bit for bit on the CPU, where a row's product does not depend on
    its neighbours."""
    target = _target(models, backend, target_cache)
    fused = DFlashDraft(models["odd"], target, window=WINDOW, top_k=4)
    monkeypatch.setenv("PYDFLASH_FUSED_WEIGHTS", "0")
    apart = DFlashDraft(models["odd"], target, window=WINDOW, top_k=4)
    w, p = fused.weights, "layers.1.self_attn."
    assert p + "qkv_proj.weight" in w and p + "qkv_proj.weight" not in apart.weights
    def rows(t):   # the matrix's rows as raw bytes
        return t.numpy().reshape(t.ne[1], -1)
    parts = [rows(apart.weights[p + f"{m}_proj.weight"]) for m in "qkv"]
    np.testing.assert_array_equal(rows(w[p + "qkv_proj.weight"]), np.concatenate(parts))   # each read into its rows
    np.testing.assert_array_equal(rows(w[p + "kv_proj.weight"]), np.concatenate(parts[1:]))
    p = "layers.1.mlp."
    assert p + "gateup_proj.weight" in w and p + "gateup_proj.weight" not in apart.weights
    np.testing.assert_array_equal(rows(w[p + "gateup_proj.weight"]),
                                  np.concatenate([rows(apart.weights[p + f"{m}_proj.weight"]) for m in ("gate", "up")]))
    features = rng.standard_normal((40, len(CAPTURE), 64)).astype(np.float32)
    for draft in (fused, apart):
        draft.append_features(features)
    if backend.name == "CPU":
        np.testing.assert_array_equal(fused.logits(7), apart.logits(7))
        for a, b in zip(fused.propose(7), apart.propose(7)):
            np.testing.assert_array_equal(a, b)
    else:   # a GPU may pick another kernel for a matrix of other rows (its rounding of the activations)
        assert _max_rel(fused.logits(7), apart.logits(7)) < LOGIT_TOL / 10


def test_propose_runs_then_once_between_queueing_and_waiting(models, backend, target_cache, rng):
    """propose(token, then): `then` runs once, after the forward is queued and before its proposals are read, so
    work it queues (the engine's target commit) overlaps the host's; the proposals are those without it."""
    target = _target(models, backend, target_cache)
    draft = DFlashDraft(models["full"], target, window=WINDOW, top_k=5)
    draft.append_features(rng.standard_normal((20, len(CAPTURE), 64)).astype(np.float32))
    want = draft.propose(42)
    calls = []
    got = draft.propose(42, then=lambda: calls.append(draft.n_ctx))
    assert calls == [20]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_propose_top_k_on_device(models, backend, target_cache, rng):
    target = _target(models, backend, target_cache)
    draft = DFlashDraft(models["full"], target, window=WINDOW, top_k=5)
    draft.append_features(rng.standard_normal((20, len(CAPTURE), 64)).astype(np.float32))
    ids, logp = draft.propose(42)
    logits = draft.logits(42).astype(np.float64)
    assert ids.shape == logp.shape == (15, 5)
    log_softmax = logits - logits.max(1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(1, keepdims=True))
    want = np.argsort(-logits, axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(ids, want)
    # logit - logsumexp in one op: within 1e-5 (the bound of tests/test_top_k_logp.py)
    np.testing.assert_allclose(logp, np.take_along_axis(log_softmax, want, 1), rtol=0, atol=1e-5)
    assert np.all(np.diff(logp, axis=1) <= 0)
    # graphs are reused: the same context bucket needs no new step graph
    n = draft.n_graphs
    draft.propose(43)
    assert draft.n_graphs == n


# --- loading --------------------------------------------------------------------------------------------------------

def test_loaded_config_fields(models, backend, target_cache):
    target = _target(models, backend, target_cache)
    d = DFlashDraft(models["swa"], target)
    assert d.hp.target_layer_ids == CAPTURE and d.hp.block_size == 16 and d.hp.mask_token_id == 458
    assert d.hp.window == (8, 0) and d.hp.causal == (True, False) and d.hp.rope_theta == 1e7
    assert d.weights["layers.0.self_attn.q_proj.weight"].type.name == "BF16"   # not upcast
    g = DFlashDraft(models["gguf"], target)
    assert g.hp.target_layer_ids == CAPTURE    # stored as lid+1 in the GGUF


def test_missing_file(models, tmp_path):
    target = Qwen35Target(models["target"], "cpu", n_ctx=256, capture_layers=CAPTURE)
    (tmp_path / "config.json").write_text((models["full"] / "config.json").read_text())
    with pytest.raises(DraftLoadError, match="model.safetensors: no such file"):
        DFlashDraft(tmp_path, target)


def test_wrong_dtype(models, tmp_path):
    target = Qwen35Target(models["target"], "cpu", n_ctx=256, capture_layers=CAPTURE)
    testing.write_dflash_draft(tmp_path, models["target"], target_layer_ids=list(CAPTURE))
    tensors, mm = read_safetensors_header(tmp_path / "model.safetensors")
    arrays = {n: testing.bf16_to_f32(np.asarray(mm[t.offset: t.offset + t.nbytes]).view(np.uint16))
              .reshape(t.ne[::-1]) for n, t in tensors.items()}
    arrays["fc.weight"] = arrays["fc.weight"].astype(np.float64)
    del mm
    testing.write_safetensors(tmp_path / "model.safetensors",
                              {n: (a if a.dtype == np.float64 else testing.bf16_bits(a)) for n, a in arrays.items()})
    with pytest.raises(DraftLoadError, match=r"fc.weight' has dtype F64; expected BF16"):
        DFlashDraft(tmp_path, target)


def test_truncated_safetensors(models, tmp_path):
    target = Qwen35Target(models["target"], "cpu", n_ctx=256, capture_layers=CAPTURE)
    testing.write_dflash_draft(tmp_path, models["target"], target_layer_ids=list(CAPTURE))
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(DraftLoadError, match="outside the file"):
        DFlashDraft(tmp_path, target)
    path.write_bytes((10 ** 12).to_bytes(8, "little") + b"{}")
    with pytest.raises(DraftLoadError, match="damaged safetensors header"):
        DFlashDraft(tmp_path, target)


@pytest.mark.parametrize("field,config", [
    ("hidden_size", {}),                                   # written for a 32-wide target
    ("target_layer_ids", {"target_layer_ids": [1, 4]}),    # the target has layers 0..3
    ("mask_token_id", {"mask_token_id": 459}),             # the vocabulary is 0..458
])
def test_mismatched_target(models, tmp_path, field, config):
    target = Qwen35Target(models["target"], "cpu", n_ctx=256, capture_layers=CAPTURE)
    source = models["target"]
    if field == "hidden_size":
        source = tmp_path / "narrow.gguf"
        testing.write_qwen35_gguf(source, n_embd=32)
    draft_dir = tmp_path / "draft"
    testing.write_dflash_draft(draft_dir, source, **{"target_layer_ids": list(CAPTURE), **config})
    with pytest.raises(DraftLoadError) as e:
        DFlashDraft(draft_dir, target)
    msg = str(e.value)
    assert field in msg and str(draft_dir) in msg and str(models["target"]) in msg, msg


def test_vocab_mismatch_and_unsupported(models, tmp_path):
    target = Qwen35Target(models["target"], "cpu", n_ctx=256, capture_layers=CAPTURE)
    testing.write_dflash_draft(tmp_path, models["target"], target_layer_ids=list(CAPTURE))
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg_path.write_text(json.dumps({**cfg, "vocab_size": 500}))
    with pytest.raises(DraftLoadError, match="vocab_size.*500"):
        DFlashDraft(tmp_path, target)
    cfg_path.write_text(json.dumps({k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_parameters")}))
    with pytest.raises(DraftLoadError, match="rope_theta"):
        DFlashDraft(tmp_path, target)
    cfg_path.write_text(json.dumps({**cfg, "dflash_config": {**cfg["dflash_config"], "conv_kernel_size": 4}}))
    with pytest.raises(DraftLoadError, match="DFlash2"):
        DFlashDraft(tmp_path, target)


def test_cli_writes_a_loadable_draft(models, tmp_path):
    out = tmp_path / "cli_draft"
    assert testing.main(["write-dflash", str(out), "--target", str(models["target"]), "--n-layer", "1",
                         "--block-size", "4", "--target-layer-ids", "2"]) == 0
    target = Qwen35Target(models["target"], "cpu", n_ctx=256, capture_layers=(2,))
    draft = DFlashDraft(out, target, top_k=3)
    assert draft.hp.n_layer == 1 and draft.hp.block_size == 4 and draft.hp.target_layer_ids == (2,)
    draft.append_features(np.ones((3, 1, 64), np.float32))
    ids, logp = draft.propose(5)
    assert ids.shape == (3, 3) and np.all(np.isfinite(logp))


def test_not_a_draft_gguf(models):
    target = Qwen35Target(models["target"], "cpu", n_ctx=256, capture_layers=CAPTURE)
    with pytest.raises(GGUFError, match="architecture is 'qwen35', expected 'dflash'"):
        DFlashDraft(models["target"], target)
    with pytest.raises(ValueError, match="captures layers"):
        DFlashDraft(models["full"], Qwen35Target(models["target"], "cpu", n_ctx=256,
                                                 capture_layers=(2, 1))).append_from_target()
