"""Several checked steps in one call, drafted on the devices: the serving engine's speculation with a
draft source that proposes there (`PromptLookup`, or anything with `propose(history, lengths, k)`).

A call runs up to `steps` checked steps of its rows with no host round trip between them: each step
drafts from every row's tokens so far (`history`, kept on the devices), checks the drafts over k + 1
positions of the paged cache (or over one, where no row found a draft), keeps the longest agreeing
prefix and the model's next token, and appends them to the history. The host reads the call's tokens
once it ends, so its work (scheduling, reading, handing out tokens) is paid once a call, not once a
step: at one request a synchronous step pays it in full (speculation.py). A call starts where a row
is due to draft (`Speculation.wanted`) and goes on while one is: once every row has backed off
(below), the engine decodes as usual.

A row ends within the call at its budget (the tokens it may still add); stop tokens and strings are
found on the host as its tokens are handed out, and the tokens a row made after its stop are
dropped with it (its pages released; attention never reads past a sequence's length, paged_cache.py).

A row that drafted and had nothing accepted backs off as on the host (speculation.py): it drafts again
after 2, 4, 8, then `MOST_WAIT` steps, each wait ending on a multiple of its length (`due`, the
engine step from which it drafts, follows the host's rule step by step, `Speculation._score`).

Legend: R = rows of the tables, B = rows of the call, L = the history's positions, T = k + 1, V = vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..model import Transformer
from ..sampling import MODES, filtered_rows
from ..sharding import everywhere
from ..speculative import accept_sampled, fit_drafts, step_tokens
from . import steps

MOST_WAIT = 16  # engine steps at most between a sequence's drafts after a run of misses


def row_probabilities(logits, temperature, top_k, top_p, min_p, mode: str):
    """logits [N, V], each row's settings [N] -> the probabilities [N, V] its token is drawn from
    (`sample_rows`'s); a greedy row's are 1 at its argmax."""
    V = logits.shape[-1]
    greedy = jax.nn.one_hot(jnp.argmax(logits.astype(jnp.float32), axis=-1), V, dtype=jnp.float32)
    if mode == "greedy":
        return greedy
    drawn = jax.nn.softmax(filtered_rows(logits, temperature, top_k, top_p, min_p, mode), axis=-1)
    return jnp.where((temperature > 0)[:, None], drawn, greedy)


def accept_rows(seeds, sample_steps, target, drafted, valid):
    """`accept_sampled` row by row, row b with the key fold_in(key(seeds[b]), sample_steps[b]): target
    [B, T, V], drafted and valid [B, T - 1] -> (accepted [B], the next token [B])."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, sample_steps)
    accepted, nxt = jax.vmap(lambda k, p, d, v: accept_sampled(k, p[None], d[None], v[None]))(
        keys, target, drafted, valid)  # [B, 1] each
    return accepted[:, 0], nxt[:, 0]


def picks(mode, logits, tokens, valid, settings, rows, sample_steps):
    """A checked step's acceptance in `mode` (an index into MODES, on the devices): logits [B, T, V] ->
    (accepted drafts [B], the token after them [B])."""
    B, T = tokens.shape
    seeds, temperature, top_k, top_p, min_p = (jnp.take(x, rows, mode="clip") for x in settings[:5])
    each = functools.partial(jnp.repeat, repeats=T)  # a row's settings at each of its positions

    def target(m):
        return lambda: row_probabilities(logits.reshape(B * T, -1), each(temperature), each(top_k), each(top_p),
                                         each(min_p), m).reshape(B, T, -1)

    probabilities = jax.lax.switch(mode, [target(m) for m in MODES])
    return accept_rows(seeds, sample_steps, probabilities, tokens[:, 1:], valid[:, 1:])


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh", "draft", "k", "most"),
                   donate_argnames=("pool", "history"), compiler_options=steps._STEP_OPTIONS)
