"""OpenAI routes: /v1/models, /v1/chat/completions and /v1/completions, streaming (`chat.completion.chunk`
events, then `[DONE]`) and not."""
from __future__ import annotations

import json
import time
import uuid

from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse

from .chat import openai_conversation, render
from .errors import APIError
from .parsing import OutputParser
from .schemas import ChatRequest, CompletionRequest, parse_body


def _usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


def _stops(stop) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop or [])


def _check_common(req) -> None:
    if req.n != 1:
        raise APIError(400, f"n={req.n}: one choice per request is supported (n=1)", param="n")
    if req.logprobs:
        raise APIError(400, "logprobs are not supported", param="logprobs")


async def models(request):
    state = request.app.state.server
    state.authorize(request)
    created = state.created
    # one list both clients parse: OpenAI's `object`/`owned_by` and Anthropic's `type`/`display_name`
    entry = {"id": state.alias, "object": "model", "created": created, "owned_by": "pydflash", "type": "model",
             "display_name": state.alias,
             "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))}
    return JSONResponse({"object": "list", "data": [entry], "has_more": False, "first_id": state.alias,
                         "last_id": state.alias})


def _tool_call_json(call, index: int | None = None) -> dict:
    out = {"id": call.id, "type": "function",
           "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)}}
    if index is not None:
        out["index"] = index
    return out


def _chat_finish(done: dict, parser: OutputParser) -> str:
    if done["finish_reason"] == "length":
        return "length"
    return "tool_calls" if parser.tool_calls else "stop"


async def chat_completions(request):
    state = request.app.state.server
    state.authorize(request)
    req = parse_body(await request.body(), ChatRequest)
    state.check_model(req.model)
    _check_common(req)
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise APIError(400, f"response_format {req.response_format.get('type')!r} is not supported (text only)",
                       param="response_format")
    messages, tools, kwargs = openai_conversation(req)
    prompt = render(state.tokenizer, messages, tools, kwargs)
    max_tokens = state.max_tokens_for(len(prompt.ids), req.max_completion_tokens or req.max_tokens)
    job = state.start(prompt.ids, max_tokens, req.sampling(), _stops(req.stop))
    first = await state.first_event(job, request)
    parser = OutputParser(in_reasoning=prompt.in_reasoning, tools=prompt.tools, param_types=prompt.param_types)
    cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), state.alias

    if not req.stream:
        content, reasoning = [], []
        done = None
        async for kind, value in state.events(job, first, request):
            if kind == "text":
                events = parser.feed(value)
            else:
                done, events = value, parser.finish()
            for what, item in events:          # tool calls are collected by the parser itself
                if what == "reasoning":
                    reasoning.append(item)
                elif what == "content":
                    content.append(item)
        message = {"role": "assistant", "content": "".join(content) if content or not parser.tool_calls else None}
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
        if parser.tool_calls:
            message["tool_calls"] = [_tool_call_json(c) for c in parser.tool_calls]
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": _chat_finish(done, parser)}],
                             "usage": _usage(done), "timings": done["timings"]})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(delta: dict, finish=None, **extra) -> dict:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
        body.update(extra)
        return {"data": json.dumps(body, ensure_ascii=False)}

    async def stream():
        yield chunk({"role": "assistant", "content": ""})
        async for kind, value in state.events(job, first):
            events = parser.feed(value) if kind == "text" else parser.finish()
            for what, item in events:
                if what == "content":
                    yield chunk({"content": item})
                elif what == "reasoning":
                    yield chunk({"reasoning_content": item})
                else:
                    yield chunk({"tool_calls": [_tool_call_json(item, len(parser.tool_calls) - 1)]})
            if kind == "done":
                yield chunk({}, _chat_finish(value, parser), timings=value["timings"])
                if include_usage:
                    yield {"data": json.dumps({"id": cid, "object": "chat.completion.chunk", "created": created,
                                               "model": model, "choices": [], "usage": _usage(value)})}
        yield {"data": "[DONE]"}

    return EventSourceResponse(stream(), ping=15)


def _completion_prompt(state, prompt) -> tuple[list[int], str]:
    """A completions prompt (text, one-element text list, or token ids) as (ids, text for echo)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: one prompt per request is supported, got {len(prompt)}", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "prompt: the prompt is empty", param="prompt")
        return state.tokenizer.tokenize(prompt, add_special=True), prompt
    if not prompt:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    n_vocab = state.tokenizer.n_vocab
    bad = [t for t in prompt if not 0 <= t < n_vocab]
    if bad:
        raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{n_vocab - 1})",
                       param="prompt")
    return list(prompt), state.tokenizer.detokenize(prompt)


async def completions(request):
    state = request.app.state.server
    state.authorize(request)
    req = parse_body(await request.body(), CompletionRequest)
    state.check_model(req.model)
    _check_common(req)
    if req.suffix:
        raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
    ids, prompt_text = _completion_prompt(state, req.prompt)
    max_tokens = state.max_tokens_for(len(ids), req.max_tokens)
    job = state.start(ids, max_tokens, req.sampling(), _stops(req.stop))
    first = await state.first_event(job, request)
    cid, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), state.alias
    echo = prompt_text if req.echo else ""

    if not req.stream:
        text, done = [echo], None
        async for kind, value in state.events(job, first, request):
            if kind == "text":
                text.append(value)
            else:
                done = value
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": "".join(text), "logprobs": None,
                                          "finish_reason": "length" if done["finish_reason"] == "length" else "stop"}],
                             "usage": _usage(done), "timings": done["timings"]})

    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(text: str, finish=None, **extra) -> dict:
        body = {"id": cid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
        body.update(extra)
        return {"data": json.dumps(body, ensure_ascii=False)}

    async def stream():
        if echo:
            yield chunk(echo)
        async for kind, value in state.events(job, first):
            if kind == "text":
                yield chunk(value)
            else:
                yield chunk("", "length" if value["finish_reason"] == "length" else "stop", timings=value["timings"])
                if include_usage:
                    yield {"data": json.dumps({"id": cid, "object": "text_completion", "created": created,
                                               "model": model, "choices": [], "usage": _usage(value)})}
        yield {"data": "[DONE]"}

    return EventSourceResponse(stream(), ping=15)
