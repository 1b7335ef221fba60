"""Helpers of the server tests: an app served on a free port of 127.0.0.1 on a thread, and a
stand-in engine that replies with given tokens (the tiny model's replies are random)."""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import threading
import time
import urllib.parse

import uvicorn

from conftest import VOCAB, until

from gptoss_jax import tokenizer as tk
from gptoss_jax.kernels import Kernels
from gptoss_jax.server.transport import protocol_class
from gptoss_jax.serving import QueueFull, Request, Settings, TokenLogprob
from gptoss_jax.serving.constrain import Grammars
from gptoss_jax.serving.metrics import Metrics


@contextlib.contextmanager
def serving(app, header_timeout: float = 30.0, max_connections: int = 1024, keep_alive: float = 5.0):
    """The app on 127.0.0.1 (a free port) while the block runs, through gptoss-serve's own connection
    handling (server/transport.py: the header deadline, the connection cap) -> its base URL (".../v1").
    `keep_alive`: seconds an idle kept-alive connection stays open (uvicorn's default, as gptoss-serve)."""
    protocol, _ = protocol_class("auto", header_timeout, max_connections)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, http=protocol, ws="none", log_level="warning",
                                           access_log=False, timeout_keep_alive=keep_alive))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    def started() -> bool:
        assert thread.is_alive(), "the test server's thread ended before it started"
        return server.started

    until(started, "the test server started", 30)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def serving_engine(engine, model: str):
    """gptoss-serve's app over `engine` (the genuine vocabulary, ready at once) while the block runs ->
    its base URL."""
    from gptoss_jax.server.app import Server, create_app

    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=model)
    server.ready.set()
    with serving(create_app(server)) as base:
        yield base


class ScriptedEngine:
    """Engine.submit's contract, replying to every request with `reply` (token ids), one token every
    `delay` seconds; `prompts` records what was submitted; `full` makes submit refuse (QueueFull);
    `fail_after` N: each request fails (finish reason "error", with `FAILURE` as the engine's
    message) after N tokens; `cached` N: each request finds N prompt tokens in the KV cache (at most
    all but its last); a request that asks for log-probabilities gets `logprob`'s."""

    FAILURE = "XlaRuntimeError: INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS in /opt/secret/site-packages/jaxlib"

    kernels = Kernels()

    @functools.cached_property
    def _model(self):  # the tiny model, for an echoed prompt's log-probabilities (made at first use)
        import jax.numpy as jnp

        import gptoss_jax as gj
        from gptoss_jax.testing import random_params

        config = gj.ModelConfig.tiny()
        return config, random_params(config, seed=0, dtype=jnp.float32)

    config = property(lambda self: self._model[0])
    params = property(lambda self: self._model[1])

    def __init__(self, reply: list[int], *, max_len: int = 4096, delay: float = 0.0):
        self.reply, self.max_len, self.delay = reply, max_len, delay
        self.prompts: list[list[int]] = []
        self.full = False
        self.fail_after: int | None = None
        self.cached = 0
        self.alive = True  # Engine.alive: the engine's thread runs
        self.running: list[Request] = []
        self.grammars = Grammars(tk.load_tokenizer(VOCAB), 201088)  # the grammars are checked, not followed
        self.grammars.load()  # as Engine.warm_up does

    def submit(self, prompt_ids, settings: Settings = Settings(), listener=None, after=None) -> Request:
        if self.full:
            raise QueueFull("full")
        if len(prompt_ids) + settings.max_new_tokens > self.max_len:
            raise ValueError("too long")
        request = Request(len(self.prompts), prompt_ids, settings, listener)
        request.cached_tokens = min(self.cached, len(prompt_ids) - 1)  # admitted at once
        self.prompts.append(list(prompt_ids))
        self.running.append(request)
        threading.Thread(target=self._run, args=(request,), daemon=True).start()
        return request

    @staticmethod
    def logprob(i: int, token: int, alternatives: int | None) -> TokenLogprob | None:
        """Token i's stand-in log-probability: -(i + 1) / 8, after `alternatives` tokens of its own."""
        if alternatives is None:
            return None
        return TokenLogprob(-(i + 1) / 8, tuple((token + 1 + j, -j / 16) for j in range(alternatives)))

    def _run(self, request: Request) -> None:
        reason, error = "length", None
        for i, token in enumerate(self.reply[:request.settings.max_new_tokens]):
            if self.fail_after is not None and i == self.fail_after:
                reason, error = "error", self.FAILURE
                break
            if request.cancelled:
                reason = "cancelled"
                break
            time.sleep(self.delay)  # not a wait: the stand-in engine's work on one token
            request._add(token, time.perf_counter(), self.logprob(i, token, request.settings.logprobs))
            if token in request.settings.stop_ids:
                reason = "stop"
                break
        self.running.remove(request)
        request._finish(reason, time.perf_counter(), error=error)

    def stats(self) -> dict:
        """The engine's stats (the real engine's metrics, none counted), this engine's rows running."""
        return Metrics().snapshot(running=len(self.running), prefilling=0, waiting=0, slots_in_use=len(self.running),
                                  slots=8, pages=64, pages_in_use=len(self.running), pages_cached=0, page_size=64,
                                  pages_evicted=0)


