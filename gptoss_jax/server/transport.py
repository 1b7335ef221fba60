"""Where the server meets the network: uvicorn on a socket taken before anything loads, with the
limits no endpoint can enforce, and a shutdown that ends every stream properly.

- `bind` takes the port at start-up, so that a port in use is said at once, not after the model
  has loaded; the connections that arrive meanwhile wait in the socket's queue.
- A connection has `header_timeout` seconds to send a request's headers, counted from its opening
  or, on a kept-alive connection, from the end of the previous response; a silent or trickling
  client (slowloris) is then closed, with a 408 if it had begun a request. Once the headers are in,
  the endpoints' own deadline (`Limits.read_timeout`) covers the body.
- Beyond `max_connections` open connections, a new one is answered 503 (OpenAI's error shape, with
  Retry-After) and closed, before it can hold anything.
- SIGINT or SIGTERM: `on_exit()`, stop listening, let the running requests run; `grace` seconds after
  the signal, `on_grace_over()` on the event loop (the server ends its streams properly then), and
  uvicorn's graceful shutdown waits GRACE_MARGIN seconds beyond for their last chunks to be written
  before it cancels anything. A second signal calls `on_grace_over()` at once.

Both of uvicorn's HTTP/1.1 implementations (h11, and httptools where it is installed) are covered:
the limits are a subclass of whichever runs, using what they share (`cycle`, `connections`,
`on_response_complete`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from http import HTTPStatus
from typing import Callable

from .errors import APIError, unavailable

GRACE_MARGIN = 5.0  # seconds, beyond the grace, for the ended streams' last chunks to be written
LINGER = 1.0  # seconds a refused connection is read (and discarded) before it is closed
BACKLOG = 2048  # connections waiting to be accepted, as uvicorn's default

log = logging.getLogger("gptoss_jax.server")


def bind(host: str, port: int) -> socket.socket:
    """A socket listening on host:port (port 0: any free one). OSError if the address is taken (errno
    EADDRINUSE) or is not this machine's. It listens at once: a socket only bound would let a second
    server bind the same port too (both with SO_REUSEADDR) and fail only later, when it listens."""
    family, kind, proto, _, address = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: a restarted server takes its port back without waiting out TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def raw_response(error: APIError) -> bytes:
    """An HTTP/1.1 response carrying `error` and closing the connection, for when no ASGI cycle
    exists to send it through."""
    body = json.dumps(error.body()).encode()
    headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
               **{k.lower(): v for k, v in error.headers.items()}}
    head = [f"HTTP/1.1 {error.status} {HTTPStatus(error.status).phrase}"]
    head += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def header_timeout_error(seconds: float) -> APIError:
    return APIError(408, f"The request's headers did not arrive within {seconds:g} s.", "invalid_request_error",
                    None, "request_timeout", {"Connection": "close"})


def too_many_connections(limit: int) -> APIError:
    return unavailable(f"The server has {limit} connections open, its limit (gptoss-serve --max-connections); "
                       "retry in a moment.")


class _Refusals:
    """The connections answered 503, still read until they close, and a warning in the log at most
    once a minute while they come."""

    def __init__(self, limit: int):
        self.limit, self.open, self.count, self.said = limit, set(), 0, 0.0

    def add(self, transport) -> None:
        self.open.add(transport)
        self.count += 1
        if time.monotonic() - self.said >= 60:
            self.said = time.monotonic()
            log.warning("%d connection(s) refused with 503 so far: --max-connections %d are open", self.count,
                        self.limit)

    def close_all(self) -> None:
        for transport in list(self.open):
            transport.close()


def guarded(base: type, header_timeout: float, max_connections: int, refusals: _Refusals) -> type:
    """uvicorn's HTTP protocol class `base` with the header deadline and the connection cap."""
    timeout_bytes = raw_response(header_timeout_error(header_timeout))
    refused_bytes = raw_response(too_many_connections(max_connections))

    class Guarded(base):
        _deadline: asyncio.TimerHandle | None = None
        _begun = False  # bytes of a request came since the deadline was set
        _refused = False

        def connection_made(self, transport) -> None:
            if len(self.connections) >= max_connections:
                self._refuse(transport)
                return
            super().connection_made(transport)
            self._arm()

        def _refuse(self, transport) -> None:
            # Answered before the request is read; the request is then read and dropped until the
            # client closes (or LINGER passes), since closing on unread bytes would reset the
            # connection and could lose the 503 on its way to the client.
            self._refused, self.transport = True, transport
            transport.write(refused_bytes)
            if transport.can_write_eof():
                transport.write_eof()
            refusals.add(transport)
            self._deadline = self.loop.call_later(LINGER, transport.close)

        def _between_requests(self) -> bool:
            cycle = self.cycle
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            self._disarm()
            self._begun = False
            self._deadline = self.loop.call_later(header_timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if self.transport.is_closing() or not self._between_requests():
                return
            if self._begun:
                self.transport.write(timeout_bytes)
            self.transport.close()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._between_requests():
                self._begun = True
            super().data_received(data)
            if not self._between_requests():  # the headers are in: the endpoints' deadline takes over
                self._disarm()

        def eof_received(self):
            return None if self._refused else super().eof_received()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._between_requests():
                self._arm()  # the next request's headers are due from now

        def connection_lost(self, exc) -> None:
            self._disarm()
            if self._refused:
                refusals.open.discard(self.transport)
                return
            super().connection_lost(exc)

    Guarded.__name__ = Guarded.__qualname__ = "Guarded" + base.__name__
    return Guarded


def protocol_class(http: str, header_timeout: float, max_connections: int) -> tuple[type, _Refusals]:
    """uvicorn's HTTP implementation `http` ("auto", "h11", "httptools") with this module's limits, and
    the record of its refused connections (for uvicorn.Config(http=...); serve_forever's own)."""
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    refusals = _Refusals(max_connections)
    return guarded(import_from_string(HTTP_PROTOCOLS[http]), header_timeout, max_connections, refusals), refusals


def serve_forever(app, sock: socket.socket, *, grace: float, on_started: Callable[[Callable[[], None]], None],
                  on_exit: Callable[[], None], on_grace_over: Callable[[], None], header_timeout: float,
                  max_connections: int, http: str = "auto") -> None:
    """Serve `app` on `sock` (from `bind`) until SIGINT or SIGTERM, or `stop()`, then shut down as the
    module's docstring says and return. `on_started(stop)` runs on the event loop once the server
    serves; `stop` (callable from any thread) stops it as a signal would. `http`: uvicorn's HTTP
    implementation ("auto": httptools where installed, else h11)."""
    import uvicorn

    protocol, refusals = protocol_class(http, header_timeout, max_connections)

    class _Server(uvicorn.Server):
        loop: asyncio.AbstractEventLoop | None = None

        async def serve(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started and not self.should_exit:
                on_started(self.stop)

        def stop(self) -> None:
            try:
                self.loop.call_soon_threadsafe(self.handle_exit, None, None)
            except RuntimeError:  # the loop has closed: the server has stopped already
                pass

        def handle_exit(self, sig, frame) -> None:
            # Runs in the signal handler, on the event loop's thread: the loop is reached through
            # call_soon_threadsafe, which may be called from there. Nothing is recorded for uvicorn to
            # raise again once it has stopped: a stopped server returns, and the command exits 0.
            if not self.should_exit:
                self.should_exit = True
                on_exit()
                self.loop.call_soon_threadsafe(self.loop.call_later, grace, on_grace_over)
            else:
                self.loop.call_soon_threadsafe(on_grace_over)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            refusals.close_all()

    # No WebSocket endpoints: an upgrade request is answered as plain HTTP.
    config = uvicorn.Config(app, http=protocol, ws="none", log_level="warning", access_log=False,
                            timeout_graceful_shutdown=grace + GRACE_MARGIN)
    _Server(config).run(sockets=[sock])
