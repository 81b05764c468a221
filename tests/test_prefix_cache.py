"""Prefix reuse across turns: a prompt that extends an earlier one resumes from a snapshot and must give exactly
the tokens a from-scratch prefill gives (CPU), while prefilling fewer tokens; stale state is never reused."""
import numpy as np
import pytest

import pydflash
import pydflash.models
from pydflash import testing
from pydflash.engine import Decoder
from pydflash.models.dflash_draft import DFlashDraft
from pydflash.models.qwen35 import Qwen35Target
from pydflash.prefix_cache import PrefixCache, snapshot_nbytes

N1, N2 = 20, 24              # new tokens of turn 1 and turn 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prefix")
    target = str(tmp / "tiny.gguf")
    # GDN and attention layers: both kinds of state must resume
    testing.write_qwen35_gguf(target, seed=21, recurrent_layers=(True, True, False, True))
    draft = str(tmp / "draft")
    testing.write_dflash_draft(draft, target, seed=21)
    return target, draft


def load(pair, mode, **kw):
    target, draft = pair
    return pydflash.load(target, None if mode == "ar" else draft, mode=mode, device="cpu", max_ctx=512, budget=8, **kw)


@pytest.fixture(scope="module")
def fresh(pair):
    """From-scratch references: one engine per mode without a prefix cache."""
    return {mode: load(pair, mode, prefix_cache=False) for mode in ("ar", "chain", "ddtree")}


def ids(seed, n):
    return [int(t) for t in np.random.default_rng(seed).integers(3, 400, size=n)]


P1 = ids(1, 37)
USER2 = ids(2, 11)


def test_snapshot_restores_the_recurrent_state_exactly(pair, backend):
    """A snapshot is a device-side copy: after other tokens changed the state, restoring gives back every conv
    and ssm value bit for bit (on CUDA too), and the KV rows before the snapshot are untouched."""
    target = Qwen35Target(pair[0], backend, n_ctx=256, n_ubatch=16)
    prefix = PrefixCache(target)
    target.prefill(P1, return_logits=False)
    prefix.save(P1)
    saved = {f"{kind}{il}": t.numpy().copy() for kind, ts in (("conv", target.cache.conv), ("ssm", target.cache.ssm))
             for il, t in ts.items()}
    kv = {il: t.numpy()[:len(P1)].copy() for il, t in target.cache.k.items()}
    target.prefill(ids(12, 9), return_logits=False)
    prefix.save(P1 + ids(12, 9))
    assert any(not np.array_equal(saved[f"ssm{il}"], t.numpy()) for il, t in target.cache.ssm.items())
    assert prefix.restore(P1 + ids(13, 5)) == len(P1) and target.n_past == len(P1)
    for kind, ts in (("conv", target.cache.conv), ("ssm", target.cache.ssm)):
        for il, t in ts.items():
            assert np.array_equal(t.numpy(), saved[f"{kind}{il}"]), f"{kind} of layer {il}"
    for il, t in target.cache.k.items():
        assert np.array_equal(t.numpy()[:len(P1)], kv[il])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "chain", "ddtree"])
