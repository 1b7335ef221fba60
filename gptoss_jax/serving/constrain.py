"""Grammars that constrain a reply (structured outputs), by llguidance: a request's `Settings.grammar`
(Lark syntax, JSON schemas inlined with %json) becomes a matcher that follows the tokens the request
has read, and that says, before each of its picks, which tokens may come next: a mask of one bit a
token ([n, ceil(V / 32)] int32, token t: bit t % 32 of word t // 32), which the pick applies on the
devices (steps.adjust).

    grammars = Grammars(tokenizer, vocab_size)
    grammars.check(text)                  # ValueError naming what is wrong; compiled once, then cached
    matcher = grammars.matcher(text)      # a request's own state
    grammars.masks([matcher, None], out)  # out [2, words]: the matcher's tokens; every token for None
    grammars.consume(matcher, token)      # False: the token breaks the grammar

llguidance was picked over xgrammar and outlines-core by measurement on the o200k_harmony vocabulary
(bench/grammar_engines.py, docs/serving.md): its masks take a fraction of a millisecond, a schema
compiles in milliseconds (nothing is built over the whole vocabulary per schema), and it depends on
nothing else (xgrammar needs torch). The masks of a step's rows are made on the host while the
devices run the step's model (engine.py), in llguidance's own threads.
"""

from __future__ import annotations

import collections
import threading

import numpy as np


GRAMMARS_KEPT = 256  # compiled grammars cached (a server's few schemas, each reused by many requests)


class Grammars:
    """Compiled grammars and their matchers for one tokenizer (see the module); any thread may call."""

    def __init__(self, tokenizer, vocab_size: int):
        self._encoding, self.vocab_size = tokenizer, vocab_size
        self._tokenizer = self._executor = None  # built by `load` or at first use (about a second)
        self._compiled: collections.OrderedDict[str, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _llguidance(self):
        try:
            import llguidance
            import llguidance.tiktoken
        except ImportError:
            raise ValueError("grammars (structured outputs) need llguidance: pip install 'gptoss-jax[serve]'") from None

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.tiktoken.lltokenizer_from_encoding(self._encoding)
                self._executor = llguidance.LLExecutor()
        return llguidance

    def _template(self, grammar: str):
        with self._lock:
            if grammar in self._compiled:
                self._compiled.move_to_end(grammar)
                return self._compiled[grammar]
        llguidance = self._llguidance()
        try:
            compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
        except Exception as e:  # noqa: BLE001 -- llguidance's own error, said as it says it
            raise ValueError(f"the grammar does not compile: {e}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, compiled)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > GRAMMARS_KEPT:
                self._compiled.popitem(last=False)
        return matcher

    def load(self) -> None:
        """Make llguidance's view of the vocabulary now (about a second, holding Python's lock: a server
        does it while it warms up, not at its first constrained request); nothing without llguidance,
        until a request asks for a grammar."""
        try:
            self._llguidance()
        except ValueError:
            pass

    def check(self, grammar: str) -> None:
        """Compile the grammar (kept for the requests that follow) -> ValueError if it is wrong."""
        self._template(grammar)

    def matcher(self, grammar: str):
        """A new matcher at the grammar's start (ValueError if the grammar is wrong)."""
        return self._template(grammar).deep_copy()

    def masks(self, matchers: list, out: np.ndarray) -> np.ndarray:
        """out [n, words] int32 (mask_words(vocab_size)): row i the tokens matchers[i] allows next,
        every token for a None (a row without a grammar) -> out."""
        import llguidance.numpy

        out[:] = -1
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return out
        words = llguidance.numpy.get_bitmask_shape(len(matchers), self._tokenizer.vocab_size)[1]
        full = np.zeros((len(matchers), max(words, out.shape[1])), np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, full)
        for _, i in rows:  # tokens past the tokenizer's vocabulary (the model's padding) are never allowed
            out[i] = full[i, :out.shape[1]]
        return out

    @staticmethod
    def consume(matcher, token: int) -> bool:
        """The matcher follows the token -> False when the grammar does not allow it."""
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    @staticmethod
    def error(matcher) -> str:
        return matcher.get_error() or "a token the grammar does not allow"
