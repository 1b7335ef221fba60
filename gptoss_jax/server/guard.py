"""What stands between the network and the endpoints (an ASGI middleware):

- the Host header: while the server listens on loopback, only loopback names are accepted (a web
  page a browser visits can otherwise reach the server through DNS rebinding and read its replies);
  `Limits.allowed_hosts` says which, None for any;
- any failure the endpoints did not answer themselves: logged with a request id and its traceback,
  answered with a 500 that gives the id and nothing of the internals. Nothing is raised on to the
  ASGI server, so the client's kept-alive connection stays usable. A failure after a response has
  begun ends that response's body (the streams write their own error events before that).
"""

from __future__ import annotations

import json
import logging
import secrets

from .errors import APIError, ClientLeft, bad_request, server_error

log = logging.getLogger("gptoss_jax.server")


def request_id() -> str:
    return "req_" + secrets.token_hex(12)


def host_name(header: str) -> str:
    """A Host header's name, without its port: "127.0.0.1:8000" -> "127.0.0.1", "[::1]:80" -> "::1"."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


async def send_error(send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Guard:
    def __init__(self, app, allowed_hosts: tuple[str, ...] | None):
        self.app, self.allowed_hosts = app, allowed_hosts

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.allowed_hosts is not None:
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if host_name(host) not in self.allowed_hosts:
                return await send_error(send, bad_request(
                    f"Host {host!r} is not accepted: this server answers {', '.join(self.allowed_hosts)} "
                    "(gptoss-serve --allowed-hosts)", None, "invalid_host"))
        started = ended = False

        async def watched_send(message):
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body", False))
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except ClientLeft:  # nobody to answer; not a failure of the server
            log.info("%s %s: the client left before its request's body was read", scope.get("method"),
                     scope.get("path"))
        except Exception:  # noqa: BLE001 -- answered here, logged with its traceback
            rid = request_id()
            log.exception("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"))
            try:
                if not started:
                    await send_error(send, server_error(rid))
                elif not ended:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            except Exception:  # noqa: BLE001 -- the client is gone; nothing more to say
                pass
