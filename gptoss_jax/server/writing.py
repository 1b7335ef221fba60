"""How answers are written: JSON bodies (on a worker thread, by the caller's choice: they can be
megabytes long) and event streams that always end properly."""

from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import Response

from .choices import Failed, sse
from .errors import APIError, server_error
from .generation import Generation
from .guard import log


def json_answer(data: dict) -> Response:
    """As FastAPI writes a returned dict (UTF-8, no NaN), for a worker thread to call."""
    return Response(json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":")),
                    media_type="application/json")


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'))}\n\n"


async def event_stream(chunks: AsyncIterator[str], generations: list[Generation], on_error,
                       rid: str | None = None) -> AsyncIterator[str]:
    """A stream's chunks, ended properly whatever happens: a failure (the engine's, or the server's
    own) is logged with the request's id and told to the client by `on_error(error)`'s chunks (an
    APIError: the request's own fault as a 400's error, else a 500's without internals). A client gone
    mid-stream closes it; its requests are cancelled here, at once."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # noqa: BLE001 -- told to the client without internals, logged with them
        rid = rid or generations[0].id
        if not isinstance(e, Failed):
            log.exception("request %s failed mid-stream", rid)
        for chunk in on_error(e.error if isinstance(e, Failed) else server_error(rid)):
            yield chunk
    finally:
        for g in generations:
            g.close()


def sse_error(error: APIError) -> list[str]:
    """How chat and completion streams end on a failure: an error object (the openai client raises it)
    and [DONE]."""
    return [sse(error.body()), "data: [DONE]\n\n"]


def error_response(error: APIError) -> Response:
    # ASCII JSON: whatever text of the client's an error quotes, the response can be written
    return Response(json.dumps(error.body()), status_code=error.status, headers=error.headers,
                    media_type="application/json")
