"""`gptoss-serve` as a process, on the demo model (127.0.0.1 only): its port taken before anything
loads, its exit status at every stage (warm-up, idle, streams running, a failed warm-up), the
streams still running when --grace ends, and the network's limits (silent and slow clients, too
many connections). The transport's limits are also tested alone, without a model, for each of
uvicorn's HTTP implementations installed (server/transport.py)."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from conftest import VOCAB, needs_vocab, until
from gptoss_jax.server import cli

ENV = {**os.environ, "TIKTOKEN_ENCODINGS_BASE": os.path.dirname(os.path.abspath(VOCAB))}
LIFETIME = 240  # seconds: a server process still running then is killed, whatever the test does
MODEL = "gpt-oss-demo"
GRACE_MARGIN = 5  # seconds the server's shutdown waits beyond --grace (transport.GRACE_MARGIN)


class Process:
    """A started server process: its standard error read as it comes (so it never blocks), its ready
    line, and a watchdog that kills it after LIFETIME seconds."""

    def __init__(self, *flags: str, code: str | None = None):
        argv = ["-c", code, *flags] if code else ["-m", "gptoss_jax.server", *flags]
        self.process = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, env=ENV)
        self.lines: list[str | None] = []  # None: the end
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self._watchdog = threading.Timer(LIFETIME, self.process.kill)
        self._watchdog.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append(None)
            self._changed.notify_all()

    @property
    def stderr(self) -> str:
        return "\n".join(line for line in self.lines if line is not None)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        """Until a line of standard error contains `text`."""
        def said():
            return any(text in line for line in self.lines if line is not None)

        with self._changed:
            self._changed.wait_for(lambda: said() or None in self.lines, timeout)
            assert said(), self.stderr

    def ready(self) -> str:
        """The server's base URL, http://127.0.0.1:PORT, from its ready line."""
        line = self.process.stdout.readline()
        assert line.startswith("gptoss-serve: ready at http://127.0.0.1:"), (line, self.stderr)
        return line.split()[3].removesuffix("/v1")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.process.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 60) -> int:
        code = self.process.wait(timeout)
        self._reader.join(10)
        return code

    def close(self) -> None:
        self._watchdog.cancel()
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def serve(*flags: str, code: str | None = None) -> Process:
    """The demo model with the least to compile (its steps in the run's compilation cache, conftest.py)."""
    return Process("--port", "0", "--slots", "2", "--max-context", "128", "--prefill-rows", "1", *flags, code=code)


def ended(process: Process, timeout: float) -> int:
    """The process's exit status once it ends by itself (closed either way)."""
    try:
        return process.wait(timeout)
    finally:
        process.close()