def test_second_turn_resumes_and_matches_a_fresh_prefill(pair, fresh, mode):
    engine = load(pair, mode)
    r1 = engine.generate(P1, max_tokens=N1)
    assert r1.stats["reused_tokens"] == 0 and r1.stats["prefilled_tokens"] == len(P1)
    assert r1.tokens == fresh[mode].generate(P1, max_tokens=N1).tokens
    # a chat's next turn: the previous prompt, the reply, the new user message
    p2 = P1 + r1.tokens + USER2
    r2 = engine.generate(p2, max_tokens=N2)
    ref = fresh[mode].generate(p2, max_tokens=N2)
    assert ref.stats["reused_tokens"] == 0
    assert r2.tokens == ref.tokens
    # resumed where turn 1's generation ended: the cache held the prompt and the reply but its last token
    assert r2.stats["reused_tokens"] == len(P1) + N1 - 1
    assert r2.stats["prefilled_tokens"] == len(USER2) + 1
    assert r2.stats["prompt_tokens"] == len(p2)
    if mode != "ar":   # speculative output is plain AR decoding's
        assert r2.tokens == fresh["ar"].generate(p2, max_tokens=N2).tokens
    # a third turn that diverges inside turn 2's user message resumes where turn 1's generation ended
    p3 = P1 + r1.tokens + USER2[:4] + ids(3, 6)
    r3 = engine.generate(p3, max_tokens=N2)
    assert r3.stats["reused_tokens"] == len(P1) + N1 - 1
    assert r3.tokens == fresh[mode].generate(p3, max_tokens=N2).tokens


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "ddtree"])
def test_prompt_diverging_inside_the_previous_turn(pair, fresh, mode):
    engine = load(pair, mode)
    r1 = engine.generate(P1, max_tokens=N1)
    # diverges inside the generated reply: only the snapshot at the end of turn 1's prompt is a prefix
    p2 = P1 + r1.tokens[:5] + ids(4, 7)
    r2 = engine.generate(p2, max_tokens=N2)
    assert r2.stats["reused_tokens"] == len(P1)
    assert r2.tokens == fresh[mode].generate(p2, max_tokens=N2).tokens
    # diverges inside turn 1's prompt: no snapshot is a prefix, a full prefill
    p3 = P1[:20] + ids(5, 9)
    r3 = engine.generate(p3, max_tokens=N2)
    assert r3.stats["reused_tokens"] == 0 and r3.stats["prefilled_tokens"] == len(p3)
    assert r3.tokens == fresh[mode].generate(p3, max_tokens=N2).tokens
    # turn 1's prompt is no longer in the cache (p3 overwrote its rows from position 20): nothing to reuse
    p4 = P1 + ids(6, 5)
    r4 = engine.generate(p4, max_tokens=N2)
    assert r4.stats["reused_tokens"] == 0
    assert r4.tokens == fresh[mode].generate(p4, max_tokens=N2).tokens


def test_reset_and_outside_use_of_the_target_are_not_reused(pair, fresh):
    engine = load(pair, "ar")
    r1 = engine.generate(P1, max_tokens=N1)
    p2 = P1 + r1.tokens + USER2
    engine.reset()
    assert engine.generate(p2, max_tokens=4).stats["reused_tokens"] == 0
    # running the target directly (not through the engine) changes its cache behind the prefix cache's back
    r1 = engine.generate(P1, max_tokens=N1)
    engine.target.reset()
    engine.target.prefill(ids(7, len(P1) + N1 - 1), return_logits=False)   # same length, other tokens
    r2 = engine.generate(p2, max_tokens=N2)
    assert r2.stats["reused_tokens"] == 0
    assert r2.tokens == fresh["ar"].generate(p2, max_tokens=N2).tokens


def test_identical_prompt_is_prefilled_for_its_logits(pair):
    """A prompt equal to a snapshot still prefills its last token (the first new token needs its logits)."""
    engine = load(pair, "ar")
    a = engine.generate(P1, max_tokens=6)
    b = engine.generate(P1, max_tokens=6)
    assert b.tokens == a.tokens and b.stats["prefilled_tokens"] == len(P1)   # only whole-prompt snapshots exist
    c = engine.generate(P1 + a.tokens[:3], max_tokens=3)
    assert c.stats["reused_tokens"] == len(P1) and c.tokens == a.tokens[3:6]


@pytest.mark.slow
def test_interrupted_stream_keeps_its_state(pair, fresh):
    """A consumer that stops a stream early leaves a resumable state at the last token it got."""
    engine = load(pair, "ddtree")
    prompt = engine.tokenizer.tokenize("The quick brown fox", add_special=True)
    stream = engine.stream(prompt, max_tokens=200)
    next(stream)
    next(stream)
    stream.close()
    stats = engine.last_stats
    assert 2 <= stats["new_tokens"] < 200
    got = engine.target.n_past - len(prompt) + 1              # tokens of the output the cache holds, + the root
    assert got == stats["new_tokens"]
    full = fresh["ar"].generate(prompt, max_tokens=got).tokens
    p2 = prompt + full + USER2
    r2 = engine.generate(p2, max_tokens=N2)
    assert r2.stats["reused_tokens"] == len(prompt) + got - 1
    assert r2.tokens == fresh["ar"].generate(p2, max_tokens=N2).tokens


