"""Speculative decoding in the serving engine: while few sequences decode, each step checks a draft
of up to k tokens per sequence in one pass of the model over k + 1 positions (decoding/acceptance.py
has the rule), and a sequence gains every drafted token the model agrees with, then one of its own.

    engine = Engine(config, params, draft=PromptLookup(), draft_tokens=3, speculate_rows=16)

A step speculates when at most `speculate_rows` sequences decode, none of them asks for
log-probabilities or adjusted logits (logit bias, penalties, a grammar: those need the counts and
masks of every token picked, one step at a time), and one of them is due to draft; otherwise, and
when no sequence has a draft, the step decodes one token each as usual. Past that many rows a
step's work grows with its positions (the GPU's compute, not the weights' reading, bounds it),
which is where vLLM's and SGLang's users found speculation costs throughput.

Nothing of a rejected draft needs undoing in the paged cache: attention never reads a position at
or past a sequence's length (paged_cache.py), and the next step writes its own tokens over the
rejected ones before anything reads them.

Every checked step is the program of decoding/checked.py (the command line's too). By default the
drafts are made on the host. With `steps` > 0, a draft source that proposes on the devices
(drafts/base.py's `DeviceDraft`, as `PromptLookup` is) runs up to `steps` checked steps a call
there while nothing else waits to run and a sequence is due: the call is
queued before the host reads the tokens of the decode step before it (it takes each row's latest
token from the devices), and the host reads the call's tokens once. A source on the host makes
each step synchronous: the drafts follow the tokens of the step before, so those are read first
(the decode steps' pipelining is given up for the step, also where no sequence then has a draft
and the step checks one position a sequence). On either path a sequence whose draft was empty or
wholly rejected waits before it drafts again, at most 2, 4, 8, then `MOST_WAIT` steps
(decoding/acceptance.py); one accepted drafted token makes it draft every step again. Over text
that repeats nothing, once its sequences have backed off that far, at most one step in
`MOST_WAIT` waits for its tokens (on the host) or checks k + 1
positions. A new sequence (and one taken back after a preemption) drafts at once.

Greedy rows take the model's argmax, so a greedy request's tokens are those it gives without
speculation (up to the rounding of a pass over several positions against one).
Sampled rows follow the speculative-sampling rule over the distribution `sample_rows` draws from,
with the key fold_in(key(seed), sampling step of the step's first token): the same distribution as
without speculation, not the same draws.

Legend: R = rows, B = rows checked together, T = k + 1 positions, V = vocabulary.
"""

from __future__ import annotations

import functools
import logging

import jax
import numpy as np

from ..decoding.acceptance import MOST_WAIT
from ..decoding.checked import CheckedSteps, Plan, checked_steps
from ..drafts.base import GIVEN, Draft, on_devices
from ..sampling import MODES
from . import steps
from .config import EngineConfig

log = logging.getLogger("gptoss_jax.serving")


def stateful(draft) -> bool:
    """Whether a draft source keeps a state that follows every step (an EAGLE-3 head)."""
    return on_devices(draft) and bool(draft.capture)


def speculable(settings) -> bool:
    """Whether a request's steps may be speculated: no log-probabilities, nothing adjusting its logits."""
    return settings.logprobs is None and not steps.adjusted(settings)


@functools.partial(jax.jit, donate_argnames=("history",))
def write_history(history, writes):
    """history [R, L]; writes int32 [3, U]: rows, positions, tokens (row R: padding) -> history."""
    return history.at[writes[0], writes[1]].set(writes[2], mode="drop")


HISTORY_WRITES = 4096  # history entries set by one call (a long prompt takes several)


