"""Anthropic routes: /v1/messages (streaming: message_start, content_block_start/delta/stop, message_delta,
message_stop) and /v1/messages/count_tokens."""
from __future__ import annotations

import json
import uuid

from sse_starlette import EventSourceResponse
from starlette.responses import JSONResponse

from .chat import anthropic_conversation, render
from .parsing import OutputParser
from .schemas import CountTokensRequest, MessagesRequest, parse_body


def _stop_reason(done: dict, parser: OutputParser) -> str:
    if done["finish_reason"] == "length":
        return "max_tokens"
    if done["stop_sequence"] is not None:
        return "stop_sequence"
    return "tool_use" if parser.tool_calls else "end_turn"


def _tool_id(call) -> str:
    return "toolu_" + call.id.removeprefix("call_")


async def count_tokens(request):
    state = request.app.state.server
    state.authorize(request)
    req = parse_body(await request.body(), CountTokensRequest)
    state.check_model(req.model)
    prompt = render(state.tokenizer, *anthropic_conversation(req))
    return JSONResponse({"input_tokens": len(prompt.ids)})


async def messages(request):
    state = request.app.state.server
    state.authorize(request)
    req = parse_body(await request.body(), MessagesRequest)
    state.check_model(req.model)
    prompt = render(state.tokenizer, *anthropic_conversation(req))
    max_tokens = state.max_tokens_for(len(prompt.ids), req.max_tokens)
    job = state.start(prompt.ids, max_tokens, req.sampling(), list(req.stop_sequences or []))
    first = await state.first_event(job, request)
    parser = OutputParser(in_reasoning=prompt.in_reasoning, tools=prompt.tools, param_types=prompt.param_types)
    mid = f"msg_{uuid.uuid4().hex}"
    n_prompt = len(prompt.ids)

    if not req.stream:
        blocks: list[dict] = []
        done = None
        async for kind, value in state.events(job, first, request):
            if kind == "text":
                events = parser.feed(value)
            else:
                done, events = value, parser.finish()
            for what, item in events:
                if what == "tool_call":
                    blocks.append({"type": "tool_use", "id": _tool_id(item), "name": item.name,
                                   "input": item.arguments})
                elif what == "reasoning":
                    if blocks and blocks[-1]["type"] == "thinking":
                        blocks[-1]["thinking"] += item
                    else:
                        blocks.append({"type": "thinking", "thinking": item, "signature": ""})
                elif blocks and blocks[-1]["type"] == "text":
                    blocks[-1]["text"] += item
                else:
                    blocks.append({"type": "text", "text": item})
        return JSONResponse({"id": mid, "type": "message", "role": "assistant", "model": state.alias,
                             "content": blocks, "stop_reason": _stop_reason(done, parser),
                             "stop_sequence": done["stop_sequence"],
                             "usage": {"input_tokens": n_prompt, "output_tokens": done["completion_tokens"]},
                             "timings": done["timings"]})

    def event(body: dict) -> dict:
        return {"event": body["type"], "data": json.dumps(body, ensure_ascii=False)}

    async def stream():
        yield event({"type": "message_start",
                     "message": {"id": mid, "type": "message", "role": "assistant", "model": state.alias,
                                 "content": [], "stop_reason": None, "stop_sequence": None,
                                 "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
        index, open_kind = -1, None
        async for kind, value in state.events(job, first):
            events = parser.feed(value) if kind == "text" else parser.finish()
            for what, item in events:
                if what != open_kind or what == "tool_call":
                    if open_kind is not None:
                        yield event({"type": "content_block_stop", "index": index})
                    index, open_kind = index + 1, what
                    if what == "tool_call":
                        block = {"type": "tool_use", "id": _tool_id(item), "name": item.name, "input": {}}
                    elif what == "reasoning":
                        block = {"type": "thinking", "thinking": "", "signature": ""}
                    else:
                        block = {"type": "text", "text": ""}
                    yield event({"type": "content_block_start", "index": index, "content_block": block})
                if what == "tool_call":
                    delta = {"type": "input_json_delta", "partial_json": json.dumps(item.arguments, ensure_ascii=False)}
                elif what == "reasoning":
                    delta = {"type": "thinking_delta", "thinking": item}
                else:
                    delta = {"type": "text_delta", "text": item}
                yield event({"type": "content_block_delta", "index": index, "delta": delta})
            if kind == "done":
                if open_kind is not None:
                    yield event({"type": "content_block_stop", "index": index})
                yield event({"type": "message_delta",
                             "delta": {"stop_reason": _stop_reason(value, parser),
                                       "stop_sequence": value["stop_sequence"]},
                             "usage": {"output_tokens": value["completion_tokens"]},
                             "timings": value["timings"]})
                yield event({"type": "message_stop"})

    return EventSourceResponse(stream(), ping=15)
