"""The server under careless and hostile clients: every bad input a 4xx in OpenAI's shape on a
connection that stays usable, no CPU work that stalls other clients, slots freed as soon as their
client leaves, failures told without internals, streams always ended properly, and the checks a
browser's requests meet (content type, Host, the key's scheme)."""

import asyncio
import gc
import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse

import jax.numpy as jnp
import openai
import pytest
from conftest import VOCAB, needs_vocab, until
from server_util import ScriptedEngine, demo_served, health_latencies, serving, stall_bound_here

import gptoss_jax as gj
from gptoss_jax import tokenizer as tk
from gptoss_jax.server.app import create_app
from gptoss_jax.server.cli import freeze_start_up_heap
from gptoss_jax.server.generation import Limits, Server
from gptoss_jax.serving import Engine, EngineConfig, QueueFull, Settings
from gptoss_jax.serving.lockstep import LockstepError
from gptoss_jax.testing import random_params

pytestmark = needs_vocab
MODEL = "gpt-oss-test"
HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}


def text_tokens(n: int) -> list[int]:
    """n tokens of plain text (a reply that is not harmony: its text is the content)."""
    return tk.load_tokenizer(VOCAB).encode(" a" * n)[:n]


@pytest.fixture(scope="module")
def engine():
    return ScriptedEngine(text_tokens(40), max_len=4096)


@pytest.fixture(scope="module")
def server(engine):
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL,
                    limits=Limits(max_body_bytes=2**20, read_timeout=2.0))
    server.ready.set()
    return server


@pytest.fixture(scope="module")
def url(server):
    with serving(create_app(server)) as base:
        yield base


@pytest.fixture(autouse=True)
def reset(engine, server):
    engine.reply, engine.delay, engine.full, engine.fail_after, engine.alive = text_tokens(40), 0.0, False, None, True
    server.ready.set()
    server.stopping = server.cut_done = False


class Connection:
    """One kept-alive HTTP/1.1 connection; each exchange checks that the server kept it open."""

    def __init__(self, url: str):
        parts = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
        self.conn.connect()
        self.sock = self.conn.sock

    def send(self, method: str, path: str, body=None, headers=None, raw: bytes | None = None):
        headers = {"Content-Type": "application/json", **(headers or {})}
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        self.conn.request(method, "/v1" + path if path.startswith("/") and not path.startswith("/v1") and
                          path not in ("/health", "/metrics", "/openapi.json", "/tokenize") else path, data, headers)
        r = self.conn.getresponse()
        payload = r.read()
        assert not r.will_close and self.conn.sock is self.sock, f"the server closed the connection after {r.status}"
        return r.status, dict(r.getheaders()), payload

    def close(self):
        self.conn.close()


@pytest.fixture
def conn(url):
    c = Connection(url)
    yield c
    c.close()


def error_of(response, expected_status, param="unset"):
    """The OpenAI error of a response (status, headers, payload), checked."""
    status, _, payload = response
    assert status == expected_status, payload
    error = json.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param != "unset":
        assert error["param"] == param, error
    return error


# 1. Bad input: a 4xx naming the field, never a 500, and the connection stays usable ------------------

SURROGATE = '"a\\ud800b"'  # JSON text of a string holding a lone surrogate


def chat_raw(**fields) -> bytes:
    """A chat body written by hand, so that fields can hold JSON text json.dumps would not write."""
    base = {"model": json.dumps(MODEL), "messages": json.dumps(HI)}
    base.update(fields)
    return ("{" + ",".join(f'"{k}":{v}' for k, v in base.items()) + "}").encode()


