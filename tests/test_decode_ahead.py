"""Decoding one step ahead (TargetRuntime.decode_ahead): each step's argmax (or drawn token) feeds the next step on
the device while the host handles the token. Its tokens, and the cache it leaves, must be those of `step` called
token by token (bit for bit on the CPU; the same seed draws the same tokens), whether it runs to the end or is
closed early."""
from __future__ import annotations

import numpy as np
import pytest

import pydflash
from pydflash.engine import Decoder
from pydflash.sampling import Sampler, SamplingParams
from pydflash.models import load_target
from pydflash.models.qwen2 import Qwen2Target
from pydflash.testing import write_llama_gguf, write_qwen35_gguf

N_CTX = 512


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ahead") / "qwen2.gguf")
    write_llama_gguf(path, arch="qwen2", seed=1)
    return path


@pytest.fixture(scope="module")
def qwen2_64(tmp_path_factory):
    """One head of 64: CUDA's flash attention has no kernel for the default file's heads of 16."""
    path = str(tmp_path_factory.mktemp("ahead") / "qwen2-64.gguf")
    write_llama_gguf(path, arch="qwen2", n_head=1, n_head_kv=1, seed=1)
    return path


def _prompt(n, seed=0):
    return [int(t) for t in np.random.default_rng(seed).integers(0, 400, n)]


def _stepped(target, prompt, n):
    """Reference: prefill, then n calls of step."""
    target.reset()
    tokens = [int(target.prefill(prompt).argmax())]
    for _ in range(n):
        tokens.append(target.step(tokens[-1]))
    return tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("n_prompt", [20, 250])   # 250: the steps cross the 256-cell KV bucket (a new graph)
def test_greedy_decode_ahead_equals_step_by_step(qwen2_64, n_prompt, device):
    """Bit for bit on CUDA too: the fed graph runs the same kernels as a decode step."""
    target = load_target(qwen2_64, device, n_ctx=N_CTX)
    prompt = _prompt(n_prompt)
    ref = _stepped(target, prompt, 20)
    ref_next = target.decode(ref[-1])             # what the cache gives after those steps

    target.reset()
    root = int(target.prefill(prompt).argmax())
    got = [root] + list(target.decode_ahead(root, 20))
    assert got == ref
    assert target.n_past == n_prompt + 20
    assert np.array_equal(target.decode(got[-1]), ref_next)


def test_closing_early_takes_the_queued_step_back(qwen2):
    target = load_target(qwen2, "cpu", n_ctx=N_CTX)
    prompt = _prompt(40, seed=3)
    ref = _stepped(target, prompt, 6)
    ref_next = target.decode(ref[-1])

    target.reset()
    root = int(target.prefill(prompt).argmax())
    ahead = target.decode_ahead(root, 30)
    got = [root] + [next(ahead) for _ in range(6)]
    ahead.close()                                 # step 7 was already queued
    assert got == ref
    assert target.n_past == len(prompt) + 6
    assert np.array_equal(target.decode(got[-1]), ref_next)


def test_decoder_ar_is_unchanged_by_running_ahead(qwen2, monkeypatch):
    """The engine's AR mode runs ahead on an attention-only target; with it off (decodes_ahead False) the same
    tokens come out, also when a stop token ends the run mid-way and a second turn resumes from the cache."""
    prompt = _prompt(30, seed=5)
    free = Decoder(load_target(qwen2, "cpu", n_ctx=N_CTX), mode="ar").generate_ids(prompt, 40)[0]
    stop = free[17]
    runs = {}
    for ahead in (True, False):
        if not ahead:
            monkeypatch.setattr(Qwen2Target, "decodes_ahead", False)
        target = load_target(qwen2, "cpu", n_ctx=N_CTX)
        assert target.decodes_ahead is ahead
        dec = Decoder(target, mode="ar", stop_tokens=[stop], prefix_snapshots=4)
        first, _ = dec.generate_ids(prompt, 40)
        second, stats = dec.generate_ids(prompt + first + _prompt(5, seed=6), 12)
        assert stats["reused_tokens"] > len(prompt)
        runs[ahead] = first, second
    assert runs[True][0] == free[:free.index(stop) + 1]
    assert runs[True] == runs[False]


