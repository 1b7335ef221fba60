"""Attention to a paged cache in plain jnp (paged_cache.py), and the writes of new keys and values.

Each returns (o, lse) of sink-free attention over one set of keys, as every attention kernel here
does; the caller folds in the sinks and the new tokens' own part (combine.py).
- `prefix`: full layers: every query sees keys [0, lengths[b]) of its sequence, gathered through the
  table (whole for decode over short tables, else a block of pages at a time: blockwise.py's loop).
- `in_pieces`: full layers, for a kernel that wants contiguous keys (the flash kernel on GPUs): a
  piece of the table's columns gathered at a time, as many pieces as the longest length needs.
- `window`: sliding layers: the queries see the cached keys inside their window, read from the
  `window_pages` pages that can hold them, whatever the context's length.
- `window_table`: the table columns of a sliding layer's window (also what the Mosaic GPU kernel reads).
- `write`: the new tokens' keys (or values) into their pages, at their positions.

Legend: B = sequences, T = query positions, N = pages, P = positions a page, W = table width,
K = KV heads, G = query heads per KV head, H = head dim, n = pages read.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from . import xla
from ... import fp8
from ..combine import merge


def gather(pool, pages: jax.Array, dtype) -> jax.Array:
    """pool [N, P, K, H] (an array, or FP8 storage read back in `dtype`), pages [B, n] -> their
    positions in order [B, n P, K, H]."""
    B, n = pages.shape
    taken = fp8.read(fp8.apply(lambda a: jnp.take(a, pages, axis=0, mode="clip"), pool), dtype)
    return taken.reshape(B, n * pool.shape[1], *pool.shape[2:])


def prefix(q, pool_k, pool_v, table, lengths, *, block: int, dense_max: int = 16, dense_keys: int = 4096):
    """q [B, T, K, G, H] after every key of its sequence: keys [0, lengths) through table [B, W]
    -> (o, lse). Decode-sized queries over tables of at most `dense_keys` positions gather every
    page at once; otherwise key blocks of whole pages are gathered in turn, up to the longest length."""
    B, T = q.shape[:2]
    if T <= dense_max and table.shape[1] * pool_k.shape[1] <= dense_keys:
        return xla.prefix(q, gather(pool_k, table, q.dtype), gather(pool_v, table, q.dtype), lengths, block=block, dense_max=dense_max)
    after_all = jnp.full((B, T), table.shape[1] * pool_k.shape[1], jnp.int32)  # queries past every key
    return xla.blockwise(q, pool_k, pool_v, window=None, q_pos=after_all, kv_len=lengths, q_block=block,
                         kv_block=block, table=table)


def in_pieces(q, pool_k, pool_v, table, lengths, attend: Callable, *, pages: int):
    """q [B, T, K, G, H] after every key of its sequence, keys [0, lengths) through table [B, W]
    -> (o float32, lse), by `attend(q, k, v, kv_len)` (-> (o, lse), keys [0, kv_len[b]) of contiguous
    k, v [B, pages P, K, H]) over `pages` table columns at a time, merged by their lse. A loop runs
    as many pieces as the longest length fills, so memory holds one piece and short batches read
    little of a wide table."""
    B, T, K, G, H = q.shape
    P, W = pool_k.shape[1], table.shape[1]
    span = pages * P
    table = jnp.pad(table, ((0, 0), (0, -W % pages)))  # columns past W: masked by kv_len
    count = (jnp.max(lengths) + span - 1) // span

    def piece(i, acc):
        cols = lax.dynamic_slice_in_dim(table, i * pages, pages, axis=1)  # [B, pages]
        kv_len = jnp.clip(lengths - i * span, 0, span)
        return merge(acc, attend(q, gather(pool_k, cols, q.dtype), gather(pool_v, cols, q.dtype), kv_len))

    none = (jnp.zeros((B, T, K, G, H), jnp.float32), jnp.full((B, T, K, G), -jnp.inf, jnp.float32))
    return lax.fori_loop(0, count, piece, none)


def window_table(table, lengths, *, window: int, pages: int, page_size: int):
    """The `pages` table columns a sliding layer's window can lie in, from the page holding position
    lengths - window + 1 -> (that first column [B], the page ids [B, n]; columns past W clamped)."""
    first = jnp.maximum(lengths - window + 1, 0) // page_size  # [B]
    cols = jnp.minimum(first[:, None] + jnp.arange(pages), table.shape[1] - 1)
    return first, jnp.take_along_axis(table, cols, axis=1)


def window(q, pool_k, pool_v, table, lengths, q_pos, *, window: int, pages: int):
    """Sliding layers: q [B, T, K, G, H] at positions q_pos [B, T] (lengths + 0..T-1) sees the cached
    keys p < lengths with p > q_pos - window, which lie in the `pages` pages from the one holding
    position lengths - window + 1 -> (o, lse).

    Only the first `window` queries can see any cached key: the rest get lse -inf without scoring.
    """
    B, T = q.shape[:2]
    P = pool_k.shape[1]
    first, ids = window_table(table, lengths, window=window, pages=pages, page_size=P)
    cols = first[:, None] + jnp.arange(pages)  # [B, n]
    k_pos = (cols[:, :, None] * P + jnp.arange(P)).reshape(B, pages * P)  # [B, n P]
    seeing = min(T, window)
    qp = q_pos[:, :seeing]
    mask = xla.visible(qp, k_pos, window) & (k_pos < lengths[:, None])[:, None]  # [B, seeing, n P]
    o, lse = xla.dense(q[:, :seeing], gather(pool_k, ids, q.dtype), gather(pool_v, ids, q.dtype), mask)
    if seeing < T:
        o = jnp.pad(o, ((0, 0), (0, T - seeing), (0, 0), (0, 0), (0, 0)))
        lse = jnp.pad(lse, ((0, 0), (0, T - seeing), (0, 0), (0, 0)), constant_values=-jnp.inf)
    return o, lse


def write(pool, table: jax.Array, positions: jax.Array, valid: jax.Array, new: jax.Array):
    """new [B, T, K, H] at positions [B, T] (where valid) into pool [N, P, K, H] (an array or FP8
    storage) through table [B, W]."""
    N, P = pool.shape[:2]
    W = table.shape[1]
    page = jnp.take_along_axis(table, jnp.clip(positions // P, 0, W - 1), axis=1)  # [B, T]
    page = jnp.where(valid, page, N)  # past the pool: dropped
    return fp8.scatter(pool, lambda a, x: a.at[page, positions % P].set(x, mode="drop"), fp8.like(pool, new))


# The variants "blockwise" and "reference" over the paged cache (kernels/attention/__init__.py).
_window = window  # the name their `window` argument hides

def blockwise_paged_full(q, pool_k, pool_v, table, lengths, *, kernels, mesh, dense_max: int = 16):
    return prefix(q, pool_k, pool_v, table, lengths, block=kernels.attention_block, dense_max=dense_max)


def blockwise_paged_window(q, pool_k, pool_v, table, lengths, positions, *, window, pages, kernels, mesh):
    return _window(q, pool_k, pool_v, table, lengths, positions, window=window, pages=pages)


def reference_paged_full(q, pool_k, pool_v, table, lengths, *, kernels, mesh):
    return blockwise_paged_full(q, pool_k, pool_v, table, lengths, kernels=kernels, mesh=mesh, dense_max=q.shape[1])