@pytest.mark.parametrize("path, raw, status, param", [
    pytest.param("/chat/completions", chat_raw(tool_choice='{"type": "function", "function": "f"}', tools=json.dumps([TOOL])),
     400, "tool_choice.function", id="tool_choice function a string"),
    pytest.param("/chat/completions", chat_raw(tool_choice='["f"]', tools=json.dumps([TOOL])), 400, "tool_choice", id="tool_choice a list"),
    pytest.param("/responses", json.dumps({"model": MODEL, "input": "Hi", "tool_choice": {"type": "function", "function": "f"},
                               "tools": [{"type": "function", "name": "f"}]}).encode(), 400, "tool_choice.name", id="responses tool_choice without name"),
    pytest.param("/chat/completions", chat_raw(messages='[{"role": "user", "content": ' + SURROGATE + '}]'), 400,
     "messages[0].content", id="surrogate in content"),
    pytest.param("/chat/completions", chat_raw(tools='[{"type": "function", "function": {"name": "f", "description": '
                                         + SURROGATE + '}}]'), 400, "tools[0].function.description", id="surrogate in tool description"),
    pytest.param("/chat/completions", chat_raw(messages='[{"role": "assistant", "tool_calls": [{"id": "c", "function": '
                                            '{"name": "f", "arguments": ' + SURROGATE + '}}]}]'),
     400, "messages[0].tool_calls[0].function.arguments", id="surrogate in tool arguments"),
    pytest.param("/chat/completions", chat_raw(model=SURROGATE), 400, "model", id="surrogate in model"),
    pytest.param("/responses", json.dumps({"model": MODEL, "input": [{"type": "function_call", "name": "f", "call_id": ["x"]}]
                               }).encode(), 400, "input[0].call_id", id="call_id a list"),
    pytest.param("/responses", json.dumps({"model": MODEL, "input": [{"type": "function_call_output", "call_id": {"a": 1}}]
                               }).encode(), 400, "input[0].call_id", id="call_id an object"),
    pytest.param("/responses", json.dumps({"model": MODEL, "input": [{"type": "wizard"}]}).encode(), 400, "input[0]", id="unknown item type"),
    pytest.param("/chat/completions", b"[" * 100_000, 400, None, id="100k nested brackets"),
    pytest.param("/chat/completions", chat_raw(messages='[{"role": "user", "content": ' + "[" * 5000 + "]" * 5000 + "}]"),
     400, None, id="5000 levels in messages"),
    pytest.param("/chat/completions", chat_raw(tools='[{"type": "function", "function": {"name": "f", "parameters": '
                                         + '{"a": ' * 200 + "1" + "}" * 200 + "}}]"), 400, "tools[0].parameters", id="deep tool schema"),
    pytest.param("/chat/completions", chat_raw(temperature='"0.5"'), 400, "temperature", id="temperature a string"),
    pytest.param("/chat/completions", chat_raw(top_p="true"), 400, "top_p", id="top_p a boolean"),
    pytest.param("/completions", json.dumps({"model": MODEL, "prompt": "x", "temperature": "0.5"}).encode(), 400, "temperature", id="completions temperature a string"),
    pytest.param("/chat/completions", chat_raw(temperature="NaN"), 400, None, id="NaN"),
    pytest.param("/chat/completions", b'{"model": "x", "messages": \xff}', 400, None, id="not UTF-8"),
    pytest.param("/chat/completions", chat_raw(max_tokens="1" * 5000), 400, None, id="a 5000-digit number"),
    pytest.param("/responses", b'{"model": "%s", "input": [{"type": "function_call", "call_id": "c", "name": "f"}, '
                 b'{"type": "function_call_output", "call_id": "c", "output": [{"x": 1e400}]}]}' % MODEL.encode(),
                 400, None, id="a number no float holds"),
    # Bounds declared at the door: what the engine cannot hold never reaches it (each was a 500 before).
    *[pytest.param(path, json.dumps({**body, "top_k": value}).encode(), 400, "top_k", id=f"top_k {value} {path}")
      for value in (2**31, 2**63, 201089) for path, body in (("/chat/completions", {"model": MODEL, "messages": HI}),
                                                              ("/completions", {"model": MODEL, "prompt": "x"}),
                                                              ("/responses", {"model": MODEL, "input": "x"}))],
    *[pytest.param("/chat/completions", json.dumps({"model": MODEL, "messages": HI, "logit_bias": {key: 1}}).encode(),
                   400, "logit_bias", id=f"logit_bias key {key[:8]!r}")
      for key in ("\u00b2", "\u2460", "\u0663", "\uff10", "1" * 5000, "-1", " 1")],
    *[pytest.param("/chat/completions", json.dumps({"model": MODEL, "messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}).encode(), 400,
        "response_format.json_schema.schema" + suffix, id=name)
      for name, schema, suffix in (
          ("x-guidance a number", {"type": "object", "x-guidance": 5}, ".x-guidance"),
          ("x-guidance a list", {"type": "object", "x-guidance": [1, 2]}, ".x-guidance"),
          ("a $ref loop", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, ""),
          ("a pattern of 100000 repeats", {"type": "string", "pattern": "^a{100000}$"}, ""))],
    pytest.param("/chat/completions", json.dumps({"model": MODEL, "messages": HI, "tool_choice": "required", "tools": [
        TOOL, {"type": "function", "function": {"name": "g", "strict": True, "parameters": {
            "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}).encode(), 400,
        "tools[1].function.parameters", id="an invalid strict tool's schema names its field"),
    *[pytest.param(path, json.dumps(body).encode(), 400, param, id=f"a long name in {param}")
      for path, body, param in (
          ("/chat/completions", {"model": MODEL, "messages": HI, "tools": [
              {"type": "function", "function": {"name": "a" * 50_000}}]}, "tools[0].function.name"),
          ("/chat/completions", {"model": MODEL, "messages": [{"role": "assistant", "tool_calls": [
              {"id": "c", "function": {"name": "a" * 50_000, "arguments": "{}"}}]}]},
           "messages[0].tool_calls[0].function.name"),
          ("/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "name": "a" * 50_000, "content": "x"}]},
           "messages[0].name"),
          ("/responses", {"model": MODEL, "input": [{"type": "function_call", "name": "a" * 50_000, "call_id": "c"}]},
           "input[0].name"),
          ("/responses", {"model": MODEL, "input": "x", "tools": [{"type": "function", "name": "f g"}]},
           "tools[0].name"))],
])
def test_bad_input_is_a_4xx_and_the_connection_stays(conn, path, raw, status, param):
    error_of(conn.send("POST", path, raw=raw), status, param)
    assert conn.send("GET", "/models")[0] == 200  # the same connection answers on


def test_404_and_405_are_openai_shaped(conn):
    error = error_of(conn.send("GET", "/nowhere"), 404)
    assert "/v1/nowhere" in error["message"]
    response = conn.send("GET", "/chat/completions")
    assert "POST" in error_of(response, 405)["message"] and response[1].get("allow") == "POST"
    assert conn.send("GET", "/models")[0] == 200


def test_a_failure_of_the_server_is_a_500_with_an_id_and_no_internals(conn, engine, caplog, monkeypatch):
    def broken(*_, **__):
        raise KeyError("/opt/secret/internal-state")

    monkeypatch.setattr(engine, "submit", broken)
    with caplog.at_level(logging.ERROR, logger="gptoss_jax.server"):
        error = error_of(conn.send("POST", "/chat/completions", {"model": MODEL, "messages": HI}), 500)
    assert "secret" not in error["message"] and "KeyError" not in error["message"]
    rid = error["message"].split("request id ")[1].split(")")[0]
    assert any(rid in r.getMessage() and r.exc_info for r in caplog.records)  # the details, in the log
    assert conn.send("GET", "/models")[0] == 200


# 2. No CPU work on the event loop ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def stall_bound() -> float:
    return stall_bound_here()


def while_health_is_polled(url, work):
    # As gptoss-serve does once it is ready: a full collection of the test process's heap (JAX, torch)
    # that falls due in the window would pause every thread, whatever the server does.
    freeze_start_up_heap()
    done = threading.Event()
    latencies = []
    poller = threading.Thread(target=health_latencies, args=(url, done, latencies))
    poller.start()
    try:
        until(lambda: latencies, "/health answered once")
        result = work()
    finally:
        done.set()
        poller.join()
        gc.unfreeze()
    return result, latencies


def test_a_body_over_the_cap_is_refused_at_once_and_health_answers(url, stall_bound):
    parts = urllib.parse.urlsplit(url)
    fifty_mb = b"x" * (50 * 2**20)

    def send_50_mb(chunked: bool):
        s = socket.create_connection((parts.hostname, parts.port))
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
                + ("Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {len(fifty_mb)}\r\n") + "\r\n")
        s.sendall(head.encode())
        try:
            for i in range(0, len(fifty_mb), 2**20):
                piece = fifty_mb[i:i + 2**20]
                s.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n" if chunked else piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed before all of it was sent
        s.settimeout(10)
        reply = b""
        try:
            while b"\r\n\r\n" not in reply:
                more = s.recv(65536)
                if not more:
                    break
                reply += more
        except ConnectionResetError:
            pass
        s.close()
        return reply

    for chunked in (False, True):
        reply, latencies = while_health_is_polled(url, lambda: send_50_mb(chunked))
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert max(latencies) < stall_bound, (stall_bound, latencies)


def test_a_long_conversation_is_refused_without_stalling_others(url, server, monkeypatch, stall_bound):
    monkeypatch.setattr(server.engine, "max_len", 4096)
    text = "hello world, " * 70_000  # under the body cap (1 MiB here), far over the context
    c = Connection(url)
    response, latencies = while_health_is_polled(
        url, lambda: c.send("POST", "/chat/completions", {"model": MODEL, "messages": [{"role": "user",
                                                                                        "content": text}]}))
    c.close()
    assert error_of(response, 400, "messages")["code"] == "context_length_exceeded"
    assert max(latencies) < stall_bound, (stall_bound, latencies)


@pytest.fixture
def large_json(monkeypatch) -> list[bool]:
    """For each JSON text over 100 kB that this process writes from now on, whether it was written on
    an event loop's thread (where it stalls every client of the server) or elsewhere."""
    real = json.dumps

    def dumps(obj, *args, **kwargs):
        text = real(obj, *args, **kwargs)
        if len(text) > 100_000:
            try:
                asyncio.get_running_loop()
                on_loop.append(True)
            except RuntimeError:
                on_loop.append(False)
        return text

    on_loop = []
    monkeypatch.setattr(json, "dumps", dumps)
    return on_loop


@pytest.mark.parametrize("mode", ["whole", "stream", "background"])
def test_a_response_echoing_a_large_tool_schema_does_not_stall_others(url, mode, stall_bound, large_json):
    """A Responses object echoes the request's tools; a schema key harmony does not render costs no
    prompt tokens, so only the body cap bounds it. Every object that carries it is written on a worker
    thread (whole, streamed, queued in the background and then fetched). openai-harmony renders the
    schema holding Python's lock (on a worker thread, but every thread waits): twice that render is
    allowed too."""
    from openai_harmony import Message, Role, ToolDescription

    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "x-blob": [0] * 300_000}}
    body = json.dumps({"model": MODEL, "input": "Hi", "tools": [tool], "stream": mode == "stream",
                       "background": mode == "background"}).encode()  # before the window

    def render() -> float:
        t = time.perf_counter()
        tk.render_prompt([Message.from_role_and_content(Role.USER, "Hi")], vocab=VOCAB,
                         tools=[ToolDescription.new("f", "", tool["parameters"])])
        return time.perf_counter() - t

    def ask():
        answers = [c.send("POST", "/responses", raw=body)]
        if mode == "background":
            def ended():
                answers.append(c.send("GET", f"/responses/{json.loads(answers[0][2])['id']}"))
                return json.loads(answers[-1][2])["status"] not in ("queued", "in_progress")

            until(ended, "the background response ended", every=0.02)
        return answers

    bound = max(stall_bound, 2 * min(render() for _ in range(2)))
    large_json.clear()
    c = Connection(url)
    answers, latencies = while_health_is_polled(url, ask)
    c.close()
    assert all(status == 200 and len(payload) > 600_000 for status, _, payload in answers)
    assert len(large_json) >= {"whole": 1, "stream": 3, "background": 2}[mode], large_json
    assert not any(large_json), "a large response object was written on the event loop"
    assert max(latencies) < bound, (bound, latencies)


def test_a_long_prompts_tokens_are_written_off_the_event_loop(url, large_json):
    body = json.dumps({"prompt": "hello " * 100_000}).encode()
    large_json.clear()
    c = Connection(url)
    status, _, payload = c.send("POST", "/tokenize", raw=body)
    c.close()
    assert status == 200 and json.loads(payload)["count"] > 100_000
    assert large_json == [False]


def test_stop_strings_have_a_length_cap(conn):
    error = error_of(conn.send("POST", "/chat/completions", {"model": MODEL, "messages": HI,
                                                              "stop": ["x" * 100_000] * 4}), 400, "stop[0]")
    assert "1000" in error["message"]


def test_health_answers_while_long_stop_strings_are_checked(url, engine, stall_bound):
    engine.reply, engine.delay = text_tokens(400), 0.0
    stops = ["a" * 999 + "b", "a" * 998 + "c", " a" * 499 + "z", "q" * 1000]  # held back, never matched
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)

    def generate():
        return [client.completions.create(model=MODEL, prompt="x", max_tokens=400, stop=stops, stream=s)
                for s in (False, True)]

    (whole, stream), latencies = while_health_is_polled(url, generate)
    assert whole.choices[0].text == " a" * 400
    assert "".join(c.choices[0].text for c in stream) == " a" * 400
    assert max(latencies) < stall_bound, (stall_bound, latencies)


# 3. A client that leaves frees its slot at once ------------------------------------------------------

@pytest.fixture(scope="module")
def real():
    """The demo model's engine behind the app: slots are freed for real."""
    with demo_served(MODEL, slots=2, max_len=2048, max_waiting=8) as (engine, base, _):
        yield engine, base


def slots_in_use(url: str) -> int:
    c = Connection(url)
    _, _, text = c.send("GET", "/metrics")
    c.close()
    return int(float(next(line.split()[-1] for line in text.decode().splitlines()
                          if line.startswith("gptoss_kv_slots_in_use "))))


def open_request(url: str, stream: bool, max_tokens: int = 2000) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "stream": stream,
                       "ignore_eos": True}).encode()
    s = socket.create_connection((parts.hostname, parts.port))
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_frees_its_slot_within_a_few_steps(real, stream, stall_bound):
    """The slot is free within 50 of the engine's steps (timed here, as tokens come) and the stall bound
    after the client closes its connection: not at the end of its 2,000 tokens."""
    engine, url = real
    s = open_request(url, stream)
    until(lambda: engine.stats()["generated_tokens"] and slots_in_use(url), "the request is generating", 60)
    first = engine.stats()["generated_tokens"]
    t = time.perf_counter()
    until(lambda: engine.stats()["generated_tokens"] >= first + 10, "ten more tokens", 60, every=0.001)
    started = engine.stats()["generated_tokens"]  # left while tokens are coming, not in a pause
    step = (time.perf_counter() - t) / (started - first)
    s.close()
    gone = time.perf_counter()
    until(lambda: slots_in_use(url) == 0, "the slot was freed", 60)
    assert time.perf_counter() - gone < 50 * step + stall_bound, (time.perf_counter() - gone, step, stall_bound)
    assert engine.stats()["generated_tokens"] - started < 2000  # freed because the client left, not finished


@pytest.mark.slow
def test_a_waiting_request_cancelled_logs_nothing(real, caplog):
    engine, url = real
    with caplog.at_level(logging.WARNING):
        busy = [open_request(url, True) for _ in range(2)]  # both slots
        until(lambda: slots_in_use(url) == 2, "both slots are taken", every=0.02)
        waiting = open_request(url, False)
        until(lambda: engine.stats()["waiting"], "the third request waits", every=0.02)
        waiting.close()
        until(lambda: engine.stats()["waiting"] == 0, "the waiting request is gone", every=0.02)
        for s in busy:
            s.close()
        until(lambda: slots_in_use(url) == 0, "both slots are free", every=0.02)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()], caplog.text


# 4, 5. max_tokens null; --max-waiting 0 -------------------------------------------------------------------

def test_completions_max_tokens_null_is_the_default(url):
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=None, extra_body={"max_tokens": None})
    assert r.usage.completion_tokens == 16


