"""What the endpoints share (`Server`: the engine, the tokenizer, the limits, the requests running),
and one request in flight (`Generation`): its tokens handed from the engine's thread to the event
loop, its client's connection watched, its end (given, cut at shutdown, abandoned by the client)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import secrets
import threading
import time
from queue import SimpleQueue
from typing import AsyncIterator

from fastapi import Request as HTTPRequest

from .. import tokenizer as tk
from ..sampling import Sampling
from ..serving import Engine, QueueFull, Settings
from .adapters import ServedAdapters
from .errors import APIError, bad_request, queue_full, server_error, unavailable
from .guard import log
from .store import ResponseStore


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server refuses, and how long it waits (gptoss-serve's flags set them)."""

    max_body_bytes: int = 16 * 2**20  # 413 beyond
    read_timeout: float = 30.0  # seconds for a request's body once its headers came (408 after)
    max_stop_chars: int = 1000  # the longest stop string taken (400 beyond)
    allowed_hosts: tuple[str, ...] | None = None  # Host header names accepted; None: any
    stored_responses: int = 1024  # Responses API objects kept for previous_response_id and GET (oldest out)
    stored_bytes: int = 1024 * 2**20  # and at most this many bytes of their JSON
    stored_seconds: float = 3600.0  # and for at most this long


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class Server:
    """What the endpoints share: the engine, the tokenizer, the served name, the key, the limits, the
    state, and the requests running."""

    def __init__(self, engine: Engine, tokenizer, vocab, *, model_name: str, api_key: str | None = None,
                 limits: Limits = Limits(), adapters: ServedAdapters | None = None):
        self.engine, self.tokenizer, self.vocab = engine, tokenizer, vocab
        self.model_name, self.api_key, self.limits = model_name, api_key, limits
        # the names requests may ask for: the model's, and its LoRA adapters' (none unless given)
        self.adapters = adapters or ServedAdapters(model_name, 0, 0, ())
        # Loaded now, not at the first request: building it holds Python's interpreter lock for a
        # quarter of a second (2-core CPU machine), which would pause every stream then.
        tk.harmony_encoding(vocab)
        self.ready = threading.Event()  # set once the engine is warmed up and running
        self.stopping = False
        self.created = int(time.time())
        self.handoff: Handoff | None = None  # made on the event loop's first request
        self.running: set[Generation] = set()
        self.responses = ResponseStore(limits.stored_responses, limits.stored_seconds, limits.stored_bytes)
        self.background: dict[str, tuple] = {}  # response id -> (its Generation, the task finishing it)
        self.cut_done = False  # cut_all has run: the server is ending
        self._lock = threading.Lock()
        # Requests are parsed, rendered and tokenized here, off the event loop.
        self.workers = Workers(4, "gptoss-prepare")
        # Echoed prompts' passes of the model (serving/score.py), one at a time: their memory beside the
        # engine's stays one prompt's, and they never hold up the other requests' preparation.
        self.scorer = Workers(1, "gptoss-score")
        self._waiting: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()  # what cut_all cuts
        self.scoring = 0  # scoring passes asked for and not yet answered (running or waiting for the scorer)

    def cut_all(self) -> None:
        """End every running request now (on any thread): streams get their last chunk with
        finish_reason "length" (Responses: response.incomplete) and `[DONE]`; plain requests answer
        with what they have, finish_reason "length"."""
        with self._lock:
            self.cut_done = True  # a request whose body was still being prepared is refused (503)
            running, waiting = list(self.running), list(self._waiting)
        for generation in running:
            generation.cut()
        for loop, cut in waiting:  # work still running on the workers (a scoring pass): answered 503 now
            try:
                loop.call_soon_threadsafe(lambda cut=cut: cut.done() or cut.set_result(None))
            except RuntimeError:  # the loop has closed: nobody waits
                pass

    async def prepare(self, fn, *args):
        """fn(*args) on a worker thread; its APIError reaches the caller as raised (`_on`)."""
        return await self._on(self.workers, fn, *args)

    async def score(self, fn, *args):
        """fn(*args) on the scoring thread (see `scorer`; `_on`)."""
        with self._lock:
            self.scoring += 1
        try:
            return await self._on(self.scorer, fn, *args)
        finally:
            with self._lock:
                self.scoring -= 1

    async def _on(self, workers: Workers, fn, *args):
        """fn(*args) on one of `workers`, waited for until it ends or `cut_all` cuts it (then a 503:
        the grace period ended; the thread finishes the work unread, and keeps no process alive)."""
        loop = asyncio.get_running_loop()
        work, cut = loop.run_in_executor(workers, fn, *args), loop.create_future()
        with self._lock:
            self._waiting.add((loop, cut))
        try:
            await asyncio.wait({work, cut}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            with self._lock:
                self._waiting.discard((loop, cut))
        if work.done():
            return work.result()
        work.cancel()  # (not begun yet: it never runs; begun: it runs on, its outcome unread)
        raise unavailable("The server is shutting down: its grace period ended before this request was answered.")


class Workers:
    """Daemon threads that run the server's work off the event loop (concurrent.futures' `submit`, as
    loop.run_in_executor calls it): a process that ends at its grace period does not wait for work
    still running on them (a scoring pass of a long prompt), as it would for a ThreadPoolExecutor's;
    `busy` tells it that it must end without the interpreter's clean-up (gptoss-serve's exit)."""

    def __init__(self, count: int, name: str):
        self.busy = 0  # work items given and not yet ended (queued or running)
        self._count = threading.Lock()
        self._queue: SimpleQueue = SimpleQueue()
        for i in range(count):
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._count:
            self.busy += 1
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            future, fn, args = self._queue.get()
            try:
                if not future.set_running_or_notify_cancel():
                    continue
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 -- handed to whoever waits for it
                future.set_exception(e)
            finally:
                with self._count:
                    self.busy -= 1


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


class Generation:
    """One request in the engine, its tokens read on the event loop. From its submission on, a task
    watches the client's connection (independently of the tokens): a client that goes away cancels
    the request at once, so its slot is freed at the engine's next step. `after`: the generation of
    the first choice of the same API request (n > 1): this one shares its prompt (computed once:
    Engine.submit) and its watch, which cancels every choice."""

    def __init__(self, server: Server, http: HTTPRequest, prompt: list[int], settings: Settings, rid: str,
                 model: str, after: Generation | None = None, watch: bool = True, grammar_param: str | None = None):
        loop = asyncio.get_running_loop()
        if server.handoff is None or server.handoff.loop is not loop:
            server.handoff = Handoff(loop)
        handoff, queue = server.handoff, asyncio.Queue()
        self.server, self.queue, self.id, self.prompt_tokens = server, queue, rid, len(prompt)
        self.grammar_param = grammar_param  # the request's field that asked for its grammar, if any
        self.gone = self.was_cut = self.cancelled = False  # cancelled: by the API (a background response)
        if server.cut_done:  # prepared while the grace ran out: nothing may start now
            raise unavailable("The server is shutting down.")
        # Under its adapter's entry (held until close: an unload waits), or the base model's name.
        self.model, self.closed = model, True
        settings = dataclasses.replace(settings, adapter=server.adapters.hold(model))
        try:
            self.request = server.engine.submit(prompt, settings, lambda token: handoff.put(queue, token),
                                                **({} if after is None else {"after": after.request}))
            self.closed = False
            server.adapters.requests[model] += 1
        except QueueFull:
            raise queue_full(server.engine.stats()["waiting"]) from None
        except ValueError as e:
            raise bad_request(str(e)) from None
        except RuntimeError as e:  # the engine has stopped
            log.error("request %s: the engine refused it: %s", rid, e)
            raise unavailable("The server cannot generate now; retry later.") from None
        finally:
            if self.closed:  # not submitted
                server.adapters.release(model)
        with server._lock:
            server.running.add(self)
        if after is None:  # watch=False: a background response, whose client may leave
            self.siblings = [self]
            self._watch = asyncio.create_task(self._watch_client(http)) if watch else None
        else:
            self.siblings, self._watch = after.siblings, after._watch
            self.siblings.append(self)

    async def _watch_client(self, http: HTTPRequest) -> None:
        try:
            while (await http.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 -- a receive that fails means the client is gone too
            pass
        for g in self.siblings:
            if not g.request.finished:  # gone before the reply was complete (a complete reply: also "disconnect")
                g.gone = True
                g._end()
            g._let_go()  # (a reader that never started never closes it: a stream the client left at once)
        with self.server._lock:  # also where the reply's reader never started
            self.server.running.difference_update(self.siblings)

    def cut(self) -> None:
        self.was_cut = True
        self._end()

    def cancel(self) -> None:
        """Ended by the client through the API (POST /v1/responses/{id}/cancel)."""
        self.cancelled = True
        self._end()

    def _end(self) -> None:
        self.request.cancel()
        self.server.handoff.put(self.queue, None)  # the reader stops now, not at the engine's next step

    def close(self) -> None:
        """The reply is over (given, or abandoned): stop watching (once every choice is over), cancel what
        still runs."""
        with self.server._lock:
            self.server.running.discard(self)
        self._let_go()
        if all(g.closed for g in self.siblings) and self._watch is not None:
            self._watch.cancel()
        if not self.request.finished:
            self.request.cancel()

    def _let_go(self) -> None:
        """Closed: the adapter it ran under is no longer held (once, whoever closes first)."""
        if not self.closed:
            self.closed = True
            self.server.adapters.release(self.model)

    async def batches(self) -> AsyncIterator[list[int]]:
        """The tokens as they come, all those already there at once (a stream that falls behind
        catches up in fewer, larger chunks), until the request ends, is cut or its client leaves."""
        try:
            while True:
                token = await self.queue.get()
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
            self.close()

    async def tokens(self) -> AsyncIterator[int]:
        async for batch in self.batches():
            for token in batch:
                yield token

    @property
    def failure(self) -> APIError | None:
        """How the engine's failure on this request is answered, None where it did not fail: a 400 naming
        the field when the request brought it on itself (a grammar that cannot be followed), else a
        500 with the request's id (the details are logged under it)."""
        if self.request.finish_reason != "error" or self.was_cut:
            return None
        if self.request.invalid:
            param = self.grammar_param
            return bad_request(f"{param + ': ' if param else ''}{self.request.error}", param, "invalid_grammar")
        log.error("request %s: generation failed: %s", self.id, self.request.error)
        return server_error(self.id)

    def usage(self) -> dict:
        """OpenAI's usage object (chat and completions): the prompt's tokens, of them those found in the
        KV cache (`cached_tokens`, whole pages; 0 for a request never admitted), and the reply's."""
        completion = len(self.request.output_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": self.request.cached_tokens or 0}}


def settings_of(server: Server, prompt: list[int], max_tokens: int | None, body, stops,
                logprobs: int | None = None, grammar=None) -> Settings:
    """The engine settings of a request; 400 when the prompt and its budget exceed the context.
    logprobs: each token's log-probability with that many alternatives' (None: none); grammar: (a
    function of the reply's token budget -> the grammar it follows or None (structured.py), the
    parameter that asks for it, the schemas' probes (structured.schema_probes))."""
    max_len = server.engine.max_len
    budget = max_tokens if max_tokens is not None else max_len - len(prompt)
    if len(prompt) + max(budget, 1) > max_len:
        raise bad_request(f"This model's maximum context length is {max_len} tokens. However, you requested "
                          f"{len(prompt) + max(budget, 1)} tokens ({len(prompt)} in the prompt, {max(budget, 1)} for "
                          f"the completion). Please reduce the prompt or the completion length.",
                          "messages", "context_length_exceeded")
    temperature = 1.0 if body.temperature is None else body.temperature
    sampling = Sampling(temperature=temperature, top_p=1.0 if body.top_p is None else body.top_p,
                        top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0)
    seed = secrets.randbits(31) if body.seed is None else body.seed
    stops = [stops] if isinstance(stops, str) else list(stops or [])  # (count, emptiness: protocol.STOPS)
    if any(len(s) > server.limits.max_stop_chars for s in stops):
        raise bad_request(f"a stop sequence may have at most {server.limits.max_stop_chars} characters, got "
                          f"{max(map(len, stops))}", "stop")
    bias, vocab = [], server.tokenizer.n_vocab
    for key, value in (getattr(body, "logit_bias", None) or {}).items():  # (digits, range: protocol.py)
        if int(key) >= vocab:
            raise bad_request(f"logit_bias keys are token ids in [0, {vocab}), got {key!r}", "logit_bias")
        bias.append((int(key), float(value)))
    for probe, where in [] if grammar is None else grammar[2]:  # each schema alone: its fault names its field
        try:
            server.engine.grammars.probe(probe)
        except ValueError as e:
            raise bad_request(f"{where}: {e}", where, "invalid_schema") from None
    text = None if grammar is None else grammar[0](budget)
    if text is not None:
        if getattr(body, "ignore_eos", False):  # the grammar ends the reply at its stop token
            raise bad_request(f"ignore_eos cannot be combined with {grammar[1]} (a constrained reply ends where its "
                              "grammar does)", "ignore_eos")
        try:  # compiled here, off the event loop (and kept for the requests with the same grammar)
            server.engine.grammars.check(text)
        except ValueError as e:
            raise bad_request(f"{grammar[1]}: {e}", grammar[1]) from None
    return Settings(max_new_tokens=budget, sampling=sampling, seed=seed, logit_bias=tuple(bias),
                    stop_ids=() if getattr(body, "ignore_eos", False) else tk.STOP_TOKENS, stop_strings=tuple(stops),
                    logprobs=logprobs, presence_penalty=float(getattr(body, "presence_penalty", None) or 0.0),
                    frequency_penalty=float(getattr(body, "frequency_penalty", None) or 0.0),
                    grammar=text)
