"""`pydflash serve` as a subprocess on loopback, driven by the official `openai` and `anthropic` clients: chat,
completions and messages, streamed and not, all equal to Engine.generate's greedy output, with real usage
counts, stop sequences, the thinking switch and token counting."""
import anthropic
import httpx
import openai
import pytest

import pydflash
from pydflash.server.demo import DEMO_TEMPLATE
from pydflash.testing import write_qwen35_gguf

from server_helpers import ServeProcess

pytestmark = pytest.mark.slow
N = 16
PROMPT = "Hello, world! Write a test of the tokenizer."


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny.gguf"
    write_qwen35_gguf(path, seed=3, chat_template=DEMO_TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServeProcess("--target", model_path, "--mode", "ar", "--device", "cpu", "--max-ctx", "512",
                       "--alias", "tiny")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def engine(model_path):
    return pydflash.load(model_path, mode="ar", device="cpu", max_ctx=512, prefix_cache=False)   # fresh prefills


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat_ids(engine, messages, **template_vars):
    tok = engine.tokenizer
    return tok.tokenize(tok.apply_chat_template(messages, **template_vars), add_special=False)


def finish_of(engine, tokens, n):
    return "stop" if engine.tokenizer.is_end_of_generation(tokens[-1]) or len(tokens) < n else "length"


def test_chat_streamed_and_not_equal_engine_generate(oai, engine):
    ref = engine.generate(PROMPT, max_tokens=N, chat=True)
    messages = [{"role": "user", "content": PROMPT}]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N)
    assert out.choices[0].message.content == ref.text
    assert out.choices[0].finish_reason == finish_of(engine, ref.tokens, N)
    assert out.usage.prompt_tokens == len(chat_ids(engine, messages))
    assert out.usage.completion_tokens == len(ref.tokens)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens

    chunks = list(oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, stream=True,
                                              stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1   # streamed, not one lump
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.tokens)


def test_completions_streamed_and_not_equal_engine_generate(oai, engine):
    ref = engine.generate(PROMPT, max_tokens=N)
    out = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=N)
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == len(engine.tokenizer.tokenize(PROMPT, add_special=True))
    assert out.usage.completion_tokens == len(ref.tokens)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=N,
                                                                          stream=True) if c.choices)
    assert streamed == ref.text
    ids = engine.tokenizer.tokenize(PROMPT, add_special=True)
    by_ids = oai.completions.create(model="tiny", prompt=ids, max_tokens=N)
    assert by_ids.choices[0].text == ref.text


def test_anthropic_messages_streamed_and_not_equal_engine_generate(claude, engine):
    ref = engine.generate(PROMPT, max_tokens=N, chat=True)
    messages = [{"role": "user", "content": PROMPT}]
    out = claude.messages.create(model="tiny", max_tokens=N, messages=messages)
    assert [b.type for b in out.content] == ["text"]
    assert out.content[0].text == ref.text
    assert out.stop_reason == ("end_turn" if finish_of(engine, ref.tokens, N) == "stop" else "max_tokens")
    assert out.usage.input_tokens == len(chat_ids(engine, messages))
    assert out.usage.output_tokens == len(ref.tokens)
    with claude.messages.stream(model="tiny", max_tokens=N, messages=messages) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == ref.text and len(pieces) > 1
    assert final.content[0].text == ref.text
    assert final.stop_reason == out.stop_reason
    assert final.usage.output_tokens == len(ref.tokens)


def test_system_prompt_and_history_reach_the_template(oai, claude, engine):
    history = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi, world."},
               {"role": "user", "content": PROMPT}]
    ids = chat_ids(engine, [{"role": "system", "content": "Be brief."}] + history)
    ref = engine.generate(ids, max_tokens=N)
    out = oai.chat.completions.create(model="tiny", max_tokens=N,
                                      messages=[{"role": "system", "content": "Be brief."}] + history)
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ids)
    msg = claude.messages.create(model="tiny", max_tokens=N, system="Be brief.", messages=history)
    assert msg.content[0].text == ref.text
    assert claude.messages.count_tokens(model="tiny", system="Be brief.", messages=history).input_tokens == len(ids)