@pytest.mark.slow
def test_max_waiting_0_serves_requests_that_find_a_free_slot():
    config = gj.ModelConfig.demo()
    engine = Engine(config, random_params(config, seed=0, dtype=jnp.float32),
                    EngineConfig(slots=2, max_len=64, prefill_chunk=16, max_waiting=0))
    first, second = (engine.submit([1, 2, 3], Settings(max_new_tokens=2)) for _ in range(2))
    with pytest.raises(QueueFull):
        engine.submit([1, 2, 3], Settings(max_new_tokens=2))
    engine.run_until_idle()
    assert first.finish_reason == second.finish_reason == "length"
    engine.submit([1], Settings(max_new_tokens=1))  # free again


def test_a_request_the_kv_cache_cannot_hold_alone_is_a_400():
    """A prompt and budget within the context but beyond what the whole pool of KV pages holds: 400,
    naming the pages, before anything runs (the engine's thread runs, nothing is compiled)."""
    config = gj.ModelConfig.demo()
    engine = Engine(config, random_params(config, seed=0, dtype=jnp.float32),
                    EngineConfig(slots=2, max_len=1024, prefill_chunk=64, page_size=64, pages=4))
    engine.start()
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL)
    server.ready.set()
    try:
        with serving(create_app(server)) as base:
            client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model=MODEL, prompt=list(range(300)), max_tokens=10)
            assert "pages of the KV cache" in e.value.body["message"], e.value.body
            assert engine.stats()["finished"] == {}  # nothing was queued
    finally:
        engine.stop()


