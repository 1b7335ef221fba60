"""Structured outputs: a request's `response_format` (chat), `text.format` (Responses) and its strict
function tools, as the grammar (serving/constrain.py: llguidance's Lark syntax) that its harmony
reply must follow.

The reasoning stays free: the reply may start with an `analysis` message of any text, and a tool call
with a `commentary` preamble (each at most a quarter of the reply's token budget, rounded down to a
power of two, so that the answer always has room and few grammars are compiled); then comes either
the final answer
(JSON that follows the schema, with `response_format`; else any text) or a call of one of the tools
(its arguments JSON that follows the tool's parameters when the tool is strict; else any text).
JSON is written compactly (no whitespace between its tokens): the grammar leaves a model no loop of
spaces and newlines. `json_object` is a JSON object of any content. A reply whose start the server
wrote (a forced tool call, harmony.py) is constrained from there on: the arguments of that call.

    grammar = reply_grammar(answer=schema_or_None, tools=[(name, parameters, strict)], budget=256,
                            forced=None | name | "")
"""

from __future__ import annotations

import copy
import json

from .body import check_schema
from .errors import bad_request

OBJECT = {"type": "object"}


def _compact(schema: dict) -> dict:
    schema = copy.deepcopy(schema)
    schema["x-guidance"] = {**schema.get("x-guidance", {}), "whitespace_flexible": False}
    return schema


def _checked(schema: dict, param: str) -> dict:
    """A schema the grammars can take, else a 400 naming `param`: nested at most MAX_SCHEMA_DEPTH, its
    llguidance options (`x-guidance`), if any, an object."""
    check_schema(schema, param)
    if not isinstance(schema.get("x-guidance", {}), dict):
        raise bad_request(f"{param}: x-guidance (llguidance's options) must be an object", f"{param}.x-guidance")
    return schema


def schema_probes(fmt, param: str, tools: list[tuple[str, dict | None, bool]], tool_choice,
                  tools_param: str) -> list[tuple[str, str]]:
    """(the grammar of the schema alone, the field it came from) for each schema the reply would follow:
    the answer's, then each strict tool's parameters (tools_param: their fields' path, "{}" for the
    tool's index). serving.constrain's Grammars.probe runs each far enough to find what llguidance
    finds only as it goes, so that a fault is a 400 naming its own field before the request starts."""
    out = []
    answer = answer_schema(fmt, param)
    if answer is not None and answer is not OBJECT:
        out.append((f"start: {_json(answer)}", _where(fmt, param)))
    for i, (_, parameters, strict) in enumerate(tools if tool_choice != "none" else []):
        if strict and parameters:
            where = tools_param.format(i)
            out.append((f"start: {_json(_checked(parameters, where))}", where))
    return out


def _json(schema: dict | None) -> str:
    return "%json " + json.dumps(_compact(schema if schema is not None else {}))


def answer_schema(fmt, param: str) -> dict | None:
    """The JSON schema a `response_format` / `text.format` asks the answer to follow (None: free text);
    400 naming `param` for a format this server does not know or a schema that is not one."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise bad_request(f"{param} must be an object with a 'type'", param)
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return OBJECT
    if kind != "json_schema":
        raise bad_request(f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", f"{param}.type")
    nested = "json_schema" in fmt  # chat nests the schema under "json_schema"; Responses puts it beside "type"
    spec, where = (fmt["json_schema"], _where(fmt, param)) if nested else (fmt, _where(fmt, param))
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request(f"{where} must be a JSON schema (an object)", where)
    return _checked(spec["schema"], where) or OBJECT


def _where(fmt: dict, param: str) -> str:
    """The field of a json_schema format's schema."""
    return f"{param}.json_schema.schema" if "json_schema" in fmt else f"{param}.schema"


