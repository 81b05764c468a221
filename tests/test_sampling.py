"""Sampling: the settings' validation, the on-device filter and draw against a float64 numpy reference, seeds,
and the distribution of speculative sampling (chain, ddtree) against plain AR sampling (docs/sampling.md)."""
import numpy as np
import pytest
from scipy import stats as sps

import pydflash
from pydflash import ddtree, ggml
from pydflash.engine import Decoder
from pydflash.models.qwen35 import Qwen35Target
from pydflash.sampling import PENALTY_LAST_N, SamplingParams, reference_probs, slot_histories
from pydflash.testing import OracleDraft, write_qwen35_gguf

from conftest import run_graph

# the settings the issue names, each alone, and all of them together
SETTINGS = {
    "t0.7": SamplingParams(temperature=0.7),
    "t1-top_p0.9": SamplingParams(temperature=1.0, top_p=0.9),
    "top_k5": SamplingParams(temperature=1.0, top_k=5),
    "min_p0.1": SamplingParams(temperature=1.0, min_p=0.1),
    "penalties": SamplingParams(temperature=1.0, repeat_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3),
    "all": SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repeat_penalty=1.2,
                          presence_penalty=0.2, frequency_penalty=0.1),
    "greedy-penalised": SamplingParams(temperature=0.0, repeat_penalty=1.3),
}


# --- settings ---