# 7. A failure mid-stream ends the stream properly, without internals ------------------------------------------

def sse_lines(url: str, path: str, body: dict) -> list[str]:
    c = Connection(url)
    status, _, payload = c.send("POST", path, body)
    c.close()
    assert status == 200, payload
    return [line for line in payload.decode().splitlines() if line]


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"messages": HI}),
    ("/completions", {"prompt": "x"}),
])
def test_a_failure_mid_stream_sends_an_error_and_done(url, engine, caplog, path, body):
    engine.fail_after = 3
    with caplog.at_level(logging.ERROR, logger="gptoss_jax.server"):
        lines = sse_lines(url, path, {"model": MODEL, "stream": True, **body})
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert error["type"] == "server_error" and "request id" in error["message"]
    assert "CUDA" not in error["message"] and "secret" not in error["message"]
    assert ScriptedEngine.FAILURE in caplog.text  # the details, in the log
    # and the openai client raises it
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="request id"):
        if path == "/completions":
            list(client.completions.create(model=MODEL, prompt="x", stream=True))
        else:
            list(client.chat.completions.create(model=MODEL, messages=HI, stream=True))


def test_a_failed_response_stream_and_plain_requests(url, engine, conn):
    engine.fail_after = 3
    lines = sse_lines(url, "/responses", {"model": MODEL, "input": "Hi", "stream": True})
    events = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and "CUDA" not in json.dumps(events[-2:])
    for path, body in (("/chat/completions", {"messages": HI}), ("/completions", {"prompt": "x"}),
                       ("/responses", {"input": "Hi"})):
        error = error_of(conn.send("POST", path, {"model": MODEL, **body}), 500)
        assert "request id" in error["message"] and "CUDA" not in error["message"]


