"""A request's body: read with a size cap and a deadline (on the event loop, which only waits), then
parsed and checked on a worker thread (`parse`), so that a large or hostile body never holds up
other clients. Whatever is wrong with it is a 4xx naming the field where there is one:

- 413 beyond the size cap (from Content-Length at once, else as the body arrives), 408 when it does
  not arrive within the deadline, 415 unless it is sent as application/json;
- 400 for bytes that are not UTF-8, text that is not JSON (NaN and Infinity included), JSON that is
  not an object, nested deeper than Python's parser goes, strings holding lone UTF-16 surrogates
  (`"\\ud800"`: no UTF-8 text can carry them, so no tokenizer takes them), any field the endpoint's
  pydantic model refuses, and free-form JSON (a tool's parameter schema) nested deeper than
  MAX_SCHEMA_DEPTH.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from . import protocol
from .errors import ClientLeft, bad_request, read_timeout, too_large, unsupported_media_type

MAX_SCHEMA_DEPTH = 32  # JSON schemas of real tools nest a handful of levels
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # how a surrogate gets into JSON text


async def read(http, max_bytes: int, timeout: float) -> bytes:
    """The body of `http` (a Starlette request), at most `max_bytes`, within `timeout` seconds
    (errors.ClientLeft when the client goes away before all of it came)."""
    kind = http.headers.get("content-type")
    if kind is None or kind.split(";")[0].strip().lower() != "application/json":
        raise unsupported_media_type(kind)
    length = http.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > max_bytes):
        raise too_large(max_bytes)
    chunks, size = [], 0

    async def receive():
        nonlocal size
        async for chunk in http.stream():
            size += len(chunk)
            if size > max_bytes:
                raise too_large(max_bytes)
            chunks.append(chunk)

    try:
        await asyncio.wait_for(receive(), timeout)
    except asyncio.TimeoutError:
        raise read_timeout(timeout) from None
    except ClientDisconnect:
        raise ClientLeft() from None
    return b"".join(chunks)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: a JSON number no float holds
        raise ValueError(f"the number {text[:40]} is too large for a float")
    return value


def _param(loc: tuple) -> str | None:
    """pydantic's error location as a field path (`messages[0].content`), without its union members'
    names (`str`, `list[TextPart]`, model names, `tag:...` tags)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif re.fullmatch(r"[a-z_][a-z0-9_]*", part) and part not in ("str", "int", "float", "bool", "list", "dict"):
            out += ("." if out else "") + part
    return out or None


def _surrogate_path(value: Any, path: str = "") -> str | None:
    """The path of a string (or key) in `value` holding a lone surrogate, if any ("" for a top-level key)."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            for k, x in v.items():
                name = k.encode("utf-8", "backslashreplace").decode("utf-8")  # the path itself must be text
                stack.append((k, p))
                stack.append((x, f"{p}.{name}" if p else name))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
    return None


def depth(value: Any) -> int:
    """How deeply JSON `value` nests (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d + 1)
        stack.extend((x, d + 1) for x in v)
    return deepest


def check_schema(schema: dict | None, param: str) -> None:
    if schema is not None and depth(schema) > MAX_SCHEMA_DEPTH:
        raise bad_request(f"{param} nests deeper than {MAX_SCHEMA_DEPTH} levels", param)


def parse(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The body as `model` (see the module docstring for what is refused). Runs on a worker thread."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(f"The request body is not UTF-8 text: {e}") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:
        raise bad_request("The request body nests too deeply to parse") from None
    except ValueError as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):  # rare: only then is a walk over every string worth it
        where = _surrogate_path(data)
        if where is not None:
            raise bad_request("Strings must be valid Unicode: this one holds a lone UTF-16 surrogate "
                              f"('\\ud800' to '\\udfff' written alone){f' ({where})' if where else ''}", where or None)
    refused = protocol.refused_field(data, model)
    if refused is not None:
        name, reason = refused
        code = "unknown_parameter" if reason.startswith("Unknown") else "unsupported_parameter"
        raise bad_request(reason, name, code)
    try:
        return model.model_validate(data)
    except RecursionError:
        raise bad_request("The request body nests too deeply to read") from None
    except ValidationError as e:
        errors = e.errors(include_url=False)  # of a union's members, the one that got furthest says most
        first = max(errors, key=lambda error: len(error["loc"]))
        param = _param(first["loc"])
        raise bad_request(f"Invalid value for '{param}': {first['msg']}" if param else first["msg"], param) from None
