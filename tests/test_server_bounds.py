"""A property of the whole request models: whatever a client puts in any field, its request harms only
itself. Over the demo model's real engine (so that a value reaching the engine's steps would show),
bodies of every POST endpoint get every integer field drawn from -2^63 to 2^63, every string field
an unbroken word of up to 1 MB, and objects keys of no declared name and declared keys values of
other types. Meanwhile requests of other clients stream beside them, and /health is polled:

- no answer is a 5xx, every error has OpenAI's shape;
- every request beside them finishes with all its tokens, none with an error (the engine ends none);
- /health answers within the stall bound of the stall tests (test_server_hardening.py: about 0.25 s
  on a 2-core machine), so no request holds the event loop.

Bounded and repeatable: a fixed number of examples, derandomized, no example database.
"""

from __future__ import annotations

import copy
import gc
import json
import threading

import openai
import pytest
from conftest import needs_vocab
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_util import demo_served, health_latencies, stall_bound_here
from test_server_fuzz import VALID, Connection, is_openai_error, places

from gptoss_jax.server.cli import freeze_start_up_heap

pytestmark = [needs_vocab, pytest.mark.optimized]  # many steps of the demo model: tests/conftest.py
MODEL = "gpt-oss-test"  # (the name VALID's bodies use)
POSTS = tuple(VALID)
EDGES = [-2**63, -2**63 + 1, -2**31 - 1, -2**31, -1, 0, 1, 2, 20, 21, 128, 129, 201087, 201088, 201089,
         131072, 131073, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63]
WORD_LENGTHS = [0, 1, 64, 65, 255, 256, 1000, 10_000, 100_000, 1_000_000]
BUDGET = {"/v1/chat/completions": "max_tokens", "/v1/completions": "max_tokens", "/v1/responses": "max_output_tokens"}


@pytest.fixture(scope="module")
def stall_bound() -> float:
    return stall_bound_here()


@pytest.fixture(scope="module")
def served():
    """The demo model's engine (4 slots, a context of 512: a reply left at its default budget stays
    short) behind the app -> (engine, base URL, the app's OpenAPI description)."""
    with demo_served(MODEL, slots=4, max_len=512, max_waiting=64, keep_alive=600) as (engine, base, app):
        yield engine, base, app.openapi()


def fields(description: dict, path: str) -> dict[str, set[str]]:
    """The top-level fields of an endpoint's body by JSON type ("integer", "string"), from the OpenAPI
    description (protocol.py's models)."""
    body = description["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schemas = description["components"]["schemas"]
    out: dict[str, set[str]] = {"integer": set(), "string": set()}
    for name, prop in schemas[body["$ref"].rpartition("/")[2]]["properties"].items():
        for kind in [prop.get("type")] + [p.get("type") for p in prop.get("anyOf", [])]:
            if kind in out:
                out[kind].add(name)
    return out


def bodies(path: str, description: dict) -> st.SearchStrategy[dict]:
    """A valid body of `path` with one to three changes: an integer field (declared or in the body) set
    to an integer in [-2^63, 2^63], a string field set to an unbroken word of up to 1 MB, an object
    given a key of no declared name or a declared key a value of another type."""
    declared = fields(description, path)
    integers = st.sampled_from(EDGES) | st.integers(-2**63, 2**63)
    words = st.sampled_from(WORD_LENGTHS).map(lambda n: "a" * n)
    others = st.sampled_from([None, True, 1.5, -1, [], {}, [1, "x"], {"a": 1}, "x" * 70])
    odd_keys = st.sampled_from(["0", "", "-1", "__proto__", "x" * 1000, "\u00b2", "model ", "type"])

    @st.composite
    def body(draw):
        data = copy.deepcopy(draw(st.sampled_from(VALID[path])))
        data[BUDGET[path]] = 4  # (unless changed below) the reply short: the model is real
        for _ in range(draw(st.integers(1, 3))):
            action = draw(st.sampled_from(["integer field", "string field", "leaf", "odd key", "other type"]))
            if action == "integer field":
                data[draw(st.sampled_from(sorted(declared["integer"])))] = draw(integers)
            elif action == "string field":
                data[draw(st.sampled_from(sorted(declared["string"])))] = draw(words)
            else:
                where = draw(st.sampled_from(list(places(data))[1:]))
                parent = data
                for key in where[:-1]:
                    parent = parent[key]
                old = parent[where[-1]]
                if action == "leaf" and isinstance(old, bool):
                    continue
                if action == "leaf" and isinstance(old, int):
                    parent[where[-1]] = draw(integers)
                elif action == "leaf" and isinstance(old, str):
                    parent[where[-1]] = draw(words)
                elif action == "odd key" and isinstance(old, dict):
                    old[draw(odd_keys)] = copy.deepcopy(draw(others | integers | words))
                elif action == "other type":
                    parent[where[-1]] = copy.deepcopy(draw(others))
        return data

    return body()


class Beside:
    """Other clients' requests, one after another on a thread until `stop`: streamed completions of 24
    tokens, each of which must end with finish_reason "length" and all its tokens."""

    def __init__(self, base: str):
        self.client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0)
        self.results: list[tuple[int, str | None]] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        while not self.done.is_set():
            try:
                chunks = list(self.client.completions.create(model=MODEL, prompt="Beside", max_tokens=24, stream=True,
                                                             stream_options={"include_usage": True},
                                                             extra_body={"ignore_eos": True}))
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                self.results.append((chunks[-1].usage.completion_tokens, finish[-1] if finish else None))
            except Exception as e:  # noqa: BLE001 -- told in the test's assertion
                self.results.append((0, f"{type(e).__name__}: {e}"))

    def stop(self) -> list[tuple[int, str | None]]:
        self.done.set()
        self.thread.join(120)
        return self.results