# 8. Requests cut at the end of the grace period end properly -----------------------------------------------

def test_cut_all_ends_every_stream_with_a_last_chunk(url, server, engine):
    engine.reply, engine.delay = text_tokens(400), 0.02  # 8 s of tokens
    results = {}

    def run(i, path, body):
        results[i] = sse_lines(url, path, {"model": MODEL, "stream": True, **body}) if body.get("stream", True) \
            else None

    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    plain = {}
    threads = [threading.Thread(target=run, args=(i, path, body)) for i, (path, body) in enumerate(
        [("/chat/completions", {"messages": HI}), ("/completions", {"prompt": "x"}), ("/responses", {"input": "Hi"})])]
    threads.append(threading.Thread(target=lambda: plain.setdefault(
        "r", client.completions.create(model=MODEL, prompt="x", max_tokens=400))))
    for t in threads:
        t.start()
    until(lambda: len(server.running) == len(engine.running) == 4
          and all(len(r.output_ids) >= 2 for r in engine.running), "four requests have their first tokens")
    server.cut_all()
    for t in threads:
        t.join(5)
    chat, completion, response = results[0], results[1], results[2]
    for lines in (chat, completion):
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["choices"][0]["finish_reason"] == "length"
    assert json.loads(response[-1][len("data: "):])["type"] == "response.incomplete"
    assert plain["r"].choices[0].finish_reason == "length" and 0 < plain["r"].usage.completion_tokens < 400
    # a request whose body was still being read or prepared when the grace ran out starts nothing
    response = Connection(url).send("POST", "/completions", {"model": MODEL, "prompt": "x"})
    assert error_of(response, 503)["code"] == "service_unavailable" and not server.running


