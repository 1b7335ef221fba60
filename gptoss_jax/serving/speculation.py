"""Speculative decoding in the serving engine: while few sequences decode, each step checks a draft
of up to k tokens per sequence in one pass of the model over k + 1 positions (speculative.py has
the rule), and a sequence gains every drafted token the model agrees with, then one of its own.

    engine = Engine(config, params, draft=PromptLookup(), draft_tokens=3, speculate_rows=16)

A step speculates when at most `speculate_rows` sequences decode, none of them asks for
log-probabilities or adjusted logits (logit bias, penalties, a grammar: those need the counts and
masks of every token picked, one step at a time), and one of them is due to draft; otherwise, and
when no sequence has a draft, the step decodes one token each as usual. Past that many rows a
step's work grows with its positions (the GPU's compute, not the weights' reading, bounds it),
which is where vLLM's and SGLang's users found speculation costs throughput.

Nothing of a rejected draft needs undoing in the paged cache: attention never reads a position at
or past a sequence's length (paged_cache.py), and the next step writes its own tokens over the
rejected ones before anything reads them. The step is synchronous: the drafts follow the tokens of
the step before, so those are read first (the decode steps' pipelining is given up for the step,
also where no sequence then has a draft and the step decodes one token each). So a sequence whose
draft was empty or wholly rejected waits before it drafts again, at most 2, 4, 8, then `MOST_WAIT`
steps (each wait ends on a multiple of its length, so the waiting sequences come due together); one
accepted drafted token makes it draft every step again. Over text that repeats nothing, once its
sequences have backed off that far, at most one step in `MOST_WAIT` waits for its tokens. A new
sequence (and one taken back after a preemption) drafts at once.

Greedy rows take the model's argmax (`speculative.accept_sampled` with the argmax as a certainty
accepts exactly the drafts equal to it, and then takes it), so a greedy request's tokens are those
it gives without speculation (up to the rounding of a pass over several positions against one).
Sampled rows follow the speculative-sampling rule over the distribution `sample_rows` draws from,
with the key fold_in(key(seed), sampling step of the step's first token): the same distribution as
without speculation, not the same draws.

Legend: R = rows, B = rows checked together, T = k + 1 positions, V = vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..model import Transformer
from ..sampling import MODES, filtered_rows
from ..sharding import everywhere
from ..speculative import Draft, accept_sampled
from . import steps


def speculable(settings) -> bool:
    """Whether a request's steps may be speculated: no log-probabilities, nothing adjusting its logits."""
    return settings.logprobs is None and not steps.adjusted(settings)


def row_probabilities(logits, temperature, top_k, top_p, min_p, mode: str):
    """logits [N, V], each row's settings [N] -> the probabilities [N, V] its token is drawn from
    (`sample_rows`'s); a greedy row's are 1 at its argmax."""
    V = logits.shape[-1]
    greedy = jax.nn.one_hot(jnp.argmax(logits.astype(jnp.float32), axis=-1), V, dtype=jnp.float32)
    if mode == "greedy":
        return greedy
    drawn = jax.nn.softmax(filtered_rows(logits, temperature, top_k, top_p, min_p, mode), axis=-1)
    return jnp.where((temperature > 0)[:, None], drawn, greedy)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"), donate_argnames=("pool",),
                   compiler_options=steps._STEP_OPTIONS)
def check_rows(config, kernels, mesh, params, pool, tables, tokens, plan):
    """The model's pass of a checked step: tokens [B, T]: each row's latest token, then its draft; plan
    [4, B]: rows, lengths (positions cached), counts (1 + its drafted tokens; 0: padding, nothing
    written), sampling steps -> (logits [B, T, V], pool). One program for every sampling mode (the
    picks, `accept_checked`, are compiled per mode)."""
    rows, lengths, counts = plan[0], plan[1], plan[2]
    valid = jnp.arange(tokens.shape[1])[None] < counts[:, None]  # [B, T]
    logits, view = Transformer(config, kernels=kernels, mesh=mesh).apply(
        {"params": params}, tokens, steps.paged_view(pool, tables, rows, lengths), valid)
    return logits, {"pages": view["pages"]}


