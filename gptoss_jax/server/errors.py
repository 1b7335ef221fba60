"""Errors as the OpenAI API shapes them: {"error": {"message", "type", "param", "code"}}, with the
HTTP status that the openai client maps to its exception classes."""

from __future__ import annotations


class APIError(Exception):
    """An error answered to the client; `status` is the HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided: pass the server's key as a bearer token "
                         "(Authorization: Bearer KEY).", "invalid_request_error", None, "invalid_api_key")


def model_not_found(name: str, served: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist; this server serves `{served}`.",
                    "invalid_request_error", "model", "model_not_found")


def queue_full(waiting: int) -> APIError:
    return APIError(429, f"The server is at capacity ({waiting} requests already wait); retry later.",
                    "rate_limit_error", None, "rate_limit_exceeded")


def unavailable(why: str) -> APIError:
    return APIError(503, why, "service_unavailable", None, "service_unavailable")
