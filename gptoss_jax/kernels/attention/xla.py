"""Attention in plain jnp: the readable implementation, and the one every backend can run.

Two entry points, as the model calls them, each returning (o, lse) as every attention kernel here
does (blockwise.py says what they are):
- `causal`: queries and keys of the same positions; dense for decode-sized inputs, else blockwise
  with its own backward pass (vjp.py), so that it can be differentiated;
- `prefix`: queries after every key of a cache's earlier positions; dense for decode, else blockwise.

With the sinks (the model's definition): `attention_reference`, the plain [T, S] score matrix kept
as the readable definition, and `attention_blockwise`, the same blockwise. `ring`: new tokens to a
sliding layer's ring. The attention variants "blockwise" and "reference" (kernels/attention/__init__.py) are
the functions at the end of this file.

The building blocks (`dense`, `blockwise`, `visible`, `MASKED`, `key_block_range`) live in
blockwise.py and are re-exported here, the readable attention's one namespace.

Legend: B = batch, T = query positions, S = key positions, K = KV heads, G = query heads per KV
head, H = head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ... import fp8
from .vjp import causal_attention
from ..blockwise import MASKED, blockwise, dense, key_block_range, visible

__all__ = ["MASKED", "attention_blockwise", "attention_reference", "blockwise", "causal", "dense", "key_block_range",
           "prefix", "ring", "visible"]


def causal(q, k, v, *, window: int | None, block: int, dense_max: int = 16) -> tuple[jax.Array, jax.Array]:
    """Queries and keys of the same T positions, causal (and windowed) -> (o, lse)."""
    T = q.shape[1]
    if T <= dense_max:
        pos = jnp.broadcast_to(jnp.arange(T), q.shape[:2])
        return dense(q, k, v, visible(pos, pos, window))
    return causal_attention(q, k, v, window, block)  # sink-free


def prefix(q, k, v, kv_len, *, block: int, dense_max: int = 16) -> tuple[jax.Array, jax.Array]:
    """Every query sees keys [0, kv_len[b]) of k, v [B, S, K, H] (a cache's earlier positions) -> (o, lse)."""
    B, T = q.shape[:2]
    S = k.shape[1]
    if T <= dense_max:  # decode: one pass over the cache, no loop
        k, v = fp8.read(k, q.dtype), fp8.read(v, q.dtype)
        mask = jnp.broadcast_to((jnp.arange(S)[None] < kv_len[:, None])[:, None], (B, T, S))
        return dense(q, k, v, mask)
    after_all = jnp.full((B, T), S, jnp.int32)  # queries past every key: causality hides nothing
    return blockwise(q, k, v, window=None, q_pos=after_all, kv_len=kv_len, q_block=block, kv_block=block)


def attention_reference(q, k, v, sinks, q_pos, k_pos, *, window: int | None) -> jax.Array:
    """q [B, T, K, G, H], k and v [B, S, K, H], sinks [K, G], positions [B, T] and [B, S] -> [B, T, K, G, H].

    The readable definition: scores and softmax in float32 over [scores, sink] with the sink column
    dropped; probabilities are cast to v's dtype for the value product, as the references do.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = visible(q_pos, k_pos, window)[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(mask, s, MASKED)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None], s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]  # drop the sink column
    out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def attention_blockwise(q, k, v, sinks, *, window: int | None, q_pos=None, kv_len=None,
                        q_block: int = 512, kv_block: int = 512) -> jax.Array:
    """Same contract as `attention_reference`, for keys at positions [0, S) (key j at position j),
    computed blockwise: every row starts from its sink (m = sink, denominator 1).

    q_pos [B, T]: query positions, non-decreasing along T (default 0..T-1); kv_len [B]: keys at or
    past it are invisible (default S).
    """
    K, G = sinks.shape
    o, _ = blockwise(q, k, v, window=window, q_pos=q_pos, kv_len=kv_len, q_block=q_block, kv_block=kv_block,
                     start=(sinks, jnp.ones((K, G), jnp.float32)))
    return o.astype(q.dtype)


def ring(q, ring_k, ring_v, ring_pos, positions, window: int) -> tuple[jax.Array, jax.Array]:
    """Attention of the new tokens to a sliding layer's ring (positions before them) -> (o, lse).

    New token t sits at position lengths + t and every ring position is below lengths, so only
    tokens t < window - 1 can see any of the ring: the scores are computed for the first `window`
    tokens alone, and the rest see none of its keys (lse -inf). A 4096-token prompt chunk then
    scores 128 queries against the ring, not 4096.
    """
    T = q.shape[1]
    seeing = min(T, window)
    q, positions = q[:, :seeing], positions[:, :seeing]
    in_window = (ring_pos[:, None, :] >= 0) & (ring_pos[:, None, :] > positions[:, :, None] - window)
    o, lse = dense(q, fp8.read(ring_k, q.dtype), fp8.read(ring_v, q.dtype), in_window)
    if seeing < T:
        o = jnp.pad(o, ((0, 0), (0, T - seeing), (0, 0), (0, 0), (0, 0)))
        lse = jnp.pad(lse, ((0, 0), (0, T - seeing), (0, 0), (0, 0)), constant_values=-jnp.inf)
    return o, lse


# The variants "blockwise" (dense up to 16 queries) and "reference" (dense always), kernels/attention/__init__.py.
def blockwise_causal(q, k, v, *, window, kernels, dense_max: int = 16):
    return causal(q, k, v, window=window, block=kernels.attention_block, dense_max=dense_max)


def blockwise_prefix(q, k, v, lengths, *, kernels, dense_max: int = 16):
    return prefix(q, k, v, lengths, block=kernels.attention_block, dense_max=dense_max)


def blockwise_whole(q, k, v, sinks, positions, *, window, kernels):
    """Without a cache, more than 16 queries: the sinks inside the blockwise attention's own backward
    pass (training). None otherwise (the sinks folded into `causal`'s parts)."""
    if q.shape[1] <= 16:
        return None
    return causal_attention(q, k, v, window, kernels.attention_block, sinks)[0].astype(q.dtype)


def reference_causal(q, k, v, *, window, kernels):
    return blockwise_causal(q, k, v, window=window, kernels=kernels, dense_max=q.shape[1])


def reference_prefix(q, k, v, lengths, *, kernels):
    return blockwise_prefix(q, k, v, lengths, kernels=kernels, dense_max=q.shape[1])


def reference_whole(q, k, v, sinks, positions, *, window, kernels):
    return attention_reference(q, k, v, sinks, positions, positions, window=window)