@pytest.mark.parametrize("options, match", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"min_p": -0.1}, "min_p"), ({"min_p": 1.1}, "min_p"), ({"seed": -1}, "seed"), ({"seed": "7"}, "seed"),
    ({"repeat_penalty": 0.0}, "repeat_penalty"), ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"), ({"temprature": 0.7}, "unknown sampling option"),
    ({"max_p": 0.7}, "unknown sampling option"), ({"temperature": True}, "temperature"),
])
def test_settings_refuse_bad_values(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_options(options)


def test_settings_defaults_are_greedy():
    assert SamplingParams.from_options({}).greedy
    assert SamplingParams.from_options({"temperature": None, "top_k": None, "seed": 3}).greedy
    assert not SamplingParams.from_options({"repeat_penalty": 1.1}).greedy
    assert SamplingParams.from_options({"top_k": 5.0}).top_k == 5


def test_slot_histories_follow_each_path():
    context = list(range(100, 100 + 70))
    slot_tokens = np.array([context[-1], 7, 8, 9, 5, 0], np.int32)
    parents = np.array([-1, 0, 1, 0, 3, -1], np.int32)          # 0 -> 1 -> 2, 0 -> 3 -> 4, 5 padding
    hist = slot_histories(context, slot_tokens, parents)
    assert hist.shape == (6, PENALTY_LAST_N)
    assert hist[0].tolist() == context[-PENALTY_LAST_N:]
    assert hist[2].tolist() == (context + [7, 8])[-PENALTY_LAST_N:]
    assert hist[4].tolist() == (context + [9, 5])[-PENALTY_LAST_N:]
    assert hist[5].tolist() == context[-PENALTY_LAST_N:]
    short = slot_histories([3, 4], slot_tokens[:2], parents[:2])
    assert short[1].tolist() == [-1] * (PENALTY_LAST_N - 3) + [3, 4, 7]


# --- the op against the float64 reference ---

N_VOCAB, N_ROWS = 300, 4


def _op_inputs(rng, settings: SamplingParams):
    logits = (rng.standard_normal((N_ROWS, N_VOCAB)) * 2.5).astype(np.float32)
    # recent tokens with repeats, biased towards likely ones (so the penalties change the top of the row)
    hist = np.full((N_ROWS, PENALTY_LAST_N), -1, np.int32)
    for r in range(N_ROWS):
        top = np.argsort(logits[r])[::-1][:12]
        hist[r, 20:] = rng.choice(np.concatenate([top, rng.integers(0, N_VOCAB, 8)]), PENALTY_LAST_N - 20)
    return logits, hist, settings.vector()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_filtered_distribution_equals_float64_reference(backend, rng, name):
    settings = SETTINGS[name]
    logits, hist, params = _op_inputs(rng, settings)
    got = run_graph(backend, lambda ctx, t: ggml.sample_probs(ctx, t["logits"], t["hist"], t["params"]),
                    {"logits": logits, "hist": hist, "params": params})
    for r in range(N_ROWS):
        ref = reference_probs(logits[r], settings, hist[r])
        assert ((got[r] > 0) == (ref > 0)).all(), f"row {r}: the kept tokens differ"
        np.testing.assert_allclose(got[r], ref, rtol=2e-5, atol=1e-7)
        kept = int((ref > 0).sum())
        if name == "top_k5":
            assert kept == 5
        if name in ("t1-top_p0.9", "min_p0.1"):
            assert 1 < kept < N_VOCAB      # the filter did something, and not everything


@pytest.mark.parametrize("name", ["t0.7", "t1-top_p0.9", "all", "greedy-penalised"])
def test_draw_is_the_inverse_cdf_of_the_reference(backend, rng, name):
    """Token drawn for uniform u = the first token whose cumulative reference probability exceeds u."""
    settings = SETTINGS[name]
    logits, hist, params = _op_inputs(rng, settings)
    n_u = 48                       # uniforms per row: the rows are repeated, one uniform each
    rand = rng.random(N_ROWS * n_u, dtype=np.float32)
    got = run_graph(backend, lambda ctx, t: ggml.sample_tokens(ctx, t["logits"], t["hist"], t["params"], t["rand"]),
                    {"logits": np.repeat(logits, n_u, axis=0), "hist": np.repeat(hist, n_u, axis=0),
                     "params": params, "rand": rand})
    for r in range(N_ROWS):
        cdf = np.cumsum(reference_probs(logits[r], settings, hist[r]))
        for j in range(r * n_u, (r + 1) * n_u):
            if np.min(np.abs(cdf - rand[j])) < 1e-5:
                continue   # within rounding of a boundary: either neighbour is right
            assert got[j] == int(np.searchsorted(cdf, rand[j], side="right")), f"row {r}, u {rand[j]}"


def _probs(backend, logits, settings, hist=None):
    """ggml_sample_probs over logits f32 [n_rows, n_vocab] (no history unless given)."""
    logits = np.atleast_2d(np.asarray(logits, np.float32))
    if hist is None:
        hist = np.full((logits.shape[0], PENALTY_LAST_N), -1, np.int32)
    got = run_graph(backend, lambda ctx, t: ggml.sample_probs(ctx, t["logits"], t["hist"], t["params"]),
                    {"logits": logits, "hist": hist, "params": settings.vector()})
    return got.reshape(logits.shape)


def _draws(backend, logits, hist, settings, rand):
    return run_graph(backend, lambda ctx, t: ggml.sample_tokens(ctx, t["logits"], t["hist"], t["params"], t["rand"]),
                     {"logits": logits, "hist": hist, "params": settings.vector(), "rand": rand})


def _assert_matches_reference(got, logits, settings, hist=None):
    for r in range(logits.shape[0]):
        ref = reference_probs(logits[r], settings, () if hist is None else hist[r])
        assert ((got[r] > 0) == (ref > 0)).all(), f"row {r}: the kept tokens differ"
        np.testing.assert_allclose(got[r], ref, rtol=2e-5, atol=1e-7)


def test_ties_at_the_top_k_boundary_are_kept_together(backend, rng):
    logits = (rng.standard_normal(N_VOCAB) * 2).astype(np.float32)
    order = np.argsort(-logits)
    logits[order[3:8]] = logits[order[3]]         # the 4th..8th largest tie; top-k 5 cuts through them
    settings = SamplingParams(temperature=1.0, top_k=5)
    got = _probs(backend, logits, settings)
    assert int((got[0] > 0).sum()) == 8
    _assert_matches_reference(got, logits[None], settings)


def test_argmax_ties_take_the_lowest_id(backend, rng):
    """Temperature 0: equal largest logits far apart in the row (in different blocks of a split row) give the
    lowest id; penalising that id moves the draw to the next one."""
    logits = (rng.standard_normal((2, N_VOCAB)) - 5).astype(np.float32)
    logits[:, [7, 151, 250]] = 3.0
    hist = np.full((2, PENALTY_LAST_N), -1, np.int32)
    hist[1, -1] = 7
    settings = SamplingParams(temperature=0.0, repeat_penalty=2.0)
    got = _draws(backend, logits, hist, settings, np.zeros(2, np.float32))
    assert got.tolist() == [7, 151]


@pytest.mark.parametrize("side", ["below", "above"])
def test_top_p_just_below_and_above_each_boundary(backend, rng, side):
    """top_p a hair (1e-4 relative) below the mass of the j most likely tokens keeps exactly j tokens, a hair
    above keeps j + 1, for the first boundaries of a row."""
    logits = (rng.standard_normal(N_VOCAB) * 2).astype(np.float32)
    p = np.exp(logits.astype(np.float64) - logits.max())
    cum = np.cumsum(np.sort(p)[::-1]) / p.sum()
    checked = 0
    for j in range(1, 12):
        if cum[j] - cum[j - 1] < 1e-3:        # the next token too unlikely to sit clear of the boundary
            continue
        top_p = cum[j - 1] * (1 - 1e-4 if side == "below" else 1 + 1e-4)
        settings = SamplingParams(temperature=0.9, top_p=float(top_p))
        got = _probs(backend, logits, settings)
        assert int((got[0] > 0).sum()) == (j if side == "below" else j + 1), f"boundary {j}"
        _assert_matches_reference(got, logits[None], settings)
        checked += 1
    assert checked >= 6


def test_top_p_keeps_tied_groups_whole(backend, rng):
    """Logits in groups of 4 equal values: wherever top_p cuts a group, the whole group is kept."""
    logits = (rng.standard_normal(N_VOCAB) - 12).astype(np.float32)
    levels = np.repeat(-0.4 * np.arange(10), 4).astype(np.float32)
    logits[rng.permutation(N_VOCAB)[:levels.size]] = levels
    for top_p in (0.05, 0.2, 0.33, 0.5, 0.61, 0.8, 0.9):
        settings = SamplingParams(temperature=1.0, top_p=top_p)
        got = _probs(backend, logits, settings)
        kept = int((got[0] > 0).sum())
        assert kept % 4 == 0 and kept >= 4, f"top_p {top_p}: {kept} kept"
        _assert_matches_reference(got, logits[None], settings)


# --- the real vocabulary: on CUDA, rows split over several blocks ---

QWEN_VOCAB = 248320


def _big_inputs(rng, n_rows, n_vocab):
    """Logits like the benchmark's (normal, std 3) with a few boosted tokens (so top-p alone keeps few and the
    reference stays fast), histories of likely tokens with repeats."""
    logits = (rng.standard_normal((n_rows, n_vocab)) * 3).astype(np.float32)
    hist = np.empty((n_rows, PENALTY_LAST_N), np.int32)
    for r in range(n_rows):
        boosted = rng.choice(n_vocab, 24, replace=False)
        logits[r, boosted] += rng.uniform(18, 26, boosted.size).astype(np.float32)
        hist[r] = rng.choice(np.concatenate([boosted[:12], rng.integers(0, n_vocab, 12)]), PENALTY_LAST_N)
    return logits, hist


BIG_SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "all": SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1,
                          presence_penalty=0.2, frequency_penalty=0.1),
    "top_p0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "top_k1000-penalties": SamplingParams(temperature=1.3, top_k=1000, repeat_penalty=1.5, presence_penalty=0.5),
}