def test_lru_bound(pair):
    engine = load(pair, "ar", prefix_snapshots=2)
    prefix = engine.decoder.prefix
    tokens = list(P1)
    for turn in range(3):
        out = engine.generate(tokens, max_tokens=4).tokens
        tokens = tokens + out + ids(10 + turn, 3)
    assert len(prefix) == 2 and prefix.nbytes <= 2 * prefix.snapshot_nbytes
    # the last turn's two snapshots (end of its prompt, end of its generation) are what is kept
    assert sorted(prefix.positions) == [len(tokens) - 3 - 4, len(tokens) - 3 - 1]
    one = snapshot_nbytes(engine.target.cache)
    small = load(pair, "ar", prefix_bytes=one - 1)            # not even one snapshot fits
    small.generate(P1, max_tokens=4)
    assert small.generate(P1 + ids(8, 3), max_tokens=4).stats["reused_tokens"] == 0
    off = load(pair, "ar", prefix_cache=False)
    assert off.decoder.prefix is None
    with pytest.raises(ValueError, match="prefix_snapshots"):
        load(pair, "ar", prefix_snapshots=-1)


def test_draft_ring_truncate(pair):
    """truncate(n) keeps positions 0..n-1 exactly as a draft that only ever saw them (same proposals), and
    refuses once the ring has overwritten what that context needs."""
    target_path, draft_path = pair
    target = pydflash.models.load_target(target_path, "cpu", n_ctx=256,
                                         capture_layers=pydflash.api.draft_layer_ids(draft_path))
    n_feat = len(target.capture_layers) * target.hp.n_embd
    feats = np.random.default_rng(9).standard_normal((14, n_feat)).astype(np.float32)
    window = 8
    cut = DFlashDraft(draft_path, target, window=window)
    cut.append_features(feats[:6])
    assert cut.truncate(4) and cut.n_ctx == 4
    cut.append_features(feats[10:12])            # positions 4, 5 now hold other features
    scratch = DFlashDraft(draft_path, target, window=window)
    scratch.append_features(np.concatenate([feats[:4], feats[10:12]]))
    assert np.array_equal(cut.logits(7), scratch.logits(7))
    cut.append_features(feats[:6])               # 12 positions: the ring holds 4..11
    assert not cut.truncate(10)                  # needs 2..9
    assert cut.n_ctx == 12
    assert cut.truncate(12) and not cut.truncate(11)   # a wrapped ring can only stay where it is
    with pytest.raises(ValueError, match="truncate"):
        cut.truncate(13)


@pytest.mark.slow
def test_overwritten_draft_ring_falls_back_to_a_full_prefill(pair, fresh):
    target_path, draft_path = pair
    target = pydflash.models.load_target(target_path, "cpu", n_ctx=512, n_ubatch=512,
                                         capture_layers=pydflash.api.draft_layer_ids(draft_path))
    draft = DFlashDraft(draft_path, target, window=32, top_k=8)
    dec = Decoder(target, draft, mode="ddtree", budget=8, prefix_snapshots=4)
    out1, _ = dec.generate_ids(P1, 30)               # 66 positions: the ring of 32 has wrapped
    p2 = P1 + out1[:5] + ids(11, 4)                  # resuming at len(P1) needs positions 5..36, long gone
    out2, stats = dec.generate_ids(p2, N2)
    assert stats["reused_tokens"] == 0
    assert out2 == fresh["ar"].generate(p2, max_tokens=N2).tokens
    p3 = P1 + out1 + USER2                           # the end of turn 1 needs no truncation at all
    out3, stats = dec.generate_ids(p3, N2)
    assert stats["reused_tokens"] == 0               # turn 1's snapshots went with the cache rows p2 overwrote
    out4, stats = dec.generate_ids(p3 + out3 + USER2, 8)
    assert stats["reused_tokens"] == len(p3) + N2 - 1
    assert out4 == fresh["ar"].generate(p3 + out3 + USER2, max_tokens=8).tokens


def test_attention_only_target_resumes_without_snapshot_memory(tmp_path):
    """A llama target has no recurrent state: its snapshots hold no memory, and a second turn still resumes from
    the first (KV rows only) and gives the tokens of a fresh prefill."""
    path = str(tmp_path / "llama.gguf")
    testing.write_llama_gguf(path, seed=5)
    engine = pydflash.load(path, device="cpu", max_ctx=512, tokenizer=False)
    ref = pydflash.load(path, device="cpu", max_ctx=512, tokenizer=False, prefix_cache=False)
    assert snapshot_nbytes(engine.target.cache) == 0
    r1 = engine.generate(P1, max_tokens=N1)
    p2 = P1 + r1.tokens + USER2
    r2 = engine.generate(p2, max_tokens=N2)
    assert r2.stats["reused_tokens"] > len(P1)
    assert r2.tokens == ref.generate(p2, max_tokens=N2).tokens
