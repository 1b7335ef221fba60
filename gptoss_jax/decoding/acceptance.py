"""What a checked step keeps of its drafts, the same on the command line and in the server.

A step of one row, whose cache holds its tokens but the last, t, with a draft d_1 .. d_k:

    inputs [t, d_1, ..., d_k]  ->  the target's distributions p_0 .. p_k (greedy: its argmaxes g_i)
    accepted a: greedy, the longest prefix with d_(i+1) == g_i; sampled, the speculative-sampling
    rule (`accept_sampled`); the step's new tokens are d_1 .. d_a, then the token after them

Greedy picks make the tokens those of decoding one token a step (exactly so where a pass over k + 1
positions rounds as k + 1 passes over one do, as in float32 on a CPU; in bfloat16 the two can part
at a near-tie). Sampled, a step's tokens follow the target's distribution (after the sampling
filters) exactly, row b drawing with the key fold_in(key(seed_b), sampling step of the step's first
token): the same distribution as without drafts, not the same draws.

A row whose draft was empty or wholly rejected waits before it drafts again (`backoff`): 2, 4, 8,
then at most `most_wait` steps, each wait ending on a multiple of its length, so that rows waiting
alike come due together; one accepted drafted token makes it draft every step again.

Legend: B = rows, T = k + 1 positions checked, V = vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..sampling import MODES, draw, probabilities

MOST_WAIT = 16  # steps at most between a row's drafts after a run of misses (the serving engine's)


def fit_drafts(proposed, n, allowed, budget, vocab: int):
    """Drafts [B, k] of which a source proposes the first n [B] -> (drafts [B, k] int32, how many are
    checked [B]): none where not `allowed` [B], cut at the first id outside the vocabulary (a source's
    bug must not reach the cache) and to what the budget [B] leaves after the step's own token; the
    positions past them 0 (any id in range: they are not checked)."""
    proposed = proposed.astype(jnp.int32)
    in_vocab = jnp.cumprod(((proposed >= 0) & (proposed < vocab)).astype(jnp.int32), axis=1).sum(1)
    n = jnp.where(allowed, jnp.clip(jnp.minimum(n, in_vocab), 0, budget - 1), 0)
    return jnp.where(jnp.arange(proposed.shape[1])[None] < n[:, None], proposed, 0), n


def step_tokens(tokens, accepted, nxt):
    """tokens [B, T]: each row's last token then its draft; accepted [B], nxt [B] -> the step's new
    tokens [B, T]: the accepted drafts then the model's next token (the first accepted + 1 are new)."""
    at = jnp.arange(tokens.shape[1])[None]
    return jnp.where(at < accepted[:, None], jnp.roll(tokens, -1, axis=1), nxt[:, None])