class Speculation:
    """An engine's speculative decoding (see the module): drafts from `draft`, k = options.draft_tokens
    a step, for steps of at most options.speculate_rows decoding sequences, checked `sizes` rows at a
    time (the engine's decode sizes up to the first that holds those rows). speculate_steps 0: drafts
    made on the host, a step at a time; else a draft that proposes on the devices runs up to that
    many checked steps a call there while nothing else waits to run (no more than prefill_chunk //
    (k + 1): the positions a call may write)."""

    def __init__(self, draft: Draft, options: EngineConfig, decode_sizes: list[int]):
        tokens, rows, steps = options.draft_tokens, options.speculate_rows, options.speculate_steps
        self.k, self.rows = tokens, min(rows, decode_sizes[-1])
        self.sizes = [b for b in decode_sizes if b < self.rows] + [next(b for b in decode_sizes if b >= self.rows)]
        self._steps = min(steps, options.prefill_chunk // (tokens + 1))  # (0: drafts on the host)
        self.use(draft)
        self.now = 1  # checked steps the coming call may run
        self.history = None  # [slots, max_len] each row's tokens so far, on the devices (drafted there)
        self.clock = 0  # engine steps so far (`wanted` is asked once a step; a call of several counts them all)

    @property
    def draft(self) -> Draft:
        return self._source

    def use(self, draft: Draft) -> None:
        """Draft with this source from the next step on (a source that proposes on the devices, of
        another kind or shape than the last warmed up, compiles its steps at its first call)."""
        if not (callable(draft) or (self._steps > 0 and on_devices(draft))):
            raise ValueError(f"a draft source of the engine proposes on the host (a callable) or, with "
                             f"speculate_steps > 0, on the devices; {type(draft).__name__} does neither")
        if stateful(getattr(self, "_source", None)) or (stateful(draft) and hasattr(self, "_source")):
            raise ValueError("a draft source with a state (an EAGLE-3 head) follows every step of the engine from "
                             "its start: give it to Engine(draft=...), and change to no other")
        self._source = draft
        self.on_devices = self._steps > 0 and on_devices(draft)
        self.most = self._steps if self.on_devices else 1
        self.keeps_history = self.on_devices and draft.reads_history  # (the rows' tokens on the devices)
        self._arrays = None  # (the draft, its arrays on the devices) once placed

    def wanted(self, decoding, alone: bool = True) -> bool:
        """Whether this step of these decoding sequences speculates (their tokens not read yet): where
        one of them is due to draft; alone: nothing else waits to run, so that a call may run several
        checked steps (while one is due)."""
        self.clock += 1
        self.now = self.most if alone else 1
        return (0 < len(decoding) <= self.rows and all(speculable(s.request.settings) for s in decoding)
                and any(self._due(s) for s in decoding))

    def _due(self, seq) -> bool:
        return seq.draft_due <= self.clock

    def ahead(self, seq) -> int:
        """Positions a speculated step of the sequence may write: its latest token and, where it is due
        to draft, its draft (drafted on the devices: those of every step the call may run)."""
        if self.on_devices:  # any of the call's steps may draft
            return min(self.now * (self.k + 1), seq.request.settings.max_new_tokens - seq.queued)
        return min(self.k + 1 if self._due(seq) else 1, seq.request.settings.max_new_tokens - seq.queued)

    def warm_up(self, engine) -> str:
        """Compile the checked steps (padding rows only: nothing changes) -> what was compiled."""
        for B in self.sizes:
            jax.block_until_ready(self._check_steps(engine, [None] * B, 0, self._given([None] * B, engine)))
        if self.keeps_history:
            padding = engine.device.put(np.full((3, HISTORY_WRITES), engine.slots, np.int32))  # dropped
            self.history = write_history(self._history(engine), padding)
        if self.on_devices:
            return (f"checked drafts [{', '.join(map(str, self.sizes))}] x {self.k + 1} positions (or 1), up to "
                    f"{self.most} a call, drafted on the devices")
        return (f"checked drafts [{', '.join(map(str, self.sizes))}] x {self.k + 1} positions (or 1), "
                f"picks ({', '.join(MODES)})")

    def _draft(self, seq, vocab: int) -> list[int]:
        """The sequence's draft: at most what its budget leaves after the step's own token, cut at the
        first id outside the vocabulary (a draft source's bug must not reach the cache); none where the
        draft source fails on this sequence (logged: the sequence decodes on, its neighbours untouched)."""
        room = self.ahead(seq) - 1
        try:
            draft = list(self.draft(seq.request.prompt_ids + seq.request.output_ids, room))
        except Exception as e:  # noqa: BLE001 -- the draft source's failure, not the request's
            log.error("request %d: the draft source failed, no draft this step: %s: %s", seq.request.id,
                      type(e).__name__, e)
            return []
        ok = [0 <= int(t) < vocab for t in draft[:room]]
        return [int(t) for t in draft[:ok.index(False) if False in ok else len(ok)]]

    def _given(self, seqs, engine) -> dict | None:
        """The host's drafts of these rows (None: padding) as a `Given` draft's arrays; None on the
        devices (the draft source's own arrays are used there)."""
        if self.on_devices:
            return None
        drafts, counts = np.zeros((len(seqs), self.k), np.int32), np.zeros(len(seqs), np.int32)
        for i, seq in enumerate(seqs):
            if seq is not None and self._due(seq):
                draft = self._draft(seq, engine.config.vocab_size)
                drafts[i, :len(draft)], counts[i] = draft, len(draft)
        return {"drafts": engine.device.put(drafts), "counts": engine.device.put(counts)}

    def queue(self, engine, decoding):
        """Drafted on the devices: queue the call of these sequences' checked steps before the step
        before's tokens are read, so that the host reads them while the call runs (the call takes each
        row's latest token from the devices) -> (the sequences, the call's outputs); None drafted on the
        host, or where none of them is due any more (preempted since `wanted`: the step decodes)."""
        live = [s for s in decoding if engine.scheduler.rows[s.row] is s]
        if not (self.on_devices and any(self._due(s) for s in live)):
            return None
        if self.keeps_history:
            self._sync_history(engine, live)  # (but the tokens not read yet: the call writes the latest)
        B = next(b for b in self.sizes if b >= len(live))
        return live, self._check_steps(engine, live + [None] * (B - len(live)), self.now)

    def step(self, engine, decoding, queued=None) -> None:
        """Hand out the tokens of a call `queue` queued (drafted on the devices); drafted on the host,
        draft for these sequences (the step before's tokens read: those that ended are left out),
        check the drafts and hand out their tokens."""
        if queued is None:
            live = [s for s in decoding if engine.scheduler.rows[s.row] is s]
            if any(len(s.request.output_ids) != s.queued for s in live):
                raise RuntimeError("a speculated step needs every token sampled before it read")
            if not live:
                return
            B = next(b for b in self.sizes if b >= len(live))
            seqs = live + [None] * (B - len(live))
            queued = live, self._check_steps(engine, seqs, 1, self._given(seqs, engine))
        self._read_call(engine, *queued)

    def _check_steps(self, engine, seqs, steps: int, given: dict | None = None):
        """The checked steps of these rows (None: padding), at most `steps`, in the running rows'
        sampling mode, with the host's drafts `given` (None: drafted on the devices) -> the Outcome,
        on the devices."""
        plan = np.array([[engine.slots if s is None else s.row for s in seqs],
                         [0 if s is None else s.length for s in seqs],
                         [0 if s is None else s.request.settings.max_new_tokens - s.queued for s in seqs],
                         [0 if s is None else s.queued for s in seqs],
                         [0 if s is None else s.draft_misses for s in seqs],
                         [0 if s is None else s.draft_due for s in seqs]], np.int32)
        settings, mode, _ = engine.row_settings()
        run = np.array([steps, self.clock, MODES.index(mode)], np.int32)
        spec = CheckedSteps(engine.device.model, self.draft if given is None else GIVEN, self.k, self.most, MOST_WAIT)
        put, head = engine.device.put, engine.device.head
        if given is None and self.draft.arrays() is not None and (self._arrays is None or
                                                                  self._arrays[0] is not self.draft):
            placed = head[1] if head is not None and head[0] is self.draft else jax.tree.map(put, self.draft.arrays())
            self._arrays = (self.draft, placed)
        arrays = given if given is not None else None if self._arrays is None else self._arrays[1]
        history = self._history(engine) if given is None and self.keeps_history else None
        outcome, history = engine.device.run_checked(lambda cache, last, state: checked_steps(
            spec, engine.params, cache, history, last, Plan(put(plan), put(run), settings), arrays,
            state if given is None else None))
        if history is not None:
            self.history = history
        return outcome

    def _history(self, engine):
        """The history on the devices: made at the first call, and again after a failed call consumed it
        (the engine's rows were reset then, so each sequence's tokens are written again)."""
        if self.history is None or self.history.is_deleted():
            self.history = engine.device.put(np.zeros((engine.slots, engine.max_len), np.int32))
        return self.history

    def _sync_history(self, engine, live) -> None:
        """Each sequence's tokens that the history on the devices lacks (a new one's prompt, the tokens
        of steps outside these calls) written there."""
        writes = []
        for seq in live:
            prompt, reply = seq.request.prompt_ids, seq.request.output_ids
            at = seq.drafted_from
            new = prompt[at:] + reply[max(at - len(prompt), 0):]  # (the tokens after the last call's: few)
            writes += [(seq.row, p, t) for p, t in enumerate(new, at)]
            seq.drafted_from = at + len(new)
        for part in steps.in_parts(writes, HISTORY_WRITES, engine.slots):
            self.history = write_history(self._history(engine), engine.device.put(part))

    def _read_call(self, engine, live, outcome) -> None:
        """Hand out the tokens of a call of checked steps to its sequences (those that ended meanwhile,
        at the step before's tokens, are left out: their tokens are dropped)."""
        try:
            new, counts, drafted, accepted, ran, plan = jax.device_get(outcome[:6])  # one wait for all
        except Exception:  # a failed call's outputs carry its error: the engine resets its rows
            self.history = None
            raise
        ran = int(ran)
        metrics = engine.metrics
        metrics.drafting_steps += ran
        metrics.speculative_steps += int((drafted[:ran] > 0).any(axis=1).sum())
        self.clock += max(ran - 1, 0)
        for i, seq in enumerate(live):
            if engine.scheduler.rows[seq.row] is not seq:
                continue
            total = int(counts[:ran, i].sum())
            metrics.draft_tokens += int(drafted[:ran, i].sum())
            metrics.accepted_draft_tokens += int(accepted[:ran, i].sum())
            seq.length, seq.queued = seq.length + total, seq.queued + total
            seq.draft_misses, seq.draft_due = int(plan[4, i]), int(plan[5, i])
            for token in new[:ran, i][np.arange(self.k + 1)[None] < counts[:ran, i, None]]:
                if engine.scheduler.rows[seq.row] is not seq:
                    break
                engine.emit(seq, int(token))
            if engine.scheduler.rows[seq.row] is seq:
                seq.drafted_from = len(seq.request.prompt_ids) + len(seq.request.output_ids)
                engine.scheduler.after_step(seq)