@functools.partial(jax.jit, static_argnames=("mesh", "mode"))
def accept_checked(mesh, mode, logits, last, tokens, plan, settings):
    """A checked step's picks: logits [B, T, V] (check_rows'), tokens and plan as there, settings: every
    row's (steps.sampling_arrays, on the devices) -> (accepted drafts [B], the token after them [B],
    last [R] with the checked rows' set to it)."""
    rows, counts, sample_steps = plan[0], plan[2], plan[3]
    B, T = tokens.shape
    valid = jnp.arange(T)[None] < counts[:, None]  # [B, T]
    seeds, temperature, top_k, top_p, min_p = (jnp.take(x, rows, mode="clip") for x in settings[:5])
    each = functools.partial(jnp.repeat, repeats=T)  # a row's settings at each of its positions
    target = row_probabilities(logits.reshape(B * T, -1), each(temperature), each(top_k), each(top_p), each(min_p),
                               mode).reshape(B, T, -1)
    accepted, nxt = accept_rows(seeds, sample_steps, target, tokens[:, 1:], valid[:, 1:])
    at = jnp.where(counts > 0, rows, last.shape[0])  # padding: dropped
    last = last.at[at].set(nxt, mode="drop")
    return everywhere(accepted, mesh), everywhere(nxt, mesh), everywhere(last, mesh)