class Watched:
    """Requests sent down one kept-alive connection while other clients' requests run (`Beside`) and
    /health is polled; `check()` at the end: no 5xx and OpenAI-shaped errors, every request beside
    them whole, no request ended by the engine with an error, /health within the stall bound."""

    def __init__(self, served, stall_bound: float):
        self.engine, base, self.description = served
        self.stall_bound = stall_bound
        self.wire = Connection(base.removesuffix("/v1"))
        self.failures: list[str] = []
        self.sent = 0
        freeze_start_up_heap()  # as gptoss-serve does once ready (a full collection would pause every thread)
        self.polling = threading.Event()
        self.latencies: list[float] = []
        self.poller = threading.Thread(target=health_latencies, args=(base, self.polling, self.latencies))
        self.errors_before = self.engine.stats()["finished"].get("error", 0)
        self.beside = Beside(base)
        self.poller.start()

    def send(self, path: str, body: dict) -> None:
        status, _, data = self.wire.send("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        self.sent += 1
        if status >= 500 or (status >= 400 and not is_openai_error(data)):
            self.failures.append(f"{path} {str(body)[:300]} -> {status}: {data[:300]!r}")

    def check(self) -> None:
        self.polling.set()
        self.poller.join()
        results = self.beside.stop()
        self.wire.close()
        gc.unfreeze()
        assert not self.failures, self.failures[:5]
        assert results and all(r == (24, "length") for r in results), results
        assert self.engine.stats()["finished"].get("error", 0) == self.errors_before
        assert max(self.latencies) < self.stall_bound, (self.stall_bound, sorted(self.latencies)[-5:])


@pytest.mark.slow
@pytest.mark.parametrize("path", POSTS)
def test_every_field_at_its_edges_harms_no_other_request(path, served, stall_bound):
    """Each declared integer field of the body at -2^63, -2^31 - 1, 2^31, the vocabulary, 2^63; each
    string field an unbroken word of 1 MB."""
    watched = Watched(served, stall_bound)
    declared = fields(watched.description, path)
    try:
        for name in sorted(declared["integer"]):
            for value in (-2**63, -2**31 - 1, 2**31, 201088, 2**63):
                watched.send(path, {**VALID[path][0], BUDGET[path]: 4, name: value})
        for name in sorted(declared["string"]):
            watched.send(path, {**VALID[path][0], BUDGET[path]: 4, name: "a" * 1_000_000})
    finally:
        watched.check()
    assert watched.sent >= 5 * len(declared["integer"]) and "top_k" in declared["integer"]


@pytest.mark.slow
@pytest.mark.parametrize("path", POSTS)
def test_no_value_in_any_field_harms_another_request_or_stalls_the_server(path, served, stall_bound):
    watched = Watched(served, stall_bound)

    @settings(max_examples=100, deadline=None, derandomize=True, database=None, print_blob=False,
              suppress_health_check=list(HealthCheck))
    @given(body=bodies(path, watched.description))
    def run(body):
        watched.send(path, body)

    try:
        run()
    finally:
        watched.check()
