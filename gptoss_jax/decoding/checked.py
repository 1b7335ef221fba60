"""Checked steps: the one program that checks drafts, for `Generator` and the serving engine, over
either KV cache (the contiguous one of cache.py or the paged pool of paged_cache.py).

A call runs up to `most` checked steps of its rows with no host round trip between them. Each step
asks the draft source for up to k tokens a row (drafts/base.py: made on the devices, or made on the
host and `Given`), checks them in one pass of the model over k + 1 positions (over one, where no
row has a draft), keeps what acceptance.py says (the longest agreeing prefix and the target's next
token, or the speculative-sampling rule), takes the rest back out of the cache (the cache contract's `keep`:
the contiguous cache rolls back, the paged one needs nothing), and appends the
new tokens to the rows' history. A call goes on while some row is due to draft (back-off,
acceptance.py) and ends early once none is.

A row ends within the call at its budget (the tokens it may still add) and, where stop tokens are
given, after its first stop token (kept). The host reads a call's tokens once it ends; `Generator`
queues the next call before that, from the plan the call returns.

Legend: R = rows of the caller, B = rows of the call, L = the history's positions, k = drafted
tokens a step, T = k + 1, V = vocabulary, G = the captured layers' outputs side by side.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..drafts.base import GIVEN, DeviceDraft, DraftContext, StepResult
from ..kernels import Kernels
from ..model.cache import layout_of
from ..model.paged_cache import FULL
from ..sampling import MODES, Sampling, rows_mode, wrapped_seed
from ..sharding import everywhere, mesh_of
from .acceptance import accept, backoff, fit_drafts, step_tokens
from .steps import STEP_OPTIONS, Model, view

@dataclasses.dataclass(frozen=True)
class CheckedSteps:
    """What a call of checked steps is compiled for (a static argument)."""

    model: Model  # (its `capture` is the draft's)
    draft: DeviceDraft
    k: int  # drafted tokens a step at most
    most: int  # steps a call at most
    most_wait: int = 1  # steps at most a row waits to draft again after misses (1: it drafts every step)
    modes: tuple[str, ...] = MODES  # the acceptance modes the program serves (the plan's run picks one)


class Plan(NamedTuple):
    """A call's rows, as arrays on the devices (nothing of it is donated)."""

    rows: jax.Array  # int32 [6, B]: rows, lengths, budget, sample_steps, misses, due_at. rows: the caller's row (R: padding); lengths: positions
    #                  cached; budget: tokens it may still add (0: not running); sample_steps: its next
    #                  token's sampling step; misses, due_at: back-off (acceptance.backoff)
    run: jax.Array  # int32 [3]: steps to run (<= most), the first step's clock, the mode (an index into the spec's modes)
    settings: tuple  # every caller row's (seeds, temperature, top_k, top_p, min_p) [R] (more are ignored)
    is_stop: jax.Array | None = None  # bool [V]: tokens that end a row (None: the caller finds its stops)


class Outcome(NamedTuple):
    """What a call did, step by step (padding rows and steps not run: zeros)."""

    tokens: jax.Array  # [most, B, T] of which the first `counts` are each row's new tokens
    counts: jax.Array  # [most, B]
    drafted: jax.Array  # [most, B] tokens drafted and checked
    accepted: jax.Array  # [most, B] drafted tokens among the new ones
    ran: jax.Array  # [] steps run
    rows: jax.Array  # [6, B] the plan's rows after the call (budgets, lengths, back-off...)
    run: jax.Array  # [3] the plan's run after it (the clock moved on)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("cache", "history", "state"),
                   compiler_options=STEP_OPTIONS)
