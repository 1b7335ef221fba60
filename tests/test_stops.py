"""Stop strings in streamed text (serving/stops.py, and the server's trimmer over it): the same answer
as a plain search of the whole text, however the text is cut into pieces, in time linear in it."""

import time

from hypothesis import given, settings, strategies as st

from gptoss_jax.server.harmony import StopTrimmer
from gptoss_jax.serving.stops import StopMatcher

ALPHABET = "ab\u00e9"  # few letters: many partial matches and overlaps


def first_completed(text: str, stops) -> int | None:
    """Where the stop string that completes first (earliest end; of those, earliest start) starts."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return min(ends)[1] if ends else None


def pieces(text: str, cuts: list[int]) -> list[str]:
    cuts = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(cuts, cuts[1:])]


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.text(ALPHABET, max_size=40), st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4),
       st.lists(st.integers(0, 50), max_size=8))
def test_the_matcher_finds_what_a_search_of_the_whole_text_finds(text, stops, cuts):
    matcher = StopMatcher(stops)
    found = None
    for piece in pieces(text, cuts):
        found = matcher.feed(piece)
        if found is not None:
            break
    # the plain search over the text up to where the matcher stopped reading
    assert found == first_completed(text, stops)
    if found is None:  # what it holds back is the longest end of the text that begins a stop string
        assert matcher.partial == max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.text(ALPHABET, max_size=40), st.lists(st.text(ALPHABET, min_size=1, max_size=6), min_size=1, max_size=4),
       st.lists(st.integers(0, 50), max_size=8))
def test_the_trimmer_gives_the_text_before_the_stop(text, stops, cuts):
    trim = StopTrimmer(tuple(stops))
    out = "".join(trim.add(p) for p in pieces(text, cuts)) + trim.finish()
    cut = first_completed(text, stops)
    assert out == (text if cut is None else text[:cut])
    assert trim.hit == (cut is not None)


def test_long_stop_strings_cost_linear_time():
    """200,000-character stop strings over 200,000 characters of text that keeps almost matching them
    (the worst case of the old check, which compared every prefix of every stop string at each
    piece: about 10^10 character comparisons here). Linear: well under a second on any machine."""
    n = 200_000
    stops = ["a" * (n - 1) + "b", "a" * (n - 2) + "c"]
    matcher, trim = StopMatcher(stops), StopTrimmer(tuple(stops))
    start = time.perf_counter()
    for _ in range(n // 4):
        assert matcher.feed("aaaa") is None
        trim.add("aaaa")
    assert time.perf_counter() - start < 20  # quadratic would take hours
    assert matcher.partial == n - 1 and matcher.feed("b") == 1
