"""The OpenAPI 3.1 description of the endpoints (GET /openapi.json): every route, each request body as
protocol.py checks it, the replies' content types and the OpenAI error body.

The endpoints read their bodies themselves (app.py), so FastAPI sees no request bodies; this module
writes the description from the pydantic models instead, so that clients, code generators and
fuzzers see what the server accepts.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.routing import Route

from ..version import __version__
from . import protocol

_REF = "#/components/schemas/{model}"

# The body each POST endpoint reads.
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": protocol.ChatCompletionRequest,
    "/v1/completions": protocol.CompletionRequest,
    "/v1/responses": protocol.ResponsesRequest,
    "/tokenize": protocol.TokenizeRequest,
    "/detokenize": protocol.DetokenizeRequest,
    "/v1/load_lora_adapter": protocol.LoadLoraRequest,
    "/v1/unload_lora_adapter": protocol.UnloadLoraRequest,
}
_SUMMARIES = {
    "/health": "Whether the server is ready: 200 once the model is warmed up, 503 before and while stopping",
    "/metrics": "The engine's metrics, in Prometheus text",
    "/v1/models": "The model served, and the LoRA adapters served over it (their parent)",
    "/v1/models/{name:path}": "The model or adapter of that name (404 for another)",
    "/v1/load_lora_adapter": "Serve a LoRA adapter's folder under a name of its own",
    "/v1/unload_lora_adapter": "Stop serving an adapter: new requests get 404, running ones complete first",
    "/v1/chat/completions": "A chat reply (harmony: reasoning_content, content, tool_calls)",
    "/v1/completions": "A completion of a raw prompt (text or token ids)",
    "/v1/responses": "A reply through the Responses API",
    "/v1/responses/{name}": "A stored response (GET), or forget it (DELETE)",
    "/tokenize": "A text's token ids (vLLM's endpoint)",
    "/detokenize": "Token ids' text (vLLM's endpoint)",
    "/tokenizer_info": "The tokenizer's special tokens and the context length (vLLM's endpoint)",
}
# /health and /metrics are open to probes; the rest need the key when the server has one.
_OPEN = ("/health", "/metrics")

_ERROR = {
    "type": "object",
    "title": "Error",
    "description": "An error as the OpenAI API shapes it",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {
            "message": {"type": "string", "description": "What went wrong, for a person"},
            "type": {"type": "string", "description": "The kind: invalid_request_error, rate_limit_error, ..."},
            "param": {"type": ["string", "null"], "description": "The request field at fault, if one is"},
            "code": {"type": ["string", "null"], "description": "A stable code, if the error has one"},
        },
    }},
}
_ERROR_REPLY = {"description": "An error",
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
_JSON_OBJECT = {"application/json": {"schema": {"type": "object"}}}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` return the description (built on its first call, then kept). Calling it
    again changes nothing."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = describe(app)
        return app.openapi_schema

    app.openapi = openapi


def describe(app: FastAPI) -> dict:
    """The OpenAPI 3.1 document of the app's routes as they are now."""
    models = list(dict.fromkeys(_BODIES.values()))
    names, defs = models_json_schema([(m, "validation") for m in models], ref_template=_REF)
    schemas = {**defs.get("$defs", {}), "Error": _ERROR}
    paths: dict[str, dict] = {}
    for route in app.routes:
        if not isinstance(route, Route) or not route.include_in_schema:
            continue
        methods = sorted(set(route.methods or ()) - {"HEAD"})  # HEAD is answered as GET
        for method in methods:
            body = _BODIES.get(route.path) if method == "POST" else None
            paths.setdefault(route.path_format, {})[method.lower()] = _operation(
                route, method, len(methods) > 1, names[(body, "validation")]["$ref"] if body else None)
    return {
        "openapi": "3.1.0",
        "info": {"title": app.title, "version": __version__,
                 "description": "An OpenAI-compatible API over gpt-oss models (docs/serving.md)."},
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {
                "type": "http", "scheme": "bearer",
                "description": "The server's key (--api-key or GPTOSS_API_KEY), when it was started with one"}},
        },
    }


def _operation(route: Route, method: str, shared: bool, body_ref: str | None) -> dict:
    if route.path == "/metrics":
        ok = {"description": "Prometheus text", "content": {"text/plain": {"schema": {"type": "string"}}}}
    elif body_ref:
        ok = {"description": "The reply: a JSON object, or server-sent events when the request sets `stream`",
              "content": {**_JSON_OBJECT, "text/event-stream": {"schema": {"type": "string"}}}}
    else:
        ok = {"description": "A JSON object", "content": _JSON_OBJECT}
    operation = {
        "operationId": f"{route.name}_{method.lower()}" if shared else route.name,
        "summary": _SUMMARIES.get(route.path, route.name.replace("_", " ")),
        "responses": {"200": ok, "4XX": _ERROR_REPLY, "5XX": _ERROR_REPLY},
        # Either no key (a server started without one) or the bearer key.
        "security": [] if route.path in _OPEN else [{}, {"bearer": []}],
    }
    if body_ref:
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": {"$ref": body_ref}}}}
    if route.param_convertors:  # /v1/models/{name}: a model's name, "/" included
        operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                   for name in route.param_convertors]
    return operation
