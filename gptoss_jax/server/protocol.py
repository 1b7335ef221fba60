"""The request bodies of the endpoints, checked with pydantic (what the openai client itself uses).

A top-level field is either one the server acts on (declared below), one that changes nothing in
the reply (ACCEPTED: `user`, `metadata`, ...), or refused with a 400 naming it (`refused_field`):
a parameter of OpenAI's API that the server does not implement, unless it holds its no-op value
(`echo: false`, `suffix: ""`, ...; NO_OP), and any name it does not know, as
OpenAI's API refuses them. Inside a message or an item, unknown fields are ignored. A field of the
wrong type or out of range is a 400 naming it (body.py turns pydantic's errors into that). Types are
strict, as OpenAI's are: a number sent as a string ("0.5") or a boolean is refused.
docs/serving.md lists every parameter and what the server does with it.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Union

from pydantic import (BaseModel, ConfigDict, Discriminator, Field, StrictBool, StrictFloat, StrictInt, StrictStr, Tag,
                      field_validator)

from ..sampling import LOGIT_BIAS_MOST, TOP_LOGPROBS
from ..tokenizer import VOCAB_SIZE

# Bounds every field is declared with, so that the OpenAPI description carries them (openapi.py) and
# nothing past what the engine holds gets beyond the door.
CONTEXT_MOST = 131_072  # tokens: the longest context of the gpt-oss models; token budgets are capped here
CHOICES_MOST = 128  # n, best_of
TOOLS_MOST = 128  # tools or functions in one request (OpenAI's limit too)
STOPS_MOST = 4  # stop sequences (OpenAI's limit too)
ID_CHARS = 256  # ids a client sends back (call ids, response ids) and the model's name
# A function's name, as OpenAI's API takes it: 1 to 64 characters of a-z, A-Z, 0-9, _ and -.
NAME = Annotated[StrictStr, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
# A name in a conversation's earlier turns (a tool call's, a tool result's): what a reply of this
# server said, which the model wrote (nothing constrains its tokens), so only its length is OpenAI's.
CALLED = Annotated[StrictStr, Field(max_length=64)]
# A token id, as a JSON object's key (logit_bias): ASCII digits only, no more than the largest id has.
TOKEN_KEY = Annotated[StrictStr, Field(pattern=r"^[0-9]{1,%d}$" % len(str(VOCAB_SIZE - 1)))]
TOKEN_ID = Annotated[StrictInt, Field(ge=0, lt=VOCAB_SIZE)]
BIAS = Annotated[StrictFloat | StrictInt, Field(ge=-100, le=100)]
ID = Annotated[StrictStr, Field(max_length=ID_CHARS)]
STOP = Annotated[StrictStr, Field(min_length=1, max_length=1000)]  # (the server's Limits.max_stop_chars may lower it)
STOPS = STOP | Annotated[list[STOP], Field(max_length=STOPS_MOST)] | None
BUDGET = Annotated[StrictInt, Field(ge=1, le=CONTEXT_MOST)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


# Top-level fields that change nothing in the reply: accepted on every endpoint, and not used.
ACCEPTED = frozenset({"user", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier"})


def _none_or(*values) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


def _text_format(v) -> bool:
    return v is None or (isinstance(v, dict) and v.get("format", {"type": "text"}) == {"type": "text"}
                         and set(v) <= {"format", "verbosity"})


# Parameters of OpenAI's API that this server does not implement, each with the values that ask
# for nothing (accepted): any other value is refused.
NO_OP: dict[str, Callable[[Any], bool]] = {
    # (declared where the server uses them; on the other endpoints their no-op values are accepted)
    "presence_penalty": _none_or(0, 0.0), "frequency_penalty": _none_or(0, 0.0),
    "response_format": lambda v: v is None or v == {"type": "text"}, "text": _text_format,
    "echo": _none_or(False), "suffix": _none_or(""),  # (echo: completions)
    "store": _none_or(False), "background": _none_or(False),  # (chat: no stored completions)
    "truncation": _none_or("disabled"), "modalities": lambda v: v is None or v == ["text"],
    "audio": _none_or(), "prediction": _none_or(), "web_search_options": _none_or(), "max_tool_calls": _none_or(),
    "prompt": _none_or(), "conversation": _none_or(), "stream_options": _none_or(),
}


def refused_field(data: dict, model: type[BaseModel]) -> tuple[str, str] | None:
    """The first top-level field of a request body that `model` refuses -> (its name, the reason), or
    None: a parameter it does not implement holding a value that asks for something, or a name it does
    not know (see the module docstring)."""
    declared = model.model_fields
    for name, value in data.items():
        if name in declared or name in ACCEPTED:
            continue
        if name in NO_OP:
            if not NO_OP[name](value):
                return name, (f"{name} is not supported by this server (the value {_short(value)} would change "
                              "the reply); leave it out")
            continue
        return name, f"Unknown parameter: {name!r}"
    return None


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class TextPart(_Body):
    type: StrictStr
    text: StrictStr | None = None


class FunctionCall(_Body):
    name: CALLED
    arguments: StrictStr = "{}"


class ToolCall(_Body):
    id: ID = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: CALLED | None = None  # a participant's name, or the tool's whose result this is
    tool_calls: list[ToolCall] | None = None
    tool_call_id: ID | None = None
    reasoning_content: StrictStr | None = None  # an earlier reply's reasoning, as this server returns it
    reasoning: StrictStr | None = None  # the same, as some clients name it


class FunctionDef(_Body):
    name: NAME
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None  # the call's arguments follow `parameters` (structured.py); chat: off by default


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: NAME


class ChatToolChoice(_Body):
    """A named function, as chat completions name it: {"type": "function", "function": {"name": ...}}."""

    type: Literal["function"]
    function: NamedFunction


class ResponsesToolChoice(_Body):
    """A named function, as the Responses API names it: {"type": "function", "name": ...}."""

    type: Literal["function"]
    name: NAME


ToolChoiceMode = Literal["none", "auto", "required"]


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model: ID
    # token id (as a string, as JSON keys are) -> a bias in [-100, 100] added to its logit
    logit_bias: dict[TOKEN_KEY, BIAS] | None = Field(default=None, max_length=LOGIT_BIAS_MOST)
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-2**31, lt=2**31)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(default=1, ge=1, le=CHOICES_MOST)  # choices, each with seed + index (server/choices.py)
    ignore_eos: StrictBool = False  # an extension, as vLLM's: generate past the stop tokens (benchmarks)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=VOCAB_SIZE)  # vLLM's extension; 0 and -1 are off
    min_p: StrictFloat | None = Field(default=None, ge=0.0, lt=1.0)  # vLLM's extension; 0 is off
    presence_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: StrictFloat | StrictInt | None = Field(default=None, ge=-2.0, le=2.0)


TopLogprobs = Annotated[StrictInt, Field(ge=0, le=TOP_LOGPROBS)]


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: TopLogprobs | None = None
    tools: list[Tool] | None = Field(default=None, max_length=TOOLS_MOST)
    tool_choice: Union[ToolChoiceMode, ChatToolChoice, None] = None
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    max_tokens: BUDGET | None = None
    max_completion_tokens: BUDGET | None = None
    stop: STOPS = None
    response_format: dict[str, Any] | None = None  # text, json_object or json_schema (structured.py)
    # The legacy function calling (before tools): read as tools, answered as function_call (choices.py)
    functions: list[FunctionDef] | None = Field(default=None, max_length=TOOLS_MOST)
    function_call: Union[Literal["none", "auto"], NamedFunction, None] = None

    def as_tools(self) -> ChatCompletionRequest:
        """The request with its legacy `functions` and `function_call` as `tools` and `tool_choice`."""
        choice = self.function_call
        if isinstance(choice, NamedFunction):
            choice = ChatToolChoice(type="function", function=choice)
        return self.model_copy(update={"tools": [Tool(type="function", function=f) for f in self.functions],
                                       "tool_choice": choice, "functions": None, "function_call": None})


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[TOKEN_ID] | list[StrictStr] | list[list[TOKEN_ID]]
    best_of: StrictInt | None = Field(default=None, ge=1, le=CHOICES_MOST)  # candidates, the best n returned
    logprobs: TopLogprobs | None = None  # the sampled tokens' log-probabilities, with this many alternatives
    max_tokens: StrictInt = Field(default=16, ge=0, le=CONTEXT_MOST)  # OpenAI's default, also for null; 0: echo only
    stop: STOPS = None
    echo: StrictBool = False  # the prompt's text before the completion's (and, with logprobs, its tokens')

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _null_is_absent(cls, value):
        return 16 if value is None else value


class TokenizeRequest(_Body):
    """vLLM's POST /tokenize, which evaluation harnesses tokenize through: a text's token ids (special
    tokens written out, <|start|> and the like, read as such)."""
    model: ID | None = None
    prompt: StrictStr
    add_special_tokens: StrictBool = True  # o200k_harmony adds none either way
    return_token_strs: StrictBool = False  # also each token's text ("token_strs"; else null)


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize: token ids' text."""
    model: ID | None = None
    tokens: list[TOKEN_ID]