@pytest.mark.slow
@pytest.mark.parametrize("n_vocab", [QWEN_VOCAB, 400_000])     # CUDA: row slices in shared memory; in global scratch
@pytest.mark.parametrize("name", list(BIG_SETTINGS))
def test_full_vocabulary_equals_reference(backend, rng, n_vocab, name):
    settings = BIG_SETTINGS[name]
    n_rows = 23 if n_vocab == QWEN_VOCAB else 3
    logits, hist = _big_inputs(rng, n_rows, n_vocab)
    got = _probs(backend, logits, settings, hist)
    _assert_matches_reference(got, logits, settings, hist)


@pytest.mark.slow
def test_full_vocabulary_draws_are_the_inverse_cdf_and_repeat(backend, rng):
    """23 rows x 248,320 with every filter and penalty: the token drawn for u is the reference's inverse CDF at u,
    and the same inputs give the same tokens run after run."""
    settings = BIG_SETTINGS["all"]
    logits, hist = _big_inputs(rng, 23, QWEN_VOCAB)
    rand = rng.random(23, dtype=np.float32)
    got = _draws(backend, logits, hist, settings, rand)
    for r in range(23):
        cdf = np.cumsum(reference_probs(logits[r], settings, hist[r]))
        if np.min(np.abs(cdf - rand[r])) > 1e-5:
            assert got[r] == int(np.searchsorted(cdf, rand[r], side="right")), f"row {r}"
    for _ in range(5):
        assert _draws(backend, logits, hist, settings, rand).tolist() == got.tolist()


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.parametrize("blocks", ["1", "16"])
def test_cuda_other_blocks_per_row_pass_the_op_tests(blocks):
    """The one-block-per-row kernel (GPUs before Hopper) and 16-block clusters (PYDFLASH_SAMPLE_BLOCKS=16) pass this
    file's CUDA op tests too. The choice is made once per process, so they run in a child process."""
    import os
    import subprocess
    import sys
    tests = "reference or inverse or ties or boundary or tied or full_vocabulary"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "cuda", __file__,
         "-k", f"cuda and not blocks_per_row and ({tests})"],
        env={**os.environ, "PYDFLASH_SAMPLE_BLOCKS": blocks}, capture_output=True, text=True,
        cwd=os.path.dirname(__file__))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout


def test_op_wrappers_check_shapes():
    ctx = ggml.Context(n_tensors=8)
    logits = ctx.new_tensor(ggml.Type.F32, (10, 3))
    hist = ctx.new_tensor(ggml.Type.I32, (PENALTY_LAST_N, 3))
    params = ctx.new_tensor(ggml.Type.F32, (8,))
    with pytest.raises(ValueError, match="rand"):
        ggml.sample_tokens(ctx, logits, hist, params, ctx.new_tensor(ggml.Type.F32, (2,)))
    with pytest.raises(ValueError, match="params"):
        ggml.sample_probs(ctx, logits, hist, ctx.new_tensor(ggml.Type.F32, (7,)))
    with pytest.raises(ValueError, match="hist"):
        ggml.sample_probs(ctx, logits, ctx.new_tensor(ggml.Type.I32, (PENALTY_LAST_N, 2)), params)


# --- decoding: seeds and the distribution of speculative sampling ---

BLOCK = 8
PROMPT = [31, 7, 99, 4, 150, 62]


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """A tiny target with a small vocabulary and peaked logits (so the sampled text often follows the greedy
    one, and an oracle draft gets deep acceptance)."""
    path = tmp_path_factory.mktemp("sampling") / "tiny.gguf"
    write_qwen35_gguf(path, seed=21, n_merges=0, n_layer=4, n_embd=32, n_ff=64, head_dim=32, logit_std=7.0,
                      recurrent_layers=(True, True, False, True))
    return path


@pytest.fixture(scope="module")
def decoders(peaked_model):
    target = Qwen35Target(peaked_model, "cpu", n_ctx=256, n_ubatch=32)
    greedy, _ = Decoder(target, mode="ar").generate_ids(PROMPT, 40)
    draft = OracleDraft(PROMPT + greedy, target.hp.n_vocab, block_size=BLOCK)
    out = {"ar": Decoder(target, mode="ar"),
           "chain": Decoder(target, draft, mode="chain", budget=BLOCK - 1),
           "ddtree": Decoder(target, draft, mode="ddtree", budget=10, top_k=3)}
    return out


def _run(decoder, settings, seed, n):
    params = SamplingParams(**{**settings.__dict__, "seed": seed})
    tokens, stats = decoder.generate_ids(PROMPT, n, sampling=params)
    return tuple(tokens), stats


@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_seed_reproduces_tokens(decoders, mode):
    settings = SamplingParams(temperature=1.0)
    a, _ = _run(decoders[mode], settings, 5, 16)
    b, _ = _run(decoders[mode], settings, 5, 16)
    c, _ = _run(decoders[mode], settings, 6, 16)
    assert a == b
    assert a != c
    greedy, _ = decoders[mode].generate_ids(PROMPT, 16)
    assert a != tuple(greedy)          # it did sample


def test_greedy_with_penalties_is_lossless(decoders):
    """temperature 0 with a repeat penalty is deterministic: chain and ddtree give AR's tokens (the penalised
    argmax at every slot, each slot penalised by its own path), and the penalty changes them."""
    settings = SamplingParams(temperature=0.0, repeat_penalty=3.0, presence_penalty=1.0)
    ar, _ = decoders["ar"].generate_ids(PROMPT, 24, sampling=settings)
    assert ar != decoders["ar"].generate_ids(PROMPT, 24)[0]
    for mode in ("chain", "ddtree"):
        out, stats = decoders[mode].generate_ids(PROMPT, 24, sampling=settings)
        assert out == ar, mode
        assert stats["acceptance_length"] > 1.0


