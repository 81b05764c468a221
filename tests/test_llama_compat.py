"""pydflash.Llama side by side with llama_cpp.Llama on the same synthetic GGUF: the same greedy text, token
counts and finish reasons, and the same keys and value types in every returned dict and streamed chunk."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

import pydflash
from conftest import llama_cpp_plain
from pydflash.testing import CHATML_TEMPLATE, write_dflash_draft, write_qwen35_gguf

N_CTX = 256

# A template that renders the tools it is given (the way Qwen's does, through tojson).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}" + CHATML_TEMPLATE)

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city (°C)",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama_compat")
    write_qwen35_gguf(root / "target.gguf", seed=4, chat_template=TOOLS_TEMPLATE)
    write_dflash_draft(root / "draft", root / "target.gguf", seed=1)
    return str(root / "target.gguf"), str(root / "draft")


@pytest.fixture(scope="module")
def reference(paths):
    return llama_cpp_plain(paths[0], n_ctx=N_CTX, n_threads=2, flash_attn=True, verbose=False)


@pytest.fixture(scope="module")
def ours(paths):
    return pydflash.Llama(paths[0], n_ctx=N_CTX, device="cpu")


@pytest.fixture(scope="module")
def ours_ddtree(paths):
    return pydflash.Llama(paths[0], draft_model_path=paths[1], n_ctx=N_CTX, device="cpu", budget=6)


def shape(value):
    """Keys and value types, recursively: what two API results must share."""
    if isinstance(value, dict):
        return {key: shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [shape(item) for item in value]
    return type(value).__name__


def text_of(result) -> str:
    return result["choices"][0]["text"]


def assert_same_completion(ours_result, ref_result):
    assert shape(ours_result) == shape(ref_result)
    assert text_of(ours_result) == text_of(ref_result)
    assert ours_result["usage"] == ref_result["usage"]
    assert ours_result["choices"][0]["finish_reason"] == ref_result["choices"][0]["finish_reason"]
    assert ours_result["object"] == ref_result["object"] and ours_result["model"] == ref_result["model"]
    assert ours_result["id"].startswith("cmpl-")


COMPLETIONS = {
    "length": ("The quick brown fox", dict(max_tokens=24)),
    "stop strings": ("def fibonacci(n):", dict(max_tokens=60, stop=["fib", "\n"])),
    "single stop string": ("Hello, world!", dict(max_tokens=40, stop="wit")),
    "echo": ("The quick brown fox", dict(max_tokens=12, echo=True)),
    "past the context": ("Hello, world!", dict(max_tokens=400)),
    "multi-byte output": ("The quick brown fox", dict(max_tokens=40)),   # emits a lone 0xd8 and a 2-byte char
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c == "past the context" else c
                                  for c in sorted(COMPLETIONS)])
def test_completion_equals_llama_cpp(ours, reference, case):
    prompt, kwargs = COMPLETIONS[case]
    assert_same_completion(ours(prompt, **kwargs), reference(prompt, temperature=0.0, **kwargs))


def test_completion_of_token_ids(ours, reference):
    ids = reference.tokenize(b"import numpy as np", add_bos=False)
    assert ours.tokenize(b"import numpy as np", add_bos=False) == ids
    assert_same_completion(ours.create_completion(ids, max_tokens=20),
                           reference.create_completion(ids, max_tokens=20, temperature=0.0))


def test_prompt_extending_the_last_resumes_and_reset_forgets(ours, reference):
    """A prompt that extends the previous one resumes from the engine's prefix cache; reset() drops it. The
    completion is llama.cpp's either way."""
    ids = reference.tokenize(b"The lazy dog sleeps", add_bos=False)
    longer = ids + reference.tokenize(b" under the table", add_bos=False)
    expected = reference.create_completion(longer, max_tokens=10, temperature=0.0)
    ours.create_completion(ids, max_tokens=4)
    assert_same_completion(ours.create_completion(longer, max_tokens=10), expected)
    assert ours._engine.last_stats["reused_tokens"] == len(ids)
    ours.reset()
    assert_same_completion(ours.create_completion(longer, max_tokens=10), expected)
    assert ours._engine.last_stats["reused_tokens"] == 0


