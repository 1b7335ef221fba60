"""The serving engine's token picks (decoding/steps.py's pick_first, pick_next) and what they need beside the
logits: every row's sampling settings on the devices (sent again only when a row changes hands), the
counts of each row's generated tokens for the penalties (on the devices, set for a row when a
penalized request takes it), and the grammar masks of the rows that have a grammar (made on the host
from their matchers: constrain.py; every other row's mask allows every token and stays on the devices).
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..decoding.steps import pick_first, pick_next
from ..sampling import rows_mode
from . import steps
from .request import Request


class Picks:
    """One engine's picks over `slots` rows (see the module). put: a host array onto the devices."""

    def __init__(self, slots: int, vocab: int, mesh, put, grammars=None, tokenizer=None):
        self.slots, self.vocab, self.mesh, self._put, self.grammars = slots, vocab, mesh, put, grammars
        # Tokens below it count for the penalties: not the tokenizer's special tokens (harmony's frame).
        self.counted = vocab if tokenizer is None else min(map(tokenizer.encode_single_token,
                                                               tokenizer.special_tokens_set))
        self.reset()

    def reset(self) -> None:
        """No row's counts (a failed step may have consumed them), the rows' settings sent again."""
        self.counts = self._put(np.zeros((self.slots, self.vocab), np.int16))
        self._host = steps.sampling_arrays(self.slots)  # every row's settings, on the host
        self._rows = None  # (the scheduler's changes when made, settings on the devices, mode, wants)
        self._all = {}  # n -> a mask [n, words] that allows every token, on the devices
        self.broken: list[tuple[Request, str]] = []  # rows whose grammar failed at the latest masks (`mask`)
        self._running = True  # False during a warm-up (`compiling`): the picks compile without running

    @contextlib.contextmanager
    def compiling(self):
        """The picks compile and return zeros in place of their tokens, without running (a warm-up's:
        nothing is picked for anyone, and a sort of the vocabulary costs a CPU more than compiling it)."""
        self._running = False
        try:
            yield
        finally:
            self._running = True

    def rows(self, requests: list[Request | None], changes: int):
        """Every row's settings on the devices (requests [R]: the row's, None where idle), the decode's
        sampling mode and what its picks do beyond sampling (steps.wants), sent again when `changes`
        moves."""
        if self._rows is None or self._rows[0] != changes:
            running = [r for r in requests if r is not None]
            self._rows = (changes, tuple(self._put(x.copy()) for x in self._host),
                          rows_mode([r.settings.sampling for r in running]),
                          steps.wants([r.settings for r in running]))
        return self._rows[1:]

    def taken(self, request: Request, row: int) -> None:
        """A request took a row: its settings become the row's (an error here is the request's alone: the
        engine ends it), and a penalized one's counts its reply's so far (none, or those it had when it
        was preempted)."""
        steps.set_row(self._host, row, request.settings)
        self._rows = None
        if steps.penalized(request.settings):
            ids = np.asarray(request.output_ids, np.int64)
            values = np.bincount(ids[ids < self.counted], minlength=self.vocab)[:self.vocab]
            self.counts = steps.set_counts(self.counts, self._put(np.int32(row)),
                                           self._put(np.minimum(values, steps.COUNT_MOST).astype(np.int16)))

    def warm_up(self) -> None:
        """Compile set_counts (row 0 set to zeros: nothing holds a row during a warm-up); the rows'
        settings are sent again at the next pick (the warm-up's steps left others in their place)."""
        self._rows = None
        self.counts = steps.set_counts(self.counts, self._put(np.int32(0)), self._put(np.zeros(self.vocab, np.int16)))

    def mask(self, requests: list[Request | None]):
        """The masks [n, words] of these picks' rows (a request without a grammar, or None: every token).
        A row whose grammar fails here (llguidance finds some errors only as it goes) allows every token
        and is listed in `broken` with the error, for the engine to end that request alone."""
        matchers = [r._matcher if r is not None and not r.finished else None for r in requests]
        if not any(m is not None for m in matchers):
            n = len(requests)
            if n not in self._all:
                self._all[n] = self._put(np.full((n, steps.mask_words(self.vocab)), -1, np.int32))
            return self._all[n]
        out = np.empty((len(requests), steps.mask_words(self.vocab)), np.int32)
        out, failed = self.grammars.masks(matchers, out)
        self.broken += [(requests[i], error) for i, error in failed]
        return self._put(out)

    def first(self, logits, last, plan, settings, mode: str, wants: tuple[bool, bool], finishing: list):
        """pick_first for a prefill (finishing: the request of each row whose prompt ends, else
        None) -> (first tokens [P], last [R], log-probabilities or None)."""
        return self._pick((pick_first, steps.count_first, steps.logprobs_first), logits, last, plan, settings,
                          mode, wants, finishing)

    def next(self, logits, last, plan, settings, mode: str, wants: tuple[bool, bool], picked: list):
        """pick_next for a decode (picked: each row's request, None for padding) -> (last [R],
        log-probabilities by row or None)."""
        return self._pick((pick_next, steps.count_next, steps.logprobs_next), logits, last, plan, settings,
                          mode, wants, picked)

    def _pick(self, steps_of, logits, last, plan, settings, mode: str, wants: tuple[bool, bool], requests):
        """The pick's outputs (a tuple), then the picked tokens' log-probabilities or None: with adjusted
        logits, the logits adjusted first and the tokens counted after (the counts kept). steps_of: the
        pick, its count and its log-probabilities' steps."""
        (pick, count, logprobs_of), (logprobs, adjusted) = steps_of, wants
        if adjusted:
            logits = steps.adjust_rows(logits, plan, settings, self.counts, self.mask(requests))
        args = (self.mesh, mode, logits, last, plan, settings)
        out = pick(*args) if self._running else steps.compiled_only(self._put, pick, *args)  # a tuple: its picked tokens first
        if adjusted:
            self.counts = count(self.mesh, self.counts, plan, out[0], counted=self.counted)
        return (*out, logprobs_of(self.mesh, logits, plan, settings, out[0]) if logprobs else None)
