"""Attention in plain jnp: the readable implementation, and the one every backend can run.

Two entry points, as the model calls them, each returning (o, lse) as every attention kernel here
does (blockwise.py says what they are):
- `causal`: queries and keys of the same positions; dense for decode-sized inputs, else blockwise
  with its own backward pass (attention_vjp.py), so that it can be differentiated;
- `prefix`: queries after every key of a cache's earlier positions; dense for decode, else blockwise.

The building blocks (`dense`, `blockwise`, `visible`, `MASKED`, `key_block_range`) live in
blockwise.py and are re-exported here, the readable attention's one namespace.

Legend: B = batch, T = query positions, S = key positions, K = KV heads, G = query heads per KV
head, H = head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .attention_vjp import causal_attention
from .blockwise import MASKED, blockwise, dense, key_block_range, visible

__all__ = ["MASKED", "blockwise", "causal", "dense", "key_block_range", "prefix", "visible"]


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
        mask = jnp.broadcast_to((jnp.arange(S)[None] < kv_len[:, None])[:, None], (B, T, S))
        return dense(q, k, v, mask)
    after_all = jnp.full((B, T), S, jnp.int32)  # queries past every key: causality hides nothing
    return blockwise(q, k, v, window=None, q_pos=after_all, kv_len=kv_len, q_block=block, kv_block=block)