def check_steps(config, kernels, mesh, draft, k, most, params, pool, tables, history, last, plan, settings, run,
                draft_arrays=None):
    """Up to `most` checked steps of the call's rows (see the module); draft_arrays: the draft source's
    arrays (its `arrays()`, placed on the devices), given to its `propose`, where it has them.

    history [R, L]: each row's tokens so far (prompt and reply; the last not in the cache yet, and
    perhaps not in the history either); last [R]: each row's latest token; plan [6, B]: rows (R:
    padding), lengths (positions cached), budgets (tokens each may still add; 0: padding), sampling
    steps, draft misses, the step each drafts from (due);
    settings: every row's (steps.sampling_arrays); run [3]: the steps to run (<= most), the first
    step's clock, the mode (an index into MODES).
    -> (tokens [most, B, T] of which the first counts [most, B] are new, drafted [most, B], accepted
    [most, B], misses [B], due [B], steps run, pool, history, last)."""
    rows, lengths, budget, sample_steps, misses, due_at = plan
    B, T, L = rows.shape[0], k + 1, history.shape[1]
    at = jnp.arange(T)[None]  # [1, T]
    model = Transformer(config, kernels=kernels, mesh=mesh)
    # Each row's latest token, at its length: the call is queued before the host reads the step
    # before's tokens (speculation.py), so the history may lack it; `last` holds it.
    history = history.at[rows, lengths].set(jnp.take(last, rows, mode="clip"), mode="drop")

    def check(width, tokens, counts, pool, lengths, sample_steps):
        valid = at[:, :width] < counts[:, None]  # [B, width]
        logits, view = model.apply({"params": params}, tokens[:, :width],
                                   steps.paged_view(pool, tables, rows, lengths), valid)
        accepted, nxt = picks(run[2], logits, tokens[:, :width], valid, settings, rows, sample_steps)
        return accepted, nxt, {"pages": view["pages"]}

    def propose(history, context):
        seen = jnp.take(history, rows, axis=0, mode="clip")
        proposed, n = (draft.propose(seen, context, k) if draft_arrays is None
                       else draft.propose(seen, context, k, draft_arrays))  # [B, k], [B]
        return proposed, n

    def one(carry):
        i, pool, history, last, lengths, budget, sample_steps, misses, due_at, out = carry
        active, clock = budget > 0, run[1] + i
        due = active & (due_at <= clock)
        context = lengths + 1  # the history's tokens of each row
        proposed, n = fit_drafts(*propose(history, context), due, budget, config.vocab_size)
        tokens = jnp.concatenate([jnp.take(last, rows, mode="clip")[:, None], proposed], axis=1)  # [B, T]
        counts = jnp.where(active, n + 1, 0)
        # A step where no row found a draft checks one position, not k + 1.
        accepted, nxt, pool = jax.lax.cond(
            (n > 0).any(), functools.partial(check, T), functools.partial(check, 1),
            tokens, counts, pool, lengths, sample_steps)
        new = step_tokens(tokens, accepted, nxt)  # [B, T]
        count = jnp.where(active, accepted + 1, 0)
        where = jnp.where(at < count[:, None], context[:, None] + at, L)  # past the end: dropped
        history = history.at[jnp.where(active, rows, history.shape[0])[:, None], where].set(new, mode="drop")
        last = last.at[jnp.where(active, rows, last.shape[0])].set(nxt, mode="drop")
        misses = jnp.where(due, jnp.where(accepted > 0, 0, misses + 1), misses)
        wait = jnp.where(misses > 0, jnp.minimum(2 ** jnp.minimum(misses, 8), MOST_WAIT), 1)
        due_at = jnp.where(due, (clock // wait + 1) * wait, due_at)  # Speculation._score's rule
        out = tuple(o.at[i].set(x) for o, x in zip(out, (new, count, n, jnp.where(active, accepted, 0))))
        return (i + 1, pool, history, last, lengths + count, budget - count, sample_steps + count, misses, due_at,
                out)

    def going(carry):  # steps left, and a row due to draft (the first step's: the host called for it)
        i, budget, due_at = carry[0], carry[5], carry[8]
        return (i < run[0]) & ((budget > 0) & (due_at <= run[1] + i)).any()

    out = (jnp.zeros((most, B, T), jnp.int32),) + tuple(jnp.zeros((most, B), jnp.int32) for _ in range(3))
    i, pool, history, last, *_, misses, due_at, out = jax.lax.while_loop(
        going, one, (jnp.int32(0), pool, history, last, lengths, budget, sample_steps, misses, due_at, out))
    outputs = (*out, misses, due_at, i)
    return (*(everywhere(x, mesh) for x in outputs), pool, everywhere(history, mesh), everywhere(last, mesh))


@functools.partial(jax.jit, donate_argnames=("history",))
def write_history(history, writes):
    """history [R, L]; writes int32 [3, U]: rows, positions, tokens (row R: padding) -> history."""
    return history.at[writes[0], writes[1]].set(writes[2], mode="drop")
