"""The request bodies of the endpoints, checked with pydantic (what the openai client itself uses).

Fields the server does not use are ignored, as OpenAI's API ignores what it does not know; a field
of the wrong type or out of range is a 400 naming it (app.py turns pydantic's errors into that).
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(_Body):
    name: StrictStr
    arguments: StrictStr = "{}"


class ToolCall(_Body):
    id: StrictStr = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None  # an earlier reply's reasoning, as this server returns it
    reasoning: StrictStr | None = None  # the same, as some clients name it


class FunctionDef(_Body):
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model: StrictStr
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-2**31, lt=2**31)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=1)
    ignore_eos: StrictBool = False  # an extension, as vLLM's: generate past the stop tokens (benchmarks)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(default=16, ge=1)  # OpenAI's default
    stop: StrictStr | list[StrictStr] | None = None


class Reasoning(_Body):
    effort: Literal["low", "medium", "high"] | None = None


class ResponseTool(_Body):
    type: Literal["function"]
    name: StrictStr = Field(min_length=1)
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None


class ResponsesRequest(_Body):
    model: StrictStr
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    reasoning: Reasoning | None = None
    tools: list[ResponseTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-2**31, lt=2**31)
    stream: StrictBool = False
    previous_response_id: StrictStr | None = None
