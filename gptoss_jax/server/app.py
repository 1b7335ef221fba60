"""The endpoints: an OpenAI-compatible API over the serving engine (FastAPI; docs/serving.md).

    GET  /health               200 once warmed up, 503 before, while stopping and once the engine stopped
    GET  /metrics              the engine's metrics, Prometheus text
    GET  /openapi.json         the API's schema, request bodies included (openapi.py)
    GET  /v1/models            the one model served
    GET  /v1/models/{id}       that model (404 for another name)
    POST /v1/chat/completions  harmony chat: reasoning_content, content, tool_calls; SSE with stream
    POST /v1/completions       a raw prompt (text or token ids)
    POST /v1/responses         the Responses API (previous_response_id: continue a stored response)
    GET, DELETE /v1/responses/{id}  a stored response (store.py)

A request's body is read with a size cap and a deadline, then parsed, checked, rendered and
tokenized on a worker thread (body.py), so that no client's request holds up the others. It is
submitted to the engine in the handler, so that a full queue (429) or a prompt that does not fit
(400) is answered before any byte of a stream; its tokens then come back through the request's
listener, handed to the event loop. A task watches each request's connection from its submission
on: a client that goes away cancels its request at once, streamed or not.

Whatever goes wrong is answered in OpenAI's error shape and leaves the connection usable: a 4xx
naming the field for what the client sent, a 500 with a request id (details in the log, under
that id) for the server's own failures (guard.py). A stream that fails on the way ends with an
error event and `[DONE]` (Responses: `error` and `response.failed`); streams still running when
the server's grace period ends are ended with finish_reason "length" (`Server.cut_all`).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import AsyncIterator

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import tokenizer as tk
from ..version import __version__
from . import body, logprobs, openapi, protocol
from .errors import (APIError, bad_request, method_not_allowed, model_not_found, not_found, server_error, unauthorized,
                     unavailable)
from .generation import Generation, Server, settings_of
from .structured import grammar_for
from .guard import Guard, log
from .harmony import ReplyStream, StopTrimmer, chat_prompt, context_exceeded, responses_prompt
from .metrics import prometheus_text
from .responses import ResponseBuilder


def _finish_reason(generation: Generation, tool_calls: bool, trimmed: bool) -> str:
    reason = generation.request.finish_reason
    if generation.was_cut or (reason == "length" and not trimmed):
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _merge(deltas: list[dict | None]) -> list[dict]:
    """Chat deltas with the text of neighbours of one kind (content, reasoning) joined, Nones dropped."""
    out = []
    for d in deltas:
        if d is None:
            continue
        key = next(iter(d)) if len(d) == 1 and next(iter(d)) in ("content", "reasoning_content") else None
        if key and out and list(out[-1]) == [key]:
            out[-1] = {key: out[-1][key] + d[key]}
        else:
            out.append(d)
    return out


def _sse(data) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


def _event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


class _Failed(Exception):
    """The engine failed on this request (logged); the stream says so and ends."""


async def _stream(chunks: AsyncIterator[str], generation: Generation, on_error) -> AsyncIterator[str]:
    """A stream's chunks, ended properly whatever happens: a failure (the engine's, or the server's
    own) is logged with the request's id and told to the client by `on_error(message)`'s chunks. A
    client gone mid-stream closes it; its request is cancelled here, at once."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # noqa: BLE001 -- told to the client without internals, logged with them
        if not isinstance(e, _Failed):
            log.exception("request %s failed mid-stream", generation.id)
        for chunk in on_error(server_error(generation.id).message):
            yield chunk
    finally:
        generation.close()


def _error_sse(message: str) -> list[str]:
    """How chat and completion streams end on a failure: an error object (the openai client raises it)
    and [DONE]."""
    return [_sse({"error": {"message": message, "type": "server_error", "param": None, "code": "server_error"}}),
            "data: [DONE]\n\n"]


