"""Random and invalid requests for every endpoint, the server over a stand-in engine: whatever comes,
the answer is below 500, every error has OpenAI's shape, and the connection stays open for the next
request.

Two sources of requests:
- schemathesis, from the app's own OpenAPI description (GET /openapi.json): valid and invalid bodies
  (wrong types, missing fields, out-of-range numbers), every operation;
- a hypothesis strategy of arbitrary JSON grafted onto valid bodies of each POST endpoint: any value
  anywhere (lone surrogates, special tokens, nesting thousands deep, numbers too large to read), what
  schemathesis does not send;
- a list of odd requests: bodies that are not JSON objects, missing or wrong keys, methods and paths
  that do not exist.

Every request goes down one kept-alive connection that never reconnects by itself: a server that
closes it after an answer fails the case that caused it (each case is followed by GET /health on the
same connection). The server has an API key, so the key check is on every request's path. The run is
bounded (a fixed number of examples, a fixed seed, no example database), about a minute on 2 cores.
"""

from __future__ import annotations

import copy
import http.client
import json
import re
from urllib.parse import urlsplit

import pytest
import requests
import schemathesis
from conftest import VOCAB, needs_vocab
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import ScriptedEngine, serving
from starlette.routing import Route

from gptoss_jax import tokenizer as tk
from gptoss_jax.server.app import Server, create_app

pytestmark = needs_vocab
MODEL, KEY = "gpt-oss-test", "k"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
# Bounded and repeatable: fixed seeds, no example database (CI keeps no state between runs).
BOUNDED = dict(deadline=None, derandomize=True, database=None, print_blob=False,
               suppress_health_check=list(HealthCheck))


# The server and one connection to it -------------------------------------------------------------------

class Dropped(AssertionError):
    """The server closed the kept-alive connection."""