def accept_sampled(key: jax.Array, target: jax.Array, drafted: jax.Array, valid: jax.Array,
                   draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The speculative-sampling rule (Leviathan et al., 2023; Chen et al., 2023), with which a step's
    tokens are distributed exactly as the target's, one token at a time, whatever the draft.

    target [B, T, V]: the target's probabilities at each position (after the sampling filters);
    drafted [B, T - 1] the proposed tokens, valid [B, T - 1] which were proposed (a prefix of each
    row); draft_probs [B, T - 1, V] the distributions they were drawn from, or None for drafts that
    propose each token with certainty (prompt lookup). Draft i is accepted with probability
    min(1, p_i(d_i) / q_i(d_i)); at the first rejection the next token is drawn from max(p_i - q_i, 0)
    renormalized, and after k acceptances from p_k. -> (accepted [B], the next token [B])."""
    B, T, V = target.shape
    key_accept, key_next = jax.random.split(key)
    if T == 1:  # nothing drafted: the next token drawn from p_0 (the same draw as with drafts all invalid)
        nxt = draw(key_next, target[:, 0])
        return jnp.zeros((B,), jnp.int32), nxt
    p = jnp.take_along_axis(target[:, :-1], drafted[..., None], axis=-1)[..., 0]  # [B, T - 1]
    q = (jnp.ones_like(p) if draft_probs is None
         else jnp.take_along_axis(draft_probs, drafted[..., None], axis=-1)[..., 0])
    u = jax.random.uniform(key_accept, p.shape)
    ok = (u * q < p) & valid  # u < p / q, as q > 0 where drafted
    accepted = jnp.cumprod(ok.astype(jnp.int32), axis=1).sum(axis=1)  # [B]
    at = accepted[:, None, None]
    p_at = jnp.take_along_axis(target, at, axis=1)[:, 0]  # [B, V]
    rejected = accepted < valid.sum(axis=1)  # stopped at a proposed token, not past the last
    if draft_probs is None:
        q_at = jax.nn.one_hot(jnp.take_along_axis(drafted, jnp.minimum(accepted, T - 2)[:, None], axis=1)[:, 0], V)
    else:
        q_at = jnp.take_along_axis(draft_probs, jnp.minimum(at, T - 2), axis=1)[:, 0]
    residual = jnp.where(rejected[:, None], jnp.maximum(p_at - q_at, 0.0), p_at)
    residual = jnp.where(residual.sum(axis=-1, keepdims=True) > 0, residual, p_at)  # p == q: any p-draw will do
    nxt = draw(key_next, residual)
    return accepted, nxt


def accept_rows(seeds, sample_steps, target, drafted, valid):
    """`accept_sampled` row by row, row b with the key fold_in(key(seeds[b]), sample_steps[b]): target
    [B, T, V], drafted and valid [B, T - 1] -> (accepted [B], the next token [B])."""
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, sample_steps)
    accepted, nxt = jax.vmap(lambda k, p, d, v: accept_sampled(k, p[None], d[None], v[None]))(
        keys, target, drafted, valid)  # [B, 1] each
    return accepted[:, 0], nxt[:, 0]


def accept_greedy(logits, tokens, valid):
    """Greedy rows: logits [B, T, V], tokens and valid [B, T] -> (accepted [B]: the longest prefix of
    each draft equal to the target's argmax before it, the argmax after them [B])."""
    picks = jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)  # [B, T], sampling's greedy pick
    agree = (tokens[:, 1:] == picks[:, :-1]) & valid[:, 1:]  # [B, T - 1]
    accepted = jnp.cumprod(agree.astype(jnp.int32), axis=1).sum(axis=1)
    return accepted, jnp.take_along_axis(picks, accepted[:, None], axis=1)[:, 0]


def accept(mode, logits, tokens, valid, settings, sample_steps, modes: tuple[str, ...] = MODES):
    """A checked step's acceptance: logits [B, T, V] of tokens [B, T] (each row's last token, then its
    draft) over valid [B, T]; settings: the rows' (seeds, temperature, top_k, top_p, min_p) [B];
    mode: an index into `modes` (on the devices: one program serves each of them; the serving engine
    has every mode, the command line's `Generator` only its batch's) -> (accepted [B], the token after
    them [B]). Greedy takes the argmaxes alone; the other modes draw every sampled row by its own
    settings and key, a greedy row among them certain of its argmax (so it keeps exactly the greedy
    rule's tokens)."""
    B, T = tokens.shape
    seeds, temperature, top_k, top_p, min_p = settings
    each = functools.partial(jnp.repeat, repeats=T)  # a row's settings at each of its positions

    def drawn(m):
        def run():
            target = probabilities(logits.reshape(B * T, -1), each(temperature), each(top_k), each(top_p),
                                   each(min_p), m).reshape(B, T, -1)
            return accept_rows(seeds, sample_steps, target, tokens[:, 1:], valid[:, 1:])
        return run

    branches = [(lambda: accept_greedy(logits, tokens, valid)) if m == "greedy" else drawn(m) for m in modes]
    return branches[0]() if len(branches) == 1 else jax.lax.switch(mode, branches)


def backoff(xp, misses, due_at, due, accepted, clock, most_wait: int):
    """After a step at `clock` (xp: numpy or jax.numpy): rows that were `due` to draft count a miss
    where nothing drafted was accepted (else none) and are due again after their wait -> (misses,
    due_at), the other rows' unchanged. most_wait 1: every row drafts every step."""
    misses = xp.where(due, xp.where(accepted > 0, 0, misses + 1), misses)
    wait = xp.where(misses > 0, xp.minimum(2 ** xp.minimum(misses, 8), most_wait), 1)
    return misses, xp.where(due, (clock // wait + 1) * wait, due_at)
