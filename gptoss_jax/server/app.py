"""The endpoints: an OpenAI-compatible API over the serving engine (FastAPI; docs/serving.md).

    GET  /health               200 once warmed up, 503 before (and while stopping)
    GET  /metrics              the engine's metrics, Prometheus text
    GET  /v1/models            the one model served
    POST /v1/chat/completions  harmony chat: reasoning_content, content, tool_calls; SSE with stream
    POST /v1/completions       a raw prompt (text or token ids)
    POST /v1/responses         the Responses API subset OpenAI's gpt-oss reference serves

Every request is submitted to the engine in the handler, so that a full queue (429) or a prompt
that does not fit (400) is answered before any byte of a stream; its tokens then come back through
the request's listener, handed to the event loop. A client that goes away cancels its request: a
stream when its next chunk cannot be written, a plain request by a check every half second.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from .. import tokenizer as tk
from ..sampling import Sampling
from ..serving import Engine, QueueFull, Settings
from . import protocol
from .errors import APIError, bad_request, model_not_found, queue_full, unauthorized, unavailable
from .harmony import ReplyStream, StopTrimmer, chat_prompt, responses_prompt
from .metrics import prometheus_text
from .responses import ResponseBuilder


class Server:
    """What the endpoints share: the engine, the tokenizer, the served name, the key, the state."""

    def __init__(self, engine: Engine, tokenizer, vocab, *, model_name: str, api_key: str | None = None):
        self.engine, self.tokenizer, self.vocab = engine, tokenizer, vocab
        self.model_name, self.api_key = model_name, api_key
        self.ready = threading.Event()  # set once the engine is warmed up and running
        self.stopping = False
        self.created = int(time.time())
        self.handoff: Handoff | None = None  # made on the event loop's first request


class Handoff:
    """Tokens from the engine's thread to the event loop, with one wake-up of the loop for all that
    arrived meanwhile rather than one per token (at 256 streams, a step hands over 256 tokens)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._pending: list = []
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, queue: asyncio.Queue, item) -> None:
        """On any thread; never raises."""
        with self._lock:
            self._pending.append((queue, item))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop has closed: nobody is reading
            pass

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending, self._scheduled = self._pending, [], False
        for queue, item in pending:
            queue.put_nowait(item)


class ClientGone(Exception):
    """The client disconnected before its reply was complete."""


class Generation:
    """One request in the engine, its tokens read on the event loop."""

    def __init__(self, server: Server, prompt: list[int], settings: Settings):
        loop = asyncio.get_running_loop()
        if server.handoff is None or server.handoff.loop is not loop:
            server.handoff = Handoff(loop)
        handoff, queue = server.handoff, asyncio.Queue()
        self.queue = queue
        try:
            self.request = server.engine.submit(prompt, settings, lambda token: handoff.put(queue, token))
        except QueueFull:
            raise queue_full(server.engine.stats()["waiting"]) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        self.prompt_tokens = len(prompt)

    async def batches(self, http: HTTPRequest | None = None) -> AsyncIterator[list[int]]:
        """The tokens as they come, all those already there at once (a stream that falls behind
        catches up in fewer, larger chunks); with `http`, checks every half second that the client is
        still there (ClientGone if not). The request is cancelled if the reading stops before it ends."""
        try:
            while True:
                try:
                    token = await asyncio.wait_for(self.queue.get(), 0.5) if http else await self.queue.get()
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        raise ClientGone() from None
                    continue
                batch = []
                while token is not None:
                    batch.append(token)
                    try:
                        token = self.queue.get_nowait()
                    except asyncio.QueueEmpty:
                        break
                if batch:
                    yield batch
                if token is None:
                    return
        finally:
            if not self.request.finished:
                self.request.cancel()

    async def tokens(self, http: HTTPRequest | None = None) -> AsyncIterator[int]:
        async for batch in self.batches(http):
            for token in batch:
                yield token

    def check_error(self) -> None:
        if self.request.finish_reason == "error":
            raise APIError(500, f"generation failed: {self.request.error}", "server_error")

    def usage(self) -> dict:
        completion = len(self.request.output_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}


