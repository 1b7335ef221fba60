"""Stop strings found in text that arrives piece by piece, in time linear in the text however long
the stop strings are: one Knuth-Morris-Pratt automaton per stop string, each advanced a character
at a time. The engine stops a request with it; the server trims the reply's text with it.

Which match counts: the first to complete as the text grows (the engine stops there, so no later
one can complete); of several completing at the same character, the one starting first.
"""

from __future__ import annotations

from typing import Sequence

from ..tokenizer import StreamDecoder


def _failure(s: str) -> list[int]:
    """fail[i]: the length of the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class StopMatcher:
    """Feed text with `feed`; it tells where the first stop string that completes starts."""

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("a stop string must not be empty")
        self.stops = tuple(stops)
        self._fail = [_failure(s) for s in self.stops]
        self._state = [0] * len(self.stops)  # characters of each stop string matched at the text's end
        self.fed = 0  # characters fed so far
        self.match: int | None = None  # where the match starts (an offset into all text fed), once found

    def feed(self, text: str) -> int | None:
        """More text -> the offset (into all the text fed) where the first completed stop string starts,
        or None while none has. Once one has, more text changes nothing."""
        if self.match is not None or not self.stops:
            return self.match
        stops, fail, state = self.stops, self._fail, self._state
        for pos, ch in enumerate(text):
            for i, s in enumerate(stops):
                k = state[i]
                while k and s[k] != ch:
                    k = fail[i][k - 1]
                if s[k] == ch:
                    k += 1
                if k == len(s):
                    start = self.fed + pos + 1 - k
                    self.match = start if self.match is None else min(self.match, start)
                    k = fail[i][k - 1]
                state[i] = k
            if self.match is not None:
                self.fed += pos + 1
                return self.match
        self.fed += len(text)
        return None

    @property
    def partial(self) -> int:
        """How many of the last characters fed may begin a stop string (text a trimmer holds back)."""
        return max(self._state, default=0)


def ends(request, token: int, tokenizer) -> bool:
    """Whether a request's newest token stops it: one of its stop tokens, or the end of one of its stop
    strings in the reply's text (the request keeps the reply's decoder and matcher, so that each token
    costs time linear in its text)."""
    settings = request.settings
    if token in settings.stop_ids:
        return True
    if not settings.stop_strings:
        return False
    if request._stops is None:
        request._decoder, request._stops = StreamDecoder(tokenizer), StopMatcher(settings.stop_strings)
    return request._stops.feed(request._decoder.add(token)) is not None
