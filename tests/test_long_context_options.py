"""The long-context memory options of `load`: the draft's matrices quantized to q8_0 or q4_k at load (draft_type)
and f16 verify node states (state_type), how the memory plan counts and picks them, and the CLI flags.

Oracles: float64 numpy for the q8_0 blocks on the device, ggml's Q4_K quantizer and gguf-py's Q4_K decoder for the
q4_k blocks, z-lab's PyTorch draft (float64, bf16 weights) for the quantized draft's logits, plain AR decoding for
the speculative output, sums by hand for the plan.
"""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

import pydflash
from pydflash import cli, ggml, plan, testing
from pydflash.models.dflash_draft import DFlashDraft, DraftLoadError, read_safetensors_header
from pydflash.models.qwen35 import Qwen35Target
from test_dflash_draft import LOGIT_TOL, Reference, _max_rel

GiB = 1 << 30
CAPTURE = (1, 2)
N_GEN = 40
# The q8_0 draft's logits against z-lab's float64 model on the bf16 weights. Q8_0 rounds each weight to a step of
# its 32-value block's max / 127 (relative RMS error ~0.5% for Gaussian weights, 4-5x bf16's), and ggml quantizes
# the activations entering a Q8_0 product to 8 bits per 32 values as well (bf16 products round them to bf16):
# about 4x the bf16 path's error per product, so ~1e-2 of the largest logit expected where the bf16 path measures
# 2.5e-3 (tests/test_dflash_draft.py); 3x margin.
Q8_LOGIT_TOL = 3e-2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("lc_options")
    target = d / "target.gguf"
    testing.write_qwen35_gguf(target, seed=5)
    draft = d / "draft"
    testing.write_dflash_draft(draft, target, target_layer_ids=list(CAPTURE), seed=6)
    return str(target), str(draft)


@pytest.fixture(scope="module")
def target(pair):
    return Qwen35Target(pair[0], "cpu", n_ctx=512, capture_layers=CAPTURE)


def dequantize_q8_0(raw: np.ndarray, n_per_row: int) -> np.ndarray:
    """float64 values of Q8_0 rows: per 32 values an f16 scale d, then 32 int8 q; value = d * q."""
    blocks = np.ascontiguousarray(raw).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float64)
    return (d * q).reshape(-1, n_per_row)


def stored_tensors(draft_dir):
    """z-lab name -> (ne, the stored bf16 values as float64 rows [n_rows, ne[0]])."""
    tensors, mm = read_safetensors_header(os.path.join(draft_dir, "model.safetensors"))
    for name, info in tensors.items():
        raw = np.asarray(mm[info.offset: info.offset + info.nbytes]).view(np.uint16)
        yield name, info.ne, testing.bf16_to_f32(raw).astype(np.float64).reshape(-1, info.ne[0])


def check_q8_0(name, t, stored):
    """Each value within half a quantization step d (the block's max |value| / 127) of the bf16 value, plus the
    scale's rounding to f16 (relative 2^-11) times |q| <= 127."""
    assert t.type == ggml.Type.Q8_0, name
    blocks = stored.reshape(-1, 32)
    got = dequantize_q8_0(t.numpy(), stored.shape[1]).reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / 127
    err = np.abs(got - blocks)
    assert (err <= d * (0.5 + 127 * 2 ** -11) + 1e-12).all(), name
    assert np.median(err / d) < 0.3, name             # rounding to the nearest step: ~d/4 on average
    assert err.max() > 0, name                       # quantized, not copied


def test_q8_0_matrices_are_the_stored_values_quantized(pair, target):
    """Every matrix is Q8_0 on the device (check_q8_0); the norms stay f32 and exact."""
    draft = DFlashDraft(pair[1], target, weight_type="q8_0")
    matrices = 0
    for name, ne, stored in stored_tensors(pair[1]):
        t = draft.weights[name]
        if len(ne) == 1:
            assert t.type == ggml.Type.F32 and np.array_equal(t.numpy().reshape(stored.shape), stored), name
            continue
        matrices += 1
        check_q8_0(name, t, stored)
    assert matrices == 1 + 7 * draft.hp.n_layer          # fc, then q, k, v, o, gate, up, down per layer