def _settings(server: Server, prompt: list[int], max_tokens: int | None, body, stops) -> Settings:
    """The engine settings of a request; 400 when the prompt and its budget exceed the context."""
    max_len = server.engine.max_len
    budget = max_tokens if max_tokens is not None else max_len - len(prompt)
    if len(prompt) + max(budget, 1) > max_len:
        raise bad_request(f"This model's maximum context length is {max_len} tokens. However, you requested "
                          f"{len(prompt) + max(budget, 1)} tokens ({len(prompt)} in the prompt, {max(budget, 1)} for "
                          f"the completion). Please reduce the prompt or the completion length.",
                          "messages", "context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    sampling = Sampling(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p)
    seed = secrets.randbits(31) if body.seed is None else body.seed
    stops = [stops] if isinstance(stops, str) else list(stops or [])
    if any(not s for s in stops):
        raise bad_request("a stop sequence must not be empty", "stop")
    if len(stops) > 4:
        raise bad_request(f"at most 4 stop sequences, got {len(stops)}", "stop")
    return Settings(max_new_tokens=budget, sampling=sampling, seed=seed,
                    stop_ids=() if getattr(body, "ignore_eos", False) else tk.STOP_TOKENS, stop_strings=tuple(stops))


def _finish_reason(generation: Generation, tool_calls: bool, trimmed: bool) -> str:
    reason = generation.request.finish_reason
    if reason == "length" and not trimmed:
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


async def _stream(chunks: AsyncIterator[str], generation: Generation) -> AsyncIterator[str]:
    """A stream's chunks. A client gone mid-stream closes it (the next chunk cannot be written): its
    request is cancelled here, at once."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        if not generation.request.finished:
            generation.request.cancel()


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="gptoss-jax", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):  # never take the server down; say what happened
        return JSONResponse(APIError(500, f"{type(e).__name__}: {e}", "server_error").body(), status_code=500)

    def check(http: HTTPRequest) -> None:
        if server.api_key is not None:
            header = http.headers.get("authorization", "")
            if not secrets.compare_digest(header.encode(), f"Bearer {server.api_key}".encode()):
                raise unauthorized()
        if server.stopping:
            raise unavailable("The server is shutting down.")
        if not server.ready.is_set():
            raise unavailable("The model is warming up (compiling); retry in a moment.")

    async def body(http: HTTPRequest, model: type[BaseModel]):
        check(http)  # the key and the state first: a client without the key learns nothing more
        raw = await http.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"The request body is not valid JSON: {e}") from None
        if not isinstance(data, dict):
            raise bad_request("The request body must be a JSON object")
        try:
            parsed = model.model_validate(data)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first["loc"]) or None
            raise bad_request(f"Invalid value for '{param}': {first['msg']}" if param else first["msg"], param) \
                from None
        if parsed.model != server.model_name:
            raise model_not_found(parsed.model, server.model_name)
        return parsed

    @app.get("/health")
    async def health():
        if server.stopping:
            raise unavailable("The server is shutting down.")
        if not server.ready.is_set():
            raise unavailable("The model is warming up (compiling); retry in a moment.")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text(server.engine.stats()), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(http: HTTPRequest):
        check(http)
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "gptoss-jax"}]}

    # Chat completions --------------------------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        req = await body(http, protocol.ChatCompletionRequest)
        prompt = chat_prompt(req, server.vocab)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        generation = Generation(server, prompt.tokens, _settings(server, prompt.tokens, max_tokens, req, req.stop))
        reply = ReplyStream(server.tokenizer, server.vocab, prompt.reply_start)
        trim = StopTrimmer(generation.request.settings.stop_strings)
        rid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())

        def chunk(delta: dict, finish: str | None = None) -> str:
            return _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": server.model_name,
                         "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

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
                    deltas = [as_delta(d) for token in batch for d in reply.feed(token)]
                    if text := "".join(chunk(d) for d in _merge(deltas)):
                        yield text
                if text := "".join(chunk(d) for d in _merge([as_delta(d) for d in reply.finish()])):
                    yield text
                if rest := trim.finish():
                    yield chunk({"content": rest})
                generation.check_error()
                yield chunk({}, _finish_reason(generation, bool(reply.tool_calls), trim.hit))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                                "model": server.model_name, "choices": [], "usage": generation.usage()})
                yield "data: [DONE]\n\n"

            return StreamingResponse(_stream(chunks(), generation), media_type="text/event-stream")

        async for token in generation.tokens(http):
            reply.feed(token)
        reply.finish()
        generation.check_error()
        content = trim.add("".join(reply.content)) + trim.finish()
        message = {"role": "assistant", "content": content or (None if reply.tool_calls else ""),
                   "reasoning_content": "".join(reply.reasoning) or None}
        if reply.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in reply.tool_calls]
        return {"id": rid, "object": "chat.completion", "created": created, "model": server.model_name,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": _finish_reason(generation, bool(reply.tool_calls), trim.hit)}],
                "usage": generation.usage()}

    # Completions ---------------------------------------------------------------------------------------

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        req = await body(http, protocol.CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise bad_request(f"one prompt per request, got {len(prompt)}", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):  # special tokens written out (<|start|>, ...) are read as such
            prompt = server.tokenizer.encode(prompt, allowed_special="all")
        if not prompt:
            raise bad_request("the prompt is empty", "prompt")
        generation = Generation(server, list(prompt), _settings(server, list(prompt), req.max_tokens, req, req.stop))
        decoder, trim = tk.StreamDecoder(server.tokenizer), StopTrimmer(generation.request.settings.stop_strings)
        rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())

        def text_of(token: int) -> str:  # a stop token ends the text, unwritten
            return "" if token in tk.STOP_TOKENS else trim.add(decoder.add(token))

        def chunk(text: str, finish: str | None = None) -> str:
            return _sse({"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
                         "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]})

        if req.stream:
            async def chunks():
                async for batch in generation.batches():
                    if text := "".join(text_of(token) for token in batch):
                        yield chunk(text)
                if rest := trim.add(decoder.flush()) + trim.finish():
                    yield chunk(rest)
                generation.check_error()
                yield chunk("", _finish_reason(generation, False, trim.hit))
                if req.stream_options and req.stream_options.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": created,
                                "model": server.model_name, "choices": [], "usage": generation.usage()})
                yield "data: [DONE]\n\n"

            return StreamingResponse(_stream(chunks(), generation), media_type="text/event-stream")

        pieces = [text_of(token) async for token in generation.tokens(http)]
        generation.check_error()
        text = "".join(pieces) + trim.add(decoder.flush()) + trim.finish()
        return {"id": rid, "object": "text_completion", "created": created, "model": server.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": _finish_reason(generation, False, trim.hit)}],
                "usage": generation.usage()}

    # Responses -----------------------------------------------------------------------------------------

    @app.post("/v1/responses")
    async def responses(http: HTTPRequest):
        req = await body(http, protocol.ResponsesRequest)
        if req.previous_response_id is not None:
            raise bad_request("previous_response_id is not supported: this server keeps no responses; send the "
                              "whole conversation as input items", "previous_response_id")
        prompt = responses_prompt(req, server.vocab)
        settings = _settings(server, prompt.tokens, req.max_output_tokens, req, None)
        generation = Generation(server, prompt.tokens, settings)
        reply = ReplyStream(server.tokenizer, server.vocab, prompt.reply_start)
        builder = ResponseBuilder(req, server.model_name, generation)
        if req.stream:
            async def events():
                for kind, data in builder.start():
                    yield _event(kind, data)
                async for batch in generation.batches():
                    if text := "".join(_event(kind, data) for token in batch for d in reply.feed(token)
                                       for kind, data in builder.delta(d)):
                        yield text
                for d in reply.finish():
                    for kind, data in builder.delta(d):
                        yield _event(kind, data)
                generation.check_error()
                for kind, data in builder.end(reply):
                    yield _event(kind, data)

            return StreamingResponse(_stream(events(), generation), media_type="text/event-stream")

        async for token in generation.tokens(http):
            reply.feed(token)
        reply.finish()
        generation.check_error()
        return builder.response(reply)

    return app


def serve_forever(app: FastAPI, host: str, port: int, grace: float, on_started: Callable[[object], None],
                  on_exit: Callable[[], None] = lambda: None) -> None:
    """Run the app under uvicorn until SIGINT or SIGTERM: then `on_exit()`, stop listening, give running
    requests `grace` seconds to finish, and return. `on_started(server)` runs on a thread once it
    listens."""
    import uvicorn

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            on_exit()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace,
                            access_log=False)
    server = _Server(config)

    def watch():
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started:
            on_started(server)

    threading.Thread(target=watch, daemon=True).start()
    server.run()
