"""OpenAI and Anthropic conversations into the messages the GGUF's chat template renders, and the rendered
prompt into token ids.

The template sees the Hugging Face conventions Qwen3.5/3.6 templates are written for: roles system / user /
assistant / tool, assistant `tool_calls` as [{"type": "function", "id", "function": {"name", "arguments":
dict}}], `reasoning_content` on assistant turns, `tools` in OpenAI's function format, and `enable_thinking`
(and any other `chat_template_kwargs`) as template variables.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import APIError
from .parsing import THINK_CLOSE, THINK_OPEN

_RESERVED = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}


@dataclass
class Prompt:
    ids: list[int]
    in_reasoning: bool = False         # the prompt ends inside an open <think> block
    tools: bool = False                # the request offered tools: parse tool calls out of the output
    param_types: dict = field(default_factory=dict)


def _text_of(content, where: str) -> str:
    """A message's content (a string or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise APIError(400, f"{where}.content.{i}: content parts of type {part.type!r} are not supported "
                                "(text only)", param=f"{where}.content")
        parts.append(part.text)
    return "".join(parts)


def _arguments(raw: str, where: str) -> dict:
    try:
        args = json.loads(raw) if raw.strip() else {}
    except ValueError:
        raise APIError(400, f"{where}.function.arguments is not valid JSON: {raw[:80]!r}", param=where) from None
    if not isinstance(args, dict):
        raise APIError(400, f"{where}.function.arguments must be a JSON object, got {raw[:80]!r}", param=where)
    return args


def openai_conversation(req) -> tuple[list[dict], list[dict], dict]:
    """A ChatRequest as (template messages, tools, template kwargs)."""
    messages = []
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        role = "system" if m.role == "developer" else m.role
        if role == "user" and m.content is None:
            raise APIError(400, f"{where}.content: a user message needs content", param=f"{where}.content")
        msg = {"role": role, "content": _text_of(m.content, where)}
        if role == "assistant":
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"type": "function", "id": c.id or f"call_{i}_{j}",
                     "function": {"name": c.function.name,
                                  "arguments": _arguments(c.function.arguments, f"{where}.tool_calls.{j}")}}
                    for j, c in enumerate(m.tool_calls)]
        if role == "tool":
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        messages.append(msg)
    tools = []
    if req.tools and req.tool_choice != "none":
        if req.tool_choice not in (None, "auto"):
            raise APIError(400, f"tool_choice {req.tool_choice!r} is not supported: greedy decoding cannot force a "
                                "call; use 'auto' or 'none'", param="tool_choice")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
    kwargs = dict(req.chat_template_kwargs or {})
    for name in kwargs:
        if name in _RESERVED or not name.isidentifier():
            raise APIError(400, f"chat_template_kwargs.{name}: this name cannot be set by a request",
                           param="chat_template_kwargs")
    return messages, tools, kwargs


def anthropic_conversation(req) -> tuple[list[dict], list[dict], dict]:
    """A MessagesRequest (or CountTokensRequest) as (template messages, tools, template kwargs)."""
    messages = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "".join(b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}"
        blocks = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else \
            [b.model_dump() for b in m.content]
        text, reasoning, calls = [], [], []
        for j, b in enumerate(blocks):
            kind = b["type"]
            if kind in ("image", "document"):
                raise APIError(400, f"{where}.content.{j}: {kind} blocks are not supported (text only)",
                               param=f"{where}.content")
            if kind == "text":
                text.append(b["text"])
            elif kind == "thinking" and m.role == "assistant":
                reasoning.append(b["thinking"])
            elif kind == "tool_use" and m.role == "assistant":
                calls.append({"type": "function", "id": b["id"],
                              "function": {"name": b["name"], "arguments": b["input"]}})
            elif kind == "tool_result" and m.role == "user":
                if text:                          # keep the order of text and results
                    messages.append({"role": "user", "content": "".join(text)})
                    text = []
                content = b["content"]
                if isinstance(content, list):
                    if any(c["type"] != "text" for c in content):
                        raise APIError(400, f"{where}.content.{j}.content: only text tool results are supported",
                                       param=f"{where}.content")
                    content = "".join(c["text"] for c in content)
                messages.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": content or ""})
            elif kind == "redacted_thinking":
                continue
            else:
                raise APIError(400, f"{where}.content.{j}: a {kind} block cannot be in a {m.role} message",
                               param=f"{where}.content")
        if m.role == "user":
            if text or not any(b["type"] == "tool_result" for b in blocks):
                messages.append({"role": "user", "content": "".join(text)})
        else:
            msg = {"role": "assistant", "content": "".join(text)}
            if reasoning:
                msg["reasoning_content"] = "".join(reasoning)
            if calls:
                msg["tool_calls"] = calls
            messages.append(msg)
    tools = []
    choice = req.tool_choice.type if req.tool_choice else "auto"
    if req.tools and choice != "none":
        if choice != "auto":
            raise APIError(400, f"tool_choice {choice!r} is not supported: greedy decoding cannot force a call; "
                                "use 'auto' or 'none'", param="tool_choice")
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                   "parameters": t.input_schema}} for t in req.tools]
    kwargs = {}
    if req.thinking is not None and req.thinking.type != "adaptive":
        kwargs["enable_thinking"] = req.thinking.type == "enabled"
    return messages, tools, kwargs


def _param_types(tools: list[dict]) -> dict:
    types = {}
    for t in tools:
        fn = t["function"]
        props = (fn.get("parameters") or {}).get("properties") or {}
        types[fn["name"]] = {p: s.get("type") for p, s in props.items() if isinstance(s, dict)}
    return types


def render(tokenizer, messages: list[dict], tools: list[dict], kwargs: dict) -> Prompt:
    """Render the conversation through the GGUF's chat template and tokenise it. A final assistant message is
    a prefill: the reply continues it."""
    prefill = ""
    if messages and messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
        prefill = messages[-1]["content"]
        messages = messages[:-1]
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "messages: the conversation needs at least one user message", param="messages")
    if tools:
        kwargs = dict(kwargs, tools=tools)
    try:
        # message contents (and the prefill) become plain-text tokens: a client cannot forge a turn by typing
        # "<|im_end|>"; the template runs in the tokenizer's bounded sandbox
        ids, text = tokenizer.chat_prompt(messages, add_generation_prompt=True, **kwargs)
    except Exception as e:       # the template is the model's code: whatever it raises is about these messages
        raise APIError(400, f"the model's chat template rejected the conversation: {e}") from None
    ids += tokenizer.tokenize(prefill, parse_special=False)
    tail = (text + prefill).rstrip()
    in_reasoning = tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE)
    return Prompt(ids, in_reasoning=in_reasoning, tools=bool(tools), param_types=_param_types(tools))