# 10. What a browser's requests meet ---------------------------------------------------------------------

def test_a_body_must_be_sent_as_json(conn):
    error_of(conn.send("POST", "/chat/completions", {"model": MODEL, "messages": HI},
                       headers={"Content-Type": "text/plain"}), 415)
    assert conn.send("POST", "/chat/completions", {"model": MODEL, "messages": HI, "max_tokens": 2},
                     headers={"Content-Type": "application/json; charset=utf-8"})[0] == 200


def test_only_loopback_hosts_are_accepted_while_on_loopback(engine):
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL, api_key="Key",
                    limits=Limits(allowed_hosts=("localhost", "127.0.0.1", "::1")))
    server.ready.set()
    with serving(create_app(server)) as base:
        c = Connection(base)
        for host in ("evil.example", "evil.example:8000", "127.0.0.1.evil.example"):
            error_of(c.send("GET", "/health", headers={"Host": host}), 400)
        for host in ("localhost:8000", "127.0.0.1", "[::1]:1234", "LOCALHOST"):
            assert c.send("GET", "/health", headers={"Host": host})[0] == 200
        # the key's scheme is case-insensitive (RFC 7235); the key itself is not
        assert c.send("GET", "/models", headers={"Authorization": "bearer Key"})[0] == 200
        assert c.send("GET", "/models", headers={"Authorization": "BEARER Key"})[0] == 200
        error_of(c.send("GET", "/models", headers={"Authorization": "Bearer key"}), 401)
        c.close()