def checked_steps(spec: CheckedSteps, params, cache: dict, history, last, plan: Plan, arrays=None, state=None):
    """Up to spec.most checked steps (see the module). history [R, L]: each row's tokens so far (the
    latest may be missing: it is written from `last`; None for a `Given` draft, which reads none);
    last [R]: each row's latest token, not in the cache yet; arrays, state: the draft source's
    (`arrays()` placed on the devices; its state, donated).
    -> (Outcome, cache, history, last, state)."""
    config, k, draft = spec.model.config, spec.k, spec.draft
    model = dataclasses.replace(spec.model, capture=draft.capture)
    rows, lengths, budget, sample_steps, misses, due_at = plan.rows
    B, T, R = rows.shape[0], k + 1, last.shape[0]
    at = jnp.arange(T)[None]  # [1, T]
    settings = tuple(jnp.take(x, rows, mode="clip") for x in plan.settings[:5])
    table = None if "tables" not in cache else jnp.take(cache["tables"][FULL], rows, axis=0, mode="clip")
    if history is not None:
        history = history.at[rows, lengths].set(jnp.take(last, rows, mode="clip"), mode="drop")

    def check(width, tokens, counts, cache, lengths, sample_steps):
        valid = at[:, :width] < counts[:, None]  # [B, width]
        before = view(cache, rows, lengths)
        logits, written, states = model.apply(params, tokens[:, :width], before, valid)
        if states is not None:
            states = jnp.pad(states, ((0, 0), (0, T - width), (0, 0)))
        accepted, nxt = accept(plan.run[2], logits, tokens[:, :width], valid, settings, sample_steps, spec.modes)
        kept = jnp.where(valid[:, 0], accepted + 1, 0)
        return accepted, nxt, layout_of(cache).keep(config, cache, before, written, valid, kept), states

    def one(carry):
        i, cache, history, last, lengths, budget, sample_steps, misses, due_at, state, out = carry
        active, clock = budget > 0, plan.run[1] + i
        due = active & (due_at <= clock)
        context = lengths + 1  # each row's tokens so far
        seen = None if history is None else jnp.take(history, rows, axis=0, mode="clip")
        latest = jnp.take(last, rows, mode="clip")
        proposal = draft.propose(DraftContext(seen, context, arrays, state, params["embedding"], model.kernels,
                                              model.mesh, rows, latest, table, budget), k)
        proposed, n = fit_drafts(proposal.drafts, proposal.counts, due, budget, config.vocab_size)
        tokens = jnp.concatenate([latest[:, None], proposed], axis=1)  # [B, T]
        counts = jnp.where(active, n + 1, 0)
        # A step where no row has a draft checks one position, not k + 1.
        accepted, nxt, cache, states = jax.lax.cond(
            (n > 0).any(), functools.partial(check, T), functools.partial(check, 1),
            tokens, counts, cache, lengths, sample_steps)
        kept = at < jnp.where(counts > 0, accepted + 1, 0)[:, None]  # the tokens now in the cache
        state = draft.observe(DraftContext(seen, context, arrays, proposal.state, params["embedding"], model.kernels,
                                           model.mesh, rows, latest, table),
                              StepResult(tokens, kept, states, lengths, jnp.zeros_like(active)))
        new = step_tokens(tokens, accepted, nxt)  # [B, T]
        count = jnp.where(active, accepted + 1, 0)
        ended = jnp.zeros_like(active)
        if plan.is_stop is not None:  # cut after a row's first stop token (kept)
            stops = plan.is_stop[new] & (at < count[:, None])
            ended = stops.any(axis=1)
            count = jnp.where(ended, jnp.argmax(stops, axis=1) + 1, count)
        if history is not None:
            where = jnp.where(at < count[:, None], context[:, None] + at, history.shape[1])  # past the end: dropped
            history = history.at[jnp.where(active, rows, R)[:, None], where].set(new, mode="drop")
        last = last.at[jnp.where(active, rows, R)].set(nxt, mode="drop")
        misses, due_at = backoff(jnp, misses, due_at, due, accepted, clock, spec.most_wait)
        step = (new, count, n, jnp.minimum(accepted, count))
        out = tuple(o.at[i].set(x) for o, x in zip(out, step))
        return (i + 1, cache, history, last, lengths + count, jnp.where(ended, 0, budget - count),
                sample_steps + count, misses, due_at, state, out)

    def going(carry):  # steps left, and a row due to draft (the first step's: the caller called for it)
        i, budget, due_at = carry[0], carry[5], carry[8]
        return (i < plan.run[0]) & ((budget > 0) & (due_at <= plan.run[1] + i)).any()

    out = (jnp.zeros((spec.most, B, T), jnp.int32),) + tuple(jnp.zeros((spec.most, B), jnp.int32) for _ in range(3))
    i, cache, history, last, *rest, state, out = jax.lax.while_loop(
        going, one, (jnp.int32(0), cache, history, last, lengths, budget, sample_steps, misses, due_at, state, out))
    run = plan.run.at[1].add(i)
    outcome = Outcome(*out, i, jnp.stack([rows, *rest]), run)
    put = functools.partial(everywhere, mesh=model.mesh)
    return (jax.tree.map(put, outcome), cache, None if history is None else put(history), put(last),
            jax.tree.map(put, state))


def row_settings(sampling: Sampling, seed: int, rows: int) -> tuple[np.ndarray, ...]:
    """The settings arrays of `rows` rows that sample alike: (seeds, temperature, top_k, top_p, min_p)
    [rows], row b seeded seed + b (wrapped to 32 bits), so that equal prompts in one batch differ."""
    seeds = np.array([wrapped_seed(seed + b) for b in range(rows)], np.int32)
    return (seeds, np.full(rows, sampling.temperature, np.float32), np.full(rows, sampling.top_k, np.int32),
            np.full(rows, sampling.top_p, np.float32), np.full(rows, sampling.min_p, np.float32))


def check_draft(config: ModelConfig, cache: dict, tokens, valid, params, *, kernels: Kernels = Kernels(),
                sampling: Sampling = Sampling(temperature=0), seed: int = 0):
    """One checked step outside `Generator`, over a contiguous cache (cache.py): tokens [B, T] each
    row's last token then its draft, valid [B, T] (a prefix of each row; none: a row not checked) ->
    (accepted drafts [B], the token after them [B], the cache holding each row's last token and
    accepted drafts, nothing more). The cache is donated: use the returned one. Row b samples with
    seed + b at sampling step 0. Parameters on a mesh run on it."""
    tokens, valid = np.asarray(tokens, np.int32), np.asarray(valid, bool)
    B, T = tokens.shape
    slots = min(layer["k"].shape[1] for name, layer in cache.items() if name != "lengths")
    if T > slots:
        raise ValueError(f"a step checks at most {slots - 1} drafted tokens with this cache (its smallest layer "
                         f"holds {slots} positions), got {T - 1}")
    active = valid[:, 0]
    lengths = np.asarray(cache["lengths"], np.int32)
    plan = np.stack([np.arange(B), lengths, np.where(active, T + 1, 0), np.zeros(B), np.zeros(B), np.zeros(B)])
    spec = CheckedSteps(Model(config, kernels, mesh_of(params)), GIVEN, T - 1, most=1, modes=(rows_mode([sampling]),))
    arrays = {"drafts": jnp.asarray(tokens[:, 1:]), "counts": jnp.asarray(valid[:, 1:].sum(axis=1), jnp.int32)}
    run = np.array([1, 0, 0], np.int32)
    outcome, cache, _, last, _ = checked_steps(spec, params, cache, None, jnp.asarray(tokens[:, 0]),
                                               Plan(jnp.asarray(plan, jnp.int32), jnp.asarray(run),
                                                    tuple(map(jnp.asarray, row_settings(sampling, seed, B)))), arrays)
    return outcome.accepted[0], last, cache