def port_of(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def health(base: str) -> int:
    with urllib.request.urlopen(base + "/health", timeout=10) as response:
        return response.status


def read_until_closed(socks: dict[str, socket.socket], timeout: float,
                      start: float | None = None) -> dict[str, tuple[float, bytes]]:
    """Each socket's bytes received and the seconds from `start` (default: now) until the server
    closed it (inf: still open after `timeout` seconds)."""
    start = time.monotonic() if start is None else start
    got, ends = {name: b"" for name in socks}, {}
    with selectors.DefaultSelector() as selector:
        for name, sock in socks.items():
            selector.register(sock, selectors.EVENT_READ, name)
        while len(ends) < len(socks) and time.monotonic() - start < timeout:
            for key, _ in selector.select(0.05):
                try:
                    data = key.fileobj.recv(65536)
                except ConnectionResetError:
                    data = b""
                if data:
                    got[key.data] += data
                else:
                    ends[key.data] = time.monotonic() - start
                    selector.unregister(key.fileobj)
    return {name: (ends.get(name, float("inf")), got[name]) for name in socks}


# How late a server may act (close a connection at its deadline, answer /health beside slow clients):
# this many of its plain round trips, timed on this machine just before. A deadline not kept at all,
# or counted from the wrong moment, is late by whole seconds.
SLACK_ROUND_TRIPS = 100


def round_trip(port: int, path: str = "/health", n: int = 5) -> float:
    """The longest of `n` GET `path` round trips to 127.0.0.1:`port`, each on a fresh connection."""
    out = 0.0
    for _ in range(n):
        t = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        connection.request("GET", path)
        assert connection.getresponse().status == 200
        connection.close()
        out = max(out, time.monotonic() - t)
    return out


def error_of(response: bytes) -> tuple[int, dict[str, str], dict]:
    """A raw HTTP response's status, headers (lower-cased names) and JSON body."""
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict((k.strip().lower(), v.strip()) for k, v in (line.split(":", 1) for line in lines[1:]))
    return int(lines[0].split()[1]), headers, json.loads(body)


# One server for the tests that need no particular setting but a short --read-timeout -------------------

@pytest.fixture(scope="module")
def idle():
    """A server with --read-timeout 1, and its base URL."""
    if not os.path.isfile(VOCAB):
        pytest.skip("needs the o200k_base vocabulary")
    process = serve("--read-timeout", "1")
    try:
        yield process, process.ready()
    finally:
        process.close()


@needs_vocab
def test_a_port_in_use_is_said_in_one_line_before_anything_loads():
    """A port another program listens on: one line naming the address, exit status 1, and no model
    loaded first (before, it loaded the model, then died with a segmentation fault)."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        process = serve("--port", str(port))  # the later --port wins
        code = ended(process, 60)
    lines = process.stderr.splitlines()
    assert code == 1, process.stderr
    assert len(lines) == 1 and lines[0].startswith("gptoss-serve: error: "), lines
    assert f"127.0.0.1:{port}" in lines[0] and "(address already in use)" in lines[0], lines


@pytest.mark.slow
@needs_vocab
def test_silent_and_slow_clients_are_closed_after_the_read_timeout(idle):
    """With --read-timeout 1: a connection that sends nothing, one that stops mid-headers, one that
    trickles its headers a byte at a time and one whose body never completes are all closed within
    about a second (408 where a request had begun), while /health answers others at once."""
    _, base = idle
    port = port_of(base)
    host = f"Host: 127.0.0.1:{port}\r\n".encode()
    slack = SLACK_ROUND_TRIPS * round_trip(port)
    opened = time.monotonic()  # every deadline runs from after this
    socks = {name: socket.create_connection(("127.0.0.1", port), timeout=10)
             for name in ("silent", "half headers", "trickle", "half body")}
    closed = {}
    reader = threading.Thread(target=lambda: closed.update(read_until_closed(socks, timeout=60, start=opened)))
    try:
        socks["half headers"].sendall(b"POST /v1/chat/completions HTTP/1.1\r\n" + host)
        socks["half body"].sendall(b"POST /v1/chat/completions HTTP/1.1\r\n" + host +
                                   b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
        trickled = b"GET /health HTTP/1.1\r\n" + host + b"X-Padding: " + b"a" * 1000

        def trickle():
            for byte in trickled:
                try:
                    socks["trickle"].send(bytes([byte]))
                except OSError:
                    return
                time.sleep(0.1)  # not a wait: the client trickles a byte every 0.1 s

        threading.Thread(target=trickle, daemon=True).start()
        reader.start()
        for _ in range(3):  # the others are served meanwhile
            t = time.monotonic()
            assert health(base) == 200
            assert time.monotonic() - t < slack, (time.monotonic() - t, slack)
        reader.join()
    finally:
        for sock in socks.values():
            sock.close()
    for name, (after, got) in closed.items():
        assert 0.9 < after < 1 + slack, (name, after, slack, got)
        if name == "silent":
            assert got == b"", got
        else:
            status, headers, body = error_of(got)
            assert status == 408 and body["error"]["code"] == "request_timeout", (name, got)
    assert health(base) == 200


@pytest.mark.slow
@needs_vocab
def test_the_start_up_says_what_the_kv_cache_holds(idle):
    """One line: the pool's pages, the tokens they hold, their memory and the prefill's shape (on a CPU, room for --slots 2
    sequences of --max-context 128: two full pages each, and their sliding layers' pages)."""
    process, _ = idle
    line = next(line for line in process.stderr.splitlines() if "KV cache:" in line)
    said = re.fullmatch(r"gptoss-serve: KV cache: (\d+) pages of 64 positions \((\d+) tokens\) in float32, [\d.]+ MiB; 2 sequences at once; "
                        r"prompts prefilled 1 x 128 tokens a step", line)
    assert said, line
    pages, tokens = int(said[1]), int(said[2])
    assert tokens == 64 * pages and pages >= 2 * 2, line


@needs_vocab
def test_the_kv_cache_flags_reach_the_engine_and_a_pool_too_small_is_said():
    """--page-size, --kv-memory-gb, --kv-dtype and --no-prefix-cache make the pool the start-up line
    describes; a pool that cannot hold one request of --max-context stops the server, exit 1, before
    compiling, with a line naming both flags."""
    code = ended(process := serve("--page-size", "32", "--kv-memory-gb", "0.000026", "--kv-dtype", "fp8",
                                  "--no-prefix-cache"), 120)
    lines = process.stderr.splitlines()
    assert code == 1, process.stderr
    # 0.000026 GiB in pages of 4.25 KiB (the demo model: 2 storages, 32 positions of 2 x 2 vectors of
    # 16 values, each vector 17 bytes in FP8)
    assert ("gptoss-serve: KV cache: 6 pages of 32 positions (192 tokens) in FP8 (e4m3), 25.5 KiB; prefix cache off; "
            "2 sequences at once; prompts prefilled 1 x 128 tokens a step") \
        in lines, lines
    assert lines[-1].startswith("error: the KV cache's 6 pages (192 positions) cannot hold one request of "
                                "--max-context 128, which needs 9"), lines
    assert "--kv-memory-gb" in lines[-1] and "compiling" not in process.stderr


def test_the_max_context_is_the_models_by_default():
    from gptoss_jax.config import ModelConfig

    config = ModelConfig.demo()
    assert cli.max_context(cli.build_parser().parse_args([]), config) == config.max_context_length == 8192
    assert cli.max_context(cli.build_parser().parse_args(["--max-context", "100"]), config) == 100
    with pytest.raises(cli.UsageError, match="--max-context 9000 exceeds the model's context of 8192"):
        cli.max_context(cli.build_parser().parse_args(["--max-context", "9000"]), config)


@pytest.mark.slow
@needs_vocab
def test_sigterm_when_idle_exits_0(idle):
    process, _ = idle
    assert process.stop() == 0, process.stderr
    assert process.stderr.splitlines()[-1] == "gptoss-serve: stopped"


# Servers of their own ------------------------------------------------------------------------------

@pytest.mark.slow
@needs_vocab
def test_sigterm_while_warming_up_exits_0():
    """SIGTERM while the engine compiles on its thread: exit status 0 (today a segmentation fault,
    the interpreter torn down under XLA's compilation)."""
    process = serve("--compile-cache", "none")  # (with the steps in the cache, the warm-up could end first)
    try:
        process.wait_for("compiling the engine's steps")
        code = process.stop()
        stdout = process.process.stdout.read()
    finally:
        process.close()
    assert code == 0, (code, process.stderr)
    assert "ready at" not in stdout  # it was stopped during the warm-up, not after
    assert process.stderr.splitlines()[-1] == "gptoss-serve: stopped"


@needs_vocab
def test_a_failed_warm_up_exits_1():
    """The engine's compilation fails (here Engine.warm_up raises, as a lack of device memory would
    make it): one error line, last, and exit status 1, so that a supervisor sees the failed start
    (today: 0)."""
    code = ("import sys\n"
            "from gptoss_jax.serving import Engine\n"
            "def fail(self):\n"
            "    raise RuntimeError('RESOURCE_EXHAUSTED: out of memory while compiling')\n"
            "Engine.warm_up = fail\n"
            "from gptoss_jax.server.cli import entry\n"
            "entry('gptoss-serve')\n")
    process = serve(code=code)
    exit_code = ended(process, 120)
    assert exit_code == 1, process.stderr
    assert process.stderr.splitlines()[-1] == ("gptoss-serve: error: warming up failed: RuntimeError: "
                                               "RESOURCE_EXHAUSTED: out of memory while compiling")


@pytest.mark.slow
@needs_vocab
def test_twenty_streams_end_properly_when_the_grace_runs_out():
    """20 streamed replies far longer than --grace 1 (4 slots: 4 generating, 16 waiting), with
    --max-connections 20: one more connection is answered 503 at once; then SIGTERM. Each stream ends
    about a second later with its finish_reason chunk and `data: [DONE]`, none cut mid-body, and the
    server exits 0."""
    streams = 20
    process = Process("--port", "0", "--slots", "4", "--max-context", "4096", "--prefill-rows", "1",
                      "--prefill-chunk", "64", "--grace", "1", "--max-connections",
                      str(streams))
    try:
        base = process.ready()
        started, results = threading.Barrier(streams + 1, timeout=120), [None] * streams

        def stream(i):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me a story, {i}."}],
                    "max_tokens": 3000, "ignore_eos": True, "stream": True}
            lines, error = [], None
            connection = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=120)
            try:
                connection.request("POST", "/v1/chat/completions", json.dumps(body),
                                   {"Content-Type": "application/json"})
                response = connection.getresponse()
                assert response.status == 200, response.read()
                lines.append(response.readline())
                started.wait()
                lines += list(response)  # IncompleteRead if the body is cut
            except Exception as e:  # noqa: BLE001 -- a stream cut mid-body lands here
                error = e
                started.abort()
            finally:
                connection.close()
            results[i] = ([line.decode().strip() for line in lines if line.strip()], error, time.monotonic())

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        started.wait()  # every stream has its first chunk: 20 connections are open
        with socket.create_connection(("127.0.0.1", port_of(base)), timeout=10) as extra:
            refused = read_until_closed({"extra": extra}, timeout=10)["extra"]
        status, headers, body = error_of(refused[1])
        assert status == 503 and headers.get("retry-after"), refused
        assert body == {"error": {"message": body["error"]["message"], "type": "service_unavailable",
                                  "param": None, "code": "service_unavailable"}}

        signalled = time.monotonic()
        process.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        code = process.wait(60)
    finally:
        process.close()
    assert code == 0, process.stderr
    for lines, error, ended in results:
        assert error is None, (error, lines[-3:])
        assert lines[-1] == "data: [DONE]", lines[-3:]
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length", lines[-3:]
        assert 0.9 < ended - signalled < 1 + GRACE_MARGIN, ended - signalled