def test_q8_0_draft_logits_against_zlab(pair, target):
    """The q8_0 draft's logits stay within Q8_LOGIT_TOL of z-lab's float64 model on the bf16 weights, and further
    from it than the bf16 draft's (which the quantization must show)."""
    rng = np.random.default_rng(7)
    features = rng.standard_normal((37, len(CAPTURE), target.hp.n_embd)).astype(np.float32)
    want = Reference(pair[1], pair[0]).logits(features, 0, 123)
    errors = {}
    for weight_type in (None, "q8_0"):
        draft = DFlashDraft(pair[1], target, weight_type=weight_type)
        draft.append_features(features)
        errors[weight_type] = _max_rel(draft.logits(last_token=123), want)
    print(f"max |logit error| / max |logit|: bf16 {errors[None]:.2e}, q8_0 {errors['q8_0']:.2e}")
    assert errors[None] < LOGIT_TOL
    assert errors[None] < errors["q8_0"] < Q8_LOGIT_TOL


def _ar_reference(target: str, seed: int) -> tuple[list[int], list[int]]:
    """A random 30-token prompt and plain decoding's N_GEN tokens after it."""
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, 400, 30)]
    ar = pydflash.load(target, device="cpu", max_ctx=512, tokenizer=False)
    return prompt, ar.generate(prompt, max_tokens=N_GEN).tokens


def _assert_lossless(pair, reference, mode: str, draft_type: str) -> dict:
    """chain/ddtree with the draft's matrices as draft_type give plain decoding's tokens; returns the draft's
    weights (name -> tensor) for the caller's checks of their types."""
    prompt, want = reference
    engine = pydflash.load(*pair, device="cpu", max_ctx=512, tokenizer=False, mode=mode, draft_type=draft_type)
    assert engine.target.memory_plan.draft_type == draft_type
    assert engine.generate(prompt, max_tokens=N_GEN).tokens == want
    return engine.decoder.draft.draft.weights.t


@pytest.fixture(scope="module")
def reference(pair):
    return _ar_reference(pair[0], 8)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_q8_0_draft_is_lossless(pair, reference, mode):
    weights = _assert_lossless(pair, reference, mode, "q8_0")
    assert weights["fc.weight"].type == ggml.Type.Q8_0


# --- draft_type 'q4_k' ----------------------------------------------------------------------------------------

# A Q4_K value is d*sc*q - dmin*m: per 256-value super-block f16 d and dmin, per 32-value sub-block 6-bit sc and m,
# q in 0..15. ggml's quantizer (no importance matrix) ends by rounding every value to the nearest of its sub-block's
# 16 grid points (clamped to the ends), so each decoded value is a nearest grid point. How good the grid is: for
# N(0, s^2) weights a sub-block of 32 spans ~4.1 s (the expected max of 32 normals is 2.04 s), so the step is
# ~4.1 s / 15 = 0.27 s and rounding to it leaves an RMS error of 0.27 s / sqrt(12) = 0.079 s; the scale search
# only narrows the grid. Bound with a 25% margin:
Q4_K_RMS_TOL = 0.1


@pytest.fixture(scope="module")
def pair_256(tmp_path_factory):
    """A pair 256 wide, so that every draft matrix has rows of whole Q4_K blocks (fc 512, q/k/v/gate/up 256,
    o 4 x 64 = 256, down n_ff 256)."""
    d = tmp_path_factory.mktemp("lc_q4k")
    target = d / "target.gguf"
    testing.write_qwen35_gguf(target, seed=15, n_embd=256)
    draft = d / "draft"
    testing.write_dflash_draft(draft, target, target_layer_ids=list(CAPTURE), n_ff=256, seed=16)
    return str(target), str(draft)


def check_q4_k(name, t, stored):
    """The bytes are ggml's Q4_K of the stored values (the load's row chunks change nothing); decoded by gguf-py,
    each value is a nearest point of its sub-block's grid and the RMS error is within Q4_K_RMS_TOL of the RMS."""
    assert t.type == ggml.Type.Q4_K, name
    raw = t.numpy().reshape(len(stored), -1)
    assert np.array_equal(raw, ggml.quantize(ggml.Type.Q4_K, stored.astype(np.float32))), name
    got = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K).astype(np.float64).reshape(-1, 8, 32)
    blocks = raw.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16])
    step, low = (d * sc)[..., None], -(dmin * m)[..., None]        # [super-block, sub-block, 1]
    want = stored.reshape(-1, 8, 32)
    nearest = low + step * np.clip(np.round((want - low) / np.where(step > 0, step, 1)), 0, 15)
    err = np.abs(got - want)
    assert (err <= np.abs(nearest - want) + 1e-6 * np.abs(want).max()).all(), name
    rms = np.sqrt(np.mean(err ** 2) / np.mean(want ** 2))
    assert 0 < rms < Q4_K_RMS_TOL, (name, rms)


