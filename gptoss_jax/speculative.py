"""Speculative decoding's pieces: drafts proposed on the host, checked by the model in one step over
several positions, and the KV cache rolled back past the drafts it rejects.

A step of one sequence, whose cache holds L positions and whose last token t is not in it yet, with
a draft d_1 .. d_k:

    inputs [t, d_1, ..., d_k] at positions L .. L+k  ->  the model's greedy picks g_0 .. g_k
    accepted a: the longest prefix of the draft with d_(i+1) == g_i; the step's new tokens are
    d_1 .. d_a, then g_a (so a step gives a + 1 tokens, at least one: what one decode step gives)
    the cache keeps positions L .. L+a (t and the accepted drafts) and nothing of the others

Greedy picks make the tokens those of decoding one token a step: each kept token is the argmax
given the kept tokens before it (exactly so where a pass over k + 1 positions rounds as k + 1
passes over one do, as in float32 on a CPU; in bfloat16 the two can part at a near-tie). Nothing
of a rejected draft stays in the cache: a full layer's rejected positions are zero again, as never
written, and the sliding layers' ring slots they overwrote (cache.py: slot p % S holds position p)
get the earlier positions they held back.

Sampled decoding takes the speculative-sampling rule instead (`accept_sampled`), under which a
step's tokens follow the target's distribution (after the sampling filters) exactly.

Draft sources are callables `draft(context, k) -> up to k token ids`, given the sequence so far
(prompt and reply); `PromptLookup` proposes what followed the context's last n tokens where they
occurred before (n-gram / prompt lookup drafting, no weights). A source that also has
`propose(history, lengths, k)` drafts on the devices (`speculate_steps`: several checked steps per
call, with no host round trip between them, which at batch 1 costs more than the step itself). An
EAGLE-3 head (eagle3_draft.py) drafts there too, from a state that follows the target's own hidden
states: the checked steps capture the layers it reads.

Legend: B = batch, T = k + 1 positions checked a step, V = vocabulary, S = ring slots.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from .cache import ring_positions
from .config import ModelConfig
from .eagle3 import captured
from .model import Transformer
from .sampling import Sampling, filtered
from .sharding import everywhere

Draft = Callable[[Sequence[int], int], Sequence[int]]


@dataclasses.dataclass(frozen=True)
class PromptLookup:
    """Drafts by prompt lookup: the tokens that followed the latest earlier occurrence of the
    context's last n tokens, for n from `max_n` down to `min_n` (the longest match that has one).
    Pays off where a reply quotes its context: edits, code, retrieved text; proposes nothing where
    the last tokens are new."""

    max_n: int = 3
    min_n: int = 1

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prompt lookup takes 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def __call__(self, context: Sequence[int], k: int) -> list[int]:
        h = np.asarray(context, dtype=np.int64)
        L = len(h)
        if L < 2:
            return []
        # Where a match of the last n tokens can end: an earlier occurrence of the last token, with one
        # token after it (the suffix itself is not a match). One pass over the context, for every n.
        ends = np.flatnonzero(h[:-1] == h[-1])
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            match = ends[ends >= n - 1]
            for t in range(1, n):
                match = match[h[match - t] == h[L - 1 - t]]
            if match.size:
                follow = match[-1] + 1
                return h[follow:follow + k].tolist()
        return []

    def propose(self, history: jax.Array, lengths: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
        """The same on the devices, for every row at once: history [B, L] of which the first
        lengths [B] are each sequence's context -> (drafts [B, k], how many of each are proposed [B])."""
        B, L = history.shape
        j = jnp.arange(L)[None]  # [1, L] where an n-gram starts
        follow = jnp.full((B,), -1, jnp.int32)  # where the draft starts: after the longest n's latest match
        for n in range(self.max_n, self.min_n - 1, -1):
            match = (j + n < lengths[:, None])  # a token follows the n-gram (so it is not the suffix itself)
            for t in range(n):
                suffix = jnp.take_along_axis(history, jnp.maximum(lengths - n + t, 0)[:, None], axis=1)  # [B, 1]
                match &= history[:, jnp.minimum(jnp.arange(L) + t, L - 1)] == suffix
            latest = jnp.max(jnp.where(match, j, -1), axis=1)  # [B]
            follow = jnp.where((follow < 0) & (latest >= 0), latest + n, follow)
        count = jnp.where(follow >= 0, jnp.minimum(k, lengths - follow), 0)
        drafts = jnp.take_along_axis(history, jnp.clip(follow[:, None] + jnp.arange(k)[None], 0, L - 1), axis=1)
        return drafts, count.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh", "sampling"), donate_argnames=("cache",))