def format_instructions(fmt, param: str) -> str:
    """What the developer message tells the model of a response format ("" for none): a `# Response
    Formats` section with the schema's name, description and JSON, as gpt-oss was trained to read it."""
    schema = answer_schema(fmt, param)
    if schema is None:
        return ""
    spec = fmt.get("json_schema", fmt) if fmt.get("type") == "json_schema" else {}
    name = spec.get("name") or ("json_object" if schema is OBJECT else "response")
    about = f"// {spec['description']}\n" if spec.get("description") else ""
    return f"# Response Formats\n\n## {name}\n\n{about}{json.dumps(schema, separators=(',', ':'))}"


def reply_grammar(*, answer: dict | None, tools: list[tuple[str, dict | None, bool]], budget: int,
                  forced: str | None = None) -> str:
    """The Lark grammar of a harmony reply (see the module). answer: the final answer's JSON schema
    (None: any text); tools: (name, parameters, strict) of the tools in the prompt; budget: the reply's
    most tokens; forced: the tool whose call the server started ("" : a call of one of the tools,
    whose name the model writes), None: the reply is the model's from its start."""
    lines = []
    calls = []
    for i, (name, parameters, strict) in enumerate(tools):
        lines.append(f"args{i}: " + (_json(parameters) if strict else "TEXT"))
        calls.append((name, f"args{i}"))
    if forced:
        i = next(i for i, (name, _) in enumerate(calls) if name == forced)
        return "\n".join([f"start: {calls[i][1]} <|call|>", *lines, "TEXT: /(?s:.*)/"])
    header = '(" " <|constrain|> "json")?'
    if forced == "":  # after " to=functions": ".NAME", then the rest of the header
        names = " | ".join(f'"." {json.dumps(name)} <|channel|> "commentary" {header} <|message|> {args} <|call|>'
                           for name, args in calls)
        return "\n".join([f"start: {names}", *lines, "TEXT: /(?s:.*)/"])
    choices = [f'<|channel|> "final" {header} <|message|> answer <|return|>']
    cap = 1 << (max(budget // 4, 1).bit_length() - 1)  # a power of two: few grammars, each compiled once
    for name, args in calls:  # the recipient after the channel, or before it (harmony allows both)
        to = f'" to=functions." {json.dumps(name)}'
        choices.append(f'preamble? <|channel|> "commentary" {to} {header} <|message|> {args} <|call|>')
        choices.append(f'preamble? {to} <|channel|> "commentary" {header} <|message|> {args} <|call|>')
    return "\n".join([
        "start: analysis? reply",
        'analysis: <|channel|> "analysis" <|message|> reasoning <|end|> <|start|> "assistant"',
        'preamble: <|channel|> "commentary" <|message|> reasoning <|end|> <|start|> "assistant"',
        f"reasoning[max_tokens={cap}]: /(?s:.*)/",
        "reply: " + " | ".join(choices),
        "answer: " + (_json(answer) if answer is not None else "TEXT"),
        *lines,
        "TEXT: /(?s:.*)/",
    ])


def grammar_for(fmt, param: str, tools: list[tuple[str, dict | None, bool]], tool_choice, started: bool,
                budget: int) -> str | None:
    """A request's grammar (reply_grammar), or None when nothing in it asks for one. fmt: its
    response_format / text.format, named `param`; tools: (name, parameters, strict) of its function
    tools; tool_choice: as the request gives it; started: whether the server wrote the reply's start
    (a forced call)."""
    answer = answer_schema(fmt, param)
    if tool_choice == "none":
        tools = []
    tools = [(name, parameters or OBJECT, strict) for name, parameters, strict in tools]
    forced = None
    if started:
        if tool_choice == "required":
            forced = tools[0][0] if len(tools) == 1 else ""
        else:
            function = getattr(tool_choice, "function", None)
            forced = function.name if function is not None else tool_choice.name
    strict = [name for name, _, s in tools if s and (not forced or name == forced)]
    if not strict and (answer is None or forced is not None):
        return None
    return reply_grammar(answer=answer, tools=tools, budget=budget, forced=forced)