class LoadLoraRequest(_Body):
    """vLLM's POST /v1/load_lora_adapter: a LoRA adapter's folder (peft's format, or gptoss-finetune's
    --out) served from now on under a name of its own."""
    lora_name: Annotated[StrictStr, Field(min_length=1, max_length=ID_CHARS)]
    lora_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]


class UnloadLoraRequest(_Body):
    """vLLM's POST /v1/unload_lora_adapter: an adapter no longer served, once its requests have ended."""
    lora_name: ID


class Reasoning(_Body):
    effort: Literal["low", "medium", "high"] | None = None


class ResponseTool(_Body):
    type: Literal["function"]
    name: NAME
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool = True  # as OpenAI's Responses API: the arguments follow `parameters` unless false


class TextOptions(_Body):
    format: dict[str, Any] | None = None  # text, json_object or json_schema (structured.py)
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted; gpt-oss has no such control


class ContentPart(_Body):
    """A part of a Responses item's content; only text parts are read (harmony.py says which)."""

    type: StrictStr
    text: StrictStr | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[ContentPart] = ""


class ReasoningItem(_Body):
    type: Literal["reasoning"]
    content: list[ContentPart] | None = None
    summary: list[ContentPart] | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    name: CALLED
    arguments: StrictStr = "{}"
    call_id: ID = ""


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: ID
    output: StrictStr | list[dict[str, Any]] = ""


