"""Attention with grouped KV heads, learned sinks and the optional sliding window.

Two interchangeable kernels compute softmax([q.k * scale, sink]) @ v with the sink column dropped:
- `attention_reference`: the plain [T, S] score matrix, kept as the readable definition for tests.
- `attention_blockwise`: online softmax over key blocks (flash-attention style), never holding
  more than [q_block, kv_block] scores per head; on sliding layers it only visits the key blocks
  that overlap the window. Memory grows linearly with the prompt length.

Legend: B = batch, T = query positions, S = key positions, D = embed, N = query heads,
K = KV heads, G = query heads per KV head (N = K * G, head n reads KV head n // G), H = head dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import RMSNorm, apply_rope, rope_tables
from .params import Weight, declare

_MASKED = -1e30  # finite, so a fully masked block gives exp(-huge) = 0 rather than NaN


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """[..., T, S] mask: causal, inside the window (i - window < j <= i) when given, keys with position >= 0."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    keep = (k <= q) & (k >= 0)
    if window is not None:
        keep &= k > q - window
    return keep


def key_block_range(first_q, q_block: int, kv_block: int, num_keys: int, window: int | None):
    """(lo, hi), inclusive: the key blocks holding any key visible to queries [first_q, first_q + q_block).

    Causality bounds hi; on sliding layers the window bounds lo, so blocks wholly before the window
    are never visited.
    """
    lo = 0 if window is None else jnp.maximum(first_q - window + 1, 0) // kv_block
    hi = jnp.minimum(first_q + q_block - 1, num_keys - 1) // kv_block
    return lo, hi


def attention_reference(q, k, v, sinks, q_pos, k_pos, *, window: int | None) -> jax.Array:
    """q [B, T, K, G, H], k and v [B, S, K, H], sinks [K, G], positions [B, T] and [B, S] -> [B, T, K, G, H].

    Scores and softmax in float32; probabilities are cast to v's dtype for the value product, as the
    references do.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = _visible(q_pos, k_pos, window)[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(mask, s, _MASKED)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None], s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]  # drop the sink column
    out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def attention_blockwise(q, k, v, sinks, *, window: int | None, q_offset=0,
                        q_block: int = 512, kv_block: int = 512) -> jax.Array:
    """Same contract as `attention_reference` for queries at positions q_offset + [0, T) and keys at [0, S).

    Queries are processed a block at a time (lax.map), each visiting only the key blocks that can be
    visible to it (a dynamic-bound loop), with a running max m, denominator denom and accumulator acc.
    The sink is folded in exactly by starting every row at m = sink, denom = 1, acc = 0.
    """
    B, T, K, G, H = q.shape
    S = k.shape[1]
    scale = 1.0 / math.sqrt(H)
    bq, bk = min(q_block, T), min(kv_block, S)
    nq, nk = -(-T // bq), -(-S // bk)
    q = jnp.pad(q, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0), (0, 0)))
    k = jnp.pad(k, ((0, 0), (0, nk * bk - S), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, nk * bk - S), (0, 0), (0, 0)))
    q_blocks = q.reshape(B, nq, bq, K, G, H).swapaxes(0, 1)  # [nq, B, bq, K, G, H]
    sink = sinks.astype(jnp.float32)[None, :, :, None]  # [1, K, G, 1]

    def one_query_block(args):
        qi, q_blk = args
        first_q = q_offset + qi * bq  # position of the block's first query
        lo, hi = key_block_range(first_q, bq, bk, S, window)
        q_pos = first_q + jnp.arange(bq)

        def visit(j, carry):
            m, denom, acc = carry
            k_blk = jax.lax.dynamic_slice_in_dim(k, j * bk, bk, axis=1)  # [B, bk, K, H]
            v_blk = jax.lax.dynamic_slice_in_dim(v, j * bk, bk, axis=1)
            k_pos = j * bk + jnp.arange(bk)
            k_pos = jnp.where(k_pos < S, k_pos, -1)  # padding keys are never visible
            s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
            s = jnp.where(_visible(q_pos, k_pos, window), s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            denom = denom * alpha + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, denom, acc * alpha[..., None] + pv

        m0 = jnp.broadcast_to(sink, (B, K, G, bq))
        carry = (m0, jnp.ones_like(m0), jnp.zeros((B, K, G, bq, H), jnp.float32))
        _, denom, acc = jax.lax.fori_loop(lo, hi + 1, visit, carry)
        return (acc / denom[..., None]).transpose(0, 3, 1, 2, 4)  # [B, bq, K, G, H]

    out = jax.lax.map(one_query_block, (jnp.arange(nq), q_blocks))  # [nq, B, bq, K, G, H]
    out = out.swapaxes(0, 1).reshape(B, nq * bq, K, G, H)[:, :T]
    return out.astype(q.dtype)


class AttentionBlock(nn.Module):
    """norm -> q, k, v projections -> RoPE -> attention with sinks -> output projection (no residual)."""

    config: ModelConfig
    layer: int
    param_dtype: jnp.dtype = jnp.bfloat16
    impl: str = "blockwise"  # "blockwise" or "reference"
    block_size: int = 512
    WEIGHTS: ClassVar = {
        "q_weight": Weight(("embed", "q_heads", "head_dim")),
        "q_bias": Weight(("q_heads", "head_dim"), init="zeros"),
        "k_weight": Weight(("embed", "kv_heads", "head_dim")),
        "k_bias": Weight(("kv_heads", "head_dim"), init="zeros"),
        "v_weight": Weight(("embed", "kv_heads", "head_dim")),
        "v_bias": Weight(("kv_heads", "head_dim"), init="zeros"),
        "sinks": Weight(("q_heads",)),
        "out_weight": Weight(("q_heads", "head_dim", "embed")),
        "out_bias": Weight(("embed",), init="zeros"),
    }

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """x [B, T, D], positions [B, T] (0, 1, ... for a fresh prompt) -> [B, T, D]."""
        cfg = self.config
        w = {name: declare(self, name) for name in self.WEIGHTS}
        t = RMSNorm(cfg, name="norm")(x)
        q = jnp.einsum("btd,dnh->btnh", t, w["q_weight"]) + w["q_bias"]
        k = jnp.einsum("btd,dkh->btkh", t, w["k_weight"]) + w["k_bias"]
        v = jnp.einsum("btd,dkh->btkh", t, w["v_weight"]) + w["v_bias"]
        cos, sin = rope_tables(cfg, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        B, T = x.shape[:2]
        q = q.reshape(B, T, cfg.num_key_value_heads, cfg.q_per_kv, cfg.head_dim)  # [B, T, K, G, H]
        sinks = w["sinks"].reshape(cfg.num_key_value_heads, cfg.q_per_kv)  # [K, G]
        window = cfg.sliding_window if cfg.is_sliding(self.layer) else None
        if self.impl == "reference":
            o = attention_reference(q, k, v, sinks, positions, positions, window=window)
        elif self.impl == "blockwise":
            o = attention_blockwise(q, k, v, sinks, window=window,
                                    q_block=self.block_size, kv_block=self.block_size)
        else:
            raise ValueError(f"unknown attention implementation {self.impl!r}")
        o = o.reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
        return jnp.einsum("btnh,nhd->btd", o, w["out_weight"]) + w["out_bias"]
