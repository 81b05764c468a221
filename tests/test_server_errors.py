"""Bad requests get the right 4xx in the shape of the API they were sent to, and the server still answers a
good request correctly afterwards."""
import json

import httpx
import pytest

import pydflash
from pydflash.server.demo import DEMO_TEMPLATE
from pydflash.testing import write_qwen35_gguf

from server_helpers import ServeProcess

pytestmark = pytest.mark.slow
KEY = "sk-test-123"
CTX = 256
USER = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CHAT, COMP, MSGS, COUNT = "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"


def chat(**fields):
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}


def msgs(**fields):
    return {"model": "tiny", "messages": USER, "max_tokens": 4, **fields}


# (id, path, body: dict or raw bytes, headers, status, words the message must contain)
CASES = [
    ("chat-malformed-json", CHAT, b'{"messages": [', None, 400, ["JSON"]),
    ("chat-body-is-array", CHAT, b"[1, 2]", None, 400, ["JSON object"]),
    ("chat-messages-missing", CHAT, {"model": "tiny"}, None, 400, ["messages"]),
    ("chat-messages-empty", CHAT, chat(messages=[]), None, 400, ["messages"]),
    ("chat-messages-not-a-list", CHAT, chat(messages="hi"), None, 400, ["messages"]),
    ("chat-bad-role", CHAT, chat(messages=[{"role": "robot", "content": "x"}]), None, 400, ["role"]),
    ("chat-content-number", CHAT, chat(messages=[{"role": "user", "content": 5}]), None, 400, ["content"]),
    ("chat-user-content-null", CHAT, chat(messages=[{"role": "user", "content": None}]), None, 400, ["content"]),
    ("chat-only-system", CHAT, chat(messages=[{"role": "system", "content": "x"}]), None, 400, ["user"]),
    ("chat-image-part", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), None, 400,
     ["image_url"]),
    ("chat-max-tokens-zero", CHAT, chat(max_tokens=0), None, 400, ["max_tokens"]),
    ("chat-max-tokens-string", CHAT, chat(max_tokens="abc"), None, 400, ["max_tokens"]),
    ("chat-temperature-string", CHAT, chat(temperature="hot"), None, 400, ["temperature"]),
    ("chat-temperature-out-of-range", CHAT, chat(temperature=5), None, 400, ["temperature"]),
    ("chat-stream-not-bool", CHAT, chat(stream="yes"), None, 400, ["stream"]),
    ("chat-stop-number", CHAT, chat(stop=7), None, 400, ["stop"]),
    ("chat-too-many-stops", CHAT, chat(stop=[str(i) for i in range(17)]), None, 400, ["stop"]),
    ("chat-n-two", CHAT, chat(n=2), None, 400, ["n=2"]),
    ("chat-logprobs", CHAT, chat(logprobs=True), None, 400, ["logprobs"]),
    ("chat-json-mode", CHAT, chat(response_format={"type": "json_object"}), None, 400, ["response_format"]),
    ("chat-beyond-context", CHAT, chat(max_tokens=CTX), None, 400, ["max_tokens (256)", "256 tokens"]),
    ("chat-tool-without-function", CHAT, chat(tools=[{"type": "function"}]), None, 400, ["tools"]),
    ("chat-tool-choice-required", CHAT, chat(tools=[TOOL], tool_choice="required"), None, 400, ["tool_choice"]),
    ("chat-tool-args-not-json", CHAT, chat(messages=USER + [
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": "{oops"}}]}]), None, 400,
     ["arguments"]),
    ("chat-template-kwargs-not-object", CHAT, chat(chat_template_kwargs=[1]), None, 400, ["chat_template_kwargs"]),
    ("chat-template-kwargs-reserved", CHAT, chat(chat_template_kwargs={"messages": []}), None, 400,
     ["chat_template_kwargs.messages"]),
    ("chat-unknown-model", CHAT, chat(model="gpt-4o"), None, 404, ["gpt-4o"]),
    ("chat-no-api-key", CHAT, chat(), {"Authorization": ""}, 401, ["API key"]),
    ("chat-wrong-api-key", CHAT, chat(), {"Authorization": "Bearer nope"}, 401, ["API key"]),
    ("completions-prompt-missing", COMP, {"model": "tiny"}, None, 400, ["prompt"]),
    ("completions-prompt-empty", COMP, {"prompt": ""}, None, 400, ["empty"]),
    ("completions-two-prompts", COMP, {"prompt": ["a", "b"]}, None, 400, ["one prompt"]),
    ("completions-token-out-of-vocab", COMP, {"prompt": [1, 10 ** 9]}, None, 400, ["vocabulary"]),
    ("completions-suffix", COMP, {"prompt": "a", "suffix": "b"}, None, 400, ["suffix"]),
    ("messages-malformed-json", MSGS, b"{nope", None, 400, ["JSON"]),
    ("messages-max-tokens-missing", MSGS, {"model": "tiny", "messages": USER}, None, 400, ["max_tokens"]),
    ("messages-model-missing", MSGS, {"messages": USER, "max_tokens": 4}, None, 400, ["model"]),
    ("messages-system-role", MSGS, msgs(messages=[{"role": "system", "content": "x"}]), None, 400, ["role"]),
    ("messages-unknown-block", MSGS, msgs(messages=[{"role": "user", "content": [{"type": "video"}]}]), None, 400,
     ["video"]),
    ("messages-image-block", MSGS, msgs(messages=[{"role": "user", "content": [{"type": "image"}]}]), None, 400,
     ["image"]),
    ("messages-tool-use-in-user", MSGS, msgs(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]), None, 400, ["tool_use"]),
    ("messages-bad-thinking", MSGS, msgs(thinking={"type": "maybe"}), None, 400, ["thinking"]),
    ("messages-tool-choice-any", MSGS, msgs(tools=[{"name": "f", "input_schema": {}}], tool_choice={"type": "any"}),
     None, 400, ["tool_choice"]),
    ("messages-beyond-context", MSGS, msgs(max_tokens=10 ** 6), None, 400, ["exceed the context"]),
    ("messages-unknown-model", MSGS, msgs(model="claude-opus-4"), None, 404, ["claude-opus-4"]),
    ("messages-wrong-api-key", MSGS, msgs(), {"x-api-key": "nope"}, 401, ["API key"]),
    ("count-tokens-messages-empty", COUNT, {"model": "tiny", "messages": []}, None, 400, ["messages"]),
    ("unknown-endpoint", "/v1/embeddings", {"input": "x"}, None, 404, ["/v1/embeddings"]),
    ("get-on-post-endpoint", CHAT, None, None, 405, ["GET"]),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve-errors") / "tiny.gguf"
    write_qwen35_gguf(path, seed=5, chat_template=DEMO_TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(model_path):
    srv = ServeProcess("--target", model_path, "--mode", "ar", "--device", "cpu", "--max-ctx", str(CTX),
                       "--alias", "tiny", "--api-key", KEY)
    yield srv
    srv.close()


def test_enough_kinds():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server, case):
    _, path, body, headers, status, words = case
    h = {"Authorization": f"Bearer {KEY}"}
    if headers:
        h = {k: v for k, v in {**h, **headers}.items() if v}
    if body is None:
        r = httpx.get(server.url + path, headers=h, timeout=30)
    else:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = httpx.post(server.url + path, content=raw, headers={**h, "Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()
    if path.startswith("/v1/messages"):
        assert err["type"] == "error" and set(err["error"]) == {"type", "message"}
        assert err["error"]["type"] == {400: "invalid_request_error", 401: "authentication_error",
                                        404: "not_found_error"}[status]
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"}
    message = err["error"]["message"]
    for word in words:
        assert word in message, message


def test_still_answers_correctly_after_bad_requests(server, model_path):
    for case in CASES:                        # all of them again, back to back
        raw = case[2] if isinstance(case[2], bytes) else json.dumps(case[2] or {}).encode()
        httpx.post(server.url + case[1], content=raw, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    ref = pydflash.load(model_path, mode="ar", device="cpu", max_ctx=CTX).generate("Hello", max_tokens=8, chat=True)
    r = httpx.post(server.url + CHAT, json=chat(max_tokens=8), headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == ref.text
    assert server.health()["busy"] is False
