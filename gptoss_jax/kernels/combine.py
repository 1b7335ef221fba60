"""Attention sinks and split attention, folded in exactly through the softmax statistics.

A head's sink is one more logit in every row's softmax whose value is dropped. Attention over
several disjoint sets of keys (a cache's earlier positions, the new tokens, a sliding ring) gives,
per set i, the output o_i normalised over its keys and lse_i = log(sum over its keys of exp(s)).
Then, with M = max(sink, lse_i ...) for stability:

    out = sum_i o_i * exp(lse_i - M) / (exp(sink - M) + sum_i exp(lse_i - M))

which is softmax([all scores, sink]) @ [values, 0] exactly. Fused kernels that know nothing of
sinks return (o_i, lse_i) (or the row max m and sum l, lse = m + log l), so sinks cost nothing
inside them.

Legend: B = batch, T = queries, K = KV heads, G = query heads per KV head, H = head dim.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp


def combine(parts: Sequence[tuple[jax.Array, jax.Array]], sinks: jax.Array, dtype) -> jax.Array:
    """parts: (o [B, T, K, G, H], lse [B, T, K, G] float32, -inf where a row saw no key); sinks [K, G]
    -> [B, T, K, G, H] in dtype."""
    sink = sinks.astype(jnp.float32)
    m = jnp.broadcast_to(sink, parts[0][1].shape)
    for _, lse in parts:
        m = jnp.maximum(m, lse)
    denom = jnp.exp(sink - m)
    out = 0.0
    for o, lse in parts:
        w = jnp.exp(lse - m)  # 0 for a row that saw none of these keys
        out = out + jnp.where(w[..., None] > 0, o.astype(jnp.float32) * w[..., None], 0.0)
        denom = denom + w
    return (out / denom[..., None]).astype(dtype)


def merge(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Two sink-free parts over disjoint keys, (o, lse) each -> (o float32, lse) over the keys of both:
    each part's output weighted by its share of the joint denominator (a part whose rows saw no key,
    lse -inf, adds nothing, whatever its o holds)."""
    (o1, l1), (o2, l2) = a, b
    lse = jnp.maximum(l1, l2)
    lse = jnp.where(jnp.isfinite(lse), lse + jnp.log(jnp.exp(l1 - lse) + jnp.exp(l2 - lse)), lse)
    base = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1, w2 = jnp.exp(l1 - base)[..., None], jnp.exp(l2 - base)[..., None]  # 0 for a part that saw nothing
    o = (jnp.where(w1 > 0, o1.astype(jnp.float32) * w1, 0.0) + jnp.where(w2 > 0, o2.astype(jnp.float32) * w2, 0.0))
    return o, lse


def lse_of(m: jax.Array, l: jax.Array) -> jax.Array:
    """A kernel's row max and sum (natural base) -> log-sum-exp, -inf where the sum is 0."""
    return jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), -jnp.inf)


def fold_splits(o: jax.Array, lse: jax.Array, T: int, G: int) -> tuple[jax.Array, jax.Array]:
    """A decode kernel's partial results over disjoint key ranges: o [B, splits, K, T*G, H] (each range
    normalised over its keys), lse [B, splits, K, T*G] (-inf for a range with no key) -> (o [B, T, K, G,
    H], lse [B, T, K, G]) over all the keys, each range weighted by its share of the total denominator."""
    B, _, K, _, H = o.shape
    total = jax.nn.logsumexp(lse, axis=1, keepdims=True)  # [B, 1, K, T*G]; -inf when no key at all
    w = jnp.where(jnp.isfinite(lse), jnp.exp(lse - jnp.where(jnp.isfinite(total), total, 0.0)), 0.0)
    o = jnp.sum(o * w[..., None], axis=1)  # [B, K, T*G, H]
    o = o.reshape(B, K, T, G, H).transpose(0, 2, 1, 3, 4)
    return o, total[:, 0].reshape(B, K, T, G).transpose(0, 2, 1, 3)
