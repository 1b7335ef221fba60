"""Stored responses (the Responses API's `store`, `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`): each finished response kept with the conversation it answered, in memory,
bounded by count (the oldest goes first) and by age. A later request that names it as
`previous_response_id` continues that conversation: its input items are the stored conversation,
the stored response's output, then its own. The conversation's tokens, rendered again, begin with
those of the earlier request, so the KV cache's prefix reuse finds them (up to the earlier turns'
reasoning, which harmony drops from later prompts: docs/serving.md).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time


@dataclasses.dataclass(frozen=True)
class Stored:
    response: dict  # the response object, as it was sent
    conversation: list[dict]  # the input items it answered (earlier stored turns included), as dicts
    at: float  # time.monotonic() when it was stored

    def continued(self) -> list[dict]:
        """The input items a request continuing this response starts with: the conversation and the
        response's own output items."""
        return self.conversation + [dict(item) for item in self.response["output"]]


class ResponseStore:
    """The stored responses, at most `count` of them, each for at most `seconds`; safe on any thread."""

    def __init__(self, count: int, seconds: float):
        self.count, self.seconds = count, seconds
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = Stored(response, conversation, time.monotonic())
            self._items.move_to_end(response["id"])
            self._expire()
            while len(self._items) > self.count:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> Stored | None:
        with self._lock:
            self._expire()
            return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            self._expire()
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            self._expire()
            return len(self._items)

    def _expire(self) -> None:
        oldest = time.monotonic() - self.seconds
        while self._items and next(iter(self._items.values())).at < oldest:
            self._items.popitem(last=False)