def check_step(config, kernels, mesh, sampling, params, tokens, valid, cache, seed, step):
    """tokens [B, T]: each sequence's last token then its draft; valid [B, T]: a prefix of each row
    (none: a sequence that has stopped) -> (accepted drafts [B], the token after them [B], the cache
    holding each sequence's last token and accepted drafts, nothing more). Greedy (temperature 0):
    a draft is accepted where it is the model's argmax; else by `accept_sampled`, with the key
    fold_in(key(seed), step)."""
    accepted, nxt, cache = _check(config, kernels, mesh, sampling, params, tokens, valid, cache, seed, step)
    return everywhere(accepted, mesh), everywhere(nxt, mesh), cache


def _check(config, kernels, mesh, sampling, params, tokens, valid, cache, seed, step, capture=()):
    """check_step's computation, inside a jitted function; with `capture`, also those layers' outputs
    at the T positions [B, T, G] (an EAGLE-3 head's input)."""
    model = Transformer(config, kernels=kernels, mesh=mesh, capture=capture)
    if capture:
        (logits, written), state = model.apply({"params": params}, tokens, cache, valid, mutable=["intermediates"])
    else:
        logits, written = model.apply({"params": params}, tokens, cache, valid)
    B, T, V = logits.shape
    if sampling.temperature == 0:
        picks = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T], as sampling.sample's greedy pick
        agree = (tokens[:, 1:] == picks[:, :-1]) & valid[:, 1:]  # [B, T - 1]
        accepted = jnp.cumprod(agree.astype(jnp.int32), axis=1).sum(axis=1)  # the longest agreeing prefix
        nxt = jnp.take_along_axis(picks, accepted[:, None], axis=1)[:, 0]
    else:
        target = jax.nn.softmax(filtered(logits.reshape(B * T, V), sampling), axis=-1).reshape(B, T, V)
        key = jax.random.fold_in(jax.random.key(seed), step)
        accepted, nxt = accept_sampled(key, target, tokens[:, 1:], valid[:, 1:])
    kept = jnp.where(valid[:, 0], accepted + 1, 0)
    cache = roll_back(config, cache, written, valid, kept)
    if not capture:
        return accepted, nxt, cache
    return accepted, nxt, cache, captured(state, capture)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh", "sampling", "draft", "k", "steps"),
                   donate_argnames=("cache", "history", "draft_state"))
def speculate_steps(config, kernels, mesh, sampling, draft, k, steps, params, history, lengths, active, budget,
                    is_stop, cache, seed, step, draft_params=None, draft_state=None):
    """`steps` checked steps in one call, each drafted on the devices by `draft.propose` (a draft
    source that has it, such as `PromptLookup`; with the source's arrays, draft_params, where it has
    them): no host round trip between steps. A draft that
    follows the target's states (an EAGLE-3 head, eagle3_draft.py) has a state instead (draft_state,
    with its arrays draft_params): each step drafts from it (`draft.propose_from`) and gives it what
    the step committed and the target's outputs of the layers in `draft.capture` (`draft.observe`).

    history [B, L]: each sequence's tokens so far, prompt and reply, the first lengths [B] of each
    row (the last, history[b, lengths[b] - 1], not yet in the cache); active [B]; budget [B]: the
    tokens each may still add; is_stop [V]: the stop tokens. A step drafts up to k tokens (no more
    than the budget leaves after the step's own), checks them (`check_step`, key fold_in(key(seed),
    step + i) for step i), and appends the accepted ones and the next token, cut after a stop
    token (kept) or at the budget; a sequence ends there.
    -> (tokens [steps, B, k + 1] of which the first counts [steps, B] are new, drafted [steps, B],
    drafted tokens among the new [steps, B], history, lengths, active, budget, cache, step + steps,
    draft_state)."""
    B, L = history.shape
    rows, at = jnp.arange(B), jnp.arange(k + 1)

    capture = getattr(draft, "capture", ()) if draft_state is not None else ()

    def one(carry, i):
        history, lengths, active, budget, cache, state = carry
        if state is None:  # [B, k], [B]; a source with arrays (its `arrays()`) gets them here, as draft_params
            proposed, n = (draft.propose(history, lengths, k) if draft_params is None
                           else draft.propose(history, lengths, k, draft_params))
        else:
            proposed, n, state = draft.propose_from(draft_params, params["embedding"], state, k, kernels=kernels,
                                                    mesh=mesh)
        proposed, n = fit_drafts(proposed, n, active, budget, config.vocab_size)
        last = history[rows, lengths - 1]
        tokens = jnp.concatenate([last[:, None], proposed], axis=1)  # [B, T]
        valid = active[:, None] & (at[None] <= n[:, None])
        def check(width):  # the step over the first `width` positions, the captured states padded to T
            out = _check(config, kernels, mesh, sampling, params, tokens[:, :width], valid[:, :width], cache, seed,
                         step + i, capture)
            return out[:3] + tuple(jnp.pad(x, ((0, 0), (0, k + 1 - width), (0, 0))) for x in out[3:])

        # A step where no sequence has a draft is a decode step: one position, not k + 1.
        accepted, nxt, cache, *states = jax.lax.cond((n > 0).any(), lambda: check(k + 1), lambda: check(1))
        if state is not None:
            state = draft.observe(state, tokens, valid, accepted, nxt, *states)
        new = step_tokens(tokens, accepted, nxt)
        count = jnp.where(active, accepted + 1, 0)
        stops = is_stop[new] & (at[None] < count[:, None])
        first_stop = jnp.where(stops.any(axis=1), jnp.argmax(stops, axis=1) + 1, count)
        count = jnp.minimum(first_stop, count)
        history = history.at[rows[:, None], jnp.where(at[None] < count[:, None], lengths[:, None] + at[None], L)].set(
            new, mode="drop")
        budget = budget - count
        active = active & ~stops.any(axis=1) & (budget > 0)
        return (history, lengths + count, active, budget, cache, state), (new, count, n, jnp.minimum(accepted, count))

    def step_if_any(carry, i):  # steps after every sequence has ended (a call's last ones) cost nothing
        nothing = (jnp.zeros((B, k + 1), jnp.int32),) + (jnp.zeros((B,), jnp.int32),) * 3
        return jax.lax.cond(carry[2].any(), one, lambda carry, i: (carry, nothing), carry, i)

    carry, (new, counts, drafted, kept) = jax.lax.scan(
        step_if_any, (history, lengths, active, budget, cache, draft_state), jnp.arange(steps, dtype=jnp.int32))
    history, lengths, active, budget, cache, draft_state = carry
    return (*(everywhere(x, mesh) for x in (new, counts, drafted, kept, history, lengths, active, budget)), cache,
            everywhere(step + steps, mesh), jax.tree.map(lambda x: everywhere(x, mesh), draft_state))


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


