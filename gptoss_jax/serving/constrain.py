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
# llguidance's work on a grammar's regular expressions before it gives up ("too many expressions"),
# a tenth of its default: a pattern such as "^a{100000}$" took 3.6 s of one mask at the default on a
# CPU here, every step of the engine waiting for it; at this fuel 0.11 s, then a 400.
LEXER_FUEL = 100_000
PROBE_STEPS = 4  # tokens a schema is followed at admission (`probe`)


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
        matcher = llguidance.LLMatcher(self._tokenizer, compiled, log_level=0, limits=llguidance.LLParserLimits(
            initial_lexer_fuel=LEXER_FUEL, verbose_errors=False))
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {self.error(matcher)}")
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

    def probe(self, grammar: str, steps: int = PROBE_STEPS) -> None:
        """Compile the grammar and follow it a few tokens (each time the lowest allowed) -> ValueError for
        what that finds: llguidance finds some faults of a JSON schema only as it computes what may
        follow (a `$ref` loop; a regex whose automaton outgrows LEXER_FUEL), which a grammar of the
        schema alone reaches in its first tokens. A few milliseconds for a schema of real use; the worst
        case is bounded by the fuel."""
        matcher, mask = self.matcher(grammar), np.empty((1, -(-self.vocab_size // 32)), np.int32)
        for _ in range(steps):
            _, failed = self.masks([matcher], mask)
            if failed:
                raise ValueError(f"the schema cannot be followed: {failed[0][1]}")
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.vocab_size])
            if not len(allowed):
                return
            if not self.consume(matcher, int(allowed[0])):  # an allowed token refused: the grammar failed
                raise ValueError(f"the schema cannot be followed: {self.error(matcher)}")

    def matcher(self, grammar: str):
        """A new matcher at the grammar's start (ValueError if the grammar is wrong)."""
        return self._template(grammar).deep_copy()

    def masks(self, matchers: list, out: np.ndarray) -> tuple[np.ndarray, list[tuple[int, str]]]:
        """out [n, words] int32 (mask_words(vocab_size)): row i the tokens matchers[i] allows next,
        every token for a None (a row without a grammar) -> (out, [(i, the error) for each matcher that
        failed: its row allows every token, and its request is to end]). llguidance finds some errors
        only as it goes (a schema that loops, a regex too large to follow): each is its matcher's alone."""
        import llguidance.numpy

        out[:] = -1
        rows = [(m, i) for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return out, []
        words = llguidance.numpy.get_bitmask_shape(len(matchers), self._tokenizer.vocab_size)[1]
        full = np.zeros((len(matchers), max(words, out.shape[1])), np.int32)
        raised: dict[int, str] = {}
        try:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, rows, full)
        except Exception:  # noqa: BLE001 -- found again, matcher by matcher, to end only its request
            for m, i in rows:
                try:
                    llguidance.numpy.fill_next_token_bitmask(m, full, i)
                except Exception as e:  # noqa: BLE001 -- llguidance's own error, said as it says it
                    raised[i] = str(e).splitlines()[0] if str(e) else type(e).__name__
        failed = [(i, raised.get(i) or self.error(m)) for m, i in rows if i in raised or m.is_error()]
        for _, i in rows:  # tokens past the tokenizer's vocabulary (the model's padding) are never allowed
            out[i] = full[i, :out.shape[1]]
        for i, _ in failed:
            out[i] = -1
        return out, failed

    @staticmethod
    def consume(matcher, token: int) -> bool:
        """The matcher follows the token -> False when the grammar does not allow it."""
        return bool(matcher.consume_token(token)) and not matcher.is_error()

    @staticmethod
    def error(matcher) -> str:
        """A failed matcher's error, its first line (llguidance's own words, without its state)."""
        text = (matcher.get_error() or "").replace("<non-verbose/>", "").strip()
        return text.splitlines()[0] if text else "a token the grammar does not allow"