def health_latencies(url: str, stop: threading.Event, out: list[float] | None = None) -> list[float]:
    """/health's answer times (url: the base URL, ".../v1"), each on a fresh connection, until `stop` is
    set; appended to `out` as they come (a new list if none)."""
    parts = urllib.parse.urlsplit(url)
    out = [] if out is None else out
    while not stop.is_set():
        t = time.perf_counter()
        c = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        c.request("GET", "/health")
        assert c.getresponse().status == 200
        c.close()
        out.append(time.perf_counter() - t)
        time.sleep(0.01)  # not a wait: paces the polls
    return out


def stall_bound_here() -> float:
    """The longest /health may take while another request is worked on, on this machine: eight times
    the longest that one call into Python's JSON encoder holds the interpreter lock here (a list of
    300,000 numbers, as the largest bodies below), and at least 0.1 s. The server, the clients and
    the poller share one process, so such a call (the server reading or writing a large body, on a
    worker thread as it should) pauses every thread, and one /health exchange takes the lock several
    times (the poller's request and read, the event loop's parsing and answer), each of which may wait
    out one such call (0.21 s seen on a 2-core machine where the encoder took 0.04 s). Work on the
    event loop instead stalls /health for the whole of it (a large tool schema echoed from the event
    loop: 0.5 s and more where the encoder takes 0.05 s). Where a large answer is written is also
    checked directly (test_server_hardening.py's `large_json`), since timing alone cannot tell one call's place."""
    blob = {"x-blob": [0] * 300_000}

    def took() -> float:
        t = time.perf_counter()
        json.dumps(blob)
        return time.perf_counter() - t

    return max(0.1, 8 * min(took() for _ in range(3)))


@contextlib.contextmanager
def demo_served(model: str, *, slots: int, max_len: int, max_waiting: int, keep_alive: float = 5.0):
    """The demo model's real engine (float32 random weights, warmed up, on its thread) behind
    gptoss-serve's app while the block runs -> (the engine, its base URL, the app)."""
    import jax.numpy as jnp

    import gptoss_jax as gj
    from gptoss_jax.server.app import Server, create_app
    from gptoss_jax.serving import Engine, EngineConfig
    from gptoss_jax.testing import random_params

    config = gj.ModelConfig.demo()
    engine = Engine(config, random_params(config, seed=0, dtype=jnp.float32),
                    EngineConfig(slots=slots, max_len=max_len, prefill_chunk=64, prefill_rows=2,
                                 max_waiting=max_waiting),
                    tokenizer=tk.load_tokenizer(VOCAB))
    engine.warm_up()
    engine.start()
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=model)
    server.ready.set()
    app = create_app(server)
    try:
        with serving(app, keep_alive=keep_alive) as base:
            yield engine, base, app
    finally:
        engine.stop()