# The decisions, without a server ---------------------------------------------------------------------

def test_the_start_up_warns_when_listening_beyond_loopback_without_a_key():
    assert cli.exposure_warning("0.0.0.0", None) and cli.exposure_warning("::", None)
    assert cli.exposure_warning("192.168.1.20", None) and cli.exposure_warning("gpu-host.example", None)
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert cli.exposure_warning(host, None) is None, host
    assert cli.exposure_warning("0.0.0.0", "a key") is None


def test_allowed_hosts():
    args = cli.build_parser().parse_args([])
    assert cli.allowed_hosts(args, ("localhost", "127.0.0.1", "::1")) == ("localhost", "127.0.0.1", "::1")
    args = cli.build_parser().parse_args(["--host", "0.0.0.0"])
    assert cli.allowed_hosts(args, ("localhost",)) is None
    args = cli.build_parser().parse_args(["--allowed-hosts", "Example.com, [::1],localhost"])
    assert cli.allowed_hosts(args, ()) == ("example.com", "::1", "localhost")
    assert cli.parse_hosts("*") is None
    for bad in ("a,,b", "example.com:8000", ""):
        with pytest.raises(cli.UsageError, match="--allowed-hosts"):
            cli.parse_hosts(bad)


@pytest.mark.parametrize("flags, message", [
    (["--read-timeout", "0"], "--read-timeout must be a number above 0"),
    (["--max-connections", "0"], "--max-connections must be at least 1"),
    (["--max-body-mb", "nan"], "--max-body-mb must be a number above 0"),
    (["--grace", "inf"], "--grace must be"),
    (["--page-size", "0"], "--page-size must be at least 1, got 0"),
    (["--page-size", "12"], "--page-size must be a multiple of 8, got 12"),
    (["--kv-memory-gb", "0"], "--kv-memory-gb must be a number above 0, got 0"),
    (["--kv-memory-gb", "-2"], "--kv-memory-gb must be a number above 0"),
    (["--kv-memory-gb", "inf"], "--kv-memory-gb must be a number above 0"),
    (["--draft", "prompt-lookup", "--draft-tokens", "0"], "--draft-tokens must be at least 1, got 0"),
    (["--draft", "prompt-lookup", "--prefill-chunk", "64", "--draft-tokens", "64"],
     r"--draft-tokens must be less than --prefill-chunk \(64\), got 64"),
    (["--draft", "prompt-lookup", "--speculate-rows", "0"], "--speculate-rows must be at least 1, got 0"),
    (["--draft", "prompt-lookup", "--speculate-steps", "-1"], "--speculate-steps must be at least 0, got -1"),
    (["--draft", "eagle3:/a/head", "--speculate-steps", "0"],
     "--draft eagle3:DIR drafts on the device: --speculate-steps must be at least 1, got 0"),
])
def test_the_new_flags_are_checked(flags, message):
    with pytest.raises(cli.UsageError, match=message):
        cli.check_flags(cli.build_parser().parse_args(flags))