@pytest.mark.parametrize("which", ["pair", "pair_256"])
def test_q4_k_matrices_are_the_stored_values_quantized(which, request):
    """q4_k: matrices with rows of whole 256-value blocks are Q4_K (check_q4_k), the others Q8_0 (check_q8_0); the
    norms stay f32 and exact. The 64-wide pair has one Q4_K matrix per layer (o_proj: 4 heads x 64), the 256-wide
    pair only Q4_K matrices."""
    draft_dir = request.getfixturevalue(which)[1]
    tgt = request.getfixturevalue("target") if which == "pair" else \
        Qwen35Target(request.getfixturevalue(which)[0], "cpu", n_ctx=256, capture_layers=CAPTURE)
    draft = DFlashDraft(draft_dir, tgt, weight_type="q4_k")
    types = {}
    for name, ne, stored in stored_tensors(draft_dir):
        t = draft.weights[name]
        if len(ne) == 1:
            assert t.type == ggml.Type.F32 and np.array_equal(t.numpy().reshape(stored.shape), stored), name
            continue
        types[name] = t.type
        if ne[0] % 256 == 0:
            check_q4_k(name, t, stored)
        else:
            check_q8_0(name, t, stored)
    n_q4_k = list(types.values()).count(ggml.Type.Q4_K)
    assert len(types) == 1 + 7 * draft.hp.n_layer
    assert n_q4_k == (len(types) if which == "pair_256" else draft.hp.n_layer)


# The q4_k draft's logits against z-lab's float64 model: Q4_K's RMS weight error (0.079 s, above) is ~17x Q8_0's
# (a step of 2.04 s / 127 over a 32-block, / sqrt(12): 0.0046 s); the activations entering a Q4_K product are rounded
# to 8 bits per 256 values (Q8_K), as fine as Q8_0's. So at most ~17x the ~1e-2 expected of q8_0 (Q8_LOGIT_TOL's
# reasoning), less where q8_0's error is the activations'.
Q4_LOGIT_TOL = 0.17


def test_q4_k_draft_logits_against_zlab(pair_256):
    """Within Q4_LOGIT_TOL of z-lab's float64 model on the bf16 weights, and further from it than the q8_0 draft."""
    tgt = Qwen35Target(pair_256[0], "cpu", n_ctx=256, capture_layers=CAPTURE)
    features = np.random.default_rng(17).standard_normal((37, len(CAPTURE), tgt.hp.n_embd)).astype(np.float32)
    want = Reference(pair_256[1], pair_256[0]).logits(features, 0, 123)
    errors = {}
    for weight_type in (None, "q8_0", "q4_k"):
        draft = DFlashDraft(pair_256[1], tgt, weight_type=weight_type)
        draft.append_features(features)
        errors[weight_type] = _max_rel(draft.logits(last_token=123), want)
    print(f"max |logit error| / max |logit|: bf16 {errors[None]:.2e}, q8_0 {errors['q8_0']:.2e}, "
          f"q4_k {errors['q4_k']:.2e}")
    assert errors[None] < LOGIT_TOL
    assert errors[None] < errors["q8_0"] < errors["q4_k"] < Q4_LOGIT_TOL


@pytest.fixture(scope="module")
def reference_256(pair_256):
    return _ar_reference(pair_256[0], 18)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["chain", "ddtree"])
def test_q4_k_draft_is_lossless(pair_256, reference_256, mode):
    weights = _assert_lossless(pair_256, reference_256, mode, "q4_k")
    assert {t.type for t in weights.values() if t.ne[1] > 1} == {ggml.Type.Q4_K}


