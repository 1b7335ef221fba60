"""Attention in plain jnp, its two forms: the building blocks of the readable attention (xla.py).

Each function computes sink-free attention over one set of keys and returns it with its softmax
statistics, (o, lse): o [B, T, K, G, H] normalised over those keys, lse [B, T, K, G] float32 the
log of their softmax denominator (-inf for a row that sees no key). `combine` (combine.py) folds
several such parts and the sinks into the exact result.

- `dense`: the [T, S] scores with an explicit mask; for decode-sized queries and the sliding ring.
- `blockwise`: online softmax over key blocks (flash-attention style), never more than
  [q_block, kv_block] scores per head, visiting only the key blocks that can be visible: memory is
  linear in T. Its key loop has a data-dependent trip count (on a GPU, a host sync per block), so
  the GPU and TPU kernels replace it there, and JAX cannot differentiate it: attention/vjp.py gives
  it a backward pass of its own.

Legend: B = batch, T = query positions, S = key positions, K = KV heads, G = query heads per KV
head, H = head dim.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import fp8
from .loops import late_map

MASKED = -1e30  # finite, so a fully masked block gives exp(-huge) = 0 rather than NaN


def visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """[..., T, S] mask: causal, inside the window (i - window < j <= i) when given, keys with position >= 0."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    keep = (k <= q) & (k >= 0)
    if window is not None:
        keep &= k > q - window
    return keep