def test_drafts_are_made_on_the_host_unless_asked():
    """Prompt lookup drafts on the host by default; an EAGLE-3 head, which drafts on the device only,
    runs several checked steps a call; --draft takes the forms it names."""
    parse = cli.build_parser().parse_args
    assert cli.speculate_steps(parse(["--draft", "prompt-lookup"])) == 0
    assert cli.speculate_steps(parse(["--draft", "eagle3:/a/head"])) == cli.HEAD_STEPS
    assert cli.speculate_steps(parse(["--draft", "eagle3:/a/head", "--speculate-steps", "2"])) == 2
    for bad in ("eagle3", "eagle3:", "lookup"):
        with pytest.raises(cli.UsageError, match="--draft: choose none, prompt-lookup or eagle3:DIR"):
            cli.check_flags(parse(["--draft", bad]))


# The transport alone, for each HTTP implementation -----------------------------------------------------

def implementations():
    out = [pytest.param("h11")]
    try:
        import httptools  # noqa: F401
        out.append(pytest.param("httptools"))
    except ImportError:
        out.append(pytest.param("httptools", marks=pytest.mark.skip(reason="httptools is not installed")))
    return out


def stream_app(cut: threading.Event):
    """An ASGI app: /stream writes a chunk every 20 ms until `cut`, then `end` and finishes; anything
    else answers `ok`."""
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        headers = [(b"content-type", b"text/plain")] + ([] if scope["path"] == "/stream" else [(b"content-length", b"2")])
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if scope["path"] == "/stream":
            while not cut.is_set():
                await send({"type": "http.response.body", "body": b"x\n", "more_body": True})
                await asyncio.sleep(0.02)  # not a wait: the app streams a chunk every 20 ms
            await send({"type": "http.response.body", "body": b"end\n", "more_body": False})
        else:
            await send({"type": "http.response.body", "body": b"ok", "more_body": False})
    return app