@pytest.mark.slow
def test_speculative_completion_equals_llama_cpp(ours_ddtree, reference):
    """A DFlash draft + DDTree verify behind the same surface: the same greedy tokens as llama.cpp."""
    for prompt, kwargs in (COMPLETIONS["stop strings"], ("The quick brown fox", dict(max_tokens=16))):
        assert_same_completion(ours_ddtree(prompt, **kwargs), reference(prompt, temperature=0.0, **kwargs))
    assert ours_ddtree._engine.mode == "ddtree"


@pytest.mark.parametrize("case", ["length", "stop strings", "multi-byte output"])
def test_stream_chunks_match_llama_cpp(ours, reference, case):
    """Same chunk shapes and final chunk; the pieces add up to llama-cpp-python's completion text (its own
    stream loses characters split over tokens, so the whole text is the oracle)."""
    prompt, kwargs = COMPLETIONS[case]
    chunks = list(ours(prompt, stream=True, **kwargs))
    ref_chunks = list(reference(prompt, temperature=0.0, stream=True, **kwargs))
    ref_whole = reference(prompt, temperature=0.0, **kwargs)
    assert {str(shape(c)) for c in chunks} == {str(shape(c)) for c in ref_chunks}
    assert "".join(text_of(c) for c in chunks) == text_of(ref_whole)
    assert chunks[-1]["choices"][0] == ref_chunks[-1]["choices"][0]   # text "", finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1 and len(chunks) > 2


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a fox?"}]


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "tools"])
def test_chat_completion_equals_llama_cpp(ours, reference, tools):
    kwargs = dict(max_tokens=24, tools=tools)
    got = ours.create_chat_completion(MESSAGES, **kwargs)
    ref = reference.create_chat_completion(MESSAGES, temperature=0.0, **kwargs)
    assert shape(got) == shape(ref)
    assert got["choices"][0]["message"] == ref["choices"][0]["message"]
    assert got["usage"] == ref["usage"] and got["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
    assert got["object"] == "chat.completion" and got["id"].startswith("chatcmpl-")


def test_chat_tools_reach_the_template(ours):
    with_tools = ours.create_chat_completion(MESSAGES, max_tokens=1, tools=TOOLS)
    plain = ours.create_chat_completion(MESSAGES, max_tokens=1)
    assert with_tools["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20


def test_chat_stream_chunks_match_llama_cpp(ours, reference):
    chunks = list(ours.create_chat_completion(MESSAGES, max_tokens=24, stream=True))
    ref_chunks = list(reference.create_chat_completion(MESSAGES, max_tokens=24, stream=True, temperature=0.0))
    ref_whole = reference.create_chat_completion(MESSAGES, max_tokens=24, temperature=0.0)
    assert [shape(c) for c in chunks[:1]] == [shape(c) for c in ref_chunks[:1]]   # the role chunk
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert {str(shape(c)) for c in chunks} == {str(shape(c)) for c in ref_chunks}
    assert chunks[-1]["choices"][0] == ref_chunks[-1]["choices"][0]
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == ref_whole["choices"][0]["message"]["content"]


def test_vocabulary_surface_equals_llama_cpp(ours, reference):
    text = "Hello, world! <|im_end|> über"
    for add_bos, special in ((True, False), (False, True)):
        ids = reference.tokenize(text.encode(), add_bos=add_bos, special=special)
        assert ours.tokenize(text.encode(), add_bos=add_bos, special=special) == ids
        assert ours.detokenize(ids) == reference.detokenize(ids)
        assert ours.detokenize(ids, special=True) == reference.detokenize(ids, special=True)
    assert (ours.n_ctx(), ours.n_vocab(), ours.token_eos(), ours.token_bos()) == \
        (reference.n_ctx(), reference.n_vocab(), reference.token_eos(), reference.token_bos())
    assert ours.metadata == reference.metadata


def test_max_tokens_none_runs_to_the_context_end(ours):
    """llama-cpp-python's rule: max_tokens None (or <= 0) is the room left in n_ctx."""
    out = ours("Hello, world!", max_tokens=None)
    usage = out["usage"]
    assert out["choices"][0]["finish_reason"] == "length" and usage["total_tokens"] == N_CTX
    with pytest.raises(ValueError, match="exceed context window"):
        ours("x" * 600, max_tokens=4)


def test_default_call_is_greedy_and_sampling_reaches_the_engine(ours, monkeypatch):
    greedy = text_of(ours("The quick brown fox", max_tokens=8, temperature=0.0))
    assert text_of(ours("The quick brown fox", max_tokens=8)) == greedy
    # values that change nothing are no sampling request
    assert text_of(ours("The quick brown fox", max_tokens=8, top_p=1.0, repeat_penalty=1.0, min_p=0.0)) == greedy
    # a sampled call reaches the engine's sampler: the same seed gives the same text, and an invalid value is refused
    sampled = text_of(ours("The quick brown fox", max_tokens=8, temperature=0.8, seed=5))
    assert text_of(ours("The quick brown fox", max_tokens=8, temperature=0.8, seed=5)) == sampled
    with pytest.raises(ValueError, match="temperature"):
        ours("The quick brown fox", max_tokens=8, temperature=-0.8)
    # temperature 0 is greedy in llama.cpp whatever the truncation settings say
    assert text_of(ours("The quick brown fox", max_tokens=8, temperature=0, top_p=0.5, top_k=3, seed=7)) == greedy
    seen = {}

    def record(prompt, max_tokens, **sampling):
        seen.update(sampling)
        yield from ()

    monkeypatch.setattr(ours._engine, "stream_tokens", record)
    ours("x", temperature=0.7, top_p=0.9, top_k=20, min_p=0.1, seed=3, repeat_penalty=1.1,
         presence_penalty=0.5, frequency_penalty=0.25)
    assert seen == dict(temperature=0.7, top_p=0.9, top_k=20, min_p=0.1, seed=3, repeat_penalty=1.1,
                        presence_penalty=0.5, frequency_penalty=0.25)


def test_refuses_what_would_change_results(paths, ours):
    for kwargs, match in ((dict(logprobs=2), "logprobs"), (dict(suffix="x"), "suffix"),
                          (dict(mirostat_mode=2), "mirostat_mode"), (dict(logit_bias={1: 5.0}), "logit_bias")):
        with pytest.raises(ValueError, match=match):
            ours("x", max_tokens=2, **kwargs)
    with pytest.raises(ValueError, match="tool_choice"):
        ours.create_chat_completion(MESSAGES, tools=TOOLS,
                                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with pytest.raises(ValueError, match="lora_path"):
        pydflash.Llama(paths[0], lora_path="adapter.gguf")
    with pytest.raises(ValueError, match="chat_format"):
        pydflash.Llama(paths[0], chat_format="llama-2")
    with pytest.raises(ValueError, match="type_k"):
        pydflash.Llama(paths[0], type_k=1, type_v=8)
    with pytest.raises(TypeError, match="n_kittens"):
        pydflash.Llama(paths[0], n_kittens=3)


def test_harmless_llama_cpp_arguments_and_context_manager(paths, ours):
    with pydflash.Llama(paths[0], n_ctx=N_CTX, n_gpu_layers=0, n_threads=2, n_batch=64, use_mmap=False,
                        flash_attn=True, type_k=8, type_v=8, verbose=False) as llm:
        assert llm._engine.target.cache.kv_type == pydflash.ggml.Type.Q8_0   # llama.cpp's GGML_TYPE_Q8_0 = 8
        assert llm("The quick brown fox", max_tokens=4)["usage"]["completion_tokens"] == 4
    with pytest.raises(RuntimeError, match="closed"):
        llm("x", max_tokens=2)


QUIET_SCRIPT = """
import sys
from pydflash.tokenizer import Tokenizer
Tokenizer(sys.argv[1])
sys.stderr.write("--- llama_cpp.Llama directly:\\n"); sys.stderr.flush()
import llama_cpp
llama_cpp.Llama(sys.argv[1], vocab_only=True, verbose=False)
"""


def test_llama_cpp_load_messages_stay_quiet(paths):
    """Our vocabulary-only load prints nothing; the same load through llama-cpp-python does print its
    n_ctx_seq warning (so the check can see one)."""
    run = subprocess.run([sys.executable, "-c", QUIET_SCRIPT, paths[0]], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(paths[0]))   # not a source checkout: the installed package
    ours_part, _, direct_part = run.stderr.partition("--- llama_cpp.Llama directly:")
    assert ours_part.strip() == ""
    assert "n_ctx_seq" in direct_part