def test_recurrent_targets_step_instead(tmp_path):
    path = str(tmp_path / "q35.gguf")
    write_qwen35_gguf(path)
    target = load_target(path, "cpu", n_ctx=256)
    assert not target.decodes_ahead
    target.prefill([1, 2, 3])
    with pytest.raises(ValueError, match="recurrent"):
        next(target.decode_ahead(4, 3))


def test_generate_stream_stopped_by_the_consumer(qwen2):
    """A consumer that stops reading the stream mid-way leaves the cache as if the run had ended there: the next
    turn resumes from it and gives a fresh prefill's tokens."""
    engine = pydflash.load(qwen2, device="cpu", max_ctx=N_CTX, tokenizer=False)
    fresh = pydflash.load(qwen2, device="cpu", max_ctx=N_CTX, tokenizer=False, prefix_cache=False)
    prompt = _prompt(30, seed=7)
    stream = engine.decoder.iter_generate(prompt, 50)
    got = [t for _, tokens in zip(range(8), stream) for t in tokens]
    stream.close()
    p2 = prompt + got + _prompt(4, seed=8)
    r2 = engine.generate(p2, max_tokens=10)
    assert r2.stats["reused_tokens"] > len(prompt)
    assert r2.tokens == fresh.generate(p2, max_tokens=10).tokens


SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02, seed=7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_sampled_decode_ahead_equals_step_by_step(qwen2_64, device):
    """Sampling without penalties runs ahead too: the same seed draws the same tokens as `step` with the sampler's
    inputs set for each step, and the cache after them gives the same next logits."""
    target = load_target(qwen2_64, device, n_ctx=N_CTX)
    prompt = _prompt(30, seed=9)
    target.enable_sampling(True)
    sampler = Sampler(SAMPLED)
    target.sample_inputs = sampler.for_context(prompt)
    target.prefill(prompt, return_logits=False)
    root = int(target.sampled()[0])
    ref = [root]
    for _ in range(24):
        target.sample_inputs = sampler.for_context(prompt + ref)
        ref.append(target.step(ref[-1]))
    ref_next = target.decode(ref[-1])

    target.reset()
    sampler = Sampler(SAMPLED)
    target.sample_inputs = sampler.for_context(prompt)
    target.prefill(prompt, return_logits=False)
    assert int(target.sampled()[0]) == root
    got = [root] + list(target.decode_ahead(root, 24, sampler))
    assert got == ref
    assert len(set(got)) > 5                      # drawn, not the argmax chain
    assert np.array_equal(target.decode(got[-1]), ref_next)


def test_penalised_sampling_steps_instead(qwen2):
    target = load_target(qwen2, "cpu", n_ctx=N_CTX)
    target.enable_sampling(True)
    target.prefill(_prompt(10))
    with pytest.raises(ValueError, match="penalties"):
        next(target.decode_ahead(3, 4, Sampler(SamplingParams(temperature=0.8, repeat_penalty=1.1, seed=1))))
    with pytest.raises(ValueError, match="enable_sampling"):
        next(target.decode_ahead(3, 4))          # greedy with the sampler's graphs


@pytest.mark.parametrize("params", [SAMPLED, SamplingParams(temperature=0.7, repeat_penalty=1.2, seed=3)])
def test_decoder_sampling_is_unchanged_by_running_ahead(qwen2, monkeypatch, params):
    """The engine's sampled AR: with decoding ahead (no penalties) or stepping (penalties, or forced), the same
    seed gives the same tokens."""
    prompt = _prompt(30, seed=11)
    calls = []
    decode_ahead = Qwen2Target.decode_ahead

    def counted(self, *args):
        calls.append(args)
        return decode_ahead(self, *args)

    monkeypatch.setattr(Qwen2Target, "decode_ahead", counted)
    runs = {}
    for ahead in (True, False):
        if not ahead:
            monkeypatch.setattr(Qwen2Target, "decodes_ahead", False)
        runs[ahead] = Decoder(load_target(qwen2, "cpu", n_ctx=N_CTX), mode="ar").generate_ids(
            prompt, 30, sampling=params)[0]
    assert runs[True] == runs[False]
    assert len(calls) == (0 if params.penalised else 1)     # the first run went ahead unless penalised