def accept_rows(seeds, sample_steps, target, drafted, valid):
    """`accept_sampled` row by row, row b with the key fold_in(key(seeds[b]), sample_steps[b]): target
    [B, T, V], drafted and valid [B, T - 1] -> (accepted [B], the next token [B])."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, sample_steps)
    accepted, nxt = jax.vmap(lambda k, p, d, v: accept_sampled(k, p[None], d[None], v[None]))(
        keys, target, drafted, valid)  # [B, 1] each
    return accepted[:, 0], nxt[:, 0]


MOST_WAIT = 16  # engine steps at most between a sequence's drafts after a run of misses


class Speculation:
    """An engine's speculative decoding (see the module): drafts from `draft`, k = `tokens` a step, for
    steps of at most `rows` decoding sequences, checked `sizes` rows at a time (the engine's decode
    sizes up to the first that holds `rows`)."""

    def __init__(self, draft: Draft, tokens: int, rows: int, decode_sizes: list[int], prefill_chunk: int):
        if not (1 <= tokens < prefill_chunk and rows >= 1):  # (the pool's bound on a sequence's sliding pages)
            raise ValueError(f"speculation takes 1 <= draft_tokens < prefill_chunk ({prefill_chunk}) and "
                             f"speculate_rows >= 1, got {tokens} and {rows}")
        self.draft, self.k, self.rows = draft, tokens, min(rows, decode_sizes[-1])
        self.sizes = [b for b in decode_sizes if b < self.rows] + [next(b for b in decode_sizes if b >= self.rows)]
        self.clock = 0  # engine steps so far (`wanted` is asked once a step)

    def wanted(self, decoding) -> bool:
        """Whether this step of these decoding sequences speculates (their tokens not read yet)."""
        self.clock += 1
        return (0 < len(decoding) <= self.rows and all(speculable(s.request.settings) for s in decoding)
                and any(self._due(s) for s in decoding))

    def _due(self, seq) -> bool:
        return seq.draft_due <= self.clock

    def _score(self, seq, accepted: int) -> None:
        """After a step that drafted for the sequence: draft again next step where a drafted token was
        accepted, else wait (see the module)."""
        seq.draft_misses = 0 if accepted else seq.draft_misses + 1
        wait = min(2 ** seq.draft_misses, MOST_WAIT) if seq.draft_misses else 1
        seq.draft_due = (self.clock // wait + 1) * wait

    def ahead(self, seq) -> int:
        """Positions a speculated step of the sequence may write: its latest token and, where it is due
        to draft, its draft."""
        return min(self.k + 1 if self._due(seq) else 1, seq.request.settings.max_new_tokens - seq.queued)

    def warm_up(self, engine) -> str:
        """Compile the checked steps (padding rows only: nothing changes) -> what was compiled."""
        for B in self.sizes:
            for mode in MODES:
                jax.block_until_ready(self._check(engine, [None] * B, np.zeros((B, self.k + 1), np.int32), [0] * B,
                                                  mode))
        return (f"checked drafts [{', '.join(map(str, self.sizes))}] x {self.k + 1} positions, their picks "
                f"({', '.join(MODES)})")

    def _check(self, engine, seqs, tokens, counts, mode=None):
        """check_rows over these rows (None: padding) in `mode` (None: the running rows') -> (accepted,
        next tokens), on the devices."""
        plan = np.array([[engine.slots if s is None else s.row for s in seqs],
                         [0 if s is None else s.length for s in seqs], counts,
                         [0 if s is None else s.queued for s in seqs]], np.int32)
        settings, running_mode, _ = engine._picks.rows([s and s.request for s in engine.scheduler.rows],
                                                       engine.scheduler.changes)
        tokens, plan = engine._put(tokens), engine._put(plan)
        logits, engine._pool = check_rows(*engine._model, engine.params, engine._pool, engine._tables, tokens, plan)
        accepted, nxt, engine._last = accept_checked(engine.mesh, mode or running_mode, logits, engine._last, tokens,
                                                     plan, settings)
        return accepted, nxt

    def _draft(self, seq, vocab: int) -> list[int]:
        """The sequence's draft: at most what its budget leaves after the step's own token, cut at the
        first id outside the vocabulary (a draft source's bug must not reach the cache)."""
        room = self.ahead(seq) - 1
        draft = list(self.draft(seq.request.prompt_ids + seq.request.output_ids, room))
        ok = [0 <= int(t) < vocab for t in draft[:room]]
        return [int(t) for t in draft[:ok.index(False) if False in ok else len(ok)]]

    def step(self, engine, decoding) -> None:
        """Check the drafts of these sequences (the step before's tokens read: those that ended are
        left out) and hand out their tokens; where none has a draft, queue a decode step instead."""
        live = [s for s in decoding if engine.scheduler.rows[s.row] is s]
        if any(len(s.request.output_ids) != s.queued for s in live):
            raise RuntimeError("a speculated step needs every token sampled before it read")
        due = [self._due(s) for s in live]
        drafts = [self._draft(s, engine.config.vocab_size) if d else [] for s, d in zip(live, due)]
        engine.metrics.drafting_steps += 1
        if not any(drafts):
            for seq in [s for s, d in zip(live, due) if d]:
                self._score(seq, 0)
            decoded = engine._decode(live) if live else None
            for seq in live:
                engine.scheduler.after_step(seq)
            if live:
                engine._in_flight.append(engine._pick(*decoded))
            return
        B = next(b for b in self.sizes if b >= len(live))
        tokens, counts = np.zeros((B, self.k + 1), np.int32), [0] * B
        for i, (seq, draft) in enumerate(zip(live, drafts)):
            tokens[i, :1 + len(draft)] = [seq.request.output_ids[-1], *draft]
            counts[i] = 1 + len(draft)
        accepted, nxt = (np.asarray(x) for x in self._check(engine, live + [None] * (B - len(live)), tokens, counts))
        metrics = engine.metrics
        metrics.speculative_steps += 1
        for i, (seq, draft) in enumerate(zip(live, drafts)):
            a = int(accepted[i])
            if due[i]:
                self._score(seq, a)
            metrics.draft_tokens += len(draft)
            metrics.accepted_draft_tokens += a
            seq.length, seq.queued = seq.length + a + 1, seq.queued + a + 1
            for token in [*draft[:a], int(nxt[i])]:
                if engine.scheduler.rows[seq.row] is seq:
                    engine._emit(seq, token)
            if engine.scheduler.rows[seq.row] is seq:
                engine.scheduler.after_step(seq)