def test_429_and_503_say_when_to_retry(conn, engine, server):
    engine.full = True
    response = conn.send("POST", "/chat/completions", {"model": MODEL, "messages": HI})
    error_of(response, 429)
    assert int(response[1]["retry-after"]) >= 1
    engine.full = False
    server.ready.clear()
    response = conn.send("GET", "/health")
    error_of(response, 503)
    assert int(response[1]["retry-after"]) >= 1


# 11. /health when the engine has stopped -----------------------------------------------------------------

@pytest.mark.slow
def test_health_is_503_once_the_engines_thread_has_stopped(monkeypatch):
    config = gj.ModelConfig.demo()
    engine = Engine(config, random_params(config, seed=0, dtype=jnp.float32),
                    EngineConfig(slots=1, max_len=64, prefill_chunk=16), tokenizer=tk.load_tokenizer(VOCAB))
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL)
    server.ready.set()
    engine.start()
    with serving(create_app(server)) as base:
        c = Connection(base)
        assert c.send("GET", "/health")[0] == 200

        def lost():
            raise LockstepError("process 1 is gone")

        monkeypatch.setattr(engine, "step", lost)
        engine.submit([1, 2], Settings(max_new_tokens=1))  # the next step ends the engine's thread
        until(lambda: not engine.alive, "the engine's thread ended")
        error_of(c.send("GET", "/health"), 503)
        error_of(c.send("POST", "/chat/completions", {"model": MODEL, "messages": HI}), 503)
        c.close()
    engine.stop()


# 4. One bad request harms only itself ----------------------------------------------------------------

