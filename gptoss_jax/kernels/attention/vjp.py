"""Causal (and sliding-window) blockwise attention with its own backward pass: gradients with memory
linear in the sequence, for training.

`blockwise.blockwise` visits each query block's key blocks with a `fori_loop` whose trip count depends on
the block, which JAX cannot reverse-differentiate, and autodiff of a version with static loops would
keep every block's [q_block, kv_block] probabilities for the backward pass (memory quadratic in T).
`causal_attention` is a `jax.custom_vjp` instead (the flash-attention scheme): the forward pass
keeps only q, k, v, the output and its log-sum-exp; the backward pass recomputes each block's
scores from them.

It returns what every attention kernel here returns (kernels/blockwise.py), the output with its softmax
statistics (o [B, T, K, G, H] float32, lse [B, T, K, G] float32), and takes a cotangent for both,
so that `combine` (kernels/combine.py) may fold sinks in after it. Training passes the sinks in
instead: each row's softmax starts from its head's sink, and the backward pass gives their
gradient too (fewer roundings than differentiating `combine`). With P = exp(s - lse), the
probabilities of one row (s the scaled scores), D_i = do_i . o_i:

    dv_j = sum_i P_ij do_i
    ds_ij = P_ij (do_i . v_j - D_i + dlse_i)
    dq_i = scale sum_j ds_ij k_j,    dk_j = scale sum_i ds_ij q_i
    dsink = sum_i p_sink_i (dlse_i - D_i),   p_sink_i = exp(sink - lse_i)

Legend: B = batch, T = positions (queries and keys alike), K = KV heads, G = query heads per KV
head, H = head dim, b = block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ..blockwise import MASKED, blockwise, visible
from ..loops import late_map


def causal_attention(q, k, v, window: int | None, block: int, sinks=None) -> tuple[jax.Array, jax.Array]:
    """q [B, T, K, G, H], k and v [B, T, K, H] at positions 0..T-1 -> (o, lse), differentiable.

    sinks [K, G]: each row's softmax also counts its head's sink (a logit whose value is 0), and
    lse counts it too; the gradient reaches the sinks. Without them: the kernel contract above.
    """
    K, G = q.shape[2:4]
    sinks = jnp.full((K, G), MASKED, jnp.float32) if sinks is None else sinks
    return _attention(q, k, v, sinks, window, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _attention(q, k, v, sinks, window, block):
    return _forward(q, k, v, sinks, window, block)[0]


def _forward(q, k, v, sinks, window, block):
    # Every row starts from its sink: running max = sink, denominator exp(sink - sink) = 1. A
    # MASKED sink (no sinks) weighs exp(-1e30 - s) = 0 once the row's first key is seen.
    K, G = sinks.shape
    o, lse = blockwise(q, k, v, window=window, q_block=block, kv_block=block,
                       start=(sinks, jnp.ones((K, G), jnp.float32)))
    return (o, lse), (q, k, v, sinks, o, lse)


def _key_blocks(i, b: int, window: int | None):
    """Inclusive range of key blocks that queries of block i can see."""
    lo = 0 if window is None else jnp.maximum(i * b - window + 1, 0) // b
    return lo, i


def _query_blocks(j, b: int, n: int, window: int | None):
    """Inclusive range of query blocks that can see keys of block j."""
    hi = n - 1 if window is None else jnp.minimum(((j + 1) * b - 1 + window - 1) // b, n - 1)
    return j, hi


def _backward(window, block, residuals, cotangents):
    q, k, v, sinks, o, lse = residuals
    do, dlse = cotangents
    B, T, K, G, H = q.shape
    scale = 1.0 / math.sqrt(H)
    b = min(block, T)
    n = -(-T // b)
    pad = n * b - T

    def padded(x, value=0.0):
        return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=value)

    # Padding queries and keys sit past every real position: causality hides the padded keys from
    # real queries, and the padded queries carry zero cotangents (lse 0 keeps their P finite).
    qp, kp, vp = padded(q), padded(k), padded(v)
    dop = padded(do.astype(jnp.float32))
    lsep = padded(jnp.where(jnp.isfinite(lse), lse, 0.0))
    shift = dlse.astype(jnp.float32) - jnp.sum(do.astype(jnp.float32) * o, axis=-1)  # dlse_i - D_i [B, T, K, G]
    # The sink is one more score whose value is 0: its ds is p_sink (0 - D_i + dlse_i).
    p_sink = jnp.exp(sinks.astype(jnp.float32) - jnp.where(jnp.isfinite(lse), lse, 0.0))
    dsinks = jnp.sum(p_sink * shift, axis=(0, 1)).astype(sinks.dtype)
    dp_shift = padded(shift)
    pos = jnp.arange(n * b)

    def blk(x, i):
        return jax.lax.dynamic_slice_in_dim(x, i * b, b, axis=1)

    def scores(i, j):
        """Probabilities P and score cotangents ds [B, K, G, bq, bk] of query block i and key block j."""
        q_blk, k_blk, v_blk = blk(qp, i), blk(kp, j), blk(vp, j)
        s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
        seen = visible(blk(pos[None], i), blk(pos[None], j), window)[:, None, None]  # [1, 1, 1, bq, bk]
        p = jnp.where(seen, jnp.exp(s - blk(lsep, i).transpose(0, 2, 3, 1)[..., None]), 0.0)
        dp = jnp.einsum("bqkgh,bskh->bkgqs", blk(dop, i).astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
        ds = p * (dp + blk(dp_shift, i).transpose(0, 2, 3, 1)[..., None])
        return p, ds

    def dq_block(i):
        def visit(j, acc):
            _, ds = scores(i, j)
            return acc + jnp.einsum("bkgqs,bskh->bqkgh", ds.astype(k.dtype), blk(kp, j),
                                    preferred_element_type=jnp.float32)

        lo, hi = _key_blocks(i, b, window)
        dq = jax.lax.fori_loop(lo, hi + 1, visit, jnp.zeros((B, b, K, G, H), jnp.float32)) * scale
        return dq.astype(q.dtype)

    def dkv_block(j):
        def visit(i, carry):
            dk, dv = carry
            p, ds = scores(i, j)
            dv = dv + jnp.einsum("bkgqs,bqkgh->bskh", p.astype(v.dtype), blk(dop, i).astype(v.dtype),
                                 preferred_element_type=jnp.float32)
            dk = dk + jnp.einsum("bkgqs,bqkgh->bskh", ds.astype(q.dtype), blk(qp, i), preferred_element_type=jnp.float32)
            return dk, dv

        lo, hi = _query_blocks(j, b, n, window)
        zeros = jnp.zeros((B, b, K, H), jnp.float32)
        dk, dv = jax.lax.fori_loop(lo, hi + 1, visit, (zeros, zeros))
        return (dk * scale).astype(k.dtype), dv.astype(v.dtype)

    def unblock(x):  # [n, B, b, ...] -> [B, T, ...]
        return jnp.moveaxis(x, 0, 1).reshape((B, n * b) + x.shape[3:])[:, :T]

    # Each block's gradient is rounded to the input's dtype as it is written (the same rounding as
    # once at the end, in half the memory).
    dq = unblock(late_map(dq_block, jnp.arange(n), anchor=dop))
    dk, dv = late_map(dkv_block, jnp.arange(n), anchor=dop)
    return dq, unblock(dk), unblock(dv), dsinks


_attention.defvjp(_forward, _backward)