def _item_kind(item) -> str | None:
    """An input item's kind: its "type", "message" when it has none (as OpenAI reads it)."""
    if isinstance(item, dict):
        kind = item.get("type", "message")
    else:
        kind = getattr(item, "type", None)
    return f"tag:{kind}" if kind in ("message", "reasoning", "function_call", "function_call_output") else None


InputItem = Annotated[Union[Annotated[MessageItem, Tag("tag:message")], Annotated[ReasoningItem, Tag("tag:reasoning")],
                            Annotated[FunctionCallItem, Tag("tag:function_call")],
                            Annotated[FunctionCallOutputItem, Tag("tag:function_call_output")]],
                      Discriminator(_item_kind, custom_error_type="item_type",
                                    custom_error_message="an input item's type must be message, reasoning, "
                                                         "function_call or function_call_output")]


class ResponsesRequest(_Body):
    model: ID
    input: StrictStr | list[InputItem]
    instructions: StrictStr | None = None
    reasoning: Reasoning | None = None
    tools: list[ResponseTool] | None = Field(default=None, max_length=TOOLS_MOST)
    tool_choice: Union[ToolChoiceMode, ResponsesToolChoice, None] = None
    max_output_tokens: BUDGET | None = None
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    seed: StrictInt | None = Field(default=None, ge=-2**31, lt=2**31)
    top_k: StrictInt | None = Field(default=None, ge=-1, le=VOCAB_SIZE)
    min_p: StrictFloat | None = Field(default=None, ge=0.0, lt=1.0)
    stream: StrictBool = False
    previous_response_id: ID | None = None
    store: StrictBool = True  # kept for previous_response_id and GET /v1/responses/{id} (OpenAI's default)
    background: StrictBool = False  # answered at once; GET /v1/responses/{id} polls it, .../cancel ends it
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: TopLogprobs | None = None
    text: TextOptions | None = None