def roll_back(config: ModelConfig, before: dict, written: dict, valid: jax.Array, kept: jax.Array) -> dict:
    """The contiguous cache (cache.py; not the serving engine's paged one) after a step that wrote the
    `valid` [B, T] positions from `before`'s lengths on
    (`written`), keeping only the first `kept` [B] of them: full layers' other positions zeroed, the
    sliding layers' ring slots they took given back their earlier positions (`before`'s)."""
    lengths = before["lengths"]
    new_lengths = lengths + kept
    T = valid.shape[1]
    dropped = valid & (jnp.arange(T)[None] >= kept[:, None])  # [B, T]
    out = {"lengths": new_lengths}
    for name, layer in written.items():
        if name == "lengths":
            continue
        B, S = layer["k"].shape[:2]
        if config.is_sliding(int(name.split("_")[1])):
            # A slot whose position (for the kept length) is from this step holds it in `written`
            # (T <= S, so no later position of the step took the slot); any other, in `before`.
            from_step = (ring_positions(new_lengths, S) >= lengths[:, None])[..., None, None]  # [B, S, 1, 1]
            out[name] = {x: jnp.where(from_step, layer[x], before[name][x]) for x in ("k", "v")}
        else:
            at = jnp.where(dropped, lengths[:, None] + jnp.arange(T)[None], S)  # out of range -> dropped
            rows = jnp.arange(B)[:, None]
            out[name] = {x: layer[x].at[rows, at].set(0, mode="drop") for x in ("k", "v")}
    return out


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
        nxt = jax.random.categorical(key_next, jnp.log(target[:, 0]), axis=-1).astype(jnp.int32)
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
    nxt = jax.random.categorical(key_next, jnp.log(residual), axis=-1).astype(jnp.int32)
    return accepted, nxt


def check_draft(config: ModelConfig, cache: dict, tokens, valid, params, *, kernels, mesh=None,
                sampling: Sampling = Sampling(temperature=0), seed: int = 0, step: int = 0):
    """One checked step (`check_step`) outside `Generator`, over a contiguous cache (cache.py) and at
    least one drafted position: the cache is donated, use the returned one."""
    slots = min(layer["k"].shape[1] for name, layer in cache.items() if name != "lengths")
    if np.shape(tokens)[1] > slots:
        raise ValueError(f"a step checks at most {slots - 1} drafted tokens with this cache (its smallest layer "
                         f"holds {slots} positions), got {np.shape(tokens)[1] - 1}")
    return check_step(config, kernels, mesh, sampling, params, jnp.asarray(tokens, jnp.int32), jnp.asarray(valid, bool),
                      cache, jnp.int32(seed), jnp.int32(step))
