"""Generated text into what the APIs return: stop sequences cut, reasoning split out of <think>...</think>, and
Qwen3.5/3.6 tool-call markup turned into structured calls. Both work on streamed pieces: text that could still
become a stop sequence or a tag is held back until the next piece decides it.

Tool-call markup (Qwen3.5/3.6 chat templates), either
    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>
or bare JSON inside the tags: <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"


def _partial_suffix(text: str, needles) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `needles` (text to hold back)."""
    best = 0
    for needle in needles:
        for n in range(min(len(needle) - 1, len(text)), best, -1):
            if text.endswith(needle[:n]):
                best = n
                break
    return best


class StopMatcher:
    """Cuts the text at the first stop sequence. feed() returns the text that is safe to show."""

    def __init__(self, stops):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.hit: str | None = None          # the stop sequence that ended the text

    def feed(self, piece: str) -> str:
        if self.hit is not None:
            return ""
        text = self.pending + piece
        found = [(text.find(s), s) for s in self.stops if s in text]
        if found:
            at, stop = min(found)
            self.hit, self.pending = stop, ""
            return text[:at]
        keep = _partial_suffix(text, self.stops)
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep]

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


@dataclass
class ParsedToolCall:
    name: str
    arguments: dict
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.S)


def _strip_one_newline(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _param_value(raw: str, schema_type):
    """A parameter's text as the type its schema asks for; without a schema, JSON if it parses, else text."""
    value = _strip_one_newline(raw)
    if schema_type == "string" or (isinstance(schema_type, list) and schema_type == ["string"]):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def parse_tool_call(body: str, param_types: dict | None = None) -> ParsedToolCall | None:
    """One <tool_call> body (without the tags) as a call, or None if it is neither markup form."""
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return None
        if not isinstance(obj, dict):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            return None
        return ParsedToolCall(obj["name"], args)
    m = _FUNCTION.search(text)
    if m is None:
        return None
    name = m.group(1).strip()
    types = (param_types or {}).get(name, {})
    args = {p.strip(): _param_value(v, types.get(p.strip())) for p, v in _PARAMETER.findall(m.group(2))}
    return ParsedToolCall(name, args)


class OutputParser:
    """Splits streamed model text into ('reasoning', text), ('content', text) and ('tool_call', ParsedToolCall)
    events. in_reasoning: the prompt already opened a <think> block (Qwen3.5/3.6 templates end the generation
    prompt with one when thinking is on). tools: parse tool calls (only when the request offered tools);
    param_types: {function: {parameter: JSON-schema type}} to type XML parameter values."""

    def __init__(self, *, in_reasoning: bool = False, tools: bool = False, param_types: dict | None = None):
        self.state = "reasoning" if in_reasoning else "content"
        self.tools = tools
        self.param_types = param_types or {}
        self.buffer = ""
        self.seen_content = False            # a <think> opens reasoning only before any content
        self.after_think = False             # drop the blank lines a template puts after </think>
        self.reasoning_started = False       # and the newline after <think>
        self.tool_calls: list[ParsedToolCall] = []

    def feed(self, piece: str) -> list[tuple]:
        self.buffer += piece
        events: list[tuple] = []
        while self.buffer:
            if not self._step(events, final=False):
                break
        return events

    def finish(self) -> list[tuple]:
        events: list[tuple] = []
        while self.buffer and self._step(events, final=True):
            pass
        if self.state == "tool" and self.buffer:          # an unclosed call (max_tokens): keep it if it parses
            self._close_tool(self.buffer, events)
        elif self.buffer:
            self._emit(events, self.state, self.buffer)
        self.buffer = ""
        return events

    def _emit(self, events, kind: str, text: str) -> None:
        if kind == "content":
            if self.after_think or (not self.seen_content and self.tool_calls):
                text = text.lstrip("\n")
            if not text:
                return
            self.after_think = False
            if not self.seen_content and self.tool_calls and not text.strip():
                return
            self.seen_content = self.seen_content or bool(text.strip())
        elif kind == "reasoning" and not self.reasoning_started:
            text = text.lstrip("\n")
            self.reasoning_started = bool(text)
        if text:
            if events and events[-1][0] == kind:
                events[-1] = (kind, events[-1][1] + text)
            else:
                events.append((kind, text))

    def _close_tool(self, body: str, events) -> None:
        call = parse_tool_call(body, self.param_types)
        if call is None:                      # not a call after all: show it as it was written
            self._emit(events, "content", TOOL_OPEN + body)
        else:
            self.tool_calls.append(call)
            events.append(("tool_call", call))
        self.state = "content"

    def _step(self, events, final: bool) -> bool:
        """Consume what the buffer decides; False when the rest must wait for more text."""
        buf = self.buffer
        if self.state == "reasoning":
            at = buf.find(THINK_CLOSE)
            if at >= 0:
                self._emit(events, "reasoning", buf[:at])
                self.buffer = buf[at + len(THINK_CLOSE):]
                self.state, self.after_think = "content", True
                return True
            keep = 0 if final else _partial_suffix(buf, [THINK_CLOSE])
            self._emit(events, "reasoning", buf[:len(buf) - keep])
            self.buffer = buf[len(buf) - keep:]
            return False
        if self.state == "tool":
            at = buf.find(TOOL_CLOSE)
            if at < 0:
                return False
            self.buffer = buf[at + len(TOOL_CLOSE):]
            self._close_tool(buf[:at], events)
            return True
        # content: look for a tool call, or a <think> before any content
        tags = [TOOL_OPEN] if self.tools else []
        if not self.seen_content and not self.tool_calls:
            tags.append(THINK_OPEN)
        hits = [(buf.find(t), t) for t in tags if t in buf]
        if hits:
            at, tag = min(hits)
            if tag == THINK_OPEN and buf[:at].strip():
                tags.remove(THINK_OPEN)           # text came first: a later <think> is just text
                self.seen_content = True
                return True
            self._emit(events, "content", buf[:at])
            self.buffer = buf[at + len(tag):]
            self.state = "reasoning" if tag == THINK_OPEN else "tool"
            return True
        keep = 0 if final else _partial_suffix(buf, tags)
        if not self.seen_content and not self.tool_calls and not final and not buf[:len(buf) - keep].strip():
            return False                          # only whitespace so far: a <think> may still come
        self._emit(events, "content", buf[:len(buf) - keep])
        self.buffer = buf[len(buf) - keep:]
        return False