def test_target_stays_greedy_without_sample_inputs(decoders):
    """After a sampled generation the sampler stays in the graphs; forwards given no sample inputs are greedy."""
    target = decoders["ar"].target
    _run(decoders["ddtree"], SamplingParams(temperature=1.0), 1, 8)
    assert target.sampling_enabled
    target.reset()
    first = int(np.argmax(target.prefill(PROMPT)))
    second = target.step(first)
    target.reset()
    assert second == int(np.argmax(target.prefill(PROMPT + [first])))
    with pytest.raises(RuntimeError, match="did not sample"):
        target.sampled()


def plain_sampling_distribution(target, settings, n_tokens: int, floor: float = 1e-4) -> dict:
    """The exact probability, under plain sampling with `settings`, of every n_tokens continuation of PROMPT
    whose prefixes are all above `floor`: the target's logits after each prefix through the float64 reference
    filter (the rest of the mass is left out)."""
    out = {}

    def visit(prefix, prob):
        target.reset()
        logits = target.prefill(PROMPT + list(prefix))
        p = reference_probs(logits, settings, PROMPT + list(prefix))
        for t in np.nonzero(prob * p > floor)[0]:
            if len(prefix) + 1 == n_tokens:
                out[prefix + (int(t),)] = prob * p[t]
            else:
                visit(prefix + (int(t),), prob * p[t])

    visit((), 1.0)
    return out


def goodness_of_fit_p(samples, expected: dict, min_expected: float = 5.0) -> float:
    """Chi-square test of sequences against their exact probabilities (small cells and the rest pooled)."""
    n = len(samples)
    cells = [seq for seq, prob in expected.items() if n * prob >= min_expected]
    counts = [samples.count(seq) for seq in cells]
    probs = [expected[seq] for seq in cells]
    counts.append(n - sum(counts))
    probs.append(1.0 - sum(probs))
    observed, want = np.array(counts, float), n * np.array(probs)
    stat = float(((observed - want) ** 2 / want).sum())
    return float(sps.chi2.sf(stat, len(cells)))


N_DRAWS = 200
N_TOKENS = 3
ALPHA = 1e-3                     # strict: a correct rule fails this with probability 1/1000 (seeds are fixed)
DIST_SETTINGS = ["t0.7", "t1-top_p0.9", "top_k5", "min_p0.1", "penalties"]


@pytest.fixture(scope="module")
def plain(decoders):
    return {name: plain_sampling_distribution(decoders["ar"].target, SETTINGS[name], N_TOKENS)
            for name in DIST_SETTINGS}


def _samples(decoder, settings, n_draws: int = N_DRAWS, first_seed: int = 1000):
    seqs, accepted = [], []
    for seed in range(first_seed, first_seed + n_draws):
        seq, stats = _run(decoder, settings, seed, N_TOKENS)
        seqs.append(seq)
        accepted.append(stats["acceptance_length"])
    return seqs, float(np.mean(accepted))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
@pytest.mark.parametrize("name", DIST_SETTINGS)
def test_sampling_has_the_plain_distribution(decoders, plain, mode, name):
    """AR, chain and ddtree sampling against the exact plain-sampling distribution of the first tokens."""
    seqs, acceptance = _samples(decoders[mode], SETTINGS[name])
    if mode != "ar":
        # the tree paths were really exercised: a 3-token run commits at most 2 tokens in its speculative step (a
        # step commits no further than the output goes), so this says over 40% of the draws took a draft token
        assert acceptance > 1.4
    assert sum(plain[name].values()) > 0.95    # the enumeration holds most of the mass
    p = goodness_of_fit_p(seqs, plain[name])
    assert p > ALPHA, f"{mode} {name}: p = {p:.2e}"


@pytest.mark.slow
def test_a_biased_rule_is_detected(decoders, plain, monkeypatch):
    """The same test fails for a wrong rule: where the drawn token matches no child of the root, it takes the
    draft's first child anyway (its top proposal)."""
    original = ddtree.accept

    def biased(tree, drawn):
        kids = tree.children()
        if int(drawn[0]) not in kids[0] and kids[0]:
            drawn = np.array(drawn).copy()
            drawn[0] = next(iter(kids[0]))
        return original(tree, drawn)

    monkeypatch.setattr(ddtree, "accept", biased)
    seqs, _ = _samples(decoders["ddtree"], SETTINGS["t0.7"])
    assert goodness_of_fit_p(seqs, plain["t0.7"]) < ALPHA