@pytest.mark.parametrize("http", implementations())
def test_the_transport_alone(http):
    """serve_forever on a thread, with a 0.5 s header deadline, 3 connections at most and a 0.5 s grace:
    deadlines counted from the opening and from the end of a kept-alive connection's response, 408 for
    a request begun, 503 with Retry-After past the cap, and stop(): on_exit, streams running on until
    the grace ends, then on_grace_over ends them properly and serve_forever returns."""
    from gptoss_jax.server import transport

    assert transport.GRACE_MARGIN == GRACE_MARGIN
    cut, events, stop = threading.Event(), [], []
    sock = transport.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    started = threading.Event()

    def on_started(stopper):
        stop.append(stopper)
        started.set()

    server = threading.Thread(target=transport.serve_forever, args=(stream_app(cut), sock), kwargs=dict(
        grace=0.5, on_started=on_started, on_exit=lambda: events.append(("exit", time.monotonic())),
        on_grace_over=lambda: (events.append(("grace over", time.monotonic())), cut.set()), header_timeout=0.5,
        max_connections=3, http=http), daemon=True)
    server.start()
    assert started.wait(60)
    try:
        request = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
        slack = SLACK_ROUND_TRIPS * round_trip(port, "/")
        opened = time.monotonic()
        socks = {name: socket.create_connection(("127.0.0.1", port), timeout=10)
                 for name in ("silent", "half headers", "kept alive")}
        socks["half headers"].sendall(request[:20])
        socks["kept alive"].sendall(request)
        closed = read_until_closed(socks, timeout=60, start=opened)
        for s in socks.values():
            s.close()
        assert closed["silent"][1] == b"" and 0.45 < closed["silent"][0] < 0.5 + slack, (closed, slack)
        assert error_of(closed["half headers"][1])[0] == 408, closed
        assert 0.45 < closed["half headers"][0] < 0.5 + slack, (closed, slack)
        kept = closed["kept alive"][1]
        assert kept.startswith(b"HTTP/1.1 200") and kept.endswith(b"ok"), closed
        assert 0.45 < closed["kept alive"][0] < 0.5 + slack, (closed, slack)

        # Three streams running: a fourth connection is refused at once.
        streams = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        for s in streams:
            s.sendall(request.replace(b"GET / ", b"GET /stream "))
            assert s.recv(100).startswith(b"HTTP/1.1 200")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
            after, got = read_until_closed({"extra": extra}, timeout=60)["extra"]
        status, headers, body = error_of(got)
        assert status == 503 and headers["retry-after"] == "1" and after < slack, (got, after, slack)
        assert body["error"]["type"] == "service_unavailable" and body["error"]["param"] is None

        stopped = time.monotonic()
        stop[0]()
        ends = read_until_closed({i: s for i, s in enumerate(streams)}, timeout=60)
        server.join(60)
        assert not server.is_alive()
    finally:
        cut.set()
        if stop:
            stop[0]()
        server.join(10)
    assert [name for name, _ in events] == ["exit", "grace over"]
    assert 0.45 < events[1][1] - stopped < 0.5 + slack, (events, stopped, slack)
    for after, got in ends.values():  # each stream ran on until the grace was over, then ended whole
        assert got.endswith(b"0\r\n\r\n") and b"end\n" in got and after > 0.4, got[-50:]