def test_stop_sequences_cut_the_text(oai, claude, engine):
    ref = engine.generate(PROMPT, max_tokens=N, chat=True).text
    stop = next(ref[i:i + 2] for i in range(6, len(ref) - 2)
                if ref[i:i + 2].strip() and "\ufffd" not in ref[i:i + 2] and ref.find(ref[i:i + 2]) > 0)
    expect = ref[:ref.find(stop)]
    messages = [{"role": "user", "content": PROMPT}]
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N, stop=[stop, "never seen"])
    assert out.choices[0].message.content == expect and out.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=N, stop=stop, stream=True) if c.choices)
    assert streamed == expect
    msg = claude.messages.create(model="tiny", max_tokens=N, messages=messages, stop_sequences=[stop])
    assert msg.content[0].text == expect
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop


def test_thinking_switch_goes_through_the_template(oai, claude, engine):
    messages = [{"role": "user", "content": PROMPT}]
    ids = chat_ids(engine, messages, enable_thinking=True)
    assert engine.tokenizer.detokenize(ids).endswith("<think>\n")
    ref = engine.generate(ids, max_tokens=N).text
    assert "</think>" not in ref            # the random model never closes it: all of it is reasoning
    out = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = out.choices[0].message
    assert message.reasoning_content == ref.lstrip("\n") and not message.content
    assert out.usage.prompt_tokens == len(ids)
    msg = claude.messages.create(model="tiny", max_tokens=N, messages=messages,
                                 thinking={"type": "enabled", "budget_tokens": 16})
    assert [b.type for b in msg.content] == ["thinking"]
    assert msg.content[0].thinking == ref.lstrip("\n")
    off = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=N,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == engine.generate(PROMPT, max_tokens=N, chat=True).text


def test_chat_turn_two_reuses_turn_one(oai, server, engine):
    """The engine's prefix cache resumes a chat's next turn; the reply is the one a fresh prefill gives, and the
    response's timings and /health say what was reused."""
    turn1 = [{"role": "user", "content": PROMPT}]
    r1 = oai.chat.completions.create(model="tiny", messages=turn1, max_tokens=N)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    r2 = oai.chat.completions.create(model="tiny", messages=turn2, max_tokens=N)
    ids = chat_ids(engine, turn2)
    assert r2.choices[0].message.content == engine.generate(ids, max_tokens=N).text
    timings = r2.model_extra["timings"]
    assert timings["reused_tokens"] >= r1.usage.prompt_tokens
    assert timings["prefilled_tokens"] == len(ids) - timings["reused_tokens"]
    reuse = server.health()["prefix_reuse"]
    assert reuse["last_reused_tokens"] == timings["reused_tokens"] and reuse["total_reused_tokens"] >= reuse[
        "last_reused_tokens"]


def test_models_health_and_alias(oai, server):
    assert [m.id for m in oai.models.list().data] == ["tiny"]
    health = server.health()
    assert health["model"] == "tiny" and health["busy"] is False and health["queue_length"] == 0
    assert health["requests"] >= 1 and health["last_run"]["completion_tokens"] >= 1
    assert "prefix_reuse" in health
    with pytest.raises(openai.NotFoundError, match="not found"):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_sampling_options_follow_the_engine(server, engine):
    """Sampling fields go to the engine unchanged: what it refuses is a 400 naming the option, what it accepts
    is served (so sampling works through the API the day the engine implements it)."""
    try:
        engine.generate(PROMPT, max_tokens=2, temperature=0.7)
        refused = None
    except ValueError as e:
        refused = str(e)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2, "temperature": 0.7})
    if refused is None:
        assert r.status_code == 200
    else:
        assert r.status_code == 400 and r.json()["error"]["message"] == refused and "temperature" in refused