def test_engine_takes_sampling_keywords(peaked_model):
    engine = pydflash.load(str(peaked_model), device="cpu", max_ctx=128, tokenizer=False)
    a = engine.generate(PROMPT, max_tokens=8, temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, seed=3,
                        repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1)
    b = engine.generate(PROMPT, max_tokens=8, temperature=0.9, top_k=20, top_p=0.95, min_p=0.01, seed=3,
                        repeat_penalty=1.1, presence_penalty=0.1, frequency_penalty=0.1)
    assert a.tokens == b.tokens and a.stats["sampling"]["seed"] == 3
    greedy = engine.generate(PROMPT, max_tokens=8)
    assert engine.generate(PROMPT, max_tokens=8, temperature=0).tokens == greedy.tokens
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPT, max_tokens=2, top_p=2)
    with pytest.raises(ValueError, match="unknown sampling option"):
        list(engine.stream(PROMPT, max_tokens=2, temperatur=0.5))


@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_prefix_reuse_is_exact_under_sampling(peaked_model, mode):
    """A chat's second turn resumed from the prefix cache draws, from the same seed, exactly the tokens that a
    fresh prefill of the whole prompt draws."""
    target = Qwen35Target(peaked_model, "cpu", n_ctx=256, n_ubatch=32)
    draft = None
    if mode != "ar":
        greedy, _ = Decoder(target, mode="ar").generate_ids(PROMPT, 40)
        draft = OracleDraft(PROMPT + greedy, target.hp.n_vocab, block_size=BLOCK)
    spec = dict(budget=10, top_k=3) if draft is not None else {}
    reusing = Decoder(target, draft, mode=mode, prefix_snapshots=4, **spec)
    fresh = Decoder(target, draft, mode=mode, **spec)
    settings = SamplingParams(temperature=1.0, top_p=0.95, repeat_penalty=1.3)
    turn1, _ = reusing.generate_ids(PROMPT, 12, sampling=SamplingParams(**{**settings.__dict__, "seed": 1}))
    prompt2 = PROMPT + turn1 + [17, 240, 3]
    params2 = SamplingParams(**{**settings.__dict__, "seed": 2})
    turn2, stats = reusing.generate_ids(prompt2, 16, sampling=params2)
    assert stats["reused_tokens"] == len(PROMPT) + len(turn1) - 1
    ref, ref_stats = fresh.generate_ids(prompt2, 16, sampling=params2)
    assert ref_stats["reused_tokens"] == 0
    assert turn2 == ref
    assert turn2 != fresh.generate_ids(prompt2, 16)[0]      # it did sample


@pytest.mark.slow
def test_sampling_on_a_llama_target(tmp_path):
    """The sampler sits in the shared runtime: a llama target samples in ddtree mode reproducibly from the seed,
    and temperature 0 (with and without a penalty, i.e. with and without the sampler) gives AR's tokens."""
    from pydflash.testing import write_llama_gguf

    path = str(tmp_path / "llama.gguf")
    write_llama_gguf(path, seed=3)
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, 450, 12)]
    ar = pydflash.load(path, device="cpu", max_ctx=128, tokenizer=False, prefix_cache=False)
    ref = ar.generate(prompt, max_tokens=16)
    penalised = ar.generate(prompt, max_tokens=16, temperature=0, repeat_penalty=2.0, presence_penalty=1.0)
    assert penalised.tokens != ref.tokens
    oracle = OracleDraft(prompt + ref.tokens, ar.target.hp.n_vocab, block_size=BLOCK)
    tree = pydflash.load(path, oracle, mode="ddtree", budget=10, device="cpu", max_ctx=128, tokenizer=False,
                         prefix_cache=False)
    assert tree.generate(prompt, max_tokens=16, temperature=0).tokens == ref.tokens
    assert tree.generate(prompt, max_tokens=16, temperature=0, repeat_penalty=2.0,
                         presence_penalty=1.0).tokens == penalised.tokens
    a = tree.generate(prompt, max_tokens=16, temperature=1.0, seed=7)
    b = tree.generate(prompt, max_tokens=16, temperature=1.0, seed=7)
    c = tree.generate(prompt, max_tokens=16, temperature=1.0, seed=8)
    assert a.tokens == b.tokens and a.tokens != c.tokens and a.tokens != ref.tokens