@pytest.mark.parametrize("which", ["pair", "pair_256"])
def test_q4_k_draft_planned_as_allocated(which, request):
    """The plan counts each matrix in the type the load gives it (Q4_K, or Q8_0 where the rows are not whole
    256-value blocks): within the buffer's per-tensor alignment of what is allocated, and below the q8_0 draft's."""
    pair_ = request.getfixturevalue(which)
    plans = {}
    for draft_type in ("q4_k", "q8_0"):
        engine = pydflash.load(*pair_, device="cpu", max_ctx=512, tokenizer=False, draft_type=draft_type)
        d, p = engine.decoder.draft.draft, engine.target.memory_plan
        assert p.draft_type == draft_type
        assert p.parts["draft weights"] <= d.weights.buffer.nbytes <= p.parts["draft weights"] + 64 * len(d.weights.t)
        plans[draft_type] = p.parts["draft weights"]
    assert plans["q4_k"] < plans["q8_0"]


def test_q4_k_rows_of_neither_block_are_refused(pair, target, tmp_path):
    """o_proj rows of 4 heads x 36 = 144 values: not whole Q4_K (256) nor Q8_0 (32) blocks. The plan and the load
    refuse them by tensor name; as stored they load."""
    draft_dir = tmp_path / "odd"
    testing.write_dflash_draft(draft_dir, pair[0], target_layer_ids=list(CAPTURE), head_dim=36, seed=9)
    message = r"tensor 'layers.0.self_attn.o_proj.weight' has rows of 144 values; q4_k needs a multiple of 256 " \
              r"\(or of 32, for q8_0\)"
    with pytest.raises(DraftLoadError, match=message):
        plan.DraftShape.from_path(draft_dir, matrix_type="q4_k")
    with pytest.raises(DraftLoadError, match=message):
        DFlashDraft(draft_dir, target, weight_type="q4_k")
    assert DFlashDraft(draft_dir, target).weights["layers.0.self_attn.o_proj.weight"].type == ggml.Type.BF16


def test_load_state_type_reaches_the_verify(pair, reference):
    """state_type='f16' makes f16 node-state stores (half of f32's bytes, as planned); its output is checked
    against AR's margins in tests/test_engine.py (test_ddtree_f16_states)."""
    prompt, _ = reference
    f32 = pydflash.load(*pair, device="cpu", max_ctx=512, tokenizer=False, draft_type="stored", state_type="f32")
    f16 = pydflash.load(*pair, device="cpu", max_ctx=512, tokenizer=False, draft_type="stored", state_type="f16")
    assert {t.type for t in f16.target.slot_states.values()} == {ggml.Type.F16}
    assert {t.type for t in f32.target.slot_states.values()} == {ggml.Type.F32}
    states = [sum(t.nbytes for t in e.target.slot_states.values()) for e in (f32, f16)]
    assert states[1] * 2 == states[0]
    assert f16.target.memory_plan.parts["verify stores (23 slots, f16)"] < \
        f32.target.memory_plan.parts["verify stores (23 slots, f32)"]
    assert len(f16.generate(prompt, max_tokens=8).tokens) == 8
    assert f16.last_stats["state_type"] == "f16"


def test_load_refuses_bad_options(pair):
    with pytest.raises(ValueError, match=r"state_type 'f16' concerns the speculative verify; mode 'ar'"):
        pydflash.load(pair[0], device="cpu", max_ctx=256, tokenizer=False, state_type="f16")
    with pytest.raises(ValueError, match=r"state_type = 'bf16': expected one of 'auto', 'f32', 'replay', 'f16'"):
        pydflash.load(*pair, device="cpu", max_ctx=256, tokenizer=False, state_type="bf16")
    with pytest.raises(ValueError, match=r"draft_type = 'q4_0': expected one of 'auto', 'stored', 'q8_0', 'q4_k'"):
        pydflash.load(*pair, device="cpu", max_ctx=256, tokenizer=False, draft_type="q4_0")


def test_q8_0_draft_planned_as_allocated(pair):
    engine = pydflash.load(*pair, device="cpu", max_ctx=512, tokenizer=False, draft_type="q8_0")
    d, p = engine.decoder.draft.draft, engine.target.memory_plan
    assert p.parts["draft weights"] <= d.weights.buffer.nbytes <= p.parts["draft weights"] + 64 * len(d.weights.t)
    stored = pydflash.load(*pair, device="cpu", max_ctx=512, tokenizer=False, draft_type="stored")
    assert stored.target.memory_plan.draft_type is None
    assert p.parts["draft weights"] < 0.6 * stored.target.memory_plan.parts["draft weights"]


