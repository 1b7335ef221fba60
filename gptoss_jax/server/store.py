"""Stored responses (the Responses API's `store`, `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`): each finished response kept with the conversation it answered, in memory,
bounded by count, by bytes and by age (the oldest goes first). Each is kept as its JSON text, so
that its size is what it holds in memory and a GET sends it as it is; `put` writes it, so it runs on
a worker thread. A later request that names it as `previous_response_id` continues that
conversation: its input items are the stored conversation, the stored response's output, then its
own. The conversation's tokens, rendered again, begin with those of the earlier request, so the KV
cache's prefix reuse finds them (up to the earlier turns' reasoning, which harmony drops from later
prompts: docs/serving.md).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time


def _json(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


@dataclasses.dataclass(frozen=True)
class Stored:
    response: bytes  # the response object as JSON, as it was sent
    conversation: bytes  # the input items it answered (earlier stored turns included), as a JSON list
    at: float  # time.monotonic() when it was stored

    @property
    def size(self) -> int:
        return len(self.response) + len(self.conversation)

    def continued(self) -> list[dict]:
        """The input items a request continuing this response starts with: the conversation and the
        response's own output items (parsed here: call it off the event loop)."""
        return json.loads(self.conversation) + json.loads(self.response)["output"]


class ResponseStore:
    """The stored responses, at most `count` of them and `max_bytes` of their JSON, each for at most
    `seconds`; safe on any thread. A response larger than `max_bytes` alone is not kept."""

    def __init__(self, count: int, seconds: float, max_bytes: int = 2**30):
        self.count, self.seconds, self.max_bytes = count, seconds, max_bytes
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> bool:
        """Keep a response (written as JSON here: a worker thread's work) -> whether it was kept."""
        stored = Stored(_json(response), _json(conversation), time.monotonic())
        with self._lock:
            self._pop(response["id"])
            if stored.size > self.max_bytes or self.count == 0:
                return False
            self._items[response["id"]] = stored
            self._bytes += stored.size
            self._expire()
            while len(self._items) > self.count or self._bytes > self.max_bytes:
                self._pop(next(iter(self._items)))
            return True

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._pop(response_id) is not None

    def stats(self) -> dict:
        """{"stored_responses": how many, "stored_response_bytes": their JSON's bytes}."""
        with self._lock:
            self._expire()
            return {"stored_responses": len(self._items), "stored_response_bytes": self._bytes}

    def __len__(self) -> int:
        return self.stats()["stored_responses"]

    def _pop(self, response_id: str) -> Stored | None:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self._bytes -= stored.size
        return stored

    def _expire(self) -> None:
        oldest = time.monotonic() - self.seconds
        while self._items and next(iter(self._items.values())).at < oldest:
            self._pop(next(iter(self._items)))
