"""A request to the serving engine: its prompt, its own settings, and the stream of its tokens.

The engine's thread appends tokens and finishes the request; any other thread reads them with
`tokens()` (a generator that blocks for the next one), `result()` (all of them, once finished) or
cancels with `cancel()` (its slot is freed at the engine's next step). A `listener` given to
`Engine.submit` is called on the engine's thread with each token and with None once the request
has finished (an asyncio server hands them to its event loop with `call_soon_threadsafe`); it must
return at once and never raise (one that raises is logged and its request cancelled).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Callable, Iterator, Sequence

from ..sampling import LOGIT_BIAS_MOST, TOP_LOGPROBS, Sampling

FINISH_REASONS = ("stop", "length", "cancelled", "error")
log = logging.getLogger("gptoss_jax.serving")
LOGPROB_FLOOR = -9999.0  # the least log-probability reported (OpenAI's, for a token that cannot come)


class QueueFull(Exception):
    """The engine's waiting queue is full: try again later (a server answers 429)."""


@dataclasses.dataclass(frozen=True)
class Settings:
    """A request's own generation settings; the engine holds them per slot, as arrays."""

    max_new_tokens: int = 256
    sampling: Sampling = Sampling(temperature=0.0)
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()  # need the engine's tokenizer
    # each token's log-probability and those of this many most likely tokens (Request.logprobs); None: none
    logprobs: int | None = None
    # (token id, bias in [-100, 100]) added to those tokens' logits before anything else, at most 300
    logit_bias: tuple[tuple[int, float], ...] = ()
    # in [-2, 2], subtracted from the logit of each token the reply holds: once (presence), and once for
    # every time it occurs (frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # an llguidance grammar (Lark syntax, with %json for JSON schemas) that the reply must follow; needs
    # the engine's tokenizer (constrain.py)
    grammar: str | None = None
    # the served adapter the reply is generated under: an entry of the table the engine's parameters
    # hold (training/lora.empty_table, Engine.put_adapter); None: the base model
    adapter: int | None = None

    def __post_init__(self):
        if len(self.logit_bias) > LOGIT_BIAS_MOST:
            raise ValueError(f"logit_bias takes at most {LOGIT_BIAS_MOST} tokens, got {len(self.logit_bias)}")
        if any(not -100 <= b <= 100 for _, b in self.logit_bias):
            raise ValueError("a logit bias must lie in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {TOP_LOGPROBS}] (alternatives a token), got {self.logprobs}")
        if not (-2 <= self.presence_penalty <= 2 and -2 <= self.frequency_penalty <= 2):
            raise ValueError("presence and frequency penalties must lie in [-2, 2]")
        if self.max_new_tokens < 1:
            raise ValueError(f"max new tokens must be >= 1, got {self.max_new_tokens}")
        if not -2**31 <= self.seed < 2**31:
            raise ValueError(f"the seed must be a 32-bit signed integer, got {self.seed}")
        if any(not s for s in self.stop_strings):
            raise ValueError("a stop string must not be empty")


def check_prompt(prompt: list[int], settings: Settings, vocab: int, max_len: int, adapters: int = 0) -> None:
    """ValueError for a prompt an engine of this vocabulary and context, serving this many adapters,
    cannot take."""
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab or any(not 0 <= t < vocab for t, _ in settings.logit_bias):
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), and those of logit_bias too")
    if len(prompt) + settings.max_new_tokens > max_len:
        raise ValueError(f"a prompt of {len(prompt)} tokens plus {settings.max_new_tokens} new tokens exceeds the "
                         f"max context of {max_len}")
    if settings.adapter is not None and not 0 <= settings.adapter < adapters:
        raise ValueError(f"adapter {settings.adapter}: the engine serves {adapters} adapters"
                         + (f" (0 to {adapters - 1})" if adapters else ""))


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability, and the most likely tokens' (id, log-probability), most
    likely first (sampling.token_logprobs says of which distribution)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    @classmethod
    def of_row(cls, picked, i: int, n: int) -> TokenLogprob:
        """Row i of a step's (log-probabilities [B], top ids [B, k], top log-probabilities [B, k]), with
        its n most likely tokens."""
        chosen, ids, top = picked
        floor = LOGPROB_FLOOR  # a token a grammar forbids has -inf, which JSON cannot carry
        return cls(max(float(chosen[i]), floor), tuple((t, max(v, floor)) for t, v in zip(ids[i, :n].tolist(),
                                                                                          top[i, :n].tolist())))


_DONE = object()


class Request:
    """One request in the engine; made by `Engine.submit`."""

    def __init__(self, request_id: int, prompt_ids: Sequence[int], settings: Settings,
                 listener: Callable[[int | None], None] | None = None):
        self.id = request_id
        self.prompt_ids = [int(t) for t in prompt_ids]
        self.settings = settings
        self.output_ids: list[int] = []
        self.token_times: list[float] = []  # when each token reached the request (time.perf_counter)
        # each token's TokenLogprob, when the settings ask for them (set before the listener hears of it)
        self.logprobs: list[TokenLogprob] | None = None if settings.logprobs is None else []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.invalid = False  # the error was the request's own making (a grammar that cannot be followed)
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._cancelled = False
        self._listener = listener
        self.cached_tokens: int | None = None  # prompt tokens found in the KV cache at admission
        # The engine's, kept across a preemption: the names of its pages (pages.py), its reply as text,
        # its stop strings' matcher and its grammar's.
        self._page_names: list[bytes] = []
        self._page_seed: bytes | None = None  # their chain's start, fixed when first asked (Scheduler.seed)
        self._decoder = self._stops = None
        self._matcher = None  # its grammar's state (constrain.py), each token it has read consumed
        self._after: Request | None = None  # admitted once this one has its first token (Engine.submit)

    # Read by any thread ------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop generating for this request: its pages are freed at the engine's next step."""
        self._cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def tokens(self, timeout: float | None = None) -> Iterator[int]:
        """Each new token id as it is generated, until the request finishes. timeout: the most seconds
        to wait for one token (TimeoutError after)."""
        while True:
            try:
                item = self._events.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no token within {timeout} s") from None
            if item is _DONE:
                return
            yield item

    def result(self, timeout: float | None = None) -> list[int]:
        """Every generated token id, once the request has finished (TimeoutError after `timeout` s)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return list(self.output_ids)

    # Written by the engine's thread only ------------------------------------------------------------

    def _add(self, token: int, now: float, logprob: TokenLogprob | None = None) -> None:
        if self.first_token_at is None:
            self.first_token_at = now
        if self.logprobs is not None:
            self.logprobs.append(logprob)
        self.output_ids.append(token)
        self.token_times.append(now)
        self._events.put(token)
        self._tell(token)

    def _finish(self, reason: str, now: float, error: str | None = None, invalid: bool = False) -> None:
        assert reason in FINISH_REASONS, reason
        self.finish_reason, self.error, self.finished_at, self.invalid = reason, error, now, invalid
        self._events.put(_DONE)
        self._done.set()
        self._tell(None)

    def _tell(self, item: int | None) -> None:
        """The listener told of a token (None: the end). One that raises breaks its contract: it is
        logged and the request cancelled, freed at the engine's next step as any cancellation (with
        several processes, the others free it too: a failure only here must not make them part)."""
        if self._listener is None:
            return
        try:
            self._listener(item)
        except Exception as e:  # noqa: BLE001 -- the listener's own failure
            log.error("request %d: its listener failed: %s: %s; the request is cancelled", self.id,
                      type(e).__name__, e)
            self._cancelled = True