# --- state_type 'replay': no node states stored, the commit re-runs the accepted path ---------------------------

@pytest.fixture(scope="module")
def engine_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "tiny.gguf"
    testing.write_qwen35_gguf(path, seed=11, recurrent_layers=(True, True, False, True))   # tests/test_engine.py's
    return path


@pytest.mark.slow
@pytest.mark.parametrize("mode,budget", [("chain", 15), ("ddtree", 22)])
def test_replay_state_equals_ar_bit_for_bit(engine_model, mode, budget):
    """An oracle draft with second-rank errors (long accepted paths, off-chain commits): after every step the
    recurrent states and conv windows equal plain decoding's exactly, and the output is AR's."""
    from pydflash.engine import Decoder
    from test_engine import N_GEN as ENGINE_N_GEN, ar_reference, follow_with_ar, oracle
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 400, size=24)]
    target = Qwen35Target(engine_model, "cpu", n_ctx=512, n_ubatch=64)
    ar = Qwen35Target(engine_model, "cpu", n_ctx=512, n_ubatch=64)
    reference = ar_reference(ar, prompt)
    ar.reset()
    ar.prefill(prompt, return_logits=False)

    def recurrent_equal(got, want):
        for name in want:
            if name.startswith(("ssm", "conv")):
                assert np.array_equal(got[name], want[name]), name

    check, checked = follow_with_ar(ar, target, prompt, recurrent_equal)
    decoder = Decoder(target, oracle(prompt, reference, target), mode=mode, budget=budget, state_type="replay")
    assert sum(t.nbytes for t in target.slot_states.values()) == 3 * 4 * (budget + 2) * (   # k, delta, decay
        target.hp.key_dim + target.hp.value_dim + target.hp.ssm_n_v_heads)
    out, stats = decoder.generate_ids(prompt, 100, on_tokens=check)
    assert ENGINE_N_GEN >= 100 and out == reference[0][:100]
    check([])
    assert checked[-1] == target.n_past == len(prompt) + len(out) - 1
    assert sum(c is not None for c in checked) > 8 and stats["acceptance_length"] > 4
    if mode == "ddtree":
        assert stats["off_chain_steps"] > 0


TREE_PARENTS = [-1, 0, 1, 0, 3, 2, 4, 5, 4, 8, -1, -1]   # two branches under the root, two padding slots
COMMIT_PATHS = ([0, 1, 2], [0, 3, 4, 8, 9], [0, 1, 2, 5, 7], [0])   # a chain prefix, off-chain paths (KV moved), the root


@pytest.mark.slow
def test_replay_commit_equals_f32_store_commit(backend, tmp_path, monkeypatch):
    """One verify of a branching tree and one commit of a multi-slot path, three times, with replayed and with
    stored (f32) states on the same backend, both walking the tree (on CUDA the replay's chunk form is
    test_cuda_replay_lossless_and_state_equals_f32's): the verify's logits of every slot and the committed states
    and conv windows agree bit for bit (the commit rebuilds the node state with the tree kernel's own roundings,
    in place). Before
    the store copies had their destination's shape, CUDA's copy packed every slot's gate into slot 0's row, so the
    replay skipped later slots' steps: the states moved by O(0.1). The replay commits run 4, 8, 8 and 1 steps
    (replay_steps: the path rounded up to a power of two, padded with steps that change nothing), in one commit
    graph per step count."""
    from test_engine import CUDA_SHAPE, cache_state
    monkeypatch.setenv("PYDFLASH_GDN_CHUNK", "0")
    gguf = tmp_path / "b.gguf"
    testing.write_qwen35_gguf(gguf, **CUDA_SHAPE)
    parents = np.array(TREE_PARENTS, np.int32)
    depths = np.zeros(parents.size, np.int32)
    for s in range(1, parents.size):
        depths[s] = depths[parents[s]] + 1 if parents[s] >= 0 else 0
    rng = np.random.default_rng(7)
    prompt = [int(t) for t in rng.integers(3, 400, size=20)]
    trees = [rng.integers(3, 400, size=parents.size) for _ in COMMIT_PATHS]
    runs = {}
    for state_type in ("f32", "replay"):
        target = Qwen35Target(gguf, backend, n_ctx=256, n_ubatch=32)
        target.enable_verify(parents.size, tree=True, state_type=state_type)
        target.prefill(prompt, return_logits=False)
        steps = []
        for tokens, commit_path in zip(trees, COMMIT_PATHS):
            target.verify(tokens, parents, depths)
            logits = target.logits_of_slots()
            target.commit(commit_path)
            steps.append((logits, cache_state(target)))
        runs[state_type] = steps
        if state_type == "replay":
            # (KV compacted, replay steps, conv window from the verify inputs alone)
            assert sorted(target._commit_graphs) == [(False, 1, False), (False, 4, True), (True, 8, True)]
    for i, ((logits_f32, want), (logits, got)) in enumerate(zip(runs["f32"], runs["replay"])):
        np.testing.assert_array_equal(logits, logits_f32, err_msg=f"step {i}: verify logits")
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"step {i}: {name}")