def _error_response(error: APIError) -> Response:
    # ASCII JSON: whatever text of the client's an error quotes, the response can be written
    return Response(json.dumps(error.body()), status_code=error.status, headers=error.headers,
                    media_type="application/json")


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="gptoss-jax", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(Guard, allowed_hosts=server.limits.allowed_hosts)
    openapi.install(app)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: HTTPRequest, e: StarletteHTTPException):  # routing: 404, 405
        if e.status_code == 405:
            error = method_not_allowed(http.method, http.url.path, (e.headers or {}).get("Allow"))
        elif e.status_code == 404:
            error = not_found(http.url.path)
        else:
            error = APIError(e.status_code, str(e.detail), "invalid_request_error")
        return _error_response(error)

    def check(http: HTTPRequest) -> None:
        if server.api_key is not None:
            scheme, _, key = http.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), server.api_key.encode()):
                raise unauthorized()
        health()

    def health() -> None:
        if server.stopping:
            raise unavailable("The server is shutting down.")
        if not server.ready.is_set():
            raise unavailable("The model is warming up (compiling); retry in a moment.")
        if not server.engine.alive:
            raise unavailable("The engine has stopped; the server cannot generate (see its log).")

    async def prepared(http: HTTPRequest, model: type[BaseModel], prepare):
        """The request's body read (on the loop, which only waits) and parsed, its prompt rendered and
        tokenized and its settings made by prepare(request) on a worker thread -> (request, prepared)."""
        check(http)  # the key and the state first: a client without the key learns nothing more
        raw = await body.read(http, server.limits.max_body_bytes, server.limits.read_timeout)

        def work():
            req = body.parse(raw, model)
            if req.model != server.model_name:
                raise model_not_found(req.model, server.model_name)
            return req, prepare(req)

        return await server.prepare(work)

    @app.get("/health")
    async def health_endpoint():
        health()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text(server.engine.stats()), media_type="text/plain; version=0.0.4")

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "gptoss-jax"}

    @app.get("/v1/models")
    async def models(http: HTTPRequest):
        check(http)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")  # a name may hold "/" (openai/gpt-oss-20b)
    async def model(http: HTTPRequest, name: str):
        check(http)
        if name != server.model_name:
            raise model_not_found(name, server.model_name)
        return model_card()

    def gone() -> Response:
        return Response(status_code=499)  # nobody reads it: the client has left

    # Chat completions --------------------------------------------------------------------------------

    def chat_prepare(req):
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        prompt = chat_prompt(req, server.vocab, server.engine.max_len)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tools = [(t.function.name, t.function.parameters, bool(t.function.strict)) for t in req.tools or []]
        grammar = (lambda budget: grammar_for(req.response_format, "response_format", tools, req.tool_choice,
                                              bool(prompt.reply_start), budget), "response_format")
        return prompt, settings_of(server, prompt.tokens, max_tokens, req, req.stop,
                                   (req.top_logprobs or 0) if req.logprobs else None, grammar)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        req, (prompt, settings) = await prepared(http, protocol.ChatCompletionRequest, chat_prepare)
        rid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        generation = Generation(server, http, prompt.tokens, settings, rid)
        reply = ReplyStream(server.tokenizer, server.vocab, prompt.reply_start)
        trim = StopTrimmer(settings.stop_strings)
        answer = None if settings.logprobs is None else logprobs.Answer(server.tokenizer, generation.request, reply,
                                                                        tk.STOP_TOKENS)

        def chunk(delta: dict, finish: str | None = None, entries=None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.model_name,
                         "choices": [{"index": 0, "delta": delta,
                                      "logprobs": None if entries is None else {"content": entries, "refusal": None},
                                      "finish_reason": finish}]})

        def pieces(token: int) -> list:
            """The token's pieces, and its log-probability entry kept for the next content chunk."""
            out = reply.feed(token)
            if answer is not None:
                due.extend(answer.feed(token, out))
            return out

        due: list[dict] = []  # log-probability entries not sent yet

        def chunks_of(deltas: list) -> str:
            """Chat chunks for these deltas, the entries due on the first chunk with content."""
            out = []
            for d in _merge(deltas):
                entries = None
                if answer is not None and "content" in d and due:
                    entries, due[:] = list(due), []
                out.append(chunk(d, entries=entries))
            return "".join(out)

        def as_delta(d) -> dict | None:
            if d.kind == "tool_call":
                call = {"index": d.index, "function": {"arguments": d.text}}
                if d.id is not None:
                    call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.text})
                return {"tool_calls": [call]}
            if d.kind == "reasoning":
                return {"reasoning_content": d.text}
            text = trim.add(d.text)
            return {"content": text} if text else None

        if req.stream:
            async def chunks():
                yield chunk({"role": "assistant", "content": ""})
                async for batch in generation.batches():
                    deltas = [as_delta(d) for token in batch for d in pieces(token)]
                    if text := chunks_of(deltas):
                        yield text
                if generation.failed:
                    raise _Failed()
                finished = [as_delta(d) for d in reply.finish()]
                if answer is not None:
                    due.extend(answer.finish())
                if text := chunks_of(finished):
                    yield text
                if (rest := trim.finish()) or due:
                    yield chunk({"content": rest}, entries=None if answer is None else list(due))
                yield chunk({}, _finish_reason(generation, bool(reply.tool_calls), trim.hit))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": server.model_name, "choices": [], "usage": generation.usage()})
                yield "data: [DONE]\n\n"

            return StreamingResponse(_stream(chunks(), generation, _error_sse), media_type="text/event-stream")

        async for token in generation.tokens():
            pieces(token)
        if generation.gone:
            return gone()
        if generation.failed:
            raise server_error(rid)
        reply.finish()
        if answer is not None:
            due.extend(answer.finish())
        content = trim.add("".join(reply.content)) + trim.finish()
        message = {"role": "assistant", "content": content or (None if reply.tool_calls else ""),
                   "reasoning_content": "".join(reply.reasoning) or None}
        if reply.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]
        return {"id": rid, "object": "chat.completion", "created": created, "model": server.model_name,
                "choices": [{"index": 0, "message": message,
                             "logprobs": None if answer is None else {"content": due, "refusal": None},
                             "finish_reason": _finish_reason(generation, bool(reply.tool_calls), trim.hit)}],
                "usage": generation.usage()}

    # Completions ---------------------------------------------------------------------------------------

    def completion_prepare(req):
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request(f"one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):  # special tokens written out (<|start|>, ...) are read as such
            max_len = server.engine.max_len
            if len(prompt.encode("utf-8")) > max_len:  # may not fit: counted before the special tokens are read
                count = len(server.tokenizer.encode_ordinary(prompt))
                if count >= max_len:
                    raise context_exceeded(max_len, count, at_least=True)
            prompt = server.tokenizer.encode(prompt, allowed_special="all")
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        prompt = list(prompt)
        return prompt, settings_of(server, prompt, req.max_tokens, req, req.stop, req.logprobs)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        req, (prompt, settings) = await prepared(http, protocol.CompletionRequest, completion_prepare)
        rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
        generation = Generation(server, http, prompt, settings, rid)
        decoder, trim = tk.StreamDecoder(server.tokenizer), StopTrimmer(settings.stop_strings)
        scores = None if settings.logprobs is None else logprobs.Completion(server.tokenizer)
        count = [0]  # tokens read

        def text_of(token: int) -> str:  # a stop token ends the text, unwritten
            i, count[0] = count[0], count[0] + 1
            if token in tk.STOP_TOKENS:
                return ""
            text = trim.add(decoder.add(token))
            if scores is not None:
                scores.add(token, generation.request.logprobs[i], text)
            return text

        def chunk(text: str, finish: str | None = None) -> str:
            return _sse({"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
                         "choices": [{"index": 0, "text": text, "logprobs": None if scores is None or finish
                                      else scores.take(), "finish_reason": finish}]})

        if req.stream:
            async def chunks():
                async for batch in generation.batches():
                    if text := "".join(text_of(token) for token in batch):
                        yield chunk(text)
                if generation.failed:
                    raise _Failed()
                if (rest := trim.add(decoder.flush()) + trim.finish()) or (scores is not None and scores.tokens):
                    yield chunk(rest)  # with the log-probabilities not sent yet
                yield chunk("", _finish_reason(generation, False, trim.hit))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created,
                                "model": server.model_name, "choices": [], "usage": generation.usage()})
                yield "data: [DONE]\n\n"

            return StreamingResponse(_stream(chunks(), generation, _error_sse), media_type="text/event-stream")

        pieces = [text_of(token) async for token in generation.tokens()]
        if generation.gone:
            return gone()
        if generation.failed:
            raise server_error(rid)
        text = "".join(pieces) + trim.add(decoder.flush()) + trim.finish()
        return {"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None if scores is None else scores.take(),
                             "finish_reason": _finish_reason(generation, False, trim.hit)}],
                "usage": generation.usage()}

    # Responses -----------------------------------------------------------------------------------------

    def responses_prepare(req):
        """-> (the request, its input continuing a stored response's; the prompt; the settings; the input
        items as dicts, stored with the response)."""
        items = ([{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str)
                 else [item.model_dump() for item in req.input])
        if req.previous_response_id is not None:
            earlier = server.responses.get(req.previous_response_id)
            if earlier is None:
                raise bad_request(f"Previous response with id {req.previous_response_id!r} not found (responses are "
                                  f"kept for {server.limits.stored_seconds:g} s, the latest "
                                  f"{server.limits.stored_responses} of them).", "previous_response_id",
                                  "previous_response_not_found")
            items = earlier.continued() + items
            req = protocol.ResponsesRequest.model_validate({**req.model_dump(exclude={"input"}), "input": items})
        prompt = responses_prompt(req, server.vocab, server.engine.max_len)
        wanted = "message.output_text.logprobs" in (req.include or [])
        tools = [(t.name, t.parameters, t.strict) for t in req.tools or []]
        fmt = req.text.format if req.text is not None else None
        grammar = (lambda budget: grammar_for(fmt, "text.format", tools, req.tool_choice, bool(prompt.reply_start),
                                              budget), "text.format")
        return req, prompt, settings_of(server, prompt.tokens, req.max_output_tokens, req, None,
                                        (req.top_logprobs or 0) if wanted else None, grammar), items

    def keep(req, builder, items) -> None:
        if req.store and builder.final is not None and builder.final["status"] != "failed":
            server.responses.put(builder.final, items)

    def unknown_response(name: str) -> APIError:
        return APIError(404, f"No response with id {name!r} (responses are kept for {server.limits.stored_seconds:g} "
                             f"s, the latest {server.limits.stored_responses}).", "invalid_request_error",
                        "response_id", "not_found")

    @app.get("/v1/responses/{name}")
    async def get_response(http: HTTPRequest, name: str):
        check(http)
        if (found := server.responses.get(name)) is None:
            raise unknown_response(name)
        return found.response

    @app.delete("/v1/responses/{name}")
    async def delete_response(http: HTTPRequest, name: str):
        check(http)
        if not server.responses.delete(name):
            raise unknown_response(name)
        return {"id": name, "object": "response", "deleted": True}

    @app.post("/v1/responses")
    async def responses(http: HTTPRequest):
        _, (req, prompt, settings, items) = await prepared(http, protocol.ResponsesRequest, responses_prepare)
        rid = "resp_" + secrets.token_hex(12)
        generation = Generation(server, http, prompt.tokens, settings, rid)
        reply = ReplyStream(server.tokenizer, server.vocab, prompt.reply_start)
        builder = ResponseBuilder(req, server.model_name, generation, rid)
        answer = None if settings.logprobs is None else logprobs.Answer(server.tokenizer, generation.request, reply,
                                                                        tk.STOP_TOKENS)

        def events_of(token: int | None) -> list[tuple[str, dict]]:
            """A token's events (None: the reply's end), its log-probability entries on its text's delta."""
            pieces = reply.feed(token) if token is not None else reply.finish()
            entries = [] if answer is None else answer.feed(token, pieces) if token is not None else answer.finish()
            out = []
            for d in pieces:  # the entries go with the token's first text piece
                given, entries = (entries, []) if d.kind == "content" else ([], entries)
                out += builder.delta(d, given)
            return out
        # A response object echoes the request's tools and instructions, which a client can make
        # megabytes long: the objects that carry it are written on a worker thread.
        async def written(make) -> str:
            return await server.prepare(lambda: "".join(_event(kind, data) for kind, data in make()))

        if req.stream:
            async def events():
                yield await written(builder.start)
                async for batch in generation.batches():
                    if text := "".join(_event(kind, data) for token in batch for kind, data in events_of(token)):
                        yield text
                if generation.failed:
                    raise _Failed()
                for kind, data in events_of(None):
                    yield _event(kind, data)
                yield await written(lambda: builder.end(reply))
                keep(req, builder, items)

            def failure(message: str) -> list[str]:
                return [_event(kind, data) for kind, data in builder.fail(message)]

            return StreamingResponse(_stream(events(), generation, failure), media_type="text/event-stream")

        entries = []
        async for token in generation.tokens():
            pieces = reply.feed(token)
            if answer is not None:
                entries += answer.feed(token, pieces)
        if generation.gone:
            return gone()
        if generation.failed:
            raise server_error(rid)
        reply.finish()
        if answer is not None:
            entries += answer.finish()
        text = await server.prepare(lambda: json.dumps(builder.response(reply, entries)))
        keep(req, builder, items)
        return Response(text, media_type="application/json")

    return app
