"""Choosing the next token from logits: greedy, temperature, top-k, top-p (nucleus) and min-p.

Filters apply in that order to temperature-scaled logits; top-p keeps the smallest set of most
likely tokens whose probability reaches p (always at least one); min-p drops tokens whose
probability is below min_p times the most likely one's. Seeded through an explicit PRNG key.

`token_logprobs`: a chosen token's log-probability and the most likely alternatives', from the
distribution after temperature and before the filters (a greedy row: the model's own, temperature 1).

Legend: B = batch, V = vocab.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import jax


TOP_LOGPROBS = 20  # the most alternatives a token's log-probability comes with (OpenAI's limit too)
LOGIT_BIAS_MOST = 300  # tokens a request may bias (OpenAI's limit too)


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    min_p: float = 0.0  # 0 = off

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise ValueError(f"top-k must be >= 0 (0 is off) and a 32-bit integer, got {self.top_k}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min-p must be in [0, 1), got {self.min_p}")


def wrapped_seed(seed: int) -> int:
    """A seed wrapped to a signed 32-bit integer (seed + i for row or choice i may pass 2^31 - 1)."""
    return (seed + 2**31) % 2**32 - 2**31


def sample(logits: jax.Array, key: jax.Array, params: Sampling) -> jax.Array:
    """logits [B, V] -> token ids [B] int32, every row by the same settings, drawn with one key (the
    rows' draws from `categorical` over [B, V])."""
    import jax  # here, not at the top: `Sampling` alone checks flags before JAX starts
    import jax.numpy as jnp

    if params.temperature == 0:
        return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, filtered(logits, params), axis=-1).astype(jnp.int32)


def filtered(logits: jax.Array, params: Sampling) -> jax.Array:
    """The logits [B, V] a sampled token is drawn from (temperature > 0): `filtered_rows` with every
    row's settings `params`."""
    import jax.numpy as jnp

    B = logits.shape[0]
    each = [jnp.full((B,), x, dtype) for x, dtype in ((params.temperature, jnp.float32), (params.top_k, jnp.int32),
                                                      (params.top_p, jnp.float32), (params.min_p, jnp.float32))]
    return filtered_rows(logits, *each, mode=rows_mode([params]))


MODES = ("greedy", "draw", "rank")


def rows_mode(samplings) -> str:
    """The least work `sample_rows` needs for rows with these settings: "greedy" when none samples,
    "rank" when some sampled row asks for top-k or top-p (a sort of the vocabulary), else "draw"."""
    drawn = [s for s in samplings if s.temperature > 0]
    if not drawn:
        return "greedy"
    return "rank" if any(s.top_k > 0 or s.top_p < 1 for s in drawn) else "draw"


def sample_rows(logits: jax.Array, seeds: jax.Array, steps: jax.Array, temperature: jax.Array, top_k: jax.Array,
                top_p: jax.Array, min_p: jax.Array, mode: str = "rank") -> jax.Array:
    """Each row by its own settings, as arrays (a serving batch mixes requests): logits [B, V], and
    [B] seeds, steps, temperature (0: greedy), top_k (0: off), top_p (1: off), min_p (0: off) ->
    token ids [B] int32.

    Row b draws with key fold_in(key(seeds[b]), steps[b]) and its own filters, so its token does not
    depend on the other rows: a seeded request samples the same tokens whatever shares its batch.
    The filters are those of `sample`, in the same order (top-k, min-p, top-p). `mode` (static, from
    `rows_mode`) leaves out work no row needs: "greedy" takes the argmax only, "draw" skips the sort
    that top-k and top-p need; "rank" serves every row. It is a Python value rather than a branch on
    the device, since a GPU branch makes the host wait for the device.
    """
    import jax
    import jax.numpy as jnp

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode == "greedy":
        return greedy
    scaled = filtered_rows(logits, temperature, top_k, top_p, min_p, mode)
    keys = jax.vmap(lambda s, t: jax.random.fold_in(jax.random.key(s), t))(seeds, steps)
    drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, scaled).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


def filtered_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                  min_p: jax.Array, mode: str = "rank") -> jax.Array:
    """The logits [B, V] each row of `sample_rows` draws from, by its own settings [B]: scaled by its
    temperature (a greedy row's by 1), -inf where its filters drop a token. mode "draw" or "rank"
    (`rows_mode`): "draw" applies min-p alone."""
    import jax
    import jax.numpy as jnp

    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]

    def min_p_filter(x):
        probs = jax.nn.softmax(x, axis=-1)
        return jnp.where(probs < min_p[:, None] * probs.max(axis=-1, keepdims=True), -jnp.inf, x)

    def by_rank(x):  # top-k, min-p, then top-p, on one descending sort
        order = jnp.argsort(-x, axis=-1)
        ranked = jnp.take_along_axis(x, order, axis=-1)
        kth = jnp.take_along_axis(ranked, (jnp.clip(top_k, 1, x.shape[-1]) - 1)[:, None], axis=-1)
        ranked = min_p_filter(jnp.where((top_k[:, None] > 0) & (ranked < kth), -jnp.inf, ranked))
        probs = jax.nn.softmax(ranked, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the more likely tokens
        # The first always stays; top_p = 1 is off (a float cumsum can reach 1 before the last token).
        ranked = jnp.where((top_p[:, None] < 1) & (before >= top_p[:, None]), -jnp.inf, ranked)
        return jnp.full_like(x, -jnp.inf).at[jnp.arange(x.shape[0])[:, None], order].set(ranked)

    return by_rank(scaled) if mode == "rank" else min_p_filter(scaled)


def probabilities(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
                  mode: str) -> jax.Array:
    """logits [N, V], each row's settings [N] -> the probabilities [N, V] `sample_rows` draws its token
    from; a greedy row's are 1 at its argmax."""
    import jax
    import jax.numpy as jnp

    V = logits.shape[-1]
    greedy = jax.nn.one_hot(jnp.argmax(logits.astype(jnp.float32), axis=-1), V, dtype=jnp.float32)
    if mode == "greedy":
        return greedy
    drawn = jax.nn.softmax(filtered_rows(logits, temperature, top_k, top_p, min_p, mode), axis=-1)
    return jnp.where((temperature > 0)[:, None], drawn, greedy)


def draw(key: jax.Array, weights: jax.Array) -> jax.Array:
    """Token ids [B] int32 drawn with one key from each row's unnormalized probabilities [B, V] (the
    speculative-sampling rule's draws)."""
    import jax
    import jax.numpy as jnp

    return jax.random.categorical(key, jnp.log(weights), axis=-1).astype(jnp.int32)


def token_logprobs(logits: jax.Array, temperature: jax.Array, tokens: jax.Array,
                   k: int = TOP_LOGPROBS) -> tuple[jax.Array, jax.Array, jax.Array]:
    """logits [B, V], temperature [B] (0: greedy), the tokens chosen [B] -> (their log-probabilities
    [B] float32, the k most likely token ids [B, k] int32, their log-probabilities [B, k] float32), all
    of log_softmax(logits / temperature) (temperature 1 for a greedy row): the distribution a sampled
    token is drawn from before top-k, top-p and min-p cut it."""
    import jax
    import jax.numpy as jnp

    scaled = logits.astype(jnp.float32) / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)
    chosen = jnp.take_along_axis(logprobs, tokens[:, None].astype(jnp.int32), axis=-1)[:, 0]
    top, ids = jax.lax.top_k(logprobs, k)
    return chosen, ids.astype(jnp.int32), top