# The chunk form's committed states against the walk's after a whole generation (64 tokens, ~8 commits, a 4-layer
# random model that amplifies rounding: its f32 logits of one verify already differ by up to 2e-3): an integration
# check that the right steps are written and replayed, which a wrong slot, path or decay misses by O(0.1). The
# chunk form's own accuracy is held to the float64 reference at 5e-6 (test_gated_delta_net_tree.py::test_steps_op).
# Measured on the H100: 1.5e-4.
STATE_TOL = 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("chunk", ["0", "1"], ids=["walk", "chunk_form"])
@pytest.mark.parametrize("mode,budget", [("chain", 15), ("ddtree", 22)])
def test_cuda_replay_lossless_and_state_equals_f32(tmp_path, monkeypatch, mode, budget, chunk):
    """On CUDA: replayed states give AR's tokens (up to tests/test_engine.py's CUDA near-tie margin). With the
    tree walk (PYDFLASH_GDN_CHUNK=0) exactly the f32-store path's tokens and committed recurrent states (the commit
    rebuilds the verify's node state bit for bit; a wrong slot or path moves them by O(0.1)); with the chunk form
    (the default) the same tokens and states within f32 rounding (STATE_TOL)."""
    monkeypatch.setenv("PYDFLASH_GDN_CHUNK", chunk)
    from pydflash.engine import Decoder
    from test_engine import BLOCK, CUDA_MARGIN, CUDA_SHAPE, ERRORS, N_GEN as ENGINE_N_GEN, ar_reference
    path = tmp_path / "b.gguf"
    testing.write_qwen35_gguf(path, **CUDA_SHAPE)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 400, size=24)]
    ar = Qwen35Target(path, "cuda", n_ctx=512, n_ubatch=64)
    ref, margins = ar_reference(ar, prompt)
    states = {}
    for state_type in ("f32", "replay"):
        target = Qwen35Target(path, "cuda", n_ctx=512, n_ubatch=64)
        draft = testing.OracleDraft(prompt + ref, target.hp.n_vocab, block_size=BLOCK, error_positions=ERRORS)
        out, stats = Decoder(target, draft, mode=mode, budget=budget, state_type=state_type).generate_ids(
            prompt, ENGINE_N_GEN)
        first = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), None)
        print(f"{mode} {state_type}: acceptance length {stats['acceptance_length']:.2f}, first token unlike AR: {first}")
        if first is not None:
            assert margins[first] < CUDA_MARGIN, f"{state_type} token {first}: {out[first]} != AR {ref[first]}, " \
                                                 f"margin {margins[first]:.3g}"
        assert len(out) == ENGINE_N_GEN and stats["acceptance_length"] > 4, state_type
        states[state_type] = (out, {il: t.numpy() for il, t in target.cache.ssm.items()})
    assert states["replay"][0] == states["f32"][0]
    for il, want in states["f32"][1].items():
        if chunk == "0":
            np.testing.assert_array_equal(states["replay"][1][il], want, err_msg=f"layer {il}")
        else:
            err = np.linalg.norm(states["replay"][1][il] - want) / np.linalg.norm(want)
            assert err < STATE_TOL, f"layer {il}: relative difference {err:.2e}"



def test_replay_with_the_real_draft_is_lossless(pair, reference):
    prompt, want = reference
    engine = pydflash.load(*pair, device="cpu", max_ctx=512, tokenizer=False, state_type="replay")
    assert engine.generate(prompt, max_tokens=N_GEN).tokens == want
    p, t = engine.target.memory_plan, engine.target
    stores = sum(x.nbytes for x in t.slot_states.values()) + sum(x.nbytes for x in t.slot_inputs.values())
    planned = p.parts["verify stores (23 slots, replay)"]
    assert planned <= stores <= planned + 64 * 2 * len(t.slot_states)