@pytest.mark.slow
def test_six_streams_finish_normally_beside_a_request_the_engine_cannot_hold(real):
    """The attack that once ended every stream in flight (a top_k past int32 raised inside the engine's
    step, which ended every running request): now a 400 at the door on every endpoint, sent once all
    six streams have their first chunk, and the six finish with all their tokens. (The engine's side,
    a row whose settings raise in the step, is tests/test_serving.py's.)"""
    engine, url = real
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    results, started = [None] * 6, threading.Barrier(7, timeout=120)

    def victim(i):
        stream = client.completions.create(model=MODEL, prompt=f"Victim {i}", max_tokens=24, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        started.wait()
        chunks += list(stream)
        results[i] = ("".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].choices[0].finish_reason)

    threads = [threading.Thread(target=victim, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    started.wait()  # every stream has begun (two generate, four wait for a slot)
    c = Connection(url)
    for path, body in (("/chat/completions", {"model": MODEL, "messages": HI}),
                       ("/completions", {"model": MODEL, "prompt": "x"}), ("/responses", {"model": MODEL, "input": "x"})):
        error_of(c.send("POST", path, {**body, "top_k": 2147483648, "max_tokens" if path != "/responses" else
                                       "max_output_tokens": 4}), 400, "top_k")
    c.close()
    for t in threads:
        t.join(120)
    assert all(r is not None and r[1] == "length" for r in results), results
    assert engine.stats()["finished"].get("error", 0) == 0


def test_the_stored_responses_are_bounded_in_bytes_and_metrics_say_how_many(engine):
    """Responses echoing 1 MB of tools each, under a 3 MiB store: the oldest are forgotten (404) as the
    newest come, /metrics reports the bytes held, and a text.format's unknown keys are not echoed."""
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL,
                    limits=Limits(max_body_bytes=4 * 2**20, stored_bytes=3 * 2**20))
    server.ready.set()
    tools = [{"type": "function", "name": "f", "description": "d" * 2**20}]
    with serving(create_app(server)) as base:
        c = Connection(base)
        ids = []
        for _ in range(6):
            status, _, payload = c.send("POST", "/responses", {
                "model": MODEL, "input": "Hi", "tools": tools, "tool_choice": "none", "max_output_tokens": 1,
                "text": {"format": {"type": "text", "junk": "j" * 1000}}})
            assert status == 200, payload
            ids.append(json.loads(payload)["id"])
            assert "junk" not in json.loads(payload)["text"]["format"]
        kept = [c.send("GET", f"/responses/{i}")[0] for i in ids]
        _, _, metrics = c.send("GET", "/metrics")
        c.close()
    held = {line.split()[0]: float(line.split()[1]) for line in metrics.decode().splitlines()
            if line.startswith("gptoss_stored_response")}
    assert kept == [404] * 4 + [200] * 2, kept
    assert held["gptoss_stored_responses"] == 2 and 2 * 2**20 < held["gptoss_stored_response_bytes"] <= 3 * 2**20


def test_a_client_that_leaves_mid_body_is_one_line_in_the_log(url, caplog):
    parts = urllib.parse.urlsplit(url)
    logged = threading.Event()

    class Seen(logging.Handler):
        def emit(self, record):
            if "the client left" in record.getMessage():
                logged.set()

    seen = Seen()
    logging.getLogger("gptoss_jax.server").addHandler(seen)
    try:
        with caplog.at_level("INFO", "gptoss_jax.server"):
            s = socket.create_connection((parts.hostname, parts.port))
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: "
                      f"application/json\r\nContent-Length: 1000\r\n\r\n".encode() + b'{"model": ')
            s.close()  # 990 bytes short
            assert logged.wait(10), caplog.text
    finally:
        logging.getLogger("gptoss_jax.server").removeHandler(seen)
    assert "the client left before its request's body was read" in caplog.text
    assert not [r for r in caplog.records if r.name.startswith("gptoss_jax.server") and r.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text


WORD = "a" * 200_000  # one unbroken word: openai-harmony took 11 to 29 s to render it, holding Python's lock


@pytest.mark.parametrize("path, body, status, param", [
    ("/chat/completions", {"messages": [{"role": "user", "content": WORD}]}, 200, None),
    ("/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {WORD: {"type": "string"}}}}}]}, 400, "tools"),
    ("/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "description": WORD}}], "tool_choice": "required"}, 400, "tools"),
    ("/chat/completions", {"messages": [{"role": "system", "content": WORD}, *HI]}, 200, None),
    ("/responses", {"input": [{"type": "message", "role": "user", "content": WORD}],
                    "instructions": WORD, "max_output_tokens": 4}, 200, None),
], ids=["content", "parameter key", "description, forced call", "system message", "responses"])
def test_a_long_word_is_answered_without_stalling_others(url, server, monkeypatch, stall_bound, path, body, status,
                                                         param):
    """Long unbroken words where a client may put them, on a context that holds them (131,072 tokens, as
    the real models'): message texts and instructions are tokenized by tiktoken in place of
    openai-harmony (no quadratic work, the lock let go), and words too long for openai-harmony to
    render in bounded time in the tools are a 400 before it renders anything."""
    monkeypatch.setattr(server.engine, "max_len", 131_072)
    c = Connection(url)
    response, latencies = while_health_is_polled(
        url, lambda: c.send("POST", path, {"model": MODEL, **({"max_tokens": 4} if "messages" in body else {}),
                                           **body}))
    c.close()
    if status == 400:
        error_of(response, 400, param)
    else:
        assert response[0] == 200, response[2][:300]
    assert max(latencies) < stall_bound, (stall_bound, latencies)


def test_names_the_model_wrote_are_taken_back_and_a_stored_response_continued(conn):
    """A tool call's name in an earlier turn is what a reply said, which the model wrote: only its length
    is bounded (a dotted name is taken); a stored response is continued whatever its items hold, and
    a continuation its input cannot make is a 400 naming previous_response_id, never a 500."""
    status, _, _ = conn.send("POST", "/chat/completions", {"model": MODEL, "max_tokens": 2, "messages": [
        *HI, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "a.b", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "{}"}]})
    assert status == 200
    status, _, payload = conn.send("POST", "/responses", {"model": MODEL, "input": [
        {"type": "function_call", "call_id": "c", "name": "a.b"}, {"type": "function_call_output", "call_id": "c"}],
        "max_output_tokens": 2})
    assert status == 200, payload
    first = json.loads(payload)["id"]
    status, _, payload = conn.send("POST", "/responses", {"model": MODEL, "input": "More", "max_output_tokens": 2,
                                                          "previous_response_id": first})
    assert status == 200, payload
