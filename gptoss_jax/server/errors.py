"""Errors as the OpenAI API shapes them: {"error": {"message", "type", "param", "code"}}, with the
HTTP status that the openai client maps to its exception classes, and the headers that go with it
(Retry-After with 429 and 503; Connection: close where the request's body was left unread)."""

from __future__ import annotations

RETRY_AFTER_S = 1  # what a 429 or 503 asks the client to wait before retrying


class APIError(Exception):
    """An error answered to the client; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers or {})
        if status in (429, 503):
            self.headers.setdefault("Retry-After", str(RETRY_AFTER_S))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientLeft(Exception):
    """The client went away before its request's body was read: nothing to answer, one line to log."""


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided: pass the server's key as a bearer token "
                         "(Authorization: Bearer KEY).", "invalid_request_error", None, "invalid_api_key")


def model_not_found(name: str, served: str, adapters: list[str] = ()) -> APIError:
    also = f" and the adapters {', '.join(map(repr, adapters))} over it" if adapters else ""
    return APIError(404, f"The model {name!r} does not exist; this server serves {served!r}{also}.",
                    "invalid_request_error", "model", "model_not_found")


def not_found(path: str) -> APIError:
    return APIError(404, f"There is no endpoint {path!r} (see /openapi.json).", "invalid_request_error", None,
                    "not_found")


def method_not_allowed(method: str, path: str, allow: str | None) -> APIError:
    return APIError(405, f"{path} does not take {method} requests" + (f" (it takes {allow})" if allow else "") + ".",
                    "invalid_request_error", None, "method_not_allowed", {"Allow": allow} if allow else None)


def queue_full(waiting: int) -> APIError:
    return APIError(429, f"The server is at capacity ({waiting} requests already wait); retry later.",
                    "rate_limit_error", None, "rate_limit_exceeded")


def unavailable(why: str) -> APIError:
    return APIError(503, why, "service_unavailable", None, "service_unavailable")


def too_large(limit: int) -> APIError:
    return APIError(413, f"The request body exceeds this server's limit of {limit:,} bytes.",
                    "invalid_request_error", None, "request_too_large", {"Connection": "close"})


def read_timeout(seconds: float) -> APIError:
    return APIError(408, f"The request body did not arrive within {seconds:g} s.", "invalid_request_error", None,
                    "request_timeout", {"Connection": "close"})


def unsupported_media_type(got: str | None) -> APIError:
    return APIError(415, f"Send the request body as JSON with 'Content-Type: application/json' (got "
                         f"{got!r}).", "invalid_request_error", None, "unsupported_media_type")


def server_error(request_id: str) -> APIError:
    """What a client is told of a failure on the server's side: no internals (they go to the log)."""
    return APIError(500, f"The server failed while handling the request (request id {request_id}); the failure "
                         f"is in the server's log under that id. Retry, or report it with the id.",
                    "server_error", None, "server_error")