def dense(q, k, v, mask) -> tuple[jax.Array, jax.Array]:
    """q [B, T, K, G, H], k and v [B, S, K, H], mask [B, T, S] -> (o, lse)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask[:, None, None], s, MASKED)
    m = s.max(axis=-1, keepdims=True)
    p = jnp.where(mask[:, None, None], jnp.exp(s - m), 0.0)
    denom = p.sum(axis=-1)  # [B, K, G, T]
    o = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    o = o / jnp.maximum(denom, 1e-30).transpose(0, 3, 1, 2)[..., None]
    lse = jnp.where(denom > 0, m[..., 0] + jnp.log(jnp.maximum(denom, 1e-30)), -jnp.inf)
    return o, lse.transpose(0, 3, 1, 2)


def key_block_range(first_q, last_q, kv_block: int, num_keys, window: int | None):
    """(lo, hi), inclusive: the key blocks holding any key visible to queries at positions [first_q, last_q].

    Causality and the number of keys bound hi; on sliding layers the window bounds lo, so blocks
    wholly before the window are never visited. Key j sits at position j.
    """
    lo = 0 if window is None else jnp.maximum(first_q - window + 1, 0) // kv_block
    hi = jnp.minimum(last_q, num_keys - 1) // kv_block
    return lo, hi


def blockwise(q, k, v, *, window: int | None, q_pos=None, kv_len=None, q_block: int = 512, kv_block: int = 512,
              start=None, table=None) -> tuple[jax.Array, jax.Array]:
    """q [B, T, K, G, H], k and v [B, S, K, H] with key j at position j -> (o, lse), or with
    start=(m0, l0) [K, G] the rows begin from that state (the sinks: m0 = sink, l0 = 1) and lse counts it.

    With a page table [B, W] (paged_cache.py), k and v are pools of pages [N, P, K, H] and sequence b's
    key j sits in page table[b, j // P]: S = W P, and each key block gathers its pages (blocks of
    whole pages).

    q_pos [B, T]: query positions, non-decreasing along T (default 0..T-1); kv_len [B]: keys at or
    past it are invisible (default S), as in a KV cache holding kv_len positions.

    Queries are processed a block at a time (loops.late_map), each visiting only the key blocks that can be
    visible to it (a dynamic-bound loop), with a running max m, denominator denom and accumulator acc.
    """
    B, T, K, G, H = q.shape
    S = k.shape[1] if table is None else table.shape[1] * k.shape[1]
    scale = 1.0 / math.sqrt(H)
    bq, bk = min(q_block, T), min(kv_block, S)
    if table is not None:
        bk = max(bk // k.shape[1], 1) * k.shape[1]  # whole pages
    nq = -(-T // bq)
    if q_pos is None:
        q_pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    kv_len = jnp.full((B,), S) if kv_len is None else kv_len
    q = jnp.pad(q, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0), (0, 0)))
    q_pos = jnp.pad(q_pos, ((0, 0), (0, nq * bq - T)), mode="edge")  # padding rows repeat the last query
    # Keys are not padded (that would copy a whole KV cache every step): the last block starts at
    # S - bk instead, and its keys before j * bk, which the previous block already counted, are masked.
    q_blocks = q.reshape(B, nq, bq, K, G, H).swapaxes(0, 1)  # [nq, B, bq, K, G, H]
    pos_blocks = q_pos.reshape(B, nq, bq).swapaxes(0, 1)  # [nq, B, bq]
    if start is None:
        m0, l0 = jnp.full((K, G), MASKED, jnp.float32), jnp.zeros((K, G), jnp.float32)
    else:
        m0, l0 = (s.astype(jnp.float32) for s in start)

    def one_query_block(args):
        q_blk, pos_blk = args
        lo, hi = key_block_range(pos_blk[:, 0].min(), pos_blk[:, -1].max(), bk, jnp.minimum(kv_len.max(), S), window)

        def visit(j, carry):
            m, denom, acc = carry
            first = jnp.minimum(j * bk, S - bk)
            k_blk, v_blk = _key_block(k, first, bk, table, q.dtype), _key_block(v, first, bk, table, q.dtype)  # [B, bk, K, H]
            k_pos = first + jnp.arange(bk)
            seen = (k_pos[None] < kv_len[:, None]) & (k_pos[None] >= j * bk)
            k_pos = jnp.where(seen, k_pos[None], -1)  # [B, bk]; -1 never visible
            s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
            s = jnp.where(visible(pos_blk, k_pos, window)[:, None, None], s, MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            denom = denom * alpha + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, denom, acc * alpha[..., None] + pv

        m_init = jnp.broadcast_to(m0[None, :, :, None], (B, K, G, bq))
        carry = (m_init, jnp.broadcast_to(l0[None, :, :, None], (B, K, G, bq)), jnp.zeros((B, K, G, bq, H), jnp.float32))
        m, denom, acc = jax.lax.fori_loop(lo, hi + 1, visit, carry)
        o = acc / jnp.maximum(denom, 1e-30)[..., None]
        lse = jnp.where(denom > 0, m + jnp.log(jnp.maximum(denom, 1e-30)), -jnp.inf)
        return o.transpose(0, 3, 1, 2, 4), lse.transpose(0, 3, 1, 2)  # [B, bq, K, G, H], [B, bq, K, G]

    o, lse = late_map(one_query_block, (q_blocks, pos_blocks), anchor=q)  # [nq, B, bq, ...]
    o = o.swapaxes(0, 1).reshape(B, nq * bq, K, G, H)[:, :T]
    lse = lse.swapaxes(0, 1).reshape(B, nq * bq, K, G)[:, :T]
    return o, lse


def _key_block(x, first, size: int, table, dtype):
    """Keys [first, first + size) of every sequence in `dtype`: a slice of x [B, S, K, H], or through
    the page table [B, W] the pages of a pool [N, P, K, H] that hold them (first a multiple of P);
    x an array or FP8 storage."""
    if table is None:
        return fp8.read(fp8.apply(lambda a: jax.lax.dynamic_slice_in_dim(a, first, size, axis=1), x), dtype)
    P = x.shape[1]
    pages = jax.lax.dynamic_slice_in_dim(table, first // P, size // P, axis=1)  # [B, size / P]
    taken = fp8.read(fp8.apply(lambda a: jnp.take(a, pages, axis=0, mode="clip"), x), dtype)
    return taken.reshape(table.shape[0], size, *x.shape[2:])