@pytest.mark.slow
@needs_vocab
def test_sigterm_cuts_a_scoring_pass_at_the_grace_with_a_503():
    """An echoed 8,000-token prompt with logprobs (one pass of the model over it, on the scoring thread:
    longer than --grace 1 on a CPU), then SIGTERM: the request is answered at the grace's end with
    OpenAI's 503, and the server exits 0 within the grace and its margin, not after the pass (13.6 s
    with --grace 5 before the scoring pass could be cut)."""
    process = Process("--port", "0", "--slots", "2", "--max-context", "8192", "--prefill-rows", "1",
                      "--grace", "1")
    try:
        base = process.ready()
        prompt = list(range(1000, 9000))
        answer = {}

        def score():
            connection = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=120)
            connection.request("POST", "/v1/completions", json.dumps({
                "model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0}),
                {"Content-Type": "application/json"})
            response = connection.getresponse()
            answer.update(status=response.status, body=response.read(), at=time.monotonic())
            connection.close()

        thread = threading.Thread(target=score, daemon=True)
        thread.start()
        def scoring() -> bool:
            assert thread.is_alive(), answer
            return "gptoss_scoring_passes 1.0" in urllib.request.urlopen(base + "/metrics", timeout=30).read().decode()

        until(scoring, "the scoring pass is running", every=0.05)
        signalled = time.monotonic()
        process.process.send_signal(signal.SIGTERM)
        thread.join(60)
        code = process.wait(60)
        exited = time.monotonic()
    finally:
        process.close()
    assert code == 0, process.stderr
    assert answer["status"] == 503, answer
    error = json.loads(answer["body"])["error"]
    assert error["type"] == "service_unavailable" and "grace" in error["message"], error
    assert 0.9 < answer["at"] - signalled < 1 + GRACE_MARGIN and exited - signalled < 1 + GRACE_MARGIN + 3


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
@needs_vocab
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the server's memory from /proc")
def test_thirty_stored_responses_of_15_mb_stay_within_the_store_cap():
    """30 Responses API requests echoing 15 MB of tools each (tool_choice none, one token), under
    --store-mb 128 (8 of them fit): the server's resident memory stays within its baseline (the most
    it held after five such requests not stored) plus the cap, the oldest are forgotten and /metrics
    says the bytes held. Before the store was bounded in bytes, memory grew by 15 MB a request (450 MB
    here, over three times the cap; 16 GB at the default 1,024 responses)."""
    cap = 128 * 2**20
    process = serve("--store-mb", "128", "--max-body-mb", "16")
    try:
        base = process.ready()
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1, "tool_choice": "none",
                "tools": [{"type": "function", "name": "f", "description": "d" * (15 * 2**20 - 200)}]}
        connection = http.client.HTTPConnection("127.0.0.1", port_of(base), timeout=120)

        def post(store: bool) -> str:
            connection.request("POST", "/v1/responses", json.dumps({**body, "store": store}),
                               {"Content-Type": "application/json"})
            response = connection.getresponse()
            data = response.read()
            assert response.status == 200, data[:300]
            return json.loads(data)["id"]

        baseline = 0
        for _ in range(5):
            post(False)
            baseline = max(baseline, rss_bytes(process.process.pid))
        ids, most = [], 0
        for _ in range(30):
            ids.append(post(True))
            most = max(most, rss_bytes(process.process.pid))
        found = []
        for i in (0, 15, 29):
            connection.request("GET", f"/v1/responses/{ids[i]}")
            response = connection.getresponse()
            response.read()
            found.append(response.status)
        connection.close()
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    finally:
        process.close()
    held = float(next(line.split()[1] for line in metrics.splitlines()
                      if line.startswith("gptoss_stored_response_bytes ")))
    assert found == [404, 404, 200] and 15 * 2**20 * 7 < held <= cap, (found, held)
    assert most <= baseline + cap, (most / 2**20, baseline / 2**20)
