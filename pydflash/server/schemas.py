"""Request bodies of the OpenAI and Anthropic endpoints, validated strictly (a string where a number belongs is
a 400, not a guess). Unknown fields are ignored, as both APIs' clients send extras; the known ones are checked.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import APIError


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# --- sampling: passed through to the engine, which checks the values (pydflash.sampling) ---------------

class _Sampling(_Body):
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    seed: int | None = None
    repeat_penalty: Annotated[float, Field(gt=0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None

    def sampling(self) -> dict:
        """The sampling fields the client set, as keyword arguments for Engine.stream."""
        return {name: getattr(self, name) for name in _Sampling.model_fields if getattr(self, name) is not None}


StopField = Union[str, Annotated[list[str], Field(max_length=16)], None]


class StreamOptions(_Body):
    include_usage: bool = False


# --- OpenAI chat ------------------------------------------------------------------------------------------------

class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: Annotated[str, Field(min_length=1)]
    arguments: str = "{}"


class ToolCall(_Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDef(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class ChatRequest(_Sampling):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    n: Annotated[int, Field(ge=1)] = 1
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    model: str | None = None
    prompt: Union[str, list[str], list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    n: Annotated[int, Field(ge=1)] = 1
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    user: str | None = None


# --- Anthropic messages -----------------------------------------------------------------------------------------

class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ImageBlock(_Body):
    type: Literal["image", "document"]


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: Union[str, list[Union[TextBlock, ImageBlock]], None] = None
    is_error: bool | None = None


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Body):
    type: Literal["redacted_thinking"]
    data: str


Block = Annotated[Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock],
                  Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Block]]


class AnthropicTool(_Body):
    name: Annotated[str, Field(min_length=1, max_length=128)]
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None


class ThinkingConfig(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(_Body):
    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: Union[str, list[TextBlock], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest, _Sampling):
    max_tokens: Annotated[int, Field(ge=1)]
    stream: bool = False
    stop_sequences: Annotated[list[str], Field(max_length=16)] | None = None
    metadata: dict[str, Any] | None = None


# --- parsing ----------------------------------------------------------------------------------------------------

def parse_body(raw: bytes, model: type[BaseModel]):
    """The request body as `model`, or an APIError(400) that names the field and the problem."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        given = f" (got {json.dumps(err['input'])[:80]})" if err["type"] != "missing" and "input" in err else ""
        raise APIError(400, f"{where}: {err['msg']}{given}", param=where) from None