# --- the 27B pair, from headers only --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair_27b(tmp_path_factory):
    d = tmp_path_factory.mktemp("lc_27b")
    target = d / "q27-header.gguf"
    testing.write_qwen35_gguf(target, testing.preset_27b(), data=False)
    draft = d / "d27-header"     # z-lab's 27B draft shape, a sparse safetensors file
    testing.write_dflash_draft(draft, target, n_layer=5, n_head=32, n_head_kv=8, head_dim=128, n_ff=17408,
                               target_layer_ids=[1, 16, 31, 46, 61], data=False)
    return str(target), str(draft)


@pytest.mark.slow
def test_27b_q8_0_draft_bytes_by_hand(pair_27b):
    """q8_0 matrices hold 34 bytes per 32 values; the norms stay f32 (4 bytes a value)."""
    E, F, L = 5120, 17408, 5
    matrix_values = 5 * E * E + L * (E * 4096 + 2 * E * 1024 + 4096 * E + 3 * E * F)
    norm_values = 2 * E + L * (2 * E + 2 * 128)
    shape = plan.DraftShape.from_path(pair_27b[1], matrix_type="q8_0")
    assert shape.weight_bytes == matrix_values // 32 * 34 + 4 * norm_values
    assert plan.DraftShape.from_path(pair_27b[1]).weight_bytes == 2 * matrix_values + 4 * norm_values


@pytest.mark.slow
def test_27b_q4_k_draft_bytes_by_hand(pair_27b):
    """Every matrix of the 27B draft has rows of whole Q4_K blocks (5120 = 20 x 256, 4096 = 16 x 256, 17408 = 68 x
    256, fc's 5 x 5120): 144 bytes per 256 values; the norms stay f32."""
    E, F, L = 5120, 17408, 5
    matrix_values = 5 * E * E + L * (E * 4096 + 2 * E * 1024 + 4096 * E + 3 * E * F)
    norm_values = 2 * E + L * (2 * E + 2 * 128)
    shape = plan.DraftShape.from_path(pair_27b[1], matrix_type="q4_k")
    assert shape.weight_bytes == matrix_values // 256 * 144 + 4 * norm_values


@pytest.mark.slow
def test_27b_plan_picks_q8_0_draft_only_where_it_buys_context(pair_27b):
    """24 GiB: the bf16 draft leaves ~32K positions of tq3_0, a q8_0 one ~115K, so auto takes q8_0; 48 GiB holds
    the training context in f16 either way, so auto keeps the draft as stored."""
    tight = plan.plan_for_load(*pair_27b, vram="24GiB")
    stored = plan.plan_for_load(*pair_27b, vram="24GiB", draft_type=None)
    assert tight.draft_type == "q8_0" and tight.kv_type == stored.kv_type == "tq3_0"
    assert tight.n_ctx > 3 * stored.n_ctx and tight.total <= 24 * GiB
    assert stored.parts["draft weights"] - tight.parts["draft weights"] > 1.4 * GiB
    roomy = plan.plan_for_load(*pair_27b, vram="48GiB")
    assert roomy.draft_type is None and (roomy.n_ctx, roomy.kv_type) == (262144, "f16")
    # f16 node states on top: their store halves (the conv inputs stay f32) and the context grows again
    f16 = plan.plan_for_load(*pair_27b, vram="24GiB", state_type="f16")
    assert f16.draft_type == "q8_0" and f16.n_ctx > tight.n_ctx
    assert f16.parts["verify stores (23 slots, f16)"] * 2 == tight.parts["verify stores (23 slots, f32)"] + 23 * 48 * (
        2 * 16 * 128 + 48 * 128) * 4