class Connection:
    """One HTTP/1.1 connection kept alive across requests. It never reconnects silently (http.client's
    auto_open is off): a connection the server closed fails the request that finds it closed, and only
    then is a new one opened, for the next case."""

    def __init__(self, base: str):
        url = urlsplit(base)
        self.host, self.port = url.hostname, url.port
        self.http = None

    def send(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """-> (status, content type, body bytes); Dropped if the connection failed or is closing."""
        if self.http is None:
            self.http = http.client.HTTPConnection(self.host, self.port, timeout=30)
            self.http.connect()
            self.http.auto_open = 0
        try:
            self.http.request(method, path, body=body, headers=headers or {})
            response = self.http.getresponse()
            data = response.read()
        except (http.client.HTTPException, OSError) as e:
            self.close()
            raise Dropped(f"{method} {path}: the connection failed: {type(e).__name__}: {e}") from None
        if self.http.sock is None:  # the answer said `Connection: close`
            self.close()
            raise Dropped(f"{method} {path}: the server closed the connection after answering {response.status}")
        return response.status, response.getheader("content-type", ""), data

    def close(self):
        if self.http is not None:
            self.http.close()
            self.http = None


REPLY = ("<|channel|>analysis<|message|>Thinking.<|end|><|start|>assistant<|channel|>final<|message|>Hello "
         "there!<|return|>")


@pytest.fixture(scope="module")
def app():
    engine = ScriptedEngine(tk.load_tokenizer(VOCAB).encode(REPLY, allowed_special="all"), max_len=4096)
    server = Server(engine, tk.load_tokenizer(VOCAB), VOCAB, model_name=MODEL, api_key=KEY)
    server.ready.set()
    return create_app(server)


@pytest.fixture(scope="module")
def wire(app):
    # Idle connections are closed after uvicorn's keep-alive time (5 s): a slow machine can spend that
    # long preparing the next case, which is not what this test is about.
    with serving(app, keep_alive=600) as base:
        connection = Connection(base)
        yield connection
        connection.close()


class Failure(AssertionError):
    """A case the server got wrong. Hypothesis tells failures apart by their exception type, so each kind
    (a 5xx by the exception it names, a closed connection, an error body of another shape, a stream
    that did not end) is a class of its own: a run reports every kind it found, not only the first."""

    kinds: dict[str, type[Failure]] = {}

    @classmethod
    def of(cls, kind: str) -> type[Failure]:
        name = re.sub(r"\W+", "_", kind).strip("_")
        return cls.kinds.setdefault(name, type(f"Failure_{name}", (cls,), {}))


def is_openai_error(data: bytes) -> bool:
    try:
        error = json.loads(data)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return (isinstance(error, dict) and set(error) >= {"message", "type", "param", "code"}
            and isinstance(error["message"], str) and isinstance(error["type"], str)
            and all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")))


def ended(path: str, stream: bytes) -> bool:
    """Whether a stream ends as it should: `data: [DONE]`, or for the Responses API an event that ends
    the response."""
    if path != "/v1/responses":
        return stream.endswith(b"data: [DONE]\n\n")
    last = re.findall(rb"^event: (\S+)", stream, re.MULTILINE)[-1:]
    return last in ([b"response.completed"], [b"response.incomplete"], [b"response.failed"], [b"error"])


def check(wire: Connection, method: str, path: str, answer, sent: object = None) -> None:
    """No 5xx; an OpenAI-shaped error for any 4xx; a stream ends; the connection still serves (GET /health
    on it, whatever else is wrong, so that a closed connection is blamed on the request that closed it).
    `sent` is shown in the messages (schemathesis keeps Hypothesis from printing failing examples)."""
    status, kind, data = answer
    what = f"{method} {path}{'' if sent is None else ' ' + str(sent)[:1000]} -> {status}: {data[:300]!r}"
    try:
        wire.send("GET", "/health")
        dropped = ""
    except Dropped as e:
        dropped = f"; then {e}"
    if status >= 500:
        named = re.match(r'\{"error":\{"message":"(\w+(Error|Exception))\b', data.decode(errors="replace"))
        failure = Failure.of(f"{status} {named.group(1) if named else ''}")(what + dropped)
    elif dropped:
        failure = Failure.of("closed connection")(what + dropped)
    elif status >= 400 and not is_openai_error(data):
        failure = Failure.of(f"{status} not an OpenAI error")(f"not an OpenAI error body: {what}")
    elif status < 300 and kind.startswith("text/event-stream") and not ended(path, data):
        failure = Failure.of("stream not ended")(f"the stream did not end: {what} ... {data[-300:]!r}")
    else:
        return
    wire.close()  # the next case starts on a connection of its own
    raise failure


# schemathesis, from the app's OpenAPI description ------------------------------------------------------

def test_the_description_is_served_and_covers_every_route(app, wire):
    description = app.openapi()
    status, _, data = wire.send("GET", "/openapi.json", None, AUTH)
    assert status == 200 and json.loads(data) == description
    routes = {(route.path_format, method.lower()) for route in app.routes
              if isinstance(route, Route) and route.include_in_schema for method in route.methods - {"HEAD"}}
    assert {(path, method) for path, operations in description["paths"].items() for method in operations} == routes
    for path in POSTS:
        body = description["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].rpartition("/")[2] in description["components"]["schemas"]
    refs = re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(description))
    assert refs and set(refs) <= set(description["components"]["schemas"])


CONFIG = schemathesis.Config.from_dict({
    "seed": 44,
    "generation": {"mode": "all", "max-examples": 50, "with-security-parameters": False},
    # Methods an endpoint does not have are tried in test_odd_requests: here their first 405 would end
    # the run before any body is tried.
    "phases": {"coverage": {"unexpected-methods": []}},
})


@pytest.fixture
def api_schema(app):
    description = copy.deepcopy(app.openapi())
    # A valid body names the served model (others are refused with 404 before anything else is read);
    # invalid ones still get every other string.
    for schema in description["components"]["schemas"].values():
        if schema.get("properties", {}).get("model", {}).get("type") == "string":
            schema["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    return schemathesis.openapi.from_dict(description, config=CONFIG)


fuzz = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.slow
@fuzz.parametrize()
@settings(max_examples=50, **BOUNDED)
def test_schema_cases(case, wire):
    sent = requests.Request(**case.as_transport_kwargs(base_url="http://127.0.0.1")).prepare()
    url = urlsplit(sent.url)
    path = url.path + (f"?{url.query}" if url.query else "")
    headers = {**{k: v for k, v in sent.headers.items() if k.lower() != "authorization"},
               "Authorization": f"Bearer {KEY}"}
    body = sent.body.encode() if isinstance(sent.body, str) else sent.body
    check(wire, sent.method, path, wire.send(sent.method, path, body, headers), body)


# Arbitrary JSON grafted onto valid bodies --------------------------------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "description": "A tool",
                                         "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
# Valid bodies, each small and showing a few features, so that a change lands on each part often.
VALID = {
    "/v1/chat/completions": [
        CHAT,
        {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
        {"model": MODEL, "messages": [
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": None, "reasoning_content": "Need f.",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "{}"}], "tools": [TOOL]},
        {**CHAT, "max_tokens": 8, "stop": ["x", "y"], "temperature": 0.5, "top_p": 0.9, "seed": 1,
         "reasoning_effort": "low", "stream": True, "stream_options": {"include_usage": True}},
    ],
    "/v1/completions": [
        {"model": MODEL, "prompt": "Hi"},
        {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8, "stop": "x", "stream": True,
         "stream_options": {"include_usage": True}, "ignore_eos": True},
    ],
    "/v1/responses": [
        {"model": MODEL, "input": "Hi"},
        {"model": MODEL, "input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                                   {"type": "function_call_output", "call_id": "c1", "output": "{}"}]},
        {"model": MODEL, "instructions": "Be brief.", "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Need f."}]},
            {"role": "assistant", "content": "Hello."}]},
        {"model": MODEL, "input": "Hi", "tools": [{"type": "function", **TOOL["function"]}],
         "tool_choice": {"type": "function", "name": "f"}, "reasoning": {"effort": "low"}, "max_output_tokens": 8,
         "stream": True},
    ],
}

# JSON text that json.dumps cannot write, by the name a failing example shows: placed as a marker
# string, swapped in after dumping.
RAW = {"<100000 nested [>": "[" * 100_000 + "]" * 100_000, "<5000 nested {>": '{"a":' * 5000 + "1" + "}" * 5000,
       "<5000 nested [ in {>": '{"a":' + "[" * 5000 + "]" * 5000 + "}",
       "<5000 digits>": "9" * 5000, "<1e400>": "1" + "0" * 400, "<1e999>": "1e999", "<-1e999>": "-1e999",
       "<NaN>": "NaN", "<Infinity>": "Infinity"}


class Body:
    """A request body (`raw`) that prints short in a failing example: the long parts by name."""

    def __init__(self, data):
        self.data = data
        text = json.dumps(data)
        for name, raw in RAW.items():
            text = text.replace(json.dumps(name), raw)
        self.raw = text.encode()

    def __repr__(self):
        shown = json.dumps(self.data)
        return f"Body({shown[:2000]}{'...' if len(shown) > 2000 else ''})"


def words(description: dict) -> list[str]:
    """The names and fixed values the description uses, and those the endpoints read beyond it."""
    found = {"type", "function", "name", "arguments", "call_id", "output", "role", "content", "text", "summary",
             "message", "reasoning", "function_call", "function_call_output", "input_text", "output_text",
             "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>",
             "<|endoftext|>", "analysis", "final", "commentary", MODEL}

    def walk(node):
        if isinstance(node, dict):
            found.update(node.get("properties", {}))
            found.update(v for v in node.get("enum", []) if isinstance(v, str))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(description["components"]["schemas"])
    return sorted(found)


def bodies(path: str, vocabulary: list[str]) -> st.SearchStrategy[Body]:
    """A valid body of `path` changed in one or two places: a value replaced by arbitrary JSON, odd text
    put into a string, a key deleted or added, a value nested thousands deep or a number too large; the
    whole body is one of the places."""
    chars = st.characters() | st.characters(categories=["Cs"])  # lone surrogates too
    texts = st.lists(st.sampled_from(vocabulary) | st.text(chars, max_size=8), max_size=4).map("".join)
    numbers = st.integers() | st.sampled_from([0, -1, 2**31, -2**63, 2**64]) | st.floats()
    values = st.recursive(st.none() | st.booleans() | numbers | texts,
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
                          max_leaves=8)

    @st.composite
    def body(draw):
        data = copy.deepcopy(draw(st.sampled_from(VALID[path])))
        for _ in range(draw(st.integers(1, 2))):
            where = draw(st.sampled_from(list(places(data))))
            action = draw(st.sampled_from(["replace", "text", "delete", "add", "raw"]))
            if not where:
                data = draw(st.sampled_from(list(RAW))) if action == "raw" else draw(values)
                continue
            parent = data
            for key in where[:-1]:
                parent = parent[key]
            old = parent[where[-1]]
            if action == "delete":
                del parent[where[-1]]
            elif action == "add" and isinstance(old, (dict, list)):
                value = draw(values)
                if isinstance(old, dict):
                    old[draw(texts)] = value
                else:
                    old.append(value)
            elif action == "text":
                parent[where[-1]] = draw(texts) + (old if isinstance(old, str) else "") + draw(texts)
            elif action == "raw":
                parent[where[-1]] = draw(st.sampled_from(list(RAW)))
            else:
                parent[where[-1]] = draw(values)
        return Body(data)

    return body()


def places(data, where=()):
    """Every path into a JSON value, the root () first."""
    yield where
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        yield from places(value, (*where, key))


@pytest.mark.parametrize("path", POSTS)
def test_arbitrary_json(path, app, wire):
    vocabulary = words(app.openapi())

    @settings(max_examples=300, **BOUNDED)
    @given(body=bodies(path, vocabulary))
    def run(body):
        check(wire, "POST", path, wire.send("POST", path, body.raw, AUTH), body)

    run()


def odd_requests():
    """(method, path, body, headers) as pytest params: bodies that are not a JSON object; no key, a wrong
    one, one of odd bytes; methods the endpoints do not have; paths that do not exist."""
    bodies = {"empty": b"", "cut": b"{", "utf-16": "{}".encode("utf-16"), "null": b"null", "list": b"[]",
              "string": b'"x"', "bom": "\ufeff{}".encode(), "two objects": b"{}{}", "nul": b"\x00"}
    keys = {"no key": {}, "wrong key": {"Authorization": "Bearer wrong"}, "basic": {"Authorization": "Basic " + KEY},
            "latin-1 key": {"Authorization": f"Bearer {KEY}\xe9"}}
    for path in POSTS:
        good = json.dumps(VALID[path][0]).encode()
        for name, body in bodies.items():
            yield pytest.param("POST", path, body, AUTH, id=f"{path} {name}")
        for name, key in keys.items():
            yield pytest.param("POST", path, good, {"Content-Type": "application/json", **key}, id=f"{path} {name}")
        for method in ("GET", "PUT", "DELETE"):
            yield pytest.param(method, path, good if method != "GET" else None, AUTH, id=f"{method} {path}")
    yield pytest.param("POST", "/v1/health", b"{}", AUTH, id="POST /v1/health")
    yield pytest.param("GET", "/v2/models", None, AUTH, id="GET /v2/models")


@pytest.mark.parametrize("method, path, body, headers", odd_requests())
def test_odd_requests(method, path, body, headers, wire):
    check(wire, method, path, wire.send(method, path, body, headers), (body, headers))
