"""The endpoints: an OpenAI-compatible API over the serving engine (FastAPI; docs/serving.md).

    GET  /health               200 once warmed up, 503 before, while stopping and once the engine stopped
    GET  /metrics              the engine's metrics, Prometheus text
    GET  /openapi.json         the API's schema, request bodies included (openapi.py)
    GET  /v1/models            the model served, and the LoRA adapters over it (adapters.py)
    GET  /v1/models/{id}       one of them (404 for another name)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   an adapter loaded, or unloaded once its requests end
    POST /v1/chat/completions  harmony chat: reasoning_content, content, tool_calls; SSE with stream
    POST /v1/completions       a raw prompt (text or token ids); echo: the prompt too, with its tokens' logprobs
    POST /tokenize, /detokenize, GET /tokenizer_info   vLLM's tokenizer endpoints (evaluation harnesses)
    POST /v1/responses         the Responses API (previous_response_id: continue a stored response)
    GET, DELETE /v1/responses/{id}  a stored response (store.py)
    POST /v1/responses/{id}/cancel  a background response ended

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

import asyncio
import dataclasses
import secrets
import time

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import tokenizer as tk
from ..version import __version__
from . import adapters, body, logprobs, openapi, protocol
from .errors import APIError, bad_request, method_not_allowed, not_found, unauthorized, unavailable
from . import choices
from .choices import Failed, sse
from ..serving.score import prompt_logprobs
from .generation import Generation, Server, settings_of
from .structured import grammar_for, schema_probes
from .guard import Guard, log
from .harmony import ReplyStream, chat_prompt, context_exceeded, responses_prompt
from .metrics import prometheus_text
from .responses import ResponseBuilder
from .writing import error_response, event, event_stream, json_answer, sse_error


SCORED_MOST = 32_768  # the longest prompt echo scores: the pass holds every position's activations (score.py)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="gptoss-jax", version=__version__, docs_url=None, redoc_url=None)
    app.add_middleware(Guard, allowed_hosts=server.limits.allowed_hosts)
    openapi.install(app)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: HTTPRequest, e: StarletteHTTPException):  # routing: 404, 405
        if e.status_code == 405:
            error = method_not_allowed(http.method, http.url.path, (e.headers or {}).get("Allow"))
        elif e.status_code == 404:
            error = not_found(http.url.path)
        else:
            error = APIError(e.status_code, str(e.detail), "invalid_request_error")
        return error_response(error)

    def check(http: HTTPRequest) -> None:
        if server.api_key is not None:
            scheme, _, key = http.headers.get("authorization", "").strip().partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(key.strip().encode(), server.api_key.encode()):
                raise unauthorized()
        health()

    async def written_json(data: dict) -> Response:
        """A JSON answer written on a worker thread, never on the event loop: it can be megabytes long (a
        response object echoes the request's tools and instructions; echoed prompts' logprobs)."""
        return await server.prepare(json_answer, data)

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
            server.adapters.check(req.model)  # (a 404 for a name not served; an adapter's: Generation holds it)
            return req, prepare(req)

        return await server.prepare(work)

    @app.get("/health")
    async def health_endpoint():
        health()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(prometheus_text({**server.engine.stats(), **server.responses.stats(),
                                         "scoring_passes": server.scoring,
                                         "model_requests": dict(server.adapters.requests)}),
                        media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(http: HTTPRequest):
        check(http)
        return {"object": "list", "data": server.adapters.cards(server.created)}

    @app.get("/v1/models/{name:path}")  # a name may hold "/" (openai/gpt-oss-20b)
    async def model(http: HTTPRequest, name: str):
        check(http)
        server.adapters.check(name)
        return next(card for card in server.adapters.cards(server.created) if card["id"] == name)

    adapters.install(app, server, check)

    # The tokenizer: vLLM's endpoints, at the root (lm-evaluation-harness's remote tokenizer) ----------

    async def tokenizer_call(http: HTTPRequest, model: type[BaseModel], work):
        check(http)
        raw = await body.read(http, server.limits.max_body_bytes, server.limits.read_timeout)

        def run():
            req = body.parse(raw, model)
            if req.model is not None:
                server.adapters.check(req.model)
            return json_answer(work(req))  # a long prompt's tokens: written here, not on the event loop

        return await server.prepare(run)

    @app.post("/tokenize")
    async def tokenize(http: HTTPRequest):
        def work(req):
            tokens = server.tokenizer.encode(req.prompt, allowed_special="all")
            strings = [logprobs.token_text(server.tokenizer, t) for t in tokens] if req.return_token_strs else None
            return {"count": len(tokens), "max_model_len": server.engine.max_len, "tokens": tokens,
                    "token_strs": strings}

        return await tokenizer_call(http, protocol.TokenizeRequest, work)

    @app.post("/detokenize")
    async def detokenize(http: HTTPRequest):
        def work(req):
            if any(not 0 <= t < server.tokenizer.n_vocab for t in req.tokens):
                raise bad_request(f"token ids must lie in [0, {server.tokenizer.n_vocab})", "tokens")
            return {"prompt": server.tokenizer.decode(req.tokens)}

        return await tokenizer_call(http, protocol.DetokenizeRequest, work)

    @app.get("/tokenizer_info")
    async def tokenizer_info(http: HTTPRequest):
        check(http)
        return {"tokenizer_class": "o200k_harmony (tiktoken)", "vocab_size": server.tokenizer.n_vocab,
                "model_max_length": server.engine.max_len, "bos_token": "<|startoftext|>", "eos_token": "<|return|>",
                "pad_token": "<|endoftext|>"}  # as gpt-oss's Hugging Face tokenizer names them

    def gone() -> Response:
        return Response(status_code=499)  # nobody reads it: the client has left

    # Chat completions --------------------------------------------------------------------------------

    def chat_prepare(req):
        """-> (the request, legacy functions read as tools; the prompt; the settings; whether the answer
        names the call as the legacy function_call)."""
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        legacy = bool(req.functions)  # (an empty list asks for nothing)
        if legacy and req.tools is not None:
            raise bad_request("functions is the legacy form of tools: send one of them", "functions")
        if req.function_call not in (None, "none") and not legacy:
            raise bad_request("function_call needs functions", "function_call")
        req = req.as_tools() if legacy else req
        prompt = chat_prompt(req, server.vocab, server.engine.max_len)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        tools = [(t.function.name, t.function.parameters, bool(t.function.strict)) for t in req.tools or []]
        grammar = (lambda budget: grammar_for(req.response_format, "response_format", tools, req.tool_choice,
                                              bool(prompt.reply_start), budget),
                   "response_format" if req.response_format is not None else "functions" if legacy else "tools",
                   schema_probes(req.response_format, "response_format", tools, req.tool_choice,
                                 "functions[{}].parameters" if legacy else "tools[{}].function.parameters"))
        return req, prompt, settings_of(server, prompt.tokens, max_tokens, req, req.stop,
                                        (req.top_logprobs or 0) if req.logprobs else None, grammar), legacy

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        _, (req, prompt, settings, legacy) = await prepared(http, protocol.ChatCompletionRequest, chat_prepare)
        rid, created = "chatcmpl-" + secrets.token_hex(12), int(time.time())
        generations = choices.start(server, http, prompt.tokens, [choices.seeded(settings, i) for i in range(req.n)],
                                    rid, req.model, "response_format" if req.response_format is not None else
                                    "functions" if legacy else "tools")

        def chunk(choice: dict) -> str:
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": req.model,
                        "choices": [choice]})

        answers = [choices.ChatChoice(server, g, prompt, i, chunk, legacy) for i, g in enumerate(generations)]
        if req.stream:
            async def chunks():
                async for text in choices.merged([a.stream() for a in answers]):
                    yield text
                if req.stream_options and req.stream_options.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                               "model": req.model, "choices": [], "usage": choices.usage_of(generations)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(event_stream(chunks(), generations, sse_error), media_type="text/event-stream")

        whole = await asyncio.gather(*(a.whole() for a in answers))
        if not choices.check(generations, rid):
            return gone()
        return await written_json({"id": rid, "object": "chat.completion", "created": created,
                                   "model": req.model, "choices": whole,
                                   "usage": choices.usage_of(generations)})

    # Completions ---------------------------------------------------------------------------------------

    def completion_prepare(req):
        if req.best_of is not None and req.best_of < req.n:
            raise bad_request(f"best_of ({req.best_of}) must be at least n ({req.n})", "best_of")
        if req.best_of is not None and req.best_of > req.n and req.stream:
            raise bad_request("best_of greater than n cannot be streamed (the best are known at the end)", "best_of")
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
        if not all(0 <= t < server.tokenizer.n_vocab for t in prompt):
            raise bad_request(f"prompt token ids must lie in [0, {server.tokenizer.n_vocab})", "prompt")
        if req.max_tokens == 0 and not req.echo:
            raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt alone, scored)", "max_tokens")
        settings = settings_of(server, prompt, max(req.max_tokens, 1), req, req.stop, req.logprobs)
        if req.echo and req.logprobs is not None and req.model != server.model_name:
            raise bad_request(f"echo with logprobs scores the prompt under the base model only, not under the adapter "
                              f"{req.model!r}", "echo")
        if req.echo and req.logprobs is not None and len(prompt) > SCORED_MOST:
            raise bad_request(f"echo with logprobs scores prompts of at most {SCORED_MOST} tokens, got {len(prompt)}",
                              "echo")
        return prompt, settings

    def echo_of(prompt: list[int], top: int | None):
        """An echoed prompt (logprobs.echoed), its tokens scored when `top` is not None: one pass of the
        model over the prompt (serving/score.py), on the scoring thread."""
        scores = None
        if top is not None:
            try:
                scores = prompt_logprobs(server.engine.config, server.engine.params, prompt, k=top,
                                         kernels=server.engine.kernels)
            except ValueError as e:
                raise bad_request(f"echo with logprobs: {e}", "echo") from None
        return logprobs.echoed(server.tokenizer, prompt, scores)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        req, (prompt, settings) = await prepared(http, protocol.CompletionRequest, completion_prepare)
        # Only a scoring pass waits for the scoring thread; the text alone is made on a worker.
        run = server.score if req.logprobs is not None else server.prepare
        echo = await run(echo_of, prompt, req.logprobs) if req.echo else None
        rid, created = "cmpl-" + secrets.token_hex(12), int(time.time())
        best_of = req.best_of or req.n
        scored = settings.logprobs is not None
        if best_of > req.n and not scored:  # the candidates are ranked by their tokens' log-probabilities
            settings = dataclasses.replace(settings, logprobs=0)
        usage = None  # known at the end, except for an echo alone (nothing generated)
        if req.max_tokens == 0:
            generations = [None] * req.n
            usage = {"prompt_tokens": len(prompt), "completion_tokens": 0, "total_tokens": len(prompt)}
        else:
            generations = choices.start(server, http, prompt, [choices.seeded(settings, i) for i in range(best_of)],
                                        rid, req.model)

        def chunk(choice: dict) -> str:
            return sse({"id": rid, "object": "text_completion", "created": created, "model": req.model,
                        "choices": [choice]})

        texts = [choices.CompletionChoice(server, g, i, chunk, scored, echo, settings) for i, g in enumerate(generations)]
        if req.stream:
            async def chunks():
                async for text in choices.merged([t.stream() for t in texts]):
                    yield text
                if req.stream_options and req.stream_options.include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                               "model": req.model, "choices": [], "usage": usage or choices.usage_of(generations)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(event_stream(chunks(), [g for g in generations if g], sse_error, rid),
                                     media_type="text/event-stream")

        whole = await asyncio.gather(*(t.whole() for t in texts))
        if usage is not None:
            return await written_json({"id": rid, "object": "text_completion", "created": created,
                                       "model": req.model, "choices": whole, "usage": usage})
        if not choices.check(generations, rid):
            return gone()
        if best_of > req.n:  # the n of highest mean log-probability, best first, numbered again
            best = sorted(range(best_of), key=lambda i: -texts[i].mean_logprob())[:req.n]
            whole = [{**whole[i], "index": k} for k, i in enumerate(best)]
        return await written_json({"id": rid, "object": "text_completion", "created": created,
                                   "model": req.model, "choices": whole,
                                   "usage": choices.usage_of(generations)})

    # Responses -----------------------------------------------------------------------------------------

    def responses_prepare(req):
        """-> (the request, its input continuing a stored response's; the prompt; the settings; the input
        items as dicts, stored with the response)."""
        if req.background and (req.stream or not req.store):
            raise bad_request("a background response is polled (GET /v1/responses/{id}): it needs store, and is "
                              "not streamed", "background")
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
            try:
                req = protocol.ResponsesRequest.model_validate({**req.model_dump(exclude={"input"}), "input": items})
            except ValidationError as e:  # (the stored conversation with this input: a name too long, say)
                raise bad_request(f"The response {req.previous_response_id!r} cannot be continued with this input: "
                                  f"{e.errors(include_url=False)[0]['msg']}", "previous_response_id") from None
        prompt = responses_prompt(req, server.vocab, server.engine.max_len)
        wanted = "message.output_text.logprobs" in (req.include or [])
        tools = [(t.name, t.parameters, t.strict) for t in req.tools or []]
        fmt = req.text.format if req.text is not None else None
        grammar = (lambda budget: grammar_for(fmt, "text.format", tools, req.tool_choice, bool(prompt.reply_start),
                                              budget), "text.format" if fmt is not None else "tools",
                   schema_probes(fmt, "text.format", tools, req.tool_choice, "tools[{}].parameters"))
        return req, prompt, settings_of(server, prompt.tokens, req.max_output_tokens, req, None,
                                        (req.top_logprobs or 0) if wanted else None, grammar), items

    async def keep(req, builder, items) -> None:
        """Store a finished response (written as JSON on a worker thread: it can be megabytes long); a
        failure to store it is logged, and the reply, already made, stands."""
        if req.store and builder.final is not None and builder.final["status"] != "failed":
            await store(builder.final, items)

    async def store(response: dict, items: list[dict]) -> None:
        try:
            await server.prepare(server.responses.put, response, items)
        except Exception as e:  # noqa: BLE001 -- (the shutdown's 503 too): the answer goes out unstored
            log.warning("response %s was not stored: %s: %s", response["id"], type(e).__name__, e)

    def stored(found) -> Response:
        return Response(found.response, media_type="application/json")  # its JSON, as it was stored

    def unknown_response(name: str) -> APIError:
        return APIError(404, f"No response with id {name!r} (responses are kept for {server.limits.stored_seconds:g} "
                             f"s, the latest {server.limits.stored_responses}).", "invalid_request_error",
                        "response_id", "not_found")

    @app.get("/v1/responses/{name}")
    async def get_response(http: HTTPRequest, name: str):
        check(http)
        if (found := server.responses.get(name)) is None:
            raise unknown_response(name)
        return stored(found)

    @app.post("/v1/responses/{name}/cancel")
    async def cancel_response(http: HTTPRequest, name: str):
        """A background response ended now (stored as cancelled, with what it had made); one that has
        ended already is returned as it is."""
        check(http)
        running = server.background.get(name)
        if running is not None:
            running[0].cancel()
            await running[1]
        found = server.responses.get(name)
        if found is None:
            raise unknown_response(name)
        return stored(found)

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
        generation = Generation(server, http, prompt.tokens, settings, rid, req.model, watch=not req.background,
                                grammar_param="text.format" if req.text is not None and req.text.format else "tools")
        reply = ReplyStream(server.tokenizer, server.vocab, prompt.reply_start)
        builder = ResponseBuilder(req, req.model, generation, rid)
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
            return await server.prepare(lambda: "".join(event(kind, data) for kind, data in make()))

        if req.stream:
            async def events():
                yield await written(builder.start)
                async for batch in generation.batches():
                    if text := "".join(event(kind, data) for token in batch for kind, data in events_of(token)):
                        yield text
                if (error := generation.failure) is not None:
                    raise Failed(error)
                for kind, data in events_of(None):
                    yield event(kind, data)
                yield await written(lambda: builder.end(reply))
                await keep(req, builder, items)

            def failure(error: APIError) -> list[str]:
                return [event(kind, data) for kind, data in builder.fail(error)]

            return StreamingResponse(event_stream(events(), [generation], failure), media_type="text/event-stream")

        async def whole() -> list[dict]:
            entries = []
            async for token in generation.tokens():
                pieces = reply.feed(token)
                if answer is not None:
                    entries += answer.feed(token, pieces)
            reply.finish()
            return entries + (answer.finish() if answer is not None else [])

        if req.background:  # answered now; the response is stored as it is, then as it ends
            async def finish():
                try:
                    entries = await whole()
                    if (error := generation.failure) is not None:
                        final = builder.fail(error)[-1][1]["response"]
                    else:
                        final = await server.prepare(builder.response, reply, entries)
                    await store(final, items)
                finally:
                    server.background.pop(rid, None)
                    generation.close()

            queued = builder.queued()
            await store(queued, items)
            server.background[rid] = (generation, asyncio.create_task(finish()))
            return await written_json(queued)

        entries = await whole()
        if generation.gone:
            return gone()
        if (error := generation.failure) is not None:
            raise error
        answer = await written_json(builder.response(reply, entries))
        await keep(req, builder, items)
        return answer

    return app