@pytest.mark.slow
def test_27b_at_256k_in_24_gib(pair_27b):
    """The full 262,144 positions in 24 GiB: refused with f32 states (the message gives the q8_0 draft's numbers,
    the context that fits and what else would shrink), planned with f16 states and budget 7, not 8: one more
    slot adds, in each of the 48 GDN layers, an f16 state (128 x 128 x 48 heads) and an f32 conv input (10240),
    and its logits row (248320 f32) to the compute estimate."""
    fitted = plan.plan_for_load(*pair_27b, vram="24GiB")
    with pytest.raises(plan.PlanError, match=rf"max_ctx 262144 does not fit in 24.00 GiB: .* at most {fitted.n_ctx} "
                                             r"positions fit .*matrices q8_0 and f32 verify states; a smaller budget "
                                             r"and replayed states \(state_type='replay'\) shrink"):
        plan.plan_for_load(*pair_27b, vram="24GiB", max_ctx=262144)
    b7 = plan.plan_for_load(*pair_27b, vram="24GiB", max_ctx=262144, state_type="f16", budget=7)
    assert (b7.draft_type, b7.kv_type, b7.total <= 24 * GiB) == ("q8_0", "tq3_0", True)
    b8 = plan.plan_for_files(*pair_27b, max_ctx=262144, kv_type="tq3_0", state_type="f16", budget=8,
                             draft_type="q8_0")
    assert b8.total - b7.total == 48 * (128 * 128 * 48 * 2 + 10240 * 4) + 248320 * 4
    assert b8.total > 24 * GiB


@pytest.mark.slow
def test_27b_256k_in_24_gib_exact_with_replayed_states(pair_27b):
    """Both "auto" options at 24 GiB: replayed states and the q8_0 draft, the whole training context in tq3_0. The
    replay store by hand: per GDN layer, 23 conv inputs (10240 f32) and 24 columns (23 slots and the zero one) of
    k (16 x 128), delta (48 x 128) and the decay (48)."""
    p = plan.plan_for_load(*pair_27b, vram="24GiB", state_type="auto")
    assert (p.draft_type, p.state_type, p.n_ctx, p.kv_type) == ("q8_0", "replay", 262144, "tq3_0")
    assert p.parts["verify stores (23 slots, replay)"] == 48 * (23 * 10240 + 24 * (2048 + 6144 + 48)) * 4
    assert p.total <= 24 * GiB
    # 48 GiB holds the training context in f16 with the stored draft: auto keeps it (and replayed states, its first
    # choice whatever the room)
    roomy = plan.plan_for_load(*pair_27b, vram="48GiB", state_type="auto")
    assert (roomy.draft_type, roomy.state_type, roomy.n_ctx, roomy.kv_type) == (None, "replay", 262144, "f16")


@pytest.mark.slow
def test_plan_cli_prints_the_chosen_options(pair_27b, capsys):
    assert cli.main(["plan", "--target", pair_27b[0], "--draft", pair_27b[1], "--vram", "24GiB"]) == 0
    out = capsys.readouterr().out
    assert "n_ctx 262144, kv_type tq3_0" in out and "draft matrices q8_0" in out and "slots, replay)" in out
    assert cli.main(["plan", "--target", pair_27b[0], "--draft", pair_27b[1], "--vram", "24GiB",
                     "--draft-type", "stored", "--state-type", "f32"]) == 0
    out = capsys.readouterr().out
    assert "draft matrices" not in out and "slots, f32)" in out


# --- CLI ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["run", "-m", "t.gguf", "--max-ctx", "lots"], ["run", "-m", "t.gguf", "-c", "-5"],
                                  ["plan", "--target", "t.gguf", "--max-ctx", "0"],
                                  ["serve", "--target", "t.gguf", "--max-ctx", "8k"]])
def test_bad_max_ctx_says_what_is_accepted(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.build_parser().parse_args(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "expected a positive number of positions or 'auto', got" in err and "invalid" not in err


def test_memory_flags_parse():
    parse = cli.build_parser().parse_args
    for command in (["run", "-m", "t.gguf"], ["chat", "-m", "t.gguf"], ["plan", "--target", "t.gguf"],
                    ["serve", "--target", "t.gguf"]):
        args = parse(command + ["--state-type", "f16", "--draft-type", "q8_0"])
        assert (args.state_type, args.draft_type) == ("f16", "q8_0")
        assert parse(command + ["--draft-type", "q4_k"]).draft_type == "q4_k"
        default = parse(command)
        assert (default.state_type, default.draft_type) == ("auto", "auto")
    assert parse(["run", "-m", "t.gguf", "-c", "4096"]).max_ctx == 4096
    assert parse(["serve", "--target", "t.gguf"]).max_ctx == "auto"
